"""Pictures and tables a person looks at: `disttrain plan --plot`, the benchmarks' Markdown + PNG outputs, and the
dialogue demo's before/after replies. Single-process; the two that start fresh Python processes (a bench, the recipe)
are marked slow. Figures are checked through their data, not pixels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from matplotlib.container import BarContainer  # noqa: E402

from conftest import run_python  # noqa: E402

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


@pytest.mark.slow  # fresh Python processes (imports dominate): kept out of `make test-fast`
def test_a_bench_writes_its_table_as_markdown_and_png(tmp_path):
    """bench/attention.py at two short sequences (forward only, one timed call): the Markdown rows are the printed
    rows, the PNG's panels chart the ratio columns with the target lines."""
    from matplotlib.image import imread

    proc = run_python(str(ROOT / "bench/attention.py"), "--seqs", "64", "128", "--forward-only", "--repeats", "1",
                      "--skip-cuda", "--out-dir", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    md, png = tmp_path / "attention_cpu.md", tmp_path / "attention_cpu.png"
    assert f"wrote {md} and {png}" in proc.stdout
    printed = {int(line.split("|")[0]): line.split("|")[2].split()
               for line in proc.stdout.splitlines() if line.split("|")[0].strip().isdigit()}
    rows = [line.strip("|").split("|") for line in md.read_text().splitlines() if line.startswith("| seq ")]
    assert [r[0].strip() for r in rows] == ["seq 64", "seq 128"]
    for r in rows:  # eager ms, sdpa ms as printed
        seq = int(r[0].split()[1])
        assert [c.strip() for c in r[4:6]] == printed[seq][:2]
    assert "![SDPA against eager attention (CPU)](attention_cpu.png)" in md.read_text()
    assert imread(png).ndim == 3


def test_write_table_charts_the_named_columns_and_refuses_unknown_ones(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import tables
    finally:
        sys.path.remove(str(ROOT / "bench"))
    rows = [["baseline", 10.0, 1.0], ["ours", 10.4, 1.04]]
    fig = tables.chart("t", "s", ["variant", "ms/step", "ratio"], rows, ("ms/step", "ratio"), {"ratio": 1.0})
    widths = [[p.get_width() for p in ax.patches] for ax in fig.axes]
    assert widths == [[10.0, 10.4], [1.0, 1.04]]
    assert [ax.get_lines()[0].get_xdata()[0] for ax in fig.axes if ax.get_lines()] == [1.0]
    md, png = tables.write_table("x", "t", "s", ["variant", "ms/step", "ratio"], rows, bars=("ratio",),
                                 fmt={"ratio": ".2f"}, out_dir=tmp_path)
    assert "| ours | 10.4 | 1.04 |" in md.read_text() and png.is_file()
    with pytest.raises(ValueError, match=r"bars \['speed'\] are not columns"):
        tables.write_table("y", "t", "s", ["variant", "ratio"], rows, bars=("speed",), out_dir=tmp_path)
    assert not (tmp_path / "y.md").exists()


def test_side_by_side_keeps_columns_aligned_with_wide_characters():
    from disttrain.nlp.replies import side_by_side, wrap

    assert wrap("ab cd ef", 5) == ["ab cd", "ef"]
    assert wrap("我不知道你说什么", 6) == ["我不知", "道你说", "什么"]  # two columns per CJK glyph
    text = side_by_side(["Hi?"], ["你好 " * 12], ["hello there"], "before", "after", width=20)
    lines = text.splitlines()
    assert lines[0].startswith("before") and lines[0].endswith("| after")
    body = [line for line in lines[2:] if not line.startswith(("user:", "-"))]
    assert body[0].endswith("| hello there") and len(body) == 3  # 12 two-column words wrap onto 3 lines of 20
    for line in body:  # the separator sits at the same terminal column on every line
        left = line[:line.index("|")]
        assert sum(2 if ord(c) > 0x2E80 else 1 for c in left) == 21


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    from disttrain.nlp.corpus import demo_data

    root = tmp_path_factory.mktemp("demo_data")
    demo_data(root)
    return root


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory, demo_root):
    """Two tiny Llama models (different random weights) exported as HF folders with the demo tokenizer."""
    import torch

    from disttrain.nlp import DialogueLM, export_hf, load_tokenizer
    from disttrain.nlp.corpus import demo_data
    from disttrain.parallel.checkpoint.io import export_safetensors

    root = tmp_path_factory.mktemp("replies")
    _, tok_dir = demo_data(demo_root)
    tokenizer = load_tokenizer(tok_dir)
    model = {"vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        module = DialogueLM(config={"model": model})
        module.configure_model()
        folders.append(export_hf(root / f"hf{seed}", lambda p, m=module: export_safetensors(m, p, prefix="model."),
                                 module.config, tokenizer))
    return folders


def test_replies_before_and_after_are_drawn_with_the_same_seed(tiny_exports):
    import torch

    from disttrain.nlp.replies import Sampling, sample_replies, side_by_side

    prompts = ["Hello, how are you?", "What is your favorite book?"]
    sampling = Sampling(temperature=0.8, top_k=40, max_new_tokens=8, seed=3)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = sample_replies(tiny_exports[0], prompts, sampling)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is untouched
    assert sample_replies(tiny_exports[0], prompts, sampling) == first  # seeded: reproducible
    assert sample_replies(tiny_exports[0], prompts, Sampling(max_new_tokens=8, seed=4)) != first
    other = sample_replies(tiny_exports[1], prompts, sampling)
    assert other != first and all(isinstance(r, str) for r in first + other)
    greedy = Sampling(temperature=0, max_new_tokens=8)
    assert sample_replies(tiny_exports[1], prompts, greedy) == sample_replies(tiny_exports[1], prompts, greedy)
    table = side_by_side(prompts, first, other, "before training (ppl 2,000)", "after 90 steps (ppl 97)")
    assert table.count("user: ") == 2 and "before training (ppl 2,000)" in table.splitlines()[0]


@pytest.mark.slow  # fresh Python processes (imports dominate): kept out of `make test-fast`
def test_the_recipe_prints_the_demo_prompts_before_and_after_training(tmp_path, demo_root):
    """The dialogue recipe with the demo config, one process, 2 steps: the prompts answered by the starting and the
    trained export, labelled with their held-out perplexities, under the data's own reply."""
    import re

    proc = run_python(str(ROOT / "recipes/nlp/dialogue_llm.py"), "--devices", "1", "--config",
                      str(ROOT / "configs/nlp/dialogue_demo.yaml"), "--steps", "2", "--eval-every", "2", "--demo-root",
                      str(demo_root), "--out", str(tmp_path / "out"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    before = float(re.search(r"held-out perplexity before training ([\d.]+)", out).group(1))
    after = float(re.findall(r"held-out perplexity ([\d.]+)", out)[-1])
    head = re.search(r"^before training \(ppl ([\d,]+)\) +\| after 2 steps \(ppl ([\d,]+)\)$", out, re.M)
    assert head, out[-3000:]
    assert [int(g.replace(",", "")) for g in head.groups()] == [round(before), round(after)]
    assert "user: How are you doing?" in out and "user: Who is your boss" in out
    assert "(the data's reply: I am doing well, how about you?)" in out  # the demo data's own reply, shown above
    assert (tmp_path / "out/hf_before/model.safetensors").is_file() and (tmp_path / "out/hf").is_dir()


def test_a_misspelt_sampling_key_is_one_line_with_the_fix(tmp_path):
    from disttrain.config import ConfigError
    from disttrain.nlp import read_recipe_config

    path = tmp_path / "demo.yaml"
    path.write_text((ROOT / "configs/nlp/dialogue_demo.yaml").read_text().replace("top_k:", "topk:"))
    with pytest.raises(ConfigError, match=r"unknown key 'topk' in train.sampling:; did you mean 'top_k'\?"):
        read_recipe_config(path)
