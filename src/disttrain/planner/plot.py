"""The plan as a picture: per-rank memory of every candidate as stacked bars against the usable device memory.

    from disttrain.planner import choose
    from disttrain.planner.plot import save_plan_plot
    save_plan_plot(choose("configs/nlp/dialogue_10b.yaml", 32, "A100-40GB"), "plan.png")

Drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from disttrain.planner.choose import Plan

# (Estimate attribute, legend label, colour): bottom to top of each bar.
SEGMENTS = (
    ("states", "model states (params, grads, optimizer)", "#4c72b0"),
    ("activations", "activations", "#dd8452"),
    ("buffers", "buffers (gathers, buckets)", "#55a868"),
    ("host", "host memory (offload; not on the device)", "#c8c8c8"),
)


def plan_figure(plan: Plan) -> Figure:
    """One horizontal stacked bar per candidate (in the plan's order, top to bottom) in the plan's unit (GiB or
    MiB), the usable device memory per rank as a dashed line, the chosen candidate marked. The host segment sits
    after the device segments, hatched: only the device part is measured against the line."""
    unit_name, unit = plan.unit
    labels = [c.label for c in plan.candidates]
    y = list(range(len(labels)))[::-1]  # first candidate on top
    fig = Figure(figsize=(10, 1.6 + 0.45 * len(labels)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    left = [0.0] * len(labels)
    for attr, legend, colour in SEGMENTS:
        widths = [getattr(c.estimate, attr) / unit for c in plan.candidates]
        ax.barh(y, widths, left=left, color=colour, label=legend, hatch="//" if attr == "host" else None,
                edgecolor="white" if attr != "host" else "#888888", linewidth=0.5)
        left = [a + b for a, b in zip(left, widths)]
    if plan.candidates:
        usable = plan.candidates[0].usable / unit
        ax.axvline(usable, color="#c44e52", linestyle="--", linewidth=1.5,
                   label=f"usable device memory per rank ({usable:.1f} {unit_name})")
    for yi, end, c in zip(y, left, plan.candidates):
        mark = "chosen" if c is plan.choice else ("fits" if c.fits else "does not fit")
        ax.annotate(f" {c.estimate.device / unit:.1f} on device - {mark}", (end, yi),
                    va="center", fontsize=8, color="black" if c.fits else "#c44e52",
                    fontweight="bold" if c is plan.choice else "normal")
    ax.set_yticks(y, labels, fontsize=8)
    for tick, c in zip(ax.get_yticklabels(), plan.candidates):
        if c is plan.choice:
            tick.set_fontweight("bold")
    ax.set_xlabel(f"{unit_name} per rank")
    ax.set_xlim(0, max(left + [plan.candidates[0].usable / unit if plan.candidates else 1.0]) * 1.35)
    hw = plan.hardware
    ax.set_title(f"{plan.spec.family}, {_count(plan.spec.params)} parameters on {plan.world_size} x {hw.name}"
                 f" ({hw.memory / unit:.1f} {unit_name})", fontsize=10)
    ax.legend(loc="lower right", fontsize=7, framealpha=0.9)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Write ``fig`` as PNG to ``path`` (parent folders made), replacing any old file only once it is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_plan_plot(plan: Plan, path: str | os.PathLike) -> Path:
    """Draw ``plan`` (see :func:`plan_figure`) and write it as a PNG; returns the path written."""
    return save_figure(plan_figure(plan), path)
