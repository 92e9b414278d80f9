"""The daily job's model history: AUC, log loss and calibration of every published and rejected version by day,
and every day's status (a quarantined day with who set it aside, when and why), read from the JSON run records
(``MODEL_ROOT/runs/DAY.json``), drawn to ``MODEL_ROOT/report.png`` and ``MODEL_ROOT/report.md``. The records are
the job's own, so the history survives any logger choice."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.parallel.guards.diskspace import writing
from disttrain.report.run import ReportError

HISTORY_METRICS = ("auc", "logloss", "calibration")
@dataclass
class DayEntry:
    """One day's record: its status (published, rejected, skipped, late, invalid, quarantined, released), the
    version it went into, the new model's metrics on the run's held-out rows and the current model's before it (for
    the gate), why it was not published, who set it aside or released it and when (``by``, ``at``), and what
    happened to its categorical ids (``ids``, see :mod:`disttrain.recsys.ids`)."""

    day: str
    status: str
    version: str | None
    run_date: str | None
    metrics: dict[str, float]
    current_metrics: dict[str, float]
    reason: str | None
    by: str | None = None
    at: str | None = None
    ids: dict[str, Any] | None = None  # the day's new ids, and collisions (hashed) or evictions (managed tables)

    def why(self) -> str:
        """The reason; for a quarantined day, with who set it aside and when (a release's reason names both)."""
        if self.status == "quarantined" and self.by:
            return f"{self.reason} (set aside by {self.by} at {self.at})"
        return self.reason or ""


def _number(value: Any) -> float:
    try:
        return float(value)  # records keep NaN and infinities as the strings "nan", "inf"
    except (TypeError, ValueError):
        return math.nan


def read_history(model_root: str | os.PathLike) -> list[DayEntry]:
    """Every day's record under ``MODEL_ROOT/runs``, oldest day first."""
    runs = Path(model_root) / "runs"
    files = sorted(runs.glob("*.json")) if runs.is_dir() else []
    if not files:
        raise ReportError(f"{model_root}: no runs/*.json records; point `disttrain report` at the daily job's "
                          f"--model-root after it has run")
    entries = []
    for path in files:
        try:
            r = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ReportError(f"{path}: unreadable record ({e}); restore it from a backup or delete it") from None
        metrics = {k: _number(v) for k, v in (r.get("metrics") or {}).items()}
        current = {k: _number(v) for k, v in (r.get("current_metrics") or {}).items()}
        day = r.get("day", path.stem)
        entries.append(DayEntry(day, r.get("status", "?"), r.get("version"), r.get("run_date"),
                                metrics, current, r.get("reason"), r.get("by"), r.get("at"),
                                (r.get("ids") or {}).get(day)))
    return entries


def is_daily_root(path: str | os.PathLike) -> bool:
    return (Path(path) / "runs").is_dir() and any((Path(path) / "runs").glob("*.json"))


def draw_history(entries: list[DayEntry], path: Path, title: str) -> list[str]:
    """One panel per metric of ``HISTORY_METRICS`` (x: day; published versions as green dots labelled with the
    version, rejected as red crosses, the current model's value that a rejected one was compared with as a grey
    ring) and a status strip of every day. Returns the panel titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = [e.day for e in entries]
    x = {d: i for i, d in enumerate(days)}
    fig, axes = plt.subplots(2, 2, figsize=(14, 8))
    titles = []
    for ax, key in zip(axes.flat, HISTORY_METRICS):
        for status, style in (("published", dict(color="tab:green", marker="o", linestyle="")),
                              ("rejected", dict(color="tab:red", marker="x", linestyle="", markersize=9))):
            points = [(x[e.day], e.metrics.get(key, math.nan), e) for e in entries if e.status == status]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=status, **style)
            if status == "published":
                for px, py, e in points:
                    if e.version and not math.isnan(py):
                        ax.annotate(e.version.lstrip("0") or "0", (px, py), textcoords="offset points",
                                    xytext=(0, 6), ha="center", fontsize=7)
        rejected_current = [(x[e.day], e.current_metrics.get(key, math.nan)) for e in entries
                            if e.status == "rejected" and e.current_metrics]
        if rejected_current:
            ax.plot(*zip(*rejected_current), marker="o", markerfacecolor="none", color="tab:gray", linestyle="",
                    label="current model (kept)")
        if key == "calibration":
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax.set_title(f"{key} per day"), ax.set_xticks(range(len(days)), days, rotation=45, ha="right", fontsize=7)
        ax.legend(fontsize=8)
        titles.append(f"{key} per day")
    ax = axes[1, 1]
    colors = {"published": "tab:green", "rejected": "tab:red", "skipped": "tab:orange", "late": "tab:purple",
              "invalid": "tab:brown", "quarantined": "black", "released": "tab:olive"}
    ax.bar(range(len(days)), [1] * len(days), color=[colors.get(e.status, "tab:gray") for e in entries])
    for i, e in enumerate(entries):
        ax.text(i, 0.5, e.status, rotation=90, ha="center", va="center", fontsize=8, color="white")
    ax.set_xticks(range(len(days)), days, rotation=45, ha="right", fontsize=7), ax.set_yticks([])
    ax.set_title("status per day")
    titles.append("status per day")
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    try:
        with writing(path, "the model history report", "report", cleanup=tmp):
            fig.savefig(tmp, dpi=90)
    finally:
        plt.close(fig)
    os.replace(tmp, path)
    return titles


def _f(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.4f}"


def _ids(figures: dict[str, Any] | None) -> str:
    """The new ids, collisions and evictions cells of a day ("-" where a figure does not apply)."""
    figures = figures or {}
    return " | ".join(f"{figures[k]:,}" if isinstance(figures.get(k), int) else "-"
                      for k in ("new_ids", "collisions", "evictions"))


def history_markdown(entries: list[DayEntry], title: str, panels: list[str]) -> str:
    lines = [f"# Model history: {title}", "", "![report](report.png)", "", "Panels: " + ", ".join(panels) + ".", "",
             "| day | status | version | run date | AUC | log loss | calibration | current AUC | reason | new ids |"
             " collisions | evictions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        m = e.metrics
        lines.append(f"| {e.day} | {e.status} | {e.version or '-'} | {e.run_date or '-'} | {_f(m.get('auc'))} | "
                     f"{_f(m.get('logloss'))} | {_f(m.get('calibration'))} | "
                     f"{_f(e.current_metrics.get('auc'))} | {e.why().replace('|', '/')} | {_ids(e.ids)} |")
    counts = {s: sum(e.status == s for e in entries) for s in dict.fromkeys(e.status for e in entries)}
    lines += ["", "Days: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + "."]
    return "\n".join(lines) + "\n"


def write_history_report(model_root: str | os.PathLike) -> tuple[Path, Path]:
    """Draw ``MODEL_ROOT/report.png`` and write ``MODEL_ROOT/report.md`` from the run records."""
    root = Path(model_root)
    entries = read_history(root)
    png, md = root / "report.png", root / "report.md"
    panels = draw_history(entries, png, f"daily DeepFM: {root}")
    tmp = md.with_suffix(".md.tmp")
    with writing(md, "the model history report", "report", cleanup=tmp):
        tmp.write_text(history_markdown(entries, str(root), panels))
    os.replace(tmp, md)
    return png, md
