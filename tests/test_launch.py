"""The launch layer (disttrain.launch): one function from a name and options to the strategy Fabric or the Trainer
runs, the same objects the names give Lightning; the launcher's variables; and the flags the recipes share."""

from __future__ import annotations

import argparse
import dataclasses
import re

import lightning as L
import pytest
from conftest import run_python
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import disttrain  # noqa: F401  (registers the disttrain_* names)
from disttrain.launch import (Default, LaunchError, add_recipe_flags, build_strategy, fabric_kwargs, flag_names,
                              shared_flags, strategy_options, takes)
from disttrain.parallel import registry

LAUNCHER_ENV = ("LT_CLI_USED", "LT_STRATEGY", "LT_ACCELERATOR", "LT_DEVICES", "LT_NUM_NODES", "LT_PRECISION")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)


def options_of(strategy):
    """What a disttrain strategy object was built with: its engine's options (the planner's for disttrain_auto)."""
    return getattr(strategy, "auto_options", None) or strategy.engine.options


@pytest.mark.parametrize("entry,lightning_registry", [("fabric", STRATEGY_REGISTRY), ("trainer", StrategyRegistry)])
@pytest.mark.parametrize("name", registry.names())
def test_every_registered_name_builds_the_object_lightning_builds_from_the_name(name, entry, lightning_registry):
    model = "configs/nlp/dialogue_tiny.yaml"  # disttrain_auto under Fabric plans for a model given up front
    row = lightning_registry[name]
    before = row["strategy"](**row["init_params"], **({"model": model} if name == "disttrain_auto" else {}))
    built = build_strategy(name, entry=entry, model=model if entry == "fabric" else None)
    assert type(built) is type(before)
    if name == "disttrain_auto" and entry == "trainer":
        assert options_of(built) == dataclasses.replace(options_of(before), model=None)
    else:
        assert options_of(built) == options_of(before)


def test_options_come_on_top_of_the_rows_defaults():
    strategy = build_strategy("disttrain_fsdp_offload", {"activation_checkpointing": True})
    assert strategy.engine.options.cpu_offload and strategy.engine.options.activation_checkpointing
    megatron = build_strategy("disttrain_megatron", {"tensor_parallel_size": 2}, entry="trainer", world=4)
    assert type(megatron).__module__ == "disttrain.strategies.megatron"
    assert megatron.engine.options.tensor_parallel_size == 2
    auto = build_strategy("disttrain_auto", {"headroom": 0.2}, model={"hidden_size": 8},
                          planner={"micro_batch": 4, "seq_len": None, "activation_checkpointing": True})
    assert (auto.auto_options.micro_batch, auto.auto_options.seq_len, auto.auto_options.headroom) == (4, None, 0.2)
    assert auto.auto_options.model == {"hidden_size": 8} and auto.auto_options.activation_checkpointing
    # the planner's settings are not options of the other strategies: a recipe passes them whatever the name
    assert type(build_strategy("disttrain_ddp", planner={"micro_batch": 4})).__name__ == "DDPStrategy"


def test_an_option_of_another_strategy_is_one_line_naming_it():
    with pytest.raises(LaunchError) as e:
        build_strategy("disttrain_fsdp", {"tensor_parallel_size": 2})
    assert str(e.value) == ("tensor_parallel_size=2 is an option of disttrain_megatron, not of disttrain_fsdp: pass"
                            " strategy='disttrain_megatron' with it, or leave tensor_parallel_size out")
    with pytest.raises(LaunchError, match=r"^--context-parallel-size 2 is an option of disttrain_megatron, not of"
                                          r" disttrain_zero3: pass --strategy disttrain_megatron with it, or leave"
                                          r" --context-parallel-size out$"):
        build_strategy("disttrain_zero3", {"context_parallel_size": 2}, flags=flag_names())
    with pytest.raises(LaunchError, match="not of Lightning's ddp: pass --strategy disttrain_megatron"):
        build_strategy("ddp", {"pipeline_parallel_size": 2}, flags=flag_names())
    with pytest.raises(LaunchError, match="did you mean 'cpu_offload'"):  # a misspelt option: the registry's hint
        build_strategy("disttrain_fsdp", {"cpu_ofload": True})
    with pytest.raises(LaunchError, match="did you mean 'disttrain_fsdp'"):
        build_strategy("disttrain_fdsp")
    with pytest.raises(LaunchError, match="disttrain_auto under Fabric needs the model"):
        build_strategy("disttrain_auto")


def test_degrees_are_checked_against_the_processes_before_any_starts():
    with pytest.raises(LaunchError, match=r"^disttrain_megatron on 2 processes: world_size=2 is not divisible by"
                                          r" tp\*pp=4 \(tp=2, pp=2\)"):
        build_strategy("disttrain_megatron", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, world=2)
    assert build_strategy("disttrain_megatron", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, world=4)


def test_lightnings_own_names_stay_names_unless_options_come_with_them():
    assert build_strategy("ddp") == "ddp" and build_strategy(None) == "auto"
    ddp = build_strategy("ddp", {"find_unused_parameters": True}, entry="trainer")  # passed on to torch's DDP
    assert type(ddp).__name__ == "DDPStrategy" and ddp._ddp_kwargs == {"find_unused_parameters": True}
    with pytest.raises(LaunchError, match="strategy 'auto' takes no options"):
        build_strategy("auto", {"bucket_cap_mb": 25})


def test_under_the_launcher_its_strategy_wins_and_is_taken_over(monkeypatch):
    """`lightning run model --strategy disttrain_ddp --devices 1 script.py`: the script's own default names
    another strategy; the launcher's is built (with the script's options), LT_STRATEGY is taken over, and Fabric
    accepts the object and keeps the launcher's devices and precision."""
    monkeypatch.setenv("LT_CLI_USED", "1")
    monkeypatch.setenv("LT_STRATEGY", "disttrain_ddp")
    monkeypatch.setenv("LT_DEVICES", "1")
    monkeypatch.setenv("LT_NUM_NODES", "1")
    monkeypatch.setenv("LT_PRECISION", "bf16-mixed")
    strategy = build_strategy("disttrain_fsdp", {"activation_checkpointing": True})
    assert type(strategy).__name__ == "DDPStrategy" and strategy.engine.options.activation_checkpointing
    assert "LT_STRATEGY" not in __import__("os").environ
    kwargs = fabric_kwargs(strategy, accelerator="gpu", devices=8, num_nodes=4, precision="32-true")
    assert kwargs == {"strategy": strategy}  # the launcher started the processes and named the precision
    fabric = L.Fabric(**kwargs)
    assert fabric.strategy is strategy and fabric.world_size == 1
    assert str(fabric.strategy.precision.precision) == "bf16-mixed"
    monkeypatch.delenv("LT_PRECISION")
    assert fabric_kwargs(strategy, precision="32-true") == {"strategy": strategy, "precision": "32-true"}


def test_without_the_launcher_every_setting_is_passed():
    assert fabric_kwargs("ddp", accelerator="cpu", devices=2, num_nodes=1, precision=None, loggers=[]) == {
        "strategy": "ddp", "accelerator": "cpu", "devices": 2, "num_nodes": 1, "loggers": []}


def test_takes_asks_the_registry():
    assert takes("disttrain_megatron", "tensor_parallel_size") and not takes("disttrain_fsdp", "tensor_parallel_size")
    assert takes("disttrain_fsdp_offload", "cpu_offload") and not takes("ddp", "find_unused_parameters")


# ---- the shared recipe flags -------------------------------------------------------------------------------------

def parser(does_not_apply=None, aliases=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recipe.py")
    defaults = {flag.dest: Default(None, "x") for flag in shared_flags()}
    for dest in does_not_apply or {}:
        defaults.pop(dest)
    add_recipe_flags(p, defaults, does_not_apply, aliases)
    return p


def test_flags_need_a_default_or_a_reason_each():
    with pytest.raises(ValueError, match=r"give a default or a reason for \['steps'\]"):
        add_recipe_flags(argparse.ArgumentParser(), {f.dest: 1 for f in shared_flags() if f.dest != "steps"})


def test_a_flag_that_does_not_apply_is_one_line(capsys):
    p = parser({"seq_len": "set model.img_size instead", "pipeline_parallel_size": "rows are packed"},
               aliases={"steps": ["--max-steps"]})
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--seq-len", "64"])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("recipe: error: --seq-len 64 does not apply to this recipe: set model.img_size"
                                       " instead\n")
    args = p.parse_args(["--pipeline-parallel-size", "1", "--tensor-parallel-size", "2", "--max-steps", "7"])
    assert strategy_options(args) == {"tensor_parallel_size": 2}  # a size of 1 asks for nothing
    assert args.steps == 7 and "--max-steps" not in p.format_help()


# ---- the recipes ---------------------------------------------------------------------------------------------------

RECIPES = ("recipes/nlp/dialogue_llm.py", "recipes/vision/vit2b.py")


def shared_help(script: str) -> dict[str, str]:
    """The recipe's `--help` section of shared flags: flag -> its help text (wrapping undone)."""
    proc = run_python(script, "--help", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    section = proc.stdout.split("flags every recipe shares:\n", 1)[1]
    entries = re.split(r"\n  (?=--)", "\n" + section.strip("\n"))
    shown = {}
    for entry in filter(None, (e.strip() for e in entries)):
        head, _, text = entry.partition("  ")
        shown[head.split()[0].rstrip(",")] = " ".join(text.split())
    return shown


def test_both_recipes_list_the_same_shared_flags_with_the_same_help_and_their_defaults():
    dialogue, vit = (shared_help(script) for script in RECIPES)
    assert list(dialogue) == list(vit) == [flag.name for flag in shared_flags()]
    for flag in shared_flags():
        for shown in (dialogue[flag.name], vit[flag.name]):
            assert shown.startswith(" ".join(flag.help.split())), (flag.name, shown)
            assert re.search(r"\((default|does not apply here): [^)]", shown), (flag.name, shown)
    assert "(default: disttrain_fsdp)" in dialogue["--strategy"]
    assert "(default: the config's train.steps)" in dialogue["--steps"]
    assert "(default: the config's train.max_steps" in vit["--steps"]
    assert "does not apply here: a ViT's sequence is its patches" in vit["--seq-len"]
    assert "does not apply here: pipeline stages run full" in dialogue["--pipeline-parallel-size"]


@pytest.mark.parametrize("script,args,line", [
    ("recipes/vision/vit2b.py", ["--seq-len", "128"], "vit2b: error: --seq-len 128 does not apply to this recipe:"
                                                      " a ViT's sequence is its patches"),
    ("recipes/nlp/dialogue_llm.py", ["--pipeline-parallel-size", "2"],
     "dialogue_llm: error: --pipeline-parallel-size 2 does not apply to this recipe: pipeline stages run full"),
    ("recipes/nlp/dialogue_llm.py", ["--tensor-parallel-size", "2"],
     "dialogue_llm: error: --tensor-parallel-size 2 is an option of disttrain_megatron, not of disttrain_fsdp: pass"
     " --strategy disttrain_megatron with it"),
    ("recipes/vision/vit2b.py", ["--strategy", "disttrain_megatron", "--tensor-parallel-size", "2",
                                 "--pipeline-parallel-size", "2"],
     "vit2b: error: disttrain_megatron on 2 processes: world_size=2 is not divisible by tp*pp=4"),
])
def test_a_flag_that_cannot_run_is_one_line_and_no_process_starts(script, args, line, tmp_path):
    proc = run_python(script, *args, "--out", str(tmp_path / "run"), timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Initializing distributed" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()
