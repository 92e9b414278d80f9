"""`lightning run model` / `disttrain run`: the launcher users call from the README."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env, run_python

# Every test here starts processes (launches or the CLI; the console scripts themselves where the launcher is tested,
# `python -m disttrain.cli` forked from a zygote where only the command's output is).
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def test_lightning_run_model_launches_fabric_script_with_disttrain_fsdp(tmp_path):
    out = tmp_path / "cli"
    cmd = [str(BIN / "lightning"), "run", "model", "tests/dist/cli_fabric.py", "--accelerator", "cpu",
           "--devices", "2", "--strategy", "disttrain_fsdp", str(out), "--script-flag", "7"]
    # No --main-port: the launcher takes a free one itself. A port picked here could be taken by a parallel test
    # before the launcher binds it (tests/test_launch_port.py covers an explicit port).
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    assert all(r["strategy"] == "disttrain.fabric.fsdp.FSDPStrategy" and r["world_size"] == 2 for r in ranks)
    assert ranks[0]["script_args"] == ["--script-flag", "7"]  # unknown options go to the script
    assert ranks[0]["losses"] == ranks[1]["losses"]


def test_unknown_strategy_is_rejected_with_the_closest_and_the_choices(tmp_path):
    proc = run_python("-m", "disttrain.cli", "run", "tests/dist/cli_fabric.py", "--strategy", "disttrain_fsdq")
    assert proc.returncode != 0
    assert "'disttrain_fsdq' is not a registered strategy; did you mean 'disttrain_fsdp'? choose one of:" in proc.stderr
    assert "disttrain_fsdp_offload" in proc.stderr


def test_missing_script(tmp_path):
    proc = subprocess.run([str(BIN / "lightning"), "run", "model", "nope.py"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "script 'nope.py' does not exist" in proc.stderr


def test_strategies_lists_the_name_table():
    proc = run_python("-m", "disttrain.cli", "strategies")
    assert proc.returncode == 0
    from disttrain.parallel.registry import STRATEGIES

    assert [line.split()[0] for line in proc.stdout.splitlines()] == [row.name for row in STRATEGIES]
