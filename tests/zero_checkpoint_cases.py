"""What every ZeRO stage's checkpoints must do, the same for stages 1/2 and 3: train like one process, resume at the
same and at another world size, take a one-process checkpoint, be read by one process without any strategy, and
refuse a different model clearly. tests/test_zero12_checkpoints.py and tests/test_zero3_checkpoints.py import these
tests (pytest collects them in each of those files, with that file's ``edge`` fixture: its launches of
tests/dist/zero3_shards.py at 2 and 4 processes)."""

from __future__ import annotations

import pytest
import torch

from disttrain.parallel.checkpoint.io import load_sharded
from zero3_shards import edge_loss, edge_net, edge_optimizer, global_batch

# odd sizes: partitions and flat ranges start and end inside rows
SIZES = {"width": 383, "depth": 2, "vocab": 2003}
TOL = 1e-5


def close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def size_args() -> list[str]:
    return [f"--{k}={v}" for k, v in SIZES.items()]


# The cases below read the importing file's module fixture ``edge``: {2: ranks' results, 4: ranks' results,
# "saved": {2: folder, 4: folder} (each launch's own checkpoint at step 2), "plain": the one-process checkpoint at
# step 2, "reference": the one-process losses}. The 4-process launch also resumed from the 2-process one's folder.

@pytest.mark.slow
def test_trains_like_one_process(edge):
    for n in (2, 4):
        assert close(edge[n][0]["losses"], edge["reference"]), (n, edge[n][0]["losses"], edge["reference"])
        assert edge[n][0]["frozen_unchanged"]


@pytest.mark.slow
def test_resume_at_the_same_world_size(edge):
    for n in (2, 4):
        rank0, after = edge[n][0], edge[n][0]["losses"][2:]
        assert close(rank0["reloaded"], after)  # into the model and optimizer that trained on past the save
        resumed = rank0["resumed"][str(edge["saved"][n])]  # into a fresh model (another seed)
        assert resumed["start"] == 2 and close(resumed["losses"], after)


@pytest.mark.slow
def test_resume_at_another_world_size(edge):
    resumed = edge[4][0]["resumed"][str(edge["saved"][2])]
    assert resumed["start"] == 2 and close(resumed["losses"], edge[2][0]["losses"][2:])


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_zero(edge):
    for n in (2, 4):
        resumed = edge[n][0]["resumed"][str(edge["plain"])]
        assert resumed["start"] == 2 and close(resumed["losses"], edge["reference"][2:])


@pytest.mark.slow
def test_checkpoint_resumes_in_one_process(edge):
    """The stored tensors are the plain model's, by FQN and full shape: tied, frozen and buffers included, optimizer
    state per parameter with each group's hyper-parameters."""
    for n in (2, 4):
        model = edge_net(5, **SIZES)
        opt = edge_optimizer(model)
        meta = load_sharded(edge["saved"][n], {"model": model, "optimizer": opt}, model)
        assert meta == {"step": 2}
        assert model.head.weight is model.embed.weight
        assert torch.equal(model.frozen.weight, edge_net(0, **SIZES).frozen.weight)
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 5e-3] and opt.param_groups[0]["weight_decay"] == 0.1
        losses = []
        for step in (2, 3):
            loss = edge_loss(model, global_batch(step, SIZES["vocab"]), SIZES["vocab"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert close(losses, edge["reference"][2:]), (n, losses)


@pytest.mark.slow
def test_a_different_model_is_refused_clearly(edge):
    for rank in edge[2]:
        assert rank["mismatch"].startswith("CheckpointError: checkpoint ")
        assert rank["mismatch"].endswith(f"{edge['saved'][2].name}' does not match the model: missing"
                                         " ['blocks.2.bias', 'blocks.2.weight']; pass strict=False to load the"
                                         " common keys")

