"""The planner's per-rank memory estimate against measurement, on 2 CPU processes (gloo), printed as errors.

    python bench/planner_accuracy.py                 # every registered strategy, a tiny and a small Llama
    python bench/planner_accuracy.py --strategies disttrain_fsdp disttrain_zero3
    python bench/planner_accuracy.py --smoke         # one strategy, the tiny model: checks that it runs

How memory is measured (tests/dist/planner_measure.py, the script tests/test_planner_accuracy.py runs too):
- model states: the bytes of the tensors this rank holds after the second optimizer step, gradients still alive:
  parameters (a DTensor's local shard under FSDP2, a ZeRO-3 partition), gradients (ZeRO-3: its flat gradient
  partition buffer), optimizer state (ZeRO-3: also its fp32 master partition);
- activations: what autograd saves for backward during the forward (saved_tensors_hooks), unique storages counted
  once at the end of the forward, parameters and already-freed (resharded) storages excluded.
Buffers (DDP buckets, gathered FSDP/ZeRO units) are estimated but not measured here: on CPU there is no allocator
peak to read them from. Megatron rows (tp=2, pp=2) appear once disttrain_megatron is registered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_smoke, torchrun  # noqa: E402
from tables import write_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist", "planner_measure.py")
ALL = ["disttrain_ddp", "disttrain_fsdp", "disttrain_fsdp_offload", "disttrain_zero3", "disttrain_zero3_offload",
       "disttrain_megatron:tensor_parallel_size=2", "disttrain_megatron:pipeline_parallel_size=2"]


def run(spec: str, *args: str) -> list[dict]:
    """tests/dist/planner_measure.py under torchrun on 2 CPU processes; every rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        torchrun([SCRIPT, out, spec, *args], 2, env=env, cwd=ROOT, quiet=True)
        return [json.load(open(f"{out}.{rank}.json")) for rank in range(2)]


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="*", default=ALL)
    p.add_argument("--sizes", nargs="*", default=[], choices=("tiny", "small", "gpt2"),
                   help="models (default: tiny and small)")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    args = parse_smoke(p, strategies=["disttrain_fsdp"], sizes=["tiny"])
    print(f"{'strategy':<44} {'model':<6} {'states MiB':>10} {'est':>8} {'err':>7} {'acts MiB':>9} {'est':>8}"
          f" {'err':>7} {'total err':>9}")
    rows = []
    for spec in args.strategies:
        rank0 = run(spec, *args.sizes)[0]
        for size, r in rank0.items():
            m, e = r["measured"], r["estimate"]
            mib = 2**20
            print(f"{spec:<44} {size:<6} {m['states'] / mib:>10.2f} {e['states'] / mib:>8.2f}"
                  f" {error(e['states'], m['states']):>7} {m['activations'] / mib:>9.2f}"
                  f" {e['activations'] / mib:>8.2f} {error(e['activations'], m['activations']):>7}"
                  f" {error(e['states'] + e['activations'], m['states'] + m['activations']):>9}")
            total = (e["states"] + e["activations"]) / (m["states"] + m["activations"]) - 1
            rows.append([f"{spec} ({size})", m["states"] / mib, e["states"] / mib, m["activations"] / mib,
                         e["activations"] / mib, 100 * abs(total)])
    if rows:
        write_table("planner_accuracy", "Planner estimate against measurement", "2 CPU processes (gloo), rank 0",
                    ["strategy (model)", "states MiB", "est states MiB", "activations MiB", "est activations MiB",
                     "|total error| %"], rows, bars=("|total error| %",), fmt={"|total error| %": ".1f"},
                    notes=["total error: (estimated - measured) / measured of states + activations"],
                    out_dir=args.out_dir)


if __name__ == "__main__":
    main()
