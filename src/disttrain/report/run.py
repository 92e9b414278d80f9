"""The run report: ``RUN_DIR/report.png`` and ``RUN_DIR/report.md``, drawn from the CSV logger's ``metrics.csv``
files and ``run.json`` only, so an interrupted run can be reported too (``disttrain report RUN_DIR``).

Metric names the report looks for (recipes log them with ``fabric.log_dict``; the ``Throughput`` callback logs the
``throughput/`` and ``memory/`` ones):

- ``train/loss``, ``val/loss`` and any other ``val/<name>`` (held-out metrics: perplexity, accuracy, ...)
- ``train/lr``
- ``throughput/tokens_per_s`` or ``throughput/samples_per_s``, ``throughput/mfu``
- ``memory/peak_mib_rank<r>`` (per-rank peak memory), ``time/elapsed_s`` (wall time so far)
"""

from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.report.loggers import read_run_info

Series = list[tuple[int, float]]
PANELS = ("loss", "held-out metrics", "learning rate", "throughput", "peak memory per rank", "run")


class ReportError(ValueError):
    """A run folder the report cannot read; the message names the folder and what is missing."""


def metrics_files(run_dir: str | os.PathLike) -> list[Path]:
    """The CSV logger's files under ``RUN_DIR/logs/csv``, oldest version first (a resumed run adds a version)."""
    root = Path(run_dir) / "logs" / "csv"

    def version(path: Path) -> int:
        m = re.search(r"version_(\d+)$", path.parent.name)
        return int(m.group(1)) if m else -1

    return sorted(root.glob("*/metrics.csv"), key=version)


def read_metrics(run_dir: str | os.PathLike) -> dict[str, Series]:
    """Every logged metric as ``[(step, value), ...]`` sorted by step. Where a later version (a resumed run) logs a
    step again, its value wins."""
    files = metrics_files(run_dir)
    if not files:
        raise ReportError(f"{run_dir}: no logs/csv/*/metrics.csv; the report is drawn from the CSV logger's file, "
                          f"so run with --logger csv (or tensorboard,csv, the default)")
    values: dict[str, dict[int, float]] = {}
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = row.pop("step", "")
                if step in ("", None):
                    continue
                for key, value in row.items():
                    if value not in ("", None):
                        try:
                            values.setdefault(key, {})[int(float(step))] = float(value)
                        except ValueError:
                            continue
    return {k: sorted(v.items()) for k, v in sorted(values.items())}


@dataclass
class RunSummary:
    """What the report shows, read back from the logs."""

    run_dir: Path
    info: dict[str, Any]
    metrics: dict[str, Series]
    held_out: list[str] = field(default_factory=list)
    throughput_key: str | None = None
    memory: dict[int, float] = field(default_factory=dict)
    wall_s: float | None = None
    finished: bool = False
    last_step: int = 0


def summarize(run_dir: str | os.PathLike) -> RunSummary:
    metrics = read_metrics(run_dir)
    info = read_run_info(run_dir)
    s = RunSummary(Path(run_dir), info, metrics)
    s.held_out = [k for k in metrics if k.startswith("val/") and k != "val/loss"]
    s.throughput_key = next((k for k in ("throughput/tokens_per_s", "throughput/samples_per_s") if k in metrics), None)
    for key, series in metrics.items():
        m = re.fullmatch(r"memory/peak_mib_rank(\d+)", key)
        if m and series:
            s.memory[int(m.group(1))] = series[-1][1]
    s.finished = bool(info.get("finished"))
    elapsed = metrics.get("time/elapsed_s")
    s.wall_s = info.get("wall_s") if s.finished and info.get("wall_s") is not None else (
        elapsed[-1][1] if elapsed else None)
    s.last_step = max((series[-1][0] for series in metrics.values() if series), default=0)
    return s


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"


def _strategy_lines(info: dict[str, Any]) -> list[str]:
    strategy = info.get("strategy") or {}
    options = strategy.get("options") or {}
    lines = [f"strategy: {strategy.get('name', '?')} ({strategy.get('class', '?')})"]
    lines += [f"  {k} = {v}" for k, v in options.items()] or ["  (default options)"]
    if strategy.get("degrees"):
        lines.append("  degrees: " + " ".join(f"{k}={v}" for k, v in strategy["degrees"].items()))
    return lines


def _info_lines(s: RunSummary) -> list[str]:
    info = s.info
    wall = f"{s.wall_s:,.1f} s" if s.wall_s is not None else "unknown"
    state = "finished" if s.finished else "interrupted or still running (wall time up to the last log)"
    lines = [f"recipe: {info.get('recipe', '?')}", *_strategy_lines(info),
             f"processes: {info.get('world_size', '?')} x {info.get('device', '?')}",
             f"precision: {info.get('precision', '?')}", f"wall time: {wall} ({state})",
             f"last logged step: {s.last_step}", f"started: {info.get('started_at', '?')}"]
    return lines


def draw_png(s: RunSummary, path: Path) -> list[str]:
    """Six panels (``PANELS``): loss, held-out metrics, learning rate, throughput (+MFU), per-rank peak memory bars,
    and the run's description. Returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    m = s.metrics
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    titles: list[str] = []

    def line(ax: Any, key: str, label: str, **kw: Any) -> None:
        if m.get(key):
            steps, values = zip(*m[key])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label, **kw)

    ax = axes[0, 0]
    line(ax, "train/loss", "train")
    line(ax, "val/loss", "held-out")
    ax.set_title("loss"), ax.set_xlabel("optimizer step"), ax.legend(loc="upper right")
    titles.append("loss")

    ax = axes[0, 1]
    if s.held_out:
        line(ax, s.held_out[0], s.held_out[0], color="tab:green")
        ax.set_ylabel(s.held_out[0])
        if s.held_out[0].endswith("ppl"):
            ax.set_yscale("log")
        if len(s.held_out) > 1:
            twin = ax.twinx()
            line(twin, s.held_out[1], s.held_out[1], color="tab:purple")
            twin.set_ylabel(s.held_out[1])
    else:
        ax.text(0.5, 0.5, "no held-out metric logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("held-out metrics: " + (", ".join(s.held_out[:2]) or "none")), ax.set_xlabel("optimizer step")
    titles.append("held-out metrics")

    ax = axes[0, 2]
    line(ax, "train/lr", "learning rate", color="tab:orange")
    ax.set_title("learning rate"), ax.set_xlabel("optimizer step")
    titles.append("learning rate")

    ax = axes[1, 0]
    if s.throughput_key:
        line(ax, s.throughput_key, s.throughput_key.split("/")[1], color="tab:blue")
        ax.set_ylabel(s.throughput_key.split("/")[1].replace("_per_s", "/s"))
        if m.get("throughput/mfu"):
            twin = ax.twinx()
            line(twin, "throughput/mfu", "MFU", color="tab:red", linestyle="--")
            twin.set_ylabel("MFU")
    else:
        ax.text(0.5, 0.5, "no throughput logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("throughput" + (" and MFU" if m.get("throughput/mfu") else " (MFU: peak FLOP/s unknown)"))
    ax.set_xlabel("optimizer step")
    titles.append("throughput")

    ax = axes[1, 1]
    if s.memory:
        ranks = sorted(s.memory)
        ax.bar([str(r) for r in ranks], [s.memory[r] for r in ranks], color="tab:gray")
        for r in ranks:
            ax.annotate(f"{s.memory[r]:,.0f}", (ranks.index(r), s.memory[r]), ha="center", va="bottom")
        ax.set_xlabel("rank"), ax.set_ylabel("MiB")
    else:
        ax.text(0.5, 0.5, "no memory logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("peak memory per rank")
    titles.append("peak memory per rank")

    ax = axes[1, 2]
    ax.axis("off")
    ax.text(0.0, 1.0, "\n".join(_info_lines(s)), va="top", family="monospace", fontsize=9, transform=ax.transAxes)
    ax.set_title("run")
    titles.append("run")

    fig.suptitle(f"{s.info.get('recipe', 'run')}: {s.run_dir}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return titles


def markdown(s: RunSummary, panels: list[str]) -> str:
    m = s.metrics
    rows = ["train/loss", "val/loss", *s.held_out, "train/lr"]
    if s.throughput_key:
        rows.append(s.throughput_key)
    if m.get("throughput/mfu"):
        rows.append("throughput/mfu")
    lines = [f"# Run report: {s.run_dir}", "", "![report](report.png)", "",
             "Panels: " + ", ".join(panels) + ".", "", "## Run", "", "```", *_info_lines(s), "```", "",
             "## Metrics", "", "| metric | first | last | best | at step |", "|---|---|---|---|---|"]
    for key in rows:
        series = m.get(key)
        if not series:
            continue
        values = [v for _, v in series]
        better = max if key in ("val/acc", "val/auc") else min
        best = better(series, key=lambda sv: sv[1]) if not key.startswith(("throughput", "train/lr")) else None
        lines.append(f"| {key} | {_fmt(values[0])} | {_fmt(values[-1])} | {_fmt(best[1] if best else None)} | "
                     f"{series[-1][0] if best is None else best[0]} |")
    lines += ["", "## Peak memory per rank", "", "| rank | peak MiB |", "|---|---|"]
    lines += [f"| {r} | {_fmt(v)} |" for r, v in sorted(s.memory.items())] or ["| - | not logged |"]
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Draw ``RUN_DIR/report.png`` and write ``RUN_DIR/report.md`` from the logs; returns both paths."""
    s = summarize(run_dir)
    png, md = Path(run_dir) / "report.png", Path(run_dir) / "report.md"
    panels = draw_png(s, png)
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(markdown(s, panels))
    os.replace(tmp, md)
    return png, md
