"""Validation of a day's data against the recent days before it, before the day is trained on: well-formed data
can still be wrong (labels flipped upstream, a feature no longer filled in, ids hashed by a new scheme), and a
model trained on it would pass an AUC gate measured on the same broken data.

The statistics (see :func:`disttrain.recsys.data.day_statistics`) and the checks follow TFX's example
validation (data drift between spans): the label rate, each column's share of missing fields, each integer
column's mean (in units of its usual standard deviation) and each categorical column's id vocabulary. A day
fails on the first statistic beyond its bound; the message names the file, the statistic, its value and the
allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass
class ValidationBounds:
    """The ``daily.validation:`` section: how far a day may move from the mean of its baseline (the ``days`` most
    recent days before it that went into the model).

    label_rate_ratio: the click rate may be at most this many times higher or lower than the baseline's.
    missing_rate_change: each column's share of missing fields may move by at most this much (absolute).
    dense_shift: each integer column's mean (of log(1 + x)) may move by at most this many baseline standard
        deviations.
    id_overlap: at least this share of each categorical column's frequent ids (weighted by rows, among the day's
        most frequent ids) must have been seen among the baseline's frequent ids.
    """

    days: int = 7
    label_rate_ratio: float = 1.5
    missing_rate_change: float = 0.1
    dense_shift: float = 1.0
    id_overlap: float = 0.5

    def __post_init__(self) -> None:
        if self.days < 1 or self.label_rate_ratio < 1 or not 0 <= self.id_overlap <= 1 or \
                self.missing_rate_change < 0 or self.dense_shift < 0:
            raise ValueError(f"daily.validation: {self} is out of range; days >= 1, label_rate_ratio >= 1,"
                             " missing_rate_change >= 0, dense_shift >= 0, 0 <= id_overlap <= 1")


@dataclass
class Finding:
    """One statistic beyond its bound: its name (e.g. ``missing_rate[C7]``), the day's value and the allowed range
    as text."""

    statistic: str
    value: float
    bound: str

    def as_dict(self) -> dict[str, Any]:
        return {"statistic": self.statistic, "value": self.value, "bound": self.bound}


def baseline(days: Sequence[dict]) -> dict:
    """The mean statistics of several days: row-weighted label rate, mean missing rates, mean of the integer
    columns' means and standard deviations, and the union of their frequent ids."""
    rows = sum(d["rows"] for d in days)
    columns = days[0]["missing"].keys()
    return {
        "days": len(days),
        "label_rate": sum(d["label_rate"] * d["rows"] for d in days) / max(rows, 1),
        "missing": {c: sum(d["missing"][c] for d in days) / len(days) for c in columns},
        "dense_mean": {c: sum(d["dense_mean"][c] for d in days) / len(days) for c in days[0]["dense_mean"]},
        "dense_std": {c: sum(d["dense_std"][c] for d in days) / len(days) for c in days[0]["dense_std"]},
        "top_ids": {c: {i for d in days for i, _ in d["top_ids"][c]} for c in days[0]["top_ids"]},
    }


def id_overlap(day_top: Sequence[Sequence[int]], seen: set[int]) -> Optional[float]:
    """Of the rows carrying one of the day's frequent ids, the share whose id the baseline saw (None: no ids)."""
    total = sum(count for _, count in day_top)
    return sum(count for i, count in day_top if i in seen) / total if total else None


def check_day(stats: dict, days: Sequence[dict], bounds: ValidationBounds) -> Optional[Finding]:
    """The first statistic of ``stats`` beyond its bound against the baseline ``days`` (statistics of earlier
    days), or None when the day passes. Without earlier days only a label rate of 0 or 1 fails."""
    rate = stats["label_rate"]
    if rate <= 0 or rate >= 1:
        return Finding("label_rate", rate, "strictly between 0 and 1 (a day needs clicks and non-clicks)")
    if not days:
        return None
    base = baseline(days)
    of = f"the mean of the {base['days']} day{'s' if base['days'] > 1 else ''} before"
    low, high = base["label_rate"] / bounds.label_rate_ratio, base["label_rate"] * bounds.label_rate_ratio
    if not low <= rate <= high:
        return Finding("label_rate", rate, f"{low:.4f}..{high:.4f} ({base['label_rate']:.4f}, {of}, times or divided"
                                           f" by daily.validation.label_rate_ratio={bounds.label_rate_ratio})")
    for column, value in stats["missing"].items():
        usual, change = base["missing"][column], bounds.missing_rate_change
        if abs(value - usual) > change:
            return Finding(f"missing_rate[{column}]", value,
                           f"{max(usual - change, 0):.4f}..{min(usual + change, 1):.4f} ({usual:.4f}, {of}, +-"
                           f" daily.validation.missing_rate_change={change})")
    for column, value in stats["dense_mean"].items():
        usual, spread = base["dense_mean"][column], max(base["dense_std"][column], 1e-3)
        if abs(value - usual) > bounds.dense_shift * spread:
            width = bounds.dense_shift * spread
            return Finding(f"dense_mean[{column}]", value,
                           f"{usual - width:.4f}..{usual + width:.4f} ({usual:.4f}, {of}, +- daily.validation."
                           f"dense_shift={bounds.dense_shift} x its standard deviation {spread:.4f})")
    for column, top in stats["top_ids"].items():
        overlap = id_overlap(top, base["top_ids"][column])
        if overlap is not None and overlap < bounds.id_overlap and base["top_ids"][column]:
            return Finding(f"id_overlap[{column}]", overlap,
                           f">= daily.validation.id_overlap={bounds.id_overlap} (the share of the day's rows whose"
                           f" {column} id is among the frequent ids of the {base['days']} day"
                           f"{'s' if base['days'] > 1 else ''} before)")
    return None
