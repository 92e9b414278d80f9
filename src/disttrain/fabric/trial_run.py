"""Run by ``disttrain plan --trial`` in every process (``disttrain run``'s launcher): a few training steps of one
plan on the devices present, timed; rank 0 writes the step times.

Usage: trial_run.py OUT PLAN_JSON   (PLAN_JSON: {"model": recipe path or model mapping, "strategy", "options",
"micro_batch", "seq_len", "precision", "model_recomputes", "steps", "min_seconds"})

The model is built from its config with random weights and trained on random data of the plan's shapes: a step's
time depends on the shapes, not on the values. Each rank gets ``micro_batch x tp x pp x cp`` samples, the batch the
planner counts per data-parallel rank (the same global batch under every strategy).
"""

import json
import math
import os
import statistics
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F

import disttrain  # noqa: F401  (registers the disttrain_* names)
from disttrain.launch import LAUNCHER_SETTINGS, LAUNCHER_STRATEGY, build_strategy, fabric_kwargs, launched
from disttrain.parallel import registry
from disttrain.planner.spec import model_spec, recipe_model
from disttrain.planner.workload import build, loss_of, random_batch

# TEST ONLY: "strategy label=seconds[;label=seconds]" adds that many seconds to every step of the plan with that
# label, so a test can make one plan the slow one whatever the machine's noise.
DELAY = "DISTTRAIN_TRIAL_DELAY"


def delay(label: str) -> float:
    for item in filter(None, os.environ.get(DELAY, "").split(";")):
        name, seconds = item.rsplit("=", 1)
        if name.strip() == label:
            return float(seconds)
    return 0.0


MAX_STEPS = 500  # at most this many timed steps, whatever min_seconds asks


def more_steps(times: list[float], min_seconds: float) -> int:
    """The steps still to time after ``times`` for their total to reach ``min_seconds`` (at their median pace)."""
    left = min_seconds - sum(times)
    if left <= 0 or not times:
        return 0
    return min(MAX_STEPS - len(times), math.ceil(left / max(statistics.median(times), 1e-6)))


def main() -> None:
    out, job = sys.argv[1], json.loads(sys.argv[2])
    source = job["model"]
    mapping = recipe_model(source) if isinstance(source, str) else dict(source)
    spec = model_spec(source)
    world = int(os.environ["WORLD_SIZE"])
    dims = registry.lookup(job["strategy"]).dims(world, job["options"])
    # The job names the strategy and precision: a launcher that started the planning process left its own in the
    # environment, which this run's launcher (`disttrain run`, given neither) passed on.
    for variable in (LAUNCHER_STRATEGY, LAUNCHER_SETTINGS["precision"]):
        os.environ.pop(variable, None)
    strategy = build_strategy(job["strategy"], job["options"], world=world)
    fabric = L.Fabric(**fabric_kwargs(strategy, precision=job["precision"]))
    if not launched():
        fabric.launch()
    with fabric.init_module():
        model, kind = build(mapping)
    if job["model_recomputes"]:
        if kind == "vit":
            model.set_grad_checkpointing(True)
        else:
            model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = fabric.setup(model, optimizer)
    pipelined = kind == "vit" and getattr(fabric.strategy.engine, "pipeline", None) is not None
    if pipelined:
        model.pipeline.loss_fn = F.cross_entropy  # a ViT computes no loss itself: the pipeline's last stage does
    batch = job["micro_batch"] * dims.tp * dims.pp * dims.cp
    seq = int(job["seq_len"] or spec.tokens or 1)
    g = torch.Generator().manual_seed(0)  # every rank the same data: tensor-parallel ranks need the same batch
    extra = delay(job["label"])

    def step() -> None:
        inputs, targets = (fabric.to_device(t) for t in random_batch(spec, kind, batch, seq, g))
        loss = loss_of(model, kind, inputs, targets, pipelined)
        fabric.backward(loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        if extra:
            time.sleep(extra)

    def timed(n: int) -> list[float]:
        times = []
        for _ in range(n):
            if fabric.device.type == "cuda":
                torch.cuda.synchronize()
            fabric.barrier()
            t0 = time.perf_counter()
            step()
            if fabric.device.type == "cuda":
                torch.cuda.synchronize()
            fabric.barrier()
            times.append(time.perf_counter() - t0)
        return times

    timed(1)  # one warm-up step (allocations, first gathers, JIT)
    times = timed(job["steps"])
    # Steps of a few milliseconds are timed for at least min_seconds: their first ones after the warm-up run slower
    # (caches, the allocator) and a few of them are mostly noise. Rank 0 decides, so every rank runs as many.
    times += timed(fabric.broadcast(more_steps(times, float(job.get("min_seconds") or 0.0)), src=0))
    if fabric.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "median": statistics.median(times)}, f)


if __name__ == "__main__":
    main()
