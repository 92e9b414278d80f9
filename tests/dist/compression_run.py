"""Gradient compression on 2 CPU processes: the same training run (tiny Llama, AdamW, data drawn from a fixed bigram
chain, so the loss settles at the chain's entropy rather than at zero) under each strategy spec given, in one
launch: losses, the bytes each rank sent to reduce gradients per step, and what the Throughput callback reported.
Usage: compression_run.py OUT STEPS SPEC [SPEC ...]"""

import os
import sys

import lightning as L
import torch

from disttrain.callbacks import Throughput

sys.path.insert(0, os.path.dirname(__file__))
from common import VOCAB, mean_over_ranks, strategy_from_spec, tiny_llama, write_result  # noqa: E402

STEPS, SPECS = int(sys.argv[2]), sys.argv[3:]
SEQ, BATCH = 16, 4


def bigram_batch(step: int, rank: int) -> torch.Tensor:
    """This rank's batch at ``step``: sequences of a fixed bigram chain (each token has a few likely successors)."""
    transitions = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(7)), dim=1)
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(1, SEQ):
        ids[:, t] = torch.multinomial(transitions[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return ids


def train(spec: str) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "fabric"))
    if not os.environ.get("LT_CLI_USED"):
        fabric.launch()
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    meter = Throughput(every_n_steps=STEPS // 2, peak_flops=1e12)
    losses, reported = [], []
    for step in range(STEPS):
        ids = bigram_batch(step, fabric.global_rank)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
        metrics = meter.step(fabric, tokens=ids.numel())
        if "comm/grad_bytes_per_step" in metrics:
            reported.append(metrics["comm/grad_bytes_per_step"])
    sent = fabric.strategy.engine.comm_bytes()
    return {"losses": losses, "bytes_per_step": sent / STEPS if sent is not None else None, "reported": reported}


def powersgd_buckets(steps: int = 40) -> dict:
    """disttrain_ddp's PowerSGD hook (register_compression) on a DDP model of 12 buckets, where torch's own hook on
    gloo issues a bucket's later all-reduces from gloo's thread, racing the next bucket's (most such runs end in
    "collective mismatch"): the steps run and the replicas stay equal."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from disttrain.parallel.engines.ddp import DDPOptions, register_compression
    from disttrain.parallel.split.compress import Traffic

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)]), bucket_cap_mb=0.3)
    register_compression(model, DDPOptions(gradient_compression="powersgd", powersgd_start_iter=2,
                                           powersgd_rank=2), Traffic())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        model(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {"steps": steps, "replicas_equal": all(torch.equal(gathered[0], x) for x in gathered)}


write_result({**{spec: train(spec) for spec in SPECS}, "powersgd_buckets": powersgd_buckets()})
