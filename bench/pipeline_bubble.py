"""The pipeline bubble of disttrain_megatron's schedules, measured, against the theory; and TP=2 step time
against one process. One run:

    python bench/pipeline_bubble.py --hidden 768 --layers 8 --seq 256   # 2 CPU processes (gloo), p=2
    python bench/pipeline_bubble.py --device cuda --hidden 2048 --layers 8
    python bench/pipeline_bubble.py --smoke              # tiny sizes, 1 timed step: checks that it runs

1F1B over m in --microbatches (stages balanced by cost), then at m = --compare (8): 1F1B with the old split (parameter
counts, cut where the running count nears each stage's share: the rule before stages were balanced by FLOPs), 1F1B
with the balanced split, and the zero-bubble schedules (interleaved_zero_bubble, zbv, dualpipev: 2 stages per rank).

Bubble: each rank adds up the time its stages spend computing (``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk`` of torch.distributed.pipelining); idle = 1 - busy / time of the pipelined call (the
schedule; the optimizer step is not part of the bubble), averaged over ranks. Theory: (p-1)/(m+p-1) for 1F1B; for the
multi-stage schedules, the idle fraction of torch's own action list run with ideal durations (equal stages; forward =
input backward = weight backward = 1, a full backward 2) and no communication. Every microbatch has the same size, so
the work per step grows with m, as in the theory. Stage imbalance and communication come on top of the theory.

TP: the same model, one process (the baseline) vs tensor_parallel_size=2 through Fabric; ratio of step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from harness import add_model_args, build_model, parse_smoke, sync, torchrun  # noqa: E402
from tables import write_table  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(batch=2)  # here: samples per microbatch
    p.add_argument("--microbatches", default="2,4,8", help="1F1B over these m")
    p.add_argument("--compare", type=int, default=8, help="m of the schedule and split comparison")
    p.add_argument("--schedules", default=",".join(COMPARED), help="schedules compared at --compare")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after --warmup steps)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-tp", action="store_true", help="skip the TP=2 comparison")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parse_smoke(p, hidden=64, layers=4, seq=32, batch=1, microbatches="4", compare=4, steps=1, warmup=1,
                       no_tp=True)


COMPARED = ("interleaved_zero_bubble", "zbv", "dualpipev")


class StageClock:
    """Adds up the compute time of pipeline stages by wrapping their forward/backward chunk methods."""

    def __init__(self) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.busy = 0.0
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            original = getattr(_PipelineStageBase, name)
            setattr(_PipelineStageBase, name, self._timed(original))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0
        return wrapper


def make_fabric(args, device, **options):
    import lightning as L

    import disttrain

    fabric = L.Fabric(accelerator=device.type, devices=dist.get_world_size() if dist.is_initialized() else 1,
                      precision=args.precision, strategy=disttrain.fabric.MegatronStrategy(**options))
    fabric.launch()
    return fabric


def train_steps(model, opt, fabric, data, device, warmup, clock=None) -> tuple[list[float], list[float]]:
    """Per step after ``warmup``: the time of the pipelined call (forward and backward of every microbatch) and
    the compute time inside it."""
    times, busy = [], []
    for i, ids in enumerate(data):
        sync(device)
        if clock is not None:
            clock.busy = 0.0
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        sync(device)
        elapsed = time.perf_counter() - t0
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(elapsed)
            busy.append(clock.busy if clock is not None else 0.0)
    return times, busy


def old_split(model, pp: int) -> list[int]:
    """The split before stages were balanced by cost: parameter counts (the head's with the last stage, the
    embedding's not at all), cut where the running count comes closest to each stage's share."""
    from disttrain.parallel.split.pipeline import block_sizes

    sizes, first, last = block_sizes(model)
    sizes = list(sizes)
    sizes[0] += first
    sizes[-1] += last
    total, points, running = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        stage = len(points) + 1
        target = total * stage / pp
        if stage < pp and (abs(running - target) <= abs(running + sizes[i + 1] - target)
                           or len(sizes) - (i + 1) == pp - stage):
            points.append(i + 1)
    return points[: pp - 1]


def simulated_idle(pipeline_order: dict) -> float:
    """Idle fraction of torch's action list (rank -> actions) run with ideal durations and no communication:
    forward, input backward and weight backward 1, full backward 2; each action starts when its rank is free and
    what it needs is done (the forward of the stage before; the backward of the stage after)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    cost = {C.FORWARD: 1.0, C.BACKWARD_INPUT: 1.0, C.BACKWARD_WEIGHT: 1.0, C.FULL_BACKWARD: 2.0}
    compute = (*cost, C.OVERLAP_F_B)  # not communication, FSDP gathers or gradient reduction
    queues = {r: [a for a in acts if a is not None and a.computation_type in compute]
              for r, acts in pipeline_order.items()}
    done: dict[tuple, float] = {}  # (kind, stage, microbatch) -> end time; kind "F", "B" (input grads), "W"
    last_stage = max(a.stage_index for acts in queues.values() for a in acts
                     for a in (a.sub_actions or (a,)))
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)

    def needs(a) -> list[tuple]:
        s, mb, t = a.stage_index, a.microbatch_index, a.computation_type
        if t == C.FORWARD:
            return [("F", s - 1, mb)] if s > 0 else []
        if t == C.BACKWARD_WEIGHT:
            return [("B", s, mb)]
        return [("F", s, mb)] + ([("B", s + 1, mb)] if s < last_stage else [])

    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while queue:
                action = queue[0]
                parts = action.sub_actions or (action,)
                deps = [d for p in parts for d in needs(p) if d not in {k for q in parts for k in produced(q)}]
                if any(d not in done for d in deps):
                    break
                start = max([free[rank], *(done[d] for d in deps)])
                duration = sum(cost[p.computation_type] for p in parts)
                free[rank] = start + duration
                busy[rank] += duration
                for p in parts:
                    for key in produced(p):
                        done[key] = free[rank]
                queue.pop(0)
                progress = True
    if any(queues.values()):
        raise RuntimeError("the action list did not run to the end")
    span = max(free.values())
    return sum(1 - b / span for b in busy.values()) / len(busy)


def produced(action) -> list[tuple]:
    from torch.distributed.pipelining.schedules import _ComputationType as C

    s, mb, t = action.stage_index, action.microbatch_index, action.computation_type
    return {C.FORWARD: [("F", s, mb)], C.BACKWARD_INPUT: [("B", s, mb)], C.BACKWARD_WEIGHT: [("W", s, mb)],
            C.FULL_BACKWARD: [("B", s, mb), ("W", s, mb)]}[t]


def run_pp(args, device, clock, m: int, **options) -> dict:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    fabric = make_fabric(args, device, pipeline_parallel_size=2, microbatches=m, **options)
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 4096, (args.batch * m, args.seq), generator=g).to(device)
            for _ in range(args.steps + args.warmup)]
    times, busy = train_steps(model, opt, fabric, data, device, args.warmup, clock)
    idle = torch.tensor([1 - sum(busy) / sum(times)])
    dist.all_reduce(idle)
    pipe = fabric.strategy.engine.pipeline
    schedule = pipe._schedule(True, data[0].shape)  # the one that ran these batches
    # one stage per rank (1F1B): the closed form; several: their action list
    multi = isinstance(schedule, PipelineScheduleMulti)
    theory = simulated_idle(schedule.pipeline_order) if multi else 1 / (m + 1)
    return {"step_s": statistics.median(times), "idle": idle.item() / dist.get_world_size(), "theory": theory,
            "bounds": [list(b) for b in pipe.plan.bounds]}


def child_pp(args, device) -> dict:
    clock = StageClock()
    results = {}
    for m in [int(x) for x in args.microbatches.split(",")]:
        results[f"1F1B m={m}"] = run_pp(args, device, clock, m, pipeline_schedule="1f1b")
    m = args.compare
    results[f"1F1B old split m={m}"] = run_pp(args, device, clock, m, pipeline_schedule="1f1b",
                                              split_points=old_split(build_model(args), 2))
    if f"1F1B m={m}" not in results:
        results[f"1F1B m={m}"] = run_pp(args, device, clock, m, pipeline_schedule="1f1b")
    from disttrain.parallel.split.pipeline import SCHEDULES

    for name in [n for n in args.schedules.split(",") if n in SCHEDULES]:  # dualpipev: torch >= 2.9
        results[f"{name} m={m}"] = run_pp(args, device, clock, m, pipeline_schedule=name)
    return results


def child_tp(args, device) -> dict:
    if dist.is_initialized() and dist.get_world_size() > 1:
        fabric = make_fabric(args, device, tensor_parallel_size=dist.get_world_size())
    else:
        fabric = None
    model = build_model(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if fabric is not None:
        model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 4096, (args.batch, args.seq), generator=g).to(device)
            for _ in range(args.steps + args.warmup)]

    class Plain:  # the one-process baseline: a hand-written torch loop
        @staticmethod
        def backward(loss):
            loss.backward()

    times, _ = train_steps(model, opt, fabric or Plain, data, device, args.warmup)
    return {"step_s": statistics.median(times)}


def launch(args, mode: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        torchrun([os.path.abspath(__file__), *sys.argv[1:], "--child", mode, "--result", result], nproc,
                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(result) as f:
            return json.load(f)


def main() -> None:
    args = parse_args()
    if args.child:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        result = child_pp(args, device) if args.child == "pp" else child_tp(args, device)
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump(result, f)
        return

    import logging

    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    print(f"model: Llama hidden={args.hidden} layers={args.layers} seq={args.seq}, {args.batch} samples per"
          f" microbatch, {args.device}, {args.precision}")
    pp = launch(args, "pp", 2)
    print("\np=2                               step (s)   idle measured   idle theory   measured / theory   stages")
    rows = []
    for name, row in pp.items():
        ratio = row["idle"] / row["theory"] if row["theory"] else float("nan")
        bounds = " | ".join(f"{a}-{b - 1}" for a, b in row["bounds"])
        print(f"  {name:<30} {row['step_s']:8.3f}   {row['idle']:13.3f}   {row['theory']:11.3f}   {ratio:17.2f}"
              f"   {bounds}")
        rows.append([name, row["step_s"], row["idle"], row["theory"], ratio, bounds])
    notes = ["theory: (p-1)/(m+p-1) for 1F1B; torch's action list with ideal durations for the others",
             "stages: the blocks of each stage (first-last), in stage order"]
    if not args.no_tp:
        single = launch(args, "tp", 1)
        tp = launch(args, "tp", 2)
        line = (f"TP=2 step {tp['step_s']:.3f} s vs one process {single['step_s']:.3f} s: ratio"
                f" {tp['step_s'] / single['step_s']:.2f} (below 1 = faster than one process)")
        print("\n" + line)
        notes.append(line)
    write_table("pipeline_bubble", "Pipeline bubble of disttrain_megatron's schedules",
                f"Llama hidden={args.hidden} layers={args.layers} seq={args.seq}, {args.batch} samples per microbatch,"
                f" {args.device}, {args.precision}", ["schedule", "step s", "idle measured", "idle theory",
                                                      "measured / theory", "stages"], rows,
                bars=("idle measured", "idle theory"), fmt={"step s": ".3f", "idle measured": ".3f",
                                                             "idle theory": ".3f", "measured / theory": ".2f"},
                notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
