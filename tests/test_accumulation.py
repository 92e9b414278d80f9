"""GradientAccumulation: the same global batch at world size 1 and 2 gives the same losses (fp32, 1e-5)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import relative_diff, run_dist

from common import dataset, masked_labels, tiny_llama
from disttrain.callbacks import GradientAccumulation, accumulation_steps

pytestmark = pytest.mark.timeout(900)


def test_steps_follow_the_world_size():
    assert accumulation_steps(512, 4, 8) == 16
    assert accumulation_steps(512, 4, 16) == 8
    with pytest.raises(ValueError, match=r"global_batch_size=100 is not divisible by micro_batch_size x data-parallel"
                                         r" ranks = 4 x 8 = 32; choose a multiple of 32 \(e.g. 96 or 128\)"):
        accumulation_steps(100, 4, 8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def run(world: int, *args: str) -> list[float]:
        out = tmp_path_factory.mktemp("acc")
        return run_dist("accumulation_run.py", out, *args, nproc=world)[0]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["disttrain_fsdp", "disttrain_ddp"])
def test_world_1_and_2_give_the_same_losses(runs, strategy):
    one, two = runs(1, "disttrain_fsdp", "8"), runs(2, strategy, "8")
    assert (one["accumulate_grad_batches"], two["accumulate_grad_batches"]) == (4, 2)
    assert relative_diff(two["losses"], one["losses"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["disttrain_zero3", "disttrain_zero2"])
def test_zero_accumulates_inside_deepspeed_without_double_scaling(runs, strategy):
    # Global batch 4 (3 whole windows per epoch): DeepSpeed ignores epoch ends when it accumulates.
    one, two = runs(1, strategy, "4"), runs(2, strategy, "4")
    assert (one["accumulate_grad_batches"], two["accumulate_grad_batches"]) == (2, 1)
    assert relative_diff(one["losses"], two["losses"]) <= 1e-5


def token_normalized_reference(steps: int) -> list[float]:
    """One process: windows of 8 samples in the Trainer's order (epoch ends close a window), loss = token-loss sum
    / loss tokens of the window."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids_all = dataset().tensors[0]
    windows = []
    for epoch in range(2):
        order = torch.randperm(len(ids_all), generator=torch.Generator().manual_seed(epoch))
        windows += [order[:8], order[8:]]
    losses = []
    for window in windows[:steps]:
        ids = ids_all[window]
        labels = masked_labels(ids)
        logits = model(input_ids=ids).logits[:, :-1]
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100,
                                reduction="sum")
        loss = total / (labels[:, 1:] != -100).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("world,strategy", [(1, "disttrain_fsdp"), (2, "disttrain_fsdp"), (2, "disttrain_ddp")])
def test_token_normalization_matches_the_global_token_mean(runs, world, strategy):
    result = runs(world, strategy, "8", "tokens")
    assert relative_diff(result["losses"], token_normalized_reference(4)) <= 1e-5


def test_fabric_attach_and_micro_steps():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    acc = GradientAccumulation(global_batch_size=8)
    assert acc.attach(fabric, micro_batch_size=2) == 4
    assert [acc.is_last(i) for i in range(4)] == [False, False, False, True]
    assert acc.scale(fabric, torch.tensor(8.0)).item() == 2.0


def test_fabric_attach_feeds_zero3_config():
    import disttrain  # noqa: F401

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="disttrain_zero3")
    acc = GradientAccumulation(global_batch_size=8)
    assert acc.attach(fabric, micro_batch_size=2) == 4
    options = fabric.strategy.engine.options
    assert (options.micro_batch_size, options.gradient_accumulation_steps) == (2, 4)
    assert acc.scale(fabric, torch.tensor(8.0)).item() == 8.0  # DeepSpeed divides by itself


def test_trainer_setting_that_contradicts_is_an_error():
    acc = GradientAccumulation(global_batch_size=8, micro_batch_size=2)

    class Stub:
        callbacks: list = []
        accumulate_grad_batches = 3
        world_size = 1
        strategy = None

    with pytest.raises(ValueError, match=r"Trainer\(accumulate_grad_batches=3\) contradicts GradientAccumulation"
                                         r"\(global_batch_size=8\) which needs 4"):
        acc.setup(Stub(), None, "fit")
