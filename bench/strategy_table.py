"""Every strategy on one model in one run: per-rank memory and step time, measured, next to the planner's estimate.

    python bench/strategy_table.py            # 2 CPU processes (gloo), the "small" Llama of the accuracy test
    python bench/strategy_table.py --steps 5
    python bench/strategy_table.py --smoke    # DDP only, the tiny model: checks that it runs

This is the usual cross-framework comparison (DDP / FSDP / DeepSpeed ZeRO-3 / Megatron; memory and speed), rebuilt
from our own measurements: rows ddp, fsdp, fsdp_offload, zero3, zero3_offload, megatron tp=2 and
pp=2 (the megatron rows appear once disttrain_megatron is registered; until then they are skipped with a message).
Memory is measured as in bench/planner_accuracy.py (model states + saved activations per rank); step time is the
median of --steps steps after the measured ones, each in fresh processes. Times and the planner's step estimates
are printed as ratios to DDP's in the same run. On CPU "offload" moves nothing (host and device are one memory), so
its cost shows only as the copies and the CPU optimizer; the planner's device/host split is printed for reference.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_smoke  # noqa: E402
from planner_accuracy import run  # noqa: E402
from tables import write_table  # noqa: E402

ROWS = ["disttrain_ddp", "disttrain_fsdp", "disttrain_fsdp_offload", "disttrain_zero3", "disttrain_zero3_offload",
        "disttrain_megatron:tensor_parallel_size=2", "disttrain_megatron:pipeline_parallel_size=2,microbatches=2"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--rows", nargs="+", default=ROWS, help="strategies (the first is the baseline of the ratios)")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    args = parse_smoke(p, steps=1, size="tiny", rows=ROWS[:1])
    results = {}
    for spec in args.rows:
        results[spec] = run(spec, args.size, "--steps", str(args.steps))
    base = results[args.rows[0]][0][args.size]
    mib = 2**20
    print(f"\n{'strategy':<44} {'measured MiB/rank':>17} {'estimate':>9} {'est device':>10} {'est host':>8}"
          f" {'step s':>7} {'x DDP':>6} {'est x DDP':>9}")
    rows = []
    for spec, ranks in results.items():
        r = ranks[0][args.size]
        m, e = r["measured"], r["estimate"]
        busiest = max(x[args.size]["measured"]["states"] + x[args.size]["measured"]["activations"] for x in ranks)
        device = e["params"] + e["grads"] + e["optimizer"] + e["activations"] + e["buffers"]
        print(f"{spec:<44} {busiest / mib:>17.2f} {(e['states'] + e['activations']) / mib:>9.2f}"
              f" {device / mib:>10.2f} {e['host'] / mib:>8.2f} {m['step_s']:>7.3f}"
              f" {m['step_s'] / base['measured']['step_s']:>6.2f}"
              f" {r['estimated_step_s'] / base['estimated_step_s']:>9.2f}")
        rows.append([spec, busiest / mib, (e["states"] + e["activations"]) / mib, device / mib, e["host"] / mib,
                     m["step_s"], m["step_s"] / base["measured"]["step_s"],
                     r["estimated_step_s"] / base["estimated_step_s"]])
    write_table("strategy_table", "Every strategy on one model", f"2 CPU processes (gloo), {args.size} model,"
                f" {args.steps} steps", ["strategy", "measured MiB/rank", "estimate MiB", "est device MiB",
                                         "est host MiB", "step s", "x DDP", "est x DDP"], rows,
                bars=("measured MiB/rank", "x DDP"), reference={"x DDP": 1.0}, fmt={"step s": ".3f", "x DDP": ".2f",
                                                                                  "est x DDP": ".2f"},
                notes=["measured: the busiest rank's model states + saved activations; x DDP: step time over DDP's in"
                       " the same run"], out_dir=args.out_dir)


if __name__ == "__main__":
    main()
