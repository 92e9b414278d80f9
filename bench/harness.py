"""Pieces the benchmarks share: the ``--smoke`` option, the model, the timing loop, a Trainer run timed per step, and
variants run in fresh processes."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist


def parse_smoke(p: argparse.ArgumentParser, argv: Optional[list[str]] = None, **tiny: Any) -> argparse.Namespace:
    """``p``'s arguments plus ``--smoke``: the defaults in ``tiny`` replace ``p``'s (tiny sizes, a few steps; an
    argument given on the command line still wins), so that tests/test_benches.py checks in seconds that the bench
    runs and prints its table. A smoke run's figures mean nothing. Children started with this process's arguments
    get the same sizes."""
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and a few steps: checks that the bench runs (its figures mean nothing)")
    if p.parse_known_args(argv)[0].smoke:
        p.set_defaults(**tiny)
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="micro batch per rank")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG tables go (default: bench/out)")


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(4, args.hidden // 64)
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=args.seq, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def count_params(args) -> int:
    with torch.device("meta"):  # sizes only: nothing allocated
        return sum(p.numel() for p in build_model(args).parameters())


def batches(args, device) -> list[torch.Tensor]:
    """3 warm-up + ``args.steps`` timed batches, different on every rank."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randint(0, 4096, (args.batch, args.seq), generator=g).to(device) for _ in range(args.steps + 3)]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def timed_loop(step_fn, data, device) -> list[float]:
    times = []
    for i, ids in enumerate(data):
        sync(device)
        t0 = time.perf_counter()
        step_fn(ids)
        sync(device)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t0)
    return times


def trainer_step_times(args, device, data, strategy: str) -> list[float]:
    """The same model through ``lightning.Trainer`` with ``strategy``; per-step times after 3 warm-up steps."""
    import lightning as L

    import disttrain  # noqa: F401

    class Module(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = build_model(args)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            sync(device)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            sync(device)
            if batch_idx >= 3:
                self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    trainer = L.Trainer(accelerator=device.type, devices=args.devices, strategy=strategy, precision=args.precision,
                        max_steps=len(data), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock], use_distributed_sampler=False)
    trainer.fit(Module(), torch.utils.data.DataLoader([d.cpu() for d in data], batch_size=None))
    return clock.times


VARIANTS_SEP = "|"


def run_variants(script: str, variants: list[str], flag: str, devices: int, rounds: int,
                 env: Optional[dict] = None, smoke_together: bool = False) -> dict[str, list[dict]]:
    """Run ``script`` once per variant and round, each time in fresh processes (torchrun on 127.0.0.1), so one
    variant's leftovers (engines, allocator caches) never inflate the next one's memory; rounds are interleaved so
    that machine noise hits the variants alike. The child gets ``flag VARIANT --result FILE`` after this process's
    own arguments, writes JSON there from rank 0; returns each variant's results, one per round.

    ``smoke_together``: under ``--smoke`` one launch runs all the variants in turn (a smoke run checks that each
    runs; its figures mean nothing): ``flag`` then carries them all, and the child runs the (variant, result file)
    pairs :func:`each_variant` gives it."""
    results: dict[str, list[dict]] = {v: [] for v in variants}
    together = smoke_together and "--smoke" in sys.argv[1:]
    launches = [VARIANTS_SEP.join(variants)] if together else variants
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for i, launch in enumerate(launches):
                result = os.path.join(tmp, f"{i}.json")
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={devices}",
                       "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.abspath(script),
                       *sys.argv[1:], flag, launch, "--result", result]
                subprocess.run(cmd, check=True, env=env)
                for variant, path in each_variant(launch, result):
                    with open(path) as f:
                        results[variant].append(json.load(f))
    return results


def each_variant(value: str, result: str) -> Iterator[tuple[str, str]]:
    """In a child of :func:`run_variants`: each variant its ``flag`` value names (one, or all of them with
    ``smoke_together`` under ``--smoke``), with the file its JSON goes to (``result`` itself for a single one)."""
    variants = value.split(VARIANTS_SEP)
    for i, variant in enumerate(variants):
        yield variant, result if len(variants) == 1 else f"{result}.{i}"


def fabric_steps(fabric, model, optimizer, inputs: dict, steps: int, warmup: int = 1) -> tuple[list[float], int]:
    """``warmup + steps`` optimizer steps of ``model(**inputs).loss`` under Fabric: the timed steps' seconds (every
    rank between barriers) and the bytes the last forward saved for backward (``SavedActivations``)."""
    from disttrain.planner.measure import SavedActivations

    times, saved = [], 0
    for step in range(warmup + steps):
        fabric.barrier()
        start = time.perf_counter()
        with SavedActivations(model) as activations:
            loss = model(**inputs).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        sync(fabric.device)
        fabric.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        saved = activations.bytes()
    return times, saved


def write_ranks(path: str, value: object) -> None:
    """Every rank's ``value``, gathered, written as a JSON list (rank order) by rank 0: what a child of
    :func:`run_variants` leaves in its ``--result`` file."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
