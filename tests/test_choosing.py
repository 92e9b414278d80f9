"""docs/choosing.md against the tool: the guide's reference cases are the configs' own, every `disttrain plan`
command it shows prints what the guide shows below it, and every choice its tables state is the one the tool prints.

The guide's plan commands are marked ``covered:`` by this module, so tests/test_docs.py does not run them again; the
```text block after each (its lines in order, ``...`` for lines left out) is checked here with test_docs' matcher.
The commands run in this process through the console script's entry point, ``disttrain.cli:main``, with the flags the
guide shows (--gpu, --micro-batch, --activation-checkpointing) as written there.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex

import pytest
import yaml

from test_docs import ROOT, SHELL, Block, parse, printed

GUIDE = ROOT / "docs" / "choosing.md"
COVERED = "tests/test_choosing.py::test_plan_commands_print_what_the_guide_shows"
HEADING = "## The three reference cases"  # other pages link to choosing.md#the-three-reference-cases

# The three cases as the configs and their recipes give them: config -> the machine it is planned for.
REFERENCE = {
    "configs/nlp/dialogue_10b.yaml": "--gpus 32 --gpu A100",  # 4 nodes of 8 A100 40 GB
    "configs/vision/vit2b.yaml": "--gpus 16 --gpu A100",  # 2 nodes of 8 A100 40 GB
    "configs/recsys/deepfm_5b.yaml": "--gpus 8 --gpu T4",  # one node of 8 T4 16 GB
}


def own_batch(config: str) -> int:
    """Samples per GPU per step the config trains with (the planner reads it from the recipe)."""
    recipe = yaml.safe_load((ROOT / config).read_text())
    if "data" in recipe and "batch_size" in recipe["data"]:  # the ViT: images per process
        return recipe["data"]["batch_size"]
    return recipe["train"].get("micro_batch_size", recipe["train"].get("batch_size"))


def choice_tables(text: str) -> list[list[tuple[str, str]]]:
    """Each table whose last two columns are `command` and `the tool's choice`, as (command, choice) rows."""
    tables: list[list[tuple[str, str]]] = []
    current = None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[-2:] == ["command", "the tool's choice"]:
            current = []
            tables.append(current)
        elif current is not None and not set(line) <= set("|-: "):
            current.append((cells[-2].strip("`"), cells[-1].strip("`")))
    return tables


def covered_blocks() -> list[tuple[Block, Block | None]]:
    """The guide's shell blocks this module covers, each with the ```text block right after it (or None)."""
    blocks = parse(GUIDE).blocks
    return [(b, after if after is not None and after.lang == "text" else None)
            for b, after in zip(blocks, [*blocks[1:], None])
            if b.lang in SHELL and b.marker == ("covered", COVERED)]


@functools.cache
def plan(command: str) -> str:
    """What `disttrain plan ...` prints (configs/ paths read from the repository, wherever pytest runs)."""
    from disttrain import cli

    words = shlex.split(command)
    assert words[:2] == ["disttrain", "plan"], f"the guide's command is not a plan: {command}"
    argv = [str(ROOT / w) if w.startswith("configs/") else w for w in words[1:]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    assert code == 0, f"`{command}` exited {code}:\n{out.getvalue()}"
    return out.getvalue()


def recommendation(output: str) -> str:
    """The strategy label of the tool's `recommendation:` line, without the options it prints after it."""
    line = next(l for l in output.splitlines() if l.startswith("recommendation: "))
    return line.removeprefix("recommendation: ").split("  ")[0].strip()


def test_the_guide_defines_the_three_reference_cases():
    text = GUIDE.read_text()
    assert HEADING in text.splitlines(), f"docs/choosing.md has no heading {HEADING!r}"
    tables = choice_tables(text)
    assert tables, "docs/choosing.md has no table with the columns `command` and `the tool's choice`"
    expected = [f"disttrain plan --model {config} {machine}" for config, machine in REFERENCE.items()]
    assert [command for command, _ in tables[0]] == expected, "the reference table's commands differ from the cases"
    for config, machine in REFERENCE.items():  # the plain command plans at the batch the config trains with
        output = plan(f"disttrain plan --model {config} {machine}")
        rows = [l for l in output.splitlines() if l.startswith("disttrain_")]
        assert rows and all(int(re.split(r"\s{2,}", l)[1]) == own_batch(config) for l in rows), (config, output)
    assert all(choice.startswith("disttrain_") for table in tables for _, choice in table)


@pytest.mark.slow
def test_plan_commands_print_what_the_guide_shows():
    blocks = covered_blocks()
    assert blocks, f"no block of docs/choosing.md is marked covered: {COVERED}"
    for block, shown in blocks:
        commands = block.commands()
        assert len(commands) == 1, f"{block.where}: one plan command per block, so its output can follow it"
        output = plan(commands[0])
        assert shown is not None, f"{block.where}: `{commands[0]}` has no ```text block with its output after it"
        missing = printed(shown.text, output)
        assert missing is None, f"{shown.where}: `{commands[0]}` did not print {missing!r}; it printed:\n{output}"


@pytest.mark.slow
def test_the_guides_choices_are_the_tools():
    rows = [row for table in choice_tables(GUIDE.read_text()) for row in table]
    wrong = [f"`{command}`: the guide says {choice}, the tool recommends {recommendation(plan(command))}"
             for command, choice in rows if recommendation(plan(command)) != choice]
    assert not wrong, "\n".join(wrong)


# The 7B/8B configs: config -> (the machine in its header, the strategy and options its launch command uses).
SEVEN_B = {
    "configs/nlp/dialogue_8b.yaml": ("--gpus 8 --gpu A100-80GB", "disttrain_fsdp"),
    "configs/nlp/dialogue_8b_lora.yaml": ("--gpus 8 --gpu A100-80GB", "disttrain_ddp"),
    "configs/nlp/dialogue_8b_32k.yaml": ("--gpus 8 --gpu A100-80GB",
                                         "disttrain_megatron tp=1 pp=1 dp=1 cp=8  {'context_parallel_size': 8}"),
}


@pytest.mark.parametrize("config", SEVEN_B)
def test_the_7b_configs_are_what_the_planner_chooses_and_fit(config):
    """Each 8B config's launch command (its header) uses the strategy the planner recommends for the machine the
    header names, and that plan fits the GPU."""
    machine, expected = SEVEN_B[config]
    header = (ROOT / config).read_text().split("\nmodel:")[0]
    assert f"disttrain plan --model {config} {machine}" in header.replace("\n# ", " ")
    output = plan(f"disttrain plan --model {config} {machine}")
    line = next(l for l in output.splitlines() if l.startswith("recommendation: "))
    assert line.removeprefix("recommendation: ") == expected, output
    strategy, *sizes = expected.split("  ")[0].split()
    assert f"--strategy {strategy} " in header
    for size in sizes:
        name, value = size.split("=")
        if name == "cp" and value != "1":
            assert f"--context-parallel-size {value}" in header
    fits = re.search(r"fits \(([\d.]+) of ([\d.]+) GiB per rank\)", output)
    assert fits and float(fits[1]) < float(fits[2]), output
