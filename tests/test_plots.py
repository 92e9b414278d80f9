"""Pictures and tables a person looks at: `disttrain plan --plot`, the benchmarks' Markdown + PNG outputs, and the
dialogue demo's before/after replies. Single-process and fast; figures are checked through their data, not pixels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from matplotlib.container import BarContainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _bars(fig) -> dict[str, list[tuple[float, float]]]:
    """Legend label -> (left, width) of each bar, top candidate first (the plot draws the first candidate on top)."""
    ax = fig.axes[0]
    out = {}
    for container in ax.containers:
        if isinstance(container, BarContainer):
            bars = sorted(container.patches, key=lambda p: -p.get_y())
            out[container.get_label()] = [(p.get_x(), p.get_width()) for p in bars]
    return out


def test_plan_plot_draws_every_candidates_estimate_against_the_usable_line(tmp_path, monkeypatch, capsys):
    from matplotlib.image import imread

    from disttrain import cli
    from disttrain.planner import plot

    drawn = []
    monkeypatch.setattr(plot, "plan_figure", lambda plan, _draw=plot.plan_figure: drawn.append((plan, _draw(plan)))
                        or drawn[-1][1])
    out = tmp_path / "figs" / "plan.png"
    assert cli.main(["plan", "--model", str(ROOT / "configs/nlp/dialogue_10b.yaml"), "--gpus", "32",
                     "--gpu-mem", "40GiB", "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert imread(out).shape[2] in (3, 4)  # a real PNG that matplotlib reads back
    (plan, fig), = drawn
    _, unit = plan.unit
    bars = _bars(fig)
    assert len(bars) == 4 and all(len(v) == len(plan.candidates) for v in bars.values())
    states, acts, buffers, host = (bars[legend] for _, legend, _ in plot.SEGMENTS)
    for i, c in enumerate(plan.candidates):
        e = c.estimate
        assert states[i] == pytest.approx((0, e.states / unit))
        assert acts[i] == pytest.approx((e.states / unit, e.activations / unit))  # stacked on the states
        assert buffers[i][1] == pytest.approx(e.buffers / unit)
        assert host[i] == pytest.approx((e.device / unit, e.host / unit))  # after the device part
    assert any(e.host > 0 for e in (c.estimate for c in plan.candidates))  # the offload rows show host bytes
    line, = fig.axes[0].get_lines()
    assert line.get_xdata()[0] == pytest.approx(plan.candidates[0].usable / unit)
    ticks = {t.get_position()[1]: t.get_text() for t in fig.axes[0].get_yticklabels()}
    assert [ticks[y] for y in sorted(ticks, reverse=True)] == [c.label for c in plan.candidates]
    chosen, = [t for t in fig.axes[0].get_yticklabels() if t.get_fontweight() == "bold"]
    assert chosen.get_text() == plan.choice.label == "disttrain_zero3"


def test_plan_plot_to_an_unwritable_path_is_one_line(tmp_path):
    from disttrain import cli

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=r"cannot write --plot .*file/plan.png"):
        cli.main(["plan", "--model", str(ROOT / "configs/nlp/dialogue_tiny.yaml"), "--gpus", "2",
                  "--plot", str(blocker / "plan.png")])
