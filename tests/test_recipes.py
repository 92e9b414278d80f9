"""The demo scripts: the Fabric demo as `lightning run model` starts it (run_launched) and the Trainer example script."""

import subprocess

import pytest

from conftest import free_port, run_launched, run_python
from safetensors.torch import load_file

# Every test here starts processes (launches or the CLI).
pytestmark = pytest.mark.slow

def demo(strategy: str, steps: int) -> subprocess.CompletedProcess:
    return run_launched("recipes/demo/tiny_llama.py", "--steps", str(steps), "--eval-every", "10", strategy=strategy,
                        timeout=600)


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
    proc = run_python("recipes/demo/trainer_llama.py", "--accelerator", "cpu", "--devices", "2", "--strategy",
                      "disttrain_fsdp", "--max-steps", "2", "--out", str(tmp_path), env={"MASTER_PORT": str(free_port())},
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    weights = load_file(tmp_path / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
