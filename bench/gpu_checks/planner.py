"""Check 6: the planner's per-rank memory estimate (``disttrain.planner.estimate(...).device``) against the CUDA
allocator's peak (``torch.cuda.max_memory_allocated``) for ``disttrain_ddp`` and ``disttrain_fsdp`` at world size 1,
on the 1B config, with and without activation checkpointing.

The peak is taken over a training step after the first (the optimizer state exists by then), above what was
allocated before the model was built. A CPU dry run has no allocator peak: it measures what can be measured there
(model states held plus the tensors autograd saved, as ``tests/test_planner_accuracy.py`` does) and is not judged."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from gpu_checks.common import (Context, DevicePeak, Row, build_llama, fabric, free_memory, gib, guarded,
                               learnable_batches, model_args, recipe, relative_error, sync)
from gpu_checks.training import train_step

CHECK = "6 planner"
TOLERANCE = 0.15


def _strategy(name: str, ac: bool) -> Any:
    import disttrain

    if name == "disttrain_fsdp":
        return disttrain.fabric.FSDPStrategy(activation_checkpointing=ac)
    return disttrain.fabric.DDPStrategy(activation_checkpointing=ac)


def measure(ctx: Context, name: str, ac: bool, args: dict[str, Any], micro: int, seq: int) -> dict[str, Any]:
    from disttrain.planner.measure import SavedActivations, state_bytes

    sync(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    f = fabric(ctx, _strategy(name, ac), "bf16-mixed")
    with f.init_module(empty_init=name == "disttrain_fsdp"):
        model = build_llama(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = f.setup(model, optimizer)
    batches = learnable_batches(args["vocab_size"], micro, seq, 2, ctx.device)
    train_step(f, model, optimizer, batches[:1])  # creates the optimizer state
    peak = DevicePeak(ctx.device)
    with peak:
        train_step(f, model, optimizer, batches[1:])
    measured = None if peak.peak is None else peak.peak + peak.base - base
    if measured is None:  # CPU: states held + activations saved by one forward
        with SavedActivations(model) as saved:
            loss = model(input_ids=batches[1], labels=batches[1]).loss
        f.backward(loss)
        optimizer.step()
        measured = state_bytes(model, optimizer)["total"] + saved.bytes()
        optimizer.zero_grad()
    return {"measured": measured}


def run(ctx: Context) -> Iterator[Row]:
    args = model_args("configs/nlp/dialogue_1b.yaml", dry=ctx.dry)
    if ctx.dry:
        micro, seq = 2, 32
    else:
        config = recipe("configs/nlp/dialogue_1b.yaml")
        micro, seq = int(config["train"]["micro_batch_size"]), int(config["data"]["seq_len"])
    for name in ("disttrain_ddp", "disttrain_fsdp"):
        for ac in (False, True):
            item = (f"{name}, {'with' if ac else 'without'} activation checkpointing, "
                    f"{'tiny [dry]' if ctx.dry else 'dialogue_1b'}, {micro} x {seq}, bf16-mixed, world size 1")
            yield from guarded(CHECK, item, f"within {TOLERANCE:.0%}",
                               lambda: compare(ctx, name, ac, args, micro, seq, item))


def compare(ctx: Context, name: str, ac: bool, args: dict[str, Any], micro: int, seq: int, item: str) -> Row:
    from disttrain.planner import estimate

    e = estimate(dict(args, attn_implementation="sdpa"), name, world_size=1, micro_batch=micro, seq_len=seq,
                 precision="bf16-mixed", **({"activation_checkpointing": True} if ac else {}))
    predicted = e.device if not ctx.dry else e.states + e.activations
    measured = measure(ctx, name, ac, args, micro, seq)["measured"]
    free_memory()
    err = relative_error(predicted, measured)
    ok = abs(err) <= TOLERANCE
    what = "states + saved activations (CPU)" if ctx.dry else "max_memory_allocated"
    return Row(CHECK, item, f"estimate {gib(predicted)} vs {what} {gib(measured)}: {err:+.1%}",
               f"within {TOLERANCE:.0%}", ok, "" if ok else f"off by {err:+.1%}", kind="device", value=err,
               details={"estimate": {"params": e.params, "grads": e.grads, "optimizer": e.optimizer,
                                     "activations": e.activations, "buffers": e.buffers}, "measured_bytes": measured})
