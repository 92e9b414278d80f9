"""ZeRO checkpoints in the one layout (Fabric, CPU/gloo; any ZeRO stage, --strategy), on a model with every kind of
state a checkpoint must carry: tied weights, a frozen layer, a single-element parameter and one with fewer elements
than ranks, buffers and two parameter groups with different hyper-parameters (DeepSpeed itself refuses 0-d
parameters).

Usage: zero3_shards.py OUT --save DIR [--load DIR ...] [--width W --depth D --vocab V] [--strategy NAME] [--baseline]

Trains steps 0-1, saves at DIR (measuring the save), trains steps 2-3 (the uninterrupted run), then restores DIR into
the same objects (measuring the load) and into fresh ones, and each --load folder (written by another strategy or
world size) into fresh ones, training steps 2-3 after every restore. The global batch is the same whatever the world
size, so every run's losses equal one process's (``reference_losses``). Memory per rank, for save and load: the
peak bytes of tensors allocated (torch's CPU allocator, counted by the profiler) and the peak resident set above
the start (VmHWM). With --baseline the gather-to-rank-0 path disttrain used before is measured too, on the same
model (bench/zero3_checkpoint_memory.py prints the table).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))

GLOBAL_BATCH, SEQ = 8, 12


class EdgeNet(nn.Module):
    """A language model whose state holds every case a ZeRO-3 checkpoint must get right."""

    def __init__(self, vocab: int = 101, width: int = 37, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed.weight, std=0.02)  # small tied logits: a loss near log(vocab)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.tensor([1.5]))  # one element: one rank holds it, the others only padding
        self.tiny = nn.Parameter(torch.full((3,), 0.1))  # fewer elements than ranks at world size 4
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, width)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        x = (self.frozen(x) * self.gain + self.tiny.sum()) * self.scale
        return self.head(x)  # (B, T, vocab)


def edge_net(seed: int, **sizes) -> EdgeNet:
    torch.manual_seed(seed)
    return EdgeNet(**sizes)


def edge_optimizer(model: EdgeNet) -> torch.optim.Optimizer:
    """Two groups with different hyper-parameters; the frozen layer is in neither."""
    decayed = [*model.blocks.parameters(), model.gain]
    return torch.optim.AdamW([{"params": decayed, "lr": 1e-2, "weight_decay": 0.1},
                              {"params": [model.embed.weight, model.tiny], "lr": 5e-3, "weight_decay": 0.0}])


def global_batch(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def edge_loss(model: nn.Module, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))


def reference_losses(steps: int, vocab: int = 101, **sizes) -> tuple[list[float], EdgeNet, torch.optim.Optimizer]:
    """One process, the global batch per step; also returns the model and optimizer after ``steps``."""
    model = edge_net(0, vocab=vocab, **sizes)
    opt = edge_optimizer(model)
    losses = []
    for step in range(steps):
        loss = edge_loss(model, global_batch(step, vocab), vocab)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model, opt


# -- memory of one call, per rank ------------------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _release_free_memory() -> None:
    """Collect garbage and return the C heap's free pages to the system, so that what ``fn`` allocates shows as
    growth of the resident set instead of reusing memory freed earlier."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(fn) -> dict[str, int]:
    """Bytes ``fn`` needs on this rank beyond what it held before: ``rss_peak`` (the resident set's high-water mark
    above the start), ``tensor_peak`` (the most tensor bytes alive at once, counted by the profiler from every
    allocation and free of torch's CPU allocator; it does not see the frees of tensors handed to gloo collectives,
    so a path that all-gathers reads high there) and ``tensor_allocated`` (all tensor bytes allocated). Runs ``fn``
    twice, once per way of counting."""
    _release_free_memory()
    dist.barrier()
    start = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    fn()
    rss_peak = _status("VmHWM") - start
    _release_free_memory()
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = allocated = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
        allocated += max(event.self_cpu_memory_usage, 0)
    return {"rss_peak": rss_peak, "tensor_peak": peak, "tensor_allocated": allocated}


# -- the gather-to-rank-0 path this layout replaced (the baseline the benchmark measures against) -----------------
def gathered_save(path: str, module: nn.Module, optimizer) -> None:
    """Every parameter's full fp32 master and Adam moments gathered one at a time (DeepSpeed's safe_get_full_*,
    collective) and held on rank 0, which writes them."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from disttrain.parallel.checkpoint.io import flatten_optimizer, save_sharded

    rank0 = dist.get_rank() == 0
    names = {id(p): n for n, p in module.named_parameters()}
    model_state = {}
    for name, param in module.named_parameters():
        value = safe_get_full_fp32_param(param) if id(param) in _trained(optimizer) else None
        if value is None:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                value = param.detach().clone()
        if rank0:
            model_state[name] = value.to("cpu", copy=True)
    state, groups = {}, []
    for i, params in enumerate(optimizer.fp16_groups):
        flat = optimizer.optimizer.state.get(optimizer.fp32_partitioned_groups_flat[i], {})
        groups.append({**{k: v for k, v in optimizer.optimizer.param_groups[i].items() if k != "params"},
                       "params": [names[id(p)] for p in params]})
        for param in params:
            entry = {}
            for key, value in flat.items():
                if torch.is_tensor(value) and value.numel() == optimizer.fp32_partitioned_groups_flat[i].numel():
                    entry[key] = safe_get_full_optimizer_state(param, key).reshape(param.ds_shape).to("cpu", copy=True)
                else:
                    entry[key] = value
            state[names[id(param)]] = entry
    tensors = {"model": model_state, "optimizer": flatten_optimizer({"state": state, "param_groups": groups})}
    save_sharded(path, tensors if rank0 else {"model": {}, "optimizer": {}}, {})


def gathered_load(path: str, module: nn.Module, optimizer) -> None:
    """Every rank reads every full tensor and keeps its partition (DeepSpeed's safe_set_full_*)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from disttrain.parallel.checkpoint.io import read_full, unflatten_optimizer

    full = read_full(path, keys={"model", "optimizer"})
    params = dict(module.named_parameters())
    for name, value in full["model"].items():
        if name in params and id(params[name]) in _trained(optimizer) and _settable(params[name]):
            safe_set_full_fp32_param(params[name], value.reshape(params[name].ds_shape))
    saved = unflatten_optimizer(full["optimizer"])["state"]
    names = {id(p): n for n, p in module.named_parameters()}
    for params_of_group in optimizer.fp16_groups:
        for param in filter(_settable, params_of_group):
            for key, value in saved.get(names[id(param)], {}).items():
                if torch.is_tensor(value) and value.shape == param.ds_shape and key != "step":
                    safe_set_full_optimizer_state(param, value.reshape(param.ds_shape), key)
    for i in range(len(optimizer.fp16_groups)):
        optimizer._reassign_or_swap_out_partitioned_parameters(i)


def _settable(param) -> bool:
    # DeepSpeed's safe_set_full_* fail on a parameter whose size the world size does not divide (the last rank's
    # slice runs past the end), so the old path could not load such parameters at all; the baseline skips them.
    return param.ds_numel % dist.get_world_size() == 0


def _trained(optimizer) -> set[int]:
    return {id(p) for group in optimizer.fp16_groups for p in group}


def tensor_bytes_per_rank(path) -> list[int]:
    """Bytes of the stored tensors (not the one-value entries, step counts and hyper-parameters, which DCP writes
    once from any rank) in each rank's file."""
    from disttrain.parallel.checkpoint.io import storage_reader

    metadata = storage_reader(path).read_metadata()
    written: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if hasattr(entry, "chunks") and math.prod(entry.size) > 1:
            written[info.relative_path] = written.get(info.relative_path, 0) + info.length
    return [written[name] for name in sorted(written)]


# -- the run ----------------------------------------------------------------------------------------------------
def main() -> None:
    from common import write_result

    from disttrain.parallel.engines.zero import ZeroEngine
    from disttrain.parallel.registry import STRATEGIES

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--save", required=True)
    p.add_argument("--load", action="append", default=[])
    p.add_argument("--width", type=int, default=37)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--vocab", type=int, default=101)
    p.add_argument("--strategy", default="disttrain_zero3", choices=[row.name for row in STRATEGIES
                                                                      if row.engine is ZeroEngine])
    p.add_argument("--baseline", action="store_true")
    args = p.parse_args()
    sizes = {"width": args.width, "depth": args.depth, "vocab": args.vocab}

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=args.strategy)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size

    def setup(seed: int):
        model = edge_net(seed, **sizes)
        return fabric.setup(model, edge_optimizer(model))

    def train(model, optimizer, steps) -> list[float]:
        losses = []
        for step in steps:
            loss = edge_loss(model, global_batch(step, args.vocab)[rank::world], args.vocab)
            fabric.backward(loss, model=model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        return losses

    model, optimizer = setup(0)
    result = {"losses": train(model, optimizer, range(2))}
    state = {"model": model, "optimizer": optimizer, "step": 2}
    result["save"] = measure(lambda: fabric.save(args.save, state))
    result["losses"] += train(model, optimizer, range(2, 4))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    result["load"] = measure(lambda: fabric.load(args.save, state))
    result["reloaded"] = train(model, optimizer, range(state["step"], 4))
    result["resumed"] = {}
    for path in [args.save, *args.load]:
        fresh, fresh_opt = setup(5)
        restored = {"model": fresh, "optimizer": fresh_opt, "step": 0}
        fabric.load(path, restored)
        losses = train(fresh, fresh_opt, range(restored["step"], 4))
        result["resumed"][path] = {"start": restored["step"], "losses": losses}
    deeper = edge_net(0, **{**sizes, "depth": args.depth + 1})  # one block more than the checkpoint holds
    deeper, deeper_opt = fabric.setup(deeper, edge_optimizer(deeper))
    try:
        fabric.load(args.save, {"model": deeper, "optimizer": deeper_opt})
    except Exception as e:
        result["mismatch"] = f"{type(e).__name__}: {e}"
    result["frozen_unchanged"] = _frozen_matches_seed(model, sizes)
    result["file_bytes"] = os.path.getsize(os.path.join(args.save, f"__{rank}_0.distcp"))
    if args.baseline:
        module, zero = model.module, optimizer.optimizer  # the user's model and DeepSpeed's ZeRO-3 optimizer
        baseline = args.save + "-gathered"
        result["baseline"] = {"save": measure(lambda: gathered_save(baseline, module, zero)),
                              "load": measure(lambda: gathered_load(baseline, module, zero))}
    write_result(result)


def _frozen_matches_seed(model, sizes) -> bool:
    """The frozen layer, gathered, still equals its initial weights after training and reloading."""
    import deepspeed

    module = model.module
    initial = edge_net(0, **sizes).frozen.weight
    with deepspeed.zero.GatheredParameters([module.frozen.weight]):
        return bool(torch.equal(module.frozen.weight.detach(), initial))


if __name__ == "__main__":
    main()
