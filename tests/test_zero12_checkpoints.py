"""ZeRO-1/2 checkpoints in the one DCP layout: the fp32 master weights and optimizer state are flat ranges of each
parameter group, written and read by each rank as boxes of the parameters they cover; the folder moves to and from
other world sizes and strategies (CPU, gloo, fp32).

One launch at 2 (disttrain_zero2) and one at 4 processes (disttrain_zero1) of tests/dist/zero3_shards.py (a model
with tied, frozen, single-element and smaller-than-the-world parameters, buffers and two parameter groups) serve
most tests; the Llama chain through FSDP, ZeRO-3 and DDP uses tests/dist/moves.py like test_portable.py. The checks every ZeRO stage passes
(training, resuming at the same and another world size, one process reading the folder, a different model refused)
are tests/zero_checkpoint_cases.py's, collected here with this file's launches."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_dist

from disttrain.parallel.checkpoint.io import load_sharded, model_state, optimizer_state, save_sharded, stored_entries
from zero3_shards import edge_net, reference_losses, tensor_bytes_per_rank
from zero_checkpoint_cases import SIZES, close, size_args
from zero_checkpoint_cases import (  # noqa: F401  (collected here, with this file's launches)
    test_a_different_model_is_refused_clearly,
    test_checkpoint_resumes_in_one_process,
    test_one_process_checkpoint_resumes_under_zero,
    test_resume_at_another_world_size,
    test_resume_at_the_same_world_size,
    test_trains_like_one_process,
)

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """zero2@2 saves (and resumes from a one-process checkpoint at step 2); zero1@4 resumes from it and from the
    one-process checkpoint."""
    tmp = tmp_path_factory.mktemp("zero12_shards")
    _, model, opt = reference_losses(2, **SIZES)
    save_sharded(tmp / "plain", {"model": model_state(model), "optimizer": optimizer_state(model, opt)}, {"step": 2})
    runs = {}
    for n, strategy, loads in ((2, "disttrain_zero2", ["plain"]), (4, "disttrain_zero1", ["zero-2", "plain"])):
        (tmp / f"n{n}").mkdir()
        runs[n] = run_dist("zero3_shards.py", tmp / f"n{n}", "--save", str(tmp / f"zero-{n}"), "--strategy", strategy,
                           *[a for name in loads for a in ("--load", str(tmp / name))], *size_args(), nproc=n)
    return {"tmp": tmp, "saved": {n: tmp / f"zero-{n}" for n in runs}, "plain": tmp / "plain",
            "reference": reference_losses(4, **SIZES)[0], **runs}


@pytest.mark.slow
def test_each_rank_writes_only_its_ranges(edge):
    """Trainable parameters and their moments: stored once, every element, as boxes from the ranks whose flat range
    covers them; the frozen layer (not in the optimizer, whole on every rank) once; each rank a quarter of the
    bytes."""
    path = edge["tmp"] / "zero-4"
    stored = stored_entries(path)
    model = edge_net(0, **SIZES)
    for name, tensor in model.state_dict().items():
        entry = stored[f"model.{name}"]
        assert tuple(entry.size) == tuple(tensor.shape) and entry.properties.dtype == torch.float32
        assert sum(math.prod(c.sizes) for c in entry.chunks) == tensor.numel()  # every element stored once
    # the embedding (and the head tied to it) fills most of group 1: its rows are split between ranks, mid-row
    chunks = stored["model.embed.weight"].chunks
    assert len(chunks) > 2 and any(c.sizes[0] == 1 and c.sizes[1] < SIZES["width"] for c in chunks)
    assert "model.scratch" not in stored  # not persistent
    assert not any(k.startswith("optimizer.state.frozen.") for k in stored)  # frozen: no optimizer state
    assert tuple(stored["optimizer.state.blocks.0.weight.exp_avg"].size) == (SIZES["width"], SIZES["width"])
    written = tensor_bytes_per_rank(path)
    assert len(written) == 4 and max(written) < 0.3 * sum(written)  # each rank wrote about its quarter


@pytest.mark.slow
def test_saving_writes_the_ranges_in_place(edge):
    """Tensor bytes a rank allocates while saving: bookkeeping only (the ShardedTensors alias DeepSpeed's
    partitions), far below its share of the checkpoint."""
    total = sum(tensor_bytes_per_rank(edge["tmp"] / "zero-2"))
    for n in (2, 4):
        assert max(r["save"]["tensor_allocated"] for r in edge[n]) < 0.25 * total / n


@pytest.mark.slow
def test_llama_moves_between_zero_stages_world_sizes_fsdp_and_ddp(tmp_path):
    """zero2@2 -> fsdp@4 -> zero3@2 -> zero2_offload@4 -> ddp@1 -> zero1@2 -> one process, one step each after a
    resume (two before the first save): every step's loss equals the uninterrupted one-process run."""
    from common import reference_losses as llama_reference
    from common import tiny_llama

    chain = [("disttrain_zero2", 2, "-", 2), ("disttrain_fsdp", 4, "a", 1), ("disttrain_zero3", 2, "b", 1),
             ("disttrain_zero2_offload", 4, "c", 1), ("disttrain_ddp", 1, "d", 1), ("disttrain_zero1", 2, "e", 1)]
    losses, starts = [], []
    for (spec, nproc, load, steps), name in zip(chain, "abcdef"):
        (tmp_path / name).mkdir()
        ranks = run_dist("moves.py", tmp_path / name, spec, "-" if load == "-" else str(tmp_path / f"ckpt-{load}"),
                         str(steps), str(tmp_path / f"ckpt-{name}"), nproc=nproc)
        starts.append(ranks[0]["start"])
        losses += ranks[0]["losses"]
    # the last ZeRO-1 checkpoint, in one process without any strategy
    from common import global_batch as llama_batch

    model = tiny_llama(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meta = load_sharded(tmp_path / "ckpt-f", {"model": model, "optimizer": opt}, model)
    ids = llama_batch(meta["step"], 2)
    loss = model(input_ids=ids, labels=ids).loss
    losses.append(loss.item())
    assert starts == [0, 2, 3, 4, 5, 6] and meta["step"] == 7
    assert close(losses, llama_reference(8, world_size=2)), losses
