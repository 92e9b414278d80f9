"""Demo data: Criteo-format days drawn from a planted ground-truth model with daily drift, so the AUC a trained
model reaches measures real learning (labels are Bernoulli draws from the planted click probability).

Planted model: each categorical feature has a vocabulary of 32-bit ids (written as hex, as in Criteo); each id
has a bias and a latent vector; the logit is ``b0 + sum of biases + w . log(1 + dense) + FM(latents)``. Every
day the biases and latent vectors take a small random step (drift), and the category popularity is Zipf-like.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disttrain.recsys.data import CAT_FEATURE_COUNT, INT_FEATURE_COUNT


@dataclass
class PlantedModel:
    """The hidden model of one day (see the module docstring)."""

    ids: list[np.ndarray]        # per feature: (V,) raw 32-bit ids
    bias: list[np.ndarray]       # per feature: (V,)
    latent: list[np.ndarray]     # per feature: (V, K)
    popularity: list[np.ndarray]  # per feature: (V,) sampling probabilities
    dense_weight: np.ndarray     # (13,)
    dense_scale: np.ndarray      # (13,) mean of each integer feature
    offset: float

    def logits(self, dense_ints: np.ndarray, choice: np.ndarray) -> np.ndarray:
        """(N,) planted logits for integer features (N, 13) and category indices (N, 26)."""
        dense = np.log1p(dense_ints) - np.log1p(self.dense_scale)
        bias = sum(self.bias[f][choice[:, f]] for f in range(CAT_FEATURE_COUNT))
        vectors = np.stack([self.latent[f][choice[:, f]] for f in range(CAT_FEATURE_COUNT)], axis=1)  # (N, F, K)
        fm = 0.5 * (vectors.sum(1) ** 2 - (vectors ** 2).sum(1)).sum(1)
        return self.offset + bias + dense @ self.dense_weight + fm


def planted_model(seed: int, day_index: int, drift: float = 0.05, latent_dim: int = 4,
                  new_ids: float = 0.0) -> PlantedModel:
    """The planted model on day ``day_index`` (0-based): day 0 drawn from ``seed``, then one drift step a day, in
    which a ``new_ids`` share of every column's ids is replaced by ids never drawn before (new users, items)."""
    rng = np.random.default_rng(seed)
    vocab = rng.integers(20, 400, size=CAT_FEATURE_COUNT)
    ids = [rng.choice(2 ** 32, size=v, replace=False).astype(np.int64) for v in vocab]
    bias = [rng.normal(0, 0.3, size=v) for v in vocab]
    latent = [rng.normal(0, 0.15, size=(v, latent_dim)) for v in vocab]
    popularity = []
    for v in vocab:
        weight = 1.0 / np.arange(1, v + 1) ** 1.1
        popularity.append(rng.permutation(weight / weight.sum()))
    dense_weight = rng.normal(0, 0.4, size=INT_FEATURE_COUNT)
    dense_scale = rng.uniform(1, 50, size=INT_FEATURE_COUNT)
    drift_rng = np.random.default_rng([seed, 1])
    for _ in range(day_index):
        bias = [b + drift_rng.normal(0, drift, size=b.shape) for b in bias]
        latent = [z + drift_rng.normal(0, drift / 3, size=z.shape) for z in latent]
        if new_ids > 0:  # a generator of its own: without new ids the days stay what they were
            ids_rng = np.random.default_rng([seed, 3, _])
            for column in ids:
                replaced = ids_rng.random(len(column)) < new_ids
                column[replaced] = ids_rng.integers(2 ** 32, size=int(replaced.sum()))
    model = PlantedModel(ids, bias, latent, popularity, dense_weight, dense_scale, offset=0.0)
    # Centre the logits on about -1.2 (a click rate near 25%) on a fixed probe sample.
    _, dense, choice = sample_day(model, 2000, seed=seed)
    model.offset = -1.2 - float(np.median(model.logits(dense, choice)))
    return model


def sample_day(model: PlantedModel, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels (N,), integer features (N, 13), category indices (N, 26)) drawn from the planted model."""
    rng = np.random.default_rng(seed)
    dense = rng.poisson(model.dense_scale, size=(rows, INT_FEATURE_COUNT)) * \
        rng.integers(0, 2, size=(rows, INT_FEATURE_COUNT))  # half the counts are zero, as in click logs
    choice = np.stack([rng.choice(len(p), size=rows, p=p) for p in model.popularity], axis=1)
    prob = 1.0 / (1.0 + np.exp(-model.logits(dense, choice)))
    labels = (rng.random(rows) < prob).astype(np.int64)
    return labels, dense, choice


def write_day(path: Path, model: PlantedModel, labels: np.ndarray, dense: np.ndarray, choice: np.ndarray,
              missing: float, bad_rows: int, seed: int) -> None:
    """Write one day as Criteo TSV (temporary file + rename): ``missing`` share of empty fields, and
    ``bad_rows`` malformed rows (a wrong column count or a non-hex id) mixed in."""
    rng = np.random.default_rng([seed, 2])
    hex_ids = [np.char.mod("%08x", model.ids[f][choice[:, f]]) for f in range(CAT_FEATURE_COUNT)]
    ints = dense.astype(str)
    cats = np.stack(hex_ids, axis=1)
    if missing > 0:
        ints[rng.random(ints.shape) < missing] = ""
        cats[rng.random(cats.shape) < missing] = ""
    lines = ["\t".join([str(label), *i, *c]) for label, i, c in zip(labels.tolist(), ints.tolist(), cats.tolist())]
    for k, position in enumerate(sorted(rng.choice(len(lines), size=min(bad_rows, len(lines)), replace=False))):
        fields = lines[position].split("\t")
        lines[position] = "\t".join(fields[:-3]) if k % 2 == 0 else "\t".join(fields[:-1] + ["not-hex!"])
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def make_days(root: str | os.PathLike, days: int, rows_per_day: int, start: dt.date = dt.date(2026, 11, 1),
              seed: int = 0, drift: float = 0.05, missing: float = 0.02, bad_rows: int = 0,
              first_index: int = 0, every: str = "1d", new_ids: float = 0.0) -> list[Path]:
    """Write ``days`` files ``day_YYYY-MM-DD.tsv`` from ``start`` on (``every="1h"``: that many hour files
    ``day_YYYY-MM-DD_HH.tsv``); returns their paths. Day ``k`` uses the
    planted model after ``first_index + k`` drift steps (default 0), so a later call with ``first_index`` = the
    number of days written before continues the same drift. ``new_ids``: the share of each column's ids replaced by
    new ones at every drift step."""
    if days < 1 or rows_per_day < 1:
        raise ValueError(f"days={days} and rows_per_day={rows_per_day} must both be at least 1")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    base = first_index
    paths = []
    for k in range(days):
        index = base + k
        model = planted_model(seed, index, drift, new_ids=new_ids)
        labels, dense, choice = sample_day(model, rows_per_day, seed=hash((seed, index)) % 2 ** 32)
        if every == "1h":  # hour files: day_YYYY-MM-DD_HH.tsv from start's 00:00 on, one drift step per hour
            path = root / f"day_{dt.datetime.combine(start, dt.time()) + dt.timedelta(hours=k):%Y-%m-%d_%H}.tsv"
        else:
            path = root / f"day_{start + dt.timedelta(days=k):%Y-%m-%d}.tsv"
        write_day(path, model, labels, dense, choice, missing, bad_rows, seed=index)
        paths.append(path)
    return paths


