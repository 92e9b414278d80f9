"""One checkpoint layout for every strategy: moves between strategies and world sizes, crashes while saving,
elastic restarts after a killed rank, exports (CPU, gloo, fp32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, child_env, free_port, run_dist

from common import reference_losses, tiny_llama
from disttrain.parallel.checkpoint import CheckpointError, latest_checkpoint, load_sharded

TOL = 1e-5


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOL for x, y in zip(a, b))


@pytest.mark.slow
def test_checkpoint_moves_across_strategies_and_world_sizes(tmp_path):
    """zero3@2 -> fsdp@4 -> megatron tp=2 -> megatron pp=2 -> ddp@1, one step each after a resume (plus two
    before the first save): every step's loss equals the uninterrupted one-process run."""
    reference = reference_losses(6, world_size=2)  # global_batch(step, 2): the same 4 samples per step everywhere
    chain = [("disttrain_zero3", 2, "-", 2), ("disttrain_fsdp", 4, "zero3", 1),
             ("disttrain_megatron:tensor_parallel_size=2", 2, "fsdp", 1),
             ("disttrain_megatron:pipeline_parallel_size=2", 2, "tp2", 1), ("disttrain_ddp", 1, "pp2", 1)]
    names = ["zero3", "fsdp", "tp2", "pp2", "ddp"]
    losses, starts = [], []
    for (spec, nproc, load, steps), name in zip(chain, names):
        load_arg = "-" if load == "-" else str(tmp_path / load)
        ranks = run_dist("moves.py", tmp_path / name, spec, load_arg, str(steps), str(tmp_path / name), nproc=nproc)
        starts.append(ranks[0]["start"])
        losses += ranks[0]["losses"]
    assert starts == [0, 2, 3, 4, 5]
    assert close(losses, reference), (losses, reference)


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    ckpts = tmp_path / "ckpts"
    proc = subprocess.run([sys.executable, str(ROOT / "tests/dist/crash_save.py"), str(tmp_path / "out"), str(ckpts)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed inside the second save
    assert sorted(p.name for p in ckpts.iterdir()) == [".step-000002.tmp", "step-000001"]
    assert latest_checkpoint(ckpts) == ckpts / "step-000001"
    model = tiny_llama(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_sharded(ckpts / "step-000001", {"model": model, "optimizer": opt}, model) == {"step": 1}
    assert opt.state_dict()["state"][0]["step"].item() == 1
    with pytest.raises(CheckpointError, match=r"step-000002.tmp' is incomplete .*missing meta.pt \(was the save"
                                              r" interrupted\?\)"):
        load_sharded(ckpts / ".step-000002.tmp", {"model": model}, model)


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    """`disttrain run --max-restarts 1`: rank 1 is SIGKILLed after step 2 on the first attempt; the job finishes
    and the steps after the resume equal the uninterrupted run."""
    out, ckpts = tmp_path / "elastic", tmp_path / "ckpts"
    cmd = [sys.executable, "-m", "disttrain.cli", "run", "tests/dist/elastic_resume.py", "--accelerator", "cpu",
           "--devices", "2", "--strategy", "disttrain_fsdp", "--max-restarts", "1", "--main-port", str(free_port()),
           str(out), str(ckpts), "4", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "exitcode: -9" in proc.stderr  # the first attempt really lost a rank
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    assert [(r["attempt"], r["start"]) for r in ranks] == [(1, 2), (1, 2)]
    assert close(ranks[0]["losses"], reference_losses(4, world_size=2)[2:])
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-00000{i}" for i in range(1, 5)]
