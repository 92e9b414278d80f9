"""The README's runnable commands: the demo (through `lightning run model`) and the Trainer example script."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env, free_port
from safetensors.torch import load_file

# Every test here starts processes (launches or the CLI).
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def demo(strategy: str, steps: int) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "lightning"), "run", "model", "recipes/demo/tiny_llama.py", "--accelerator", "cpu",
           "--devices", "2", "--strategy", strategy, "--main-port", str(free_port()),
           "--steps", str(steps), "--eval-every", "10"]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("strategy,sharded", [("disttrain_ddp", False), ("disttrain_zero3", True)])
def test_demo_runs_under_other_strategies(strategy, sharded):
    proc = demo(strategy, 4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    share = "(50.0%; ideal 1/2 = 50.0%)" if sharded else "(100.0%; ideal 1/2 = 50.0%)"
    assert "rank 1: parameters" in proc.stdout and share in proc.stdout


def test_demo_trains_and_reports(tmp_path):
    proc = demo("disttrain_fsdp", 30)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "rank 1: parameters" in out and "(50.0%; ideal 1/2 = 50.0%)" in out
    before = float(out.split("held-out loss before training")[1].split()[0])
    after = float(out.rsplit("held-out loss", 1)[1].split()[0])
    assert after < 0.75 * before, (before, after)  # the counting rule is being learned
    assert "steps/s" in out


def test_trainer_example_script(tmp_path):
    cmd = [sys.executable, "recipes/demo/trainer_llama.py", "--accelerator", "cpu", "--devices", "2",
           "--max-steps", "2", "--out", str(tmp_path)]
    env = {**child_env(), "MASTER_PORT": str(free_port())}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    weights = load_file(tmp_path / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
