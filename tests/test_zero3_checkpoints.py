"""ZeRO-3 checkpoints in the one DCP layout: every rank writes only its partitions and reads only what it owns, and
the folder moves to and from other world sizes and strategies (CPU, gloo, fp32).

One launch at 2 and one at 4 processes of tests/dist/zero3_shards.py (a model with tied, frozen, single-element
and smaller-than-the-world parameters, buffers and two parameter groups) serve most tests; the Llama chain through
FSDP uses tests/dist/moves.py like test_portable.py. The checks every ZeRO stage passes
(training, resuming at the same and another world size, one process reading the folder, a different model refused)
are tests/zero_checkpoint_cases.py's, collected here with this file's launches."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import run_dist

from disttrain.parallel.checkpoint.io import CheckpointError, model_state, optimizer_state, save_sharded, stored_entries
from disttrain.parallel.checkpoint.zero import flat_range_boxes
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

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """zero3@2 saves; zero3_offload@4 (optimizer state and parameters on the CPU) resumes from it; both also
    resume from a one-process checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("zero3_shards")
    _, model, opt = reference_losses(2, **SIZES)
    save_sharded(tmp / "plain", {"model": model_state(model), "optimizer": optimizer_state(model, opt)}, {"step": 2})
    runs = {}
    for n, strategy, loads in ((2, "disttrain_zero3", ["plain"]), (4, "disttrain_zero3_offload", ["zero3-2", "plain"])):
        (tmp / f"n{n}").mkdir()
        runs[n] = run_dist("zero3_shards.py", tmp / f"n{n}", "--save", str(tmp / f"zero3-{n}"), "--strategy", strategy,
                           *[a for name in loads for a in ("--load", str(tmp / name))], *size_args(), nproc=n)
    return {"tmp": tmp, "saved": {n: tmp / f"zero3-{n}" for n in runs}, "plain": tmp / "plain",
            "reference": reference_losses(4, **SIZES)[0], **runs}


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_flat_ranges_are_covered_by_few_boxes_in_storage_order(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for end in range(start, numel + 1):
            boxes = flat_range_boxes(shape, start, end)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            values = [v for offsets, sizes in boxes
                      for v in full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()]
            assert values == list(range(start, end))


@pytest.mark.slow
def test_each_rank_writes_only_its_partition(edge):
    path = edge["tmp"] / "zero3-4"
    stored = stored_entries(path)
    model = edge_net(0, **SIZES)
    for name, tensor in model.state_dict().items():
        entry = stored[f"model.{name}"]
        assert tuple(entry.size) == tuple(tensor.shape) and entry.properties.dtype == torch.float32
        volumes = [math.prod(c.sizes) for c in entry.chunks]
        assert sum(volumes) == tensor.numel()  # every element stored once
        if tensor.numel() >= 4 and name != "scale":  # a partitioned parameter: a chunk (or a few) from each rank
            assert len(entry.chunks) >= 4
    assert "model.scratch" not in stored  # not persistent
    assert not any(k.startswith("optimizer.state.frozen.") for k in stored)  # frozen: no optimizer state
    assert tuple(stored["optimizer.state.blocks.0.weight.exp_avg"].size) == (SIZES["width"], SIZES["width"])
    assert [r["file_bytes"] for r in edge[4]] == [(path / f"__{r}_0.distcp").stat().st_size for r in range(4)]
    written = tensor_bytes_per_rank(path)
    assert max(written) < 0.26 * sum(written)  # each rank wrote its quarter


def checkpoint_tensor_bytes(path) -> int:
    return sum(math.prod(md.size) * md.properties.dtype.itemsize for md in stored_entries(path).values()
               if hasattr(md, "chunks"))


@pytest.mark.slow
def test_checkpoint_memory_per_rank_falls_as_one_over_world_size(edge):
    """Tensor bytes a rank allocates while saving and loading, counted from every allocation and free of torch's CPU
    allocator (the gather-to-rank-0 path held the whole checkpoint on rank 0 to save, and on every rank to load).
    Saving writes the partitions in place: far below the rank's share (the table of bench/zero3_checkpoint_memory.py
    shows MiB against hundreds). Loading reads the rank's share, a stored chunk at a time: half as much at 4 ranks
    as at 2."""
    total = checkpoint_tensor_bytes(edge["tmp"] / "zero3-2")
    worst = {n: {(op, key): max(r[op][key] for r in edge[n]) for op in ("save", "load")
                 for key in ("tensor_peak", "tensor_allocated")} for n in (2, 4)}
    for n in (2, 4):
        share = total / n
        # Only bookkeeping: rank 0 also gathers every rank's save plan (a few hundred KiB here, whatever the model).
        assert worst[n][("save", "tensor_allocated")] < 0.25 * share, (n, worst[n], share)
        assert worst[n][("load", "tensor_allocated")] <= 1.1 * share + 2**18, (n, worst[n], share)
        assert worst[n][("load", "tensor_peak")] < 0.5 * share, (n, worst[n], share)
    for key in ("tensor_peak", "tensor_allocated"):
        ratio = worst[4][("load", key)] / worst[2][("load", key)]
        assert 0.35 <= ratio <= 0.65, (key, worst, ratio)


@pytest.mark.slow
def test_llama_moves_between_zero3_world_sizes_and_fsdp(tmp_path):
    """zero3@2 -> zero3@4 -> fsdp@2 -> zero3@2, one step each after a resume (two before the first save): every
    step's loss equals the uninterrupted one-process run."""
    from common import reference_losses as llama_reference

    chain = [("disttrain_zero3", 2, "-", 2), ("disttrain_zero3", 4, "a", 1), ("disttrain_fsdp", 2, "b", 1),
             ("disttrain_zero3", 2, "c", 1)]
    losses, starts = [], []
    for (spec, nproc, load, steps), name in zip(chain, "abcd"):
        (tmp_path / name).mkdir()
        ranks = run_dist("moves.py", tmp_path / name, spec, "-" if load == "-" else str(tmp_path / f"ckpt-{load}"),
                         str(steps), str(tmp_path / f"ckpt-{name}"), nproc=nproc)
        starts.append(ranks[0]["start"])
        losses += ranks[0]["losses"]
    assert starts == [0, 2, 3, 4]
    assert close(losses, llama_reference(5, world_size=2)), losses


def test_stored_entries_lists_a_folder_without_reading_tensors(tmp_path):
    model = torch.nn.Linear(3, 3)
    save_sharded(tmp_path / "ckpt", {"weights": model_state(model)}, {})
    with pytest.raises(CheckpointError, match=r"not a disttrain checkpoint: missing .metadata"):
        stored_entries(tmp_path / "nothing")
    assert set(stored_entries(tmp_path / "ckpt")) == {"weights.weight", "weights.bias"}


@pytest.mark.slow
def test_trainer_checkpoints_move_between_zero3_and_fsdp(tmp_path, trainer_zero3, trainer_fsdp):
    """A Trainer ZeRO-3 checkpoint (epoch end, step 3) resumes under FSDP, and an FSDP one under ZeRO-3: steps 4-5
    equal those of the run that saved it."""
    zero3, fsdp = (Path(run[0]["ckpt_dir"]) / "epoch=0-step=3.ckpt" for run in (trainer_zero3, trainer_fsdp))
    written = tensor_bytes_per_rank(zero3)
    assert min(written) > 0.45 * sum(written)  # each rank wrote its half
    ranks = run_dist("trainer_resume.py", tmp_path, "disttrain_fsdp", str(zero3), "disttrain_zero3", str(fsdp))
    runs = ranks[0]["runs"]
    assert [r["global_step"] for r in runs] == [5, 5]
    assert close(runs[0]["losses"], trainer_zero3[0]["losses"][3:]), runs[0]
    assert close(runs[1]["losses"], trainer_fsdp[0]["losses"][3:]), runs[1]
