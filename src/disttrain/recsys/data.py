"""Criteo-format click logs, one TSV file per day: parsing with bad-row counting, a one-time conversion of each
day to numpy files read back by memory mapping, hashing to the table sizes, and per-day train/held-out splits.

A row is ``label \\t 13 integer features \\t 26 categorical features (hex)``; an empty field is a missing value.
Files are ``day_YYYY-MM-DD.tsv`` or ``day_YYYY-MM-DD.tsv.gz``.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT

from disttrain.recsys.publish import fsync_dir

DAY_FILE = re.compile(r"^day_(\d{4}-\d{2}-\d{2})\.tsv(\.gz)?$")
COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
CACHE_VERSION = 1
_HEX = re.compile(r"^[0-9a-fA-F]{1,16}$")


class BadDataError(ValueError):
    """A day file whose share of malformed rows passes the threshold, or a data folder that breaks the layout."""


def parse_date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"date {text!r} is not YYYY-MM-DD, e.g. 2026-11-29") from None


def list_days(root: str | os.PathLike) -> dict[dt.date, Path]:
    """``{date: file}`` for every ``day_YYYY-MM-DD.tsv[.gz]`` in ``root`` (other files are ignored)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data root {str(root)!r} is not a folder; pass the folder that holds the"
                                " day_YYYY-MM-DD.tsv files")
    days: dict[dt.date, Path] = {}
    for path in sorted(root.iterdir()):
        match = DAY_FILE.match(path.name)
        if not match:
            continue
        day = parse_date(match.group(1))
        if day in days:
            raise BadDataError(f"day {day} has two files ({days[day].name} and {path.name}); keep one")
        days[day] = path
    return days


@dataclass
class Day:
    """One day as arrays: ``labels`` (N,) float32, ``dense`` (N, 13) float32 (log(1 + x), missing -> 0),
    ``sparse`` (N, 26) int64 raw ids (missing -> 0; hashed to the table sizes per batch), and the row counts."""

    date: dt.date
    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    rows: int
    bad_rows: int

    @property
    def bad_fraction(self) -> float:
        return self.bad_rows / max(1, self.rows + self.bad_rows)


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8", errors="replace") if path.suffix == ".gz" \
        else open(path, encoding="utf-8", errors="replace")


def _parse_row(fields: list[str]) -> Optional[tuple[int, list[int], list[int]]]:
    """One row's (label, 13 ints, 26 ids), or None when the row is malformed."""
    if len(fields) != COLUMNS or fields[0] not in ("0", "1"):
        return None
    try:
        ints = [int(x) if x else 0 for x in fields[1:1 + INT_FEATURE_COUNT]]
    except ValueError:
        return None
    cats = fields[1 + INT_FEATURE_COUNT:]
    if any(x and not _HEX.match(x) for x in cats):
        return None
    return int(fields[0]), ints, [int(x, 16) if x else 0 for x in cats]


def parse_day_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Read one TSV day: (labels, raw integer features, raw ids, number of malformed rows)."""
    labels, ints, cats, bad = [], [], [], 0
    with _open_text(Path(path)) as f:
        for line in f:
            line = line.rstrip("\n").rstrip("\r")
            if not line:
                continue
            row = _parse_row(line.split("\t"))
            if row is None:
                bad += 1
                continue
            labels.append(row[0])
            ints.append(row[1])
            cats.append(row[2])
    label_arr = np.asarray(labels, dtype=np.float32)
    int_arr = np.asarray(ints, dtype=np.int64).reshape(-1, INT_FEATURE_COUNT)
    cat_arr = np.asarray(cats, dtype=np.int64).reshape(-1, CAT_FEATURE_COUNT)
    return label_arr, int_arr, cat_arr, bad


def dense_transform(ints: np.ndarray) -> np.ndarray:
    """Criteo's usual transform: log(1 + x), negatives (a few columns have -1, -2) clipped to 0."""
    return np.log1p(np.clip(ints, 0, None)).astype(np.float32)


def _source_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"version": CACHE_VERSION, "source": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def convert_day(path: str | os.PathLike, cache_root: str | os.PathLike) -> Path:
    """Convert a day file once to ``cache_root/<name>/{labels,dense,sparse}.npy`` + ``meta.json`` (written to a
    temporary folder and renamed, so a crash never leaves a half-converted day); reused while the source file's
    size and modification time are unchanged. Returns the folder."""
    path = Path(path)
    out = Path(cache_root) / path.name.split(".")[0]
    stamp = _source_stamp(path)
    meta_file = out / "meta.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if {k: meta.get(k) for k in stamp} == stamp:
            return out
    labels, ints, cats, bad = parse_day_file(path)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name, array in (("labels", labels), ("dense", dense_transform(ints)), ("sparse", cats)):
        with open(tmp / f"{name}.npy", "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
    (tmp / "meta.json").write_text(json.dumps({**stamp, "rows": int(len(labels)), "bad_rows": bad}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    fsync_dir(out.parent)
    return out


def load_day(path: str | os.PathLike, cache_root: str | os.PathLike, max_bad_fraction: float = 0.01) -> Day:
    """A day's arrays (memory-mapped from the converted cache). Raises :class:`BadDataError` when the share of
    malformed rows passes ``max_bad_fraction``."""
    path = Path(path)
    match = DAY_FILE.match(path.name)
    if not match:
        raise ValueError(f"{path.name!r} is not named day_YYYY-MM-DD.tsv or day_YYYY-MM-DD.tsv.gz")
    folder = convert_day(path, cache_root)
    meta = json.loads((folder / "meta.json").read_text())
    day = Day(date=parse_date(match.group(1)), rows=meta["rows"], bad_rows=meta["bad_rows"],
              **{name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("labels", "dense", "sparse")})
    if day.rows == 0 or day.bad_fraction > max_bad_fraction:
        raise BadDataError(
            f"{path.name}: {day.bad_rows} of {day.rows + day.bad_rows} rows are malformed"
            f" ({day.bad_fraction:.2%} > max_bad_fraction={max_bad_fraction:.2%}); fix or replace the file, or raise"
            " the threshold (--max-bad-fraction) if the rows can be dropped")
    return day


def split_rows(rows: int, eval_fraction: float) -> tuple[slice, slice]:
    """(train rows, held-out rows): the last ``eval_fraction`` of a day is held out from training."""
    held = int(round(rows * eval_fraction))
    return slice(0, rows - held), slice(rows - held, rows)


class DayBatches(torch.utils.data.Dataset):
    """Contiguous batches of a row range of a day, as ``(dense, sparse hashed to the table sizes, labels)``
    tensors; item i is batch i (use ``DataLoader(batch_size=None)``). Contiguous reads keep the memory map
    sequential; shuffle the batch order with the sampler. ``drop_last`` leaves out a final partial batch (several
    processes: torchrec's collectives on gloo need the same batch size on every rank)."""

    def __init__(self, day: Day, rows: slice, batch_size: int, table_sizes: Sequence[int],
                 drop_last: bool = False) -> None:
        if len(table_sizes) != day.sparse.shape[1]:
            raise ValueError(f"the model has {len(table_sizes)} tables but the data has {day.sparse.shape[1]}"
                             " categorical columns; set num_embeddings_per_feature to one size per column")
        self.day, self.batch_size = day, batch_size
        self.start, self.stop = rows.start or 0, rows.stop
        self.sizes = np.asarray(table_sizes, dtype=np.int64)
        self.drop_last = drop_last

    def __len__(self) -> int:
        rows = self.stop - self.start
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    @property
    def rows(self) -> int:
        return min(len(self) * self.batch_size, self.stop - self.start)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo = self.start + index * self.batch_size
        hi = min(lo + self.batch_size, self.stop)
        sparse = np.asarray(self.day.sparse[lo:hi]) % self.sizes  # hashing to the table sizes
        return (torch.from_numpy(np.array(self.day.dense[lo:hi])), torch.from_numpy(sparse),
                torch.from_numpy(np.array(self.day.labels[lo:hi])))


def iterate_batches(dataset: DayBatches, rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, ...]]:
    """This rank's share of the batches, in order (for evaluation)."""
    for index in range(rank, len(dataset), world_size):
        yield dataset[index]
