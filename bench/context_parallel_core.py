"""Context parallelism (disttrain.parallel.cp, all-to-all) against one process: saved activations and step time.

    python bench/context_parallel_core.py                 # 2 CPU processes (gloo), seq 8192, dialogue_tiny's model
    python bench/context_parallel_core.py --seq 4096 --packed 0

The model is configs/nlp/dialogue_tiny.yaml's (vocab 2048, hidden 128, 4 layers, 4 heads, 2 kv heads) with
max_position_embeddings raised to the sequence; one row of ``--seq`` tokens, packed into 512-token dialogues
(``--packed 0``: one sequence). Prints, per rank, the bytes of the tensors one forward saves for backward (each
storage counted once, parameters left out: what activation memory is made of) and the median time of a training
step (forward, backward, AdamW) for: cp=1 as HF runs the model (one process); cp=1 through apply_context_parallel
on a 1-rank mesh (what the wrapper alone changes: SDPA's per-layer copies of a packed row's mask become one); cp=2.
Ratios are against the first (target for cp=2: <= 0.55); then the largest saved storages. Each rank uses one core.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "nlp" / "dialogue_tiny.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--packed", type=int, default=512, help="dialogue length of the packed row (0: not packed)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--steps", type=int, default=2, help="timed steps (after 1 warm-up step)")
    return p.parse_args()


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model_cfg = {**yaml.safe_load(CONFIG.read_text())["model"], "max_position_embeddings": args.seq}
    return LlamaForCausalLM(LlamaConfig(**model_cfg, attn_implementation=args.attn, use_cache=False))


def batch(args, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, args.seq), generator=g)
    positions = torch.arange(args.seq) % args.packed if args.packed else torch.arange(args.seq)
    return {"input_ids": ids, "labels": ids, "position_ids": positions.unsqueeze(0)}


def saved_bytes(model, inputs) -> tuple[int, list[tuple[int, str]]]:
    """Bytes of the distinct storages one forward saves for backward (parameters excluded), and the largest."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), f"{t.dtype} {tuple(t.shape)}"))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    del loss
    return sum(n for n, _ in seen.values()), sorted(seen.values(), reverse=True)[:6]


def step_times(model, inputs, steps: int, cp_group=None) -> list[float]:
    """Seconds per training step (forward, backward, gradient average over the cp ranks, AdamW)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model(**inputs).loss.backward()
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=cp_group)
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def measure(args, cp_mesh=None) -> tuple[int, list[tuple[int, str]], float]:
    """(saved bytes, largest saved storages, median step seconds) of the model, context-parallel over cp_mesh."""
    from disttrain.parallel.cp import apply_context_parallel

    model = build(args)
    if cp_mesh is not None:
        apply_context_parallel(model, cp_mesh)
    inputs = batch(args, model.config.vocab_size)
    total, largest = saved_bytes(model, inputs)
    group = cp_mesh.get_group() if cp_mesh is not None else None
    return total, largest, statistics.median(step_times(model, inputs, args.steps, group))


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = {}
    if rank == 0:  # the model as HF runs it, one process (the other rank waits: one core each)
        rows["cp=1, plain HF"] = measure(args)
    dist.barrier()
    # Through apply_context_parallel on a 1-rank cp mesh (each rank its own): what the wrapper alone changes.
    rows["cp=1, apply_context_parallel"] = measure(args, init_device_mesh("cpu", (world, 1),
                                                                          mesh_dim_names=("dp", "cp"))["cp"])
    dist.barrier()
    rows[f"cp={world}"] = measure(args, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"])
    sizes = [None] * world
    dist.all_gather_object(sizes, rows[f"cp={world}"][0])
    if rank == 0:
        base, _, base_time = rows["cp=1, plain HF"]
        print(f"seq {args.seq}, {'packed ' + str(args.packed) if args.packed else 'one sequence'}, {args.attn};"
              f" saved activations per rank, median step (each rank one core)")
        for name, (total, _, seconds) in rows.items():
            print(f"  {name:30s} {total / 2**20:8.1f} MiB = {total / base:.3f}x   {seconds:6.2f} s ="
                  f" {seconds / base_time:.2f}x")
        print(f"  cp={world} per rank (MiB): {[round(s / 2**20, 1) for s in sizes]}")
        for name in ("cp=1, plain HF", f"cp={world}"):
            print(f"largest saved storages, {name}:")
            for nbytes, what in rows[name][1]:
                print(f"  {nbytes / 2**20:8.1f} MiB  {what}")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    mp.spawn(run, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
