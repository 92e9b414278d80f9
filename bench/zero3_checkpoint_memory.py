"""Host memory a ZeRO-3 checkpoint save and load need per rank, at 2 and 4 processes: disttrain's sharded layout
(each rank writes and reads only its partitions) against the gather-to-rank-0 path it replaced, measured in the
same run on the same model by tests/dist/zero3_shards.py.

    python bench/zero3_checkpoint_memory.py                          # ~18M parameters, 2 and 4 CPU processes
    python bench/zero3_checkpoint_memory.py --width 2048 --vocab 8192 --sizes 2 4 8
    python bench/zero3_checkpoint_memory.py --smoke                  # tiny sizes: checks that it runs

Per operation, the worst rank's figures: the resident set's high-water mark above the start (VmHWM, after the free
heap pages are returned to the system) and the most tensor bytes alive at once (every allocation and free of
torch's CPU allocator, counted by the profiler). The checkpoint's size (fp32 weights and Adam moments, tied weights
stored under both names) is printed with each world size's share. The sharded save writes each rank's partitions
in place (next to nothing extra); the sharded load reads the rank's share a stored chunk at a time (falls as 1/N);
the gathered path holds the whole checkpoint on rank 0 to save and on every rank to load, whatever N.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from harness import parse_smoke, torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "zero3_shards.py"
MIB = 2**20


def measure(n: int, sizes: list[str], tmp: str) -> tuple[list[dict], int]:
    """One launch at ``n`` processes: every rank's result, and the bytes of tensors in the checkpoint it wrote."""
    out, ckpt = os.path.join(tmp, f"n{n}"), os.path.join(tmp, f"ckpt{n}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    torchrun([str(SCRIPT), out, "--save", ckpt, "--baseline", *sizes], n, env=env, cwd=str(ROOT), quiet=True)
    return [json.load(open(f"{out}.{rank}.json")) for rank in range(n)], checkpoint_bytes(ckpt)


def checkpoint_bytes(path: str) -> int:
    import math

    from disttrain.parallel.checkpoint.io import stored_entries

    return sum(math.prod(md.size) * md.properties.dtype.itemsize for md in stored_entries(path).values()
               if hasattr(md, "chunks"))


def worst(ranks: list[dict], path: str, op: str, key: str) -> float:
    return max((r[op] if path == "sharded" else r["baseline"][op])[key] for r in ranks) / MIB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="world sizes (CPU processes)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--vocab", type=int, default=4096)
    args = parse_smoke(p, sizes=[2], width=64, depth=2, vocab=128)
    sizes = [f"--width={args.width}", f"--depth={args.depth}", f"--vocab={args.vocab}"]
    params = args.vocab * args.width + (args.depth + 1) * (args.width + 1) * args.width + 4
    with tempfile.TemporaryDirectory() as tmp:
        runs = {n: measure(n, sizes, tmp) for n in args.sizes}
    total = next(iter(runs.values()))[1] / MIB
    print(f"\nzero3_checkpoint_memory: {params / 1e6:.1f}M parameters (width {args.width}, {args.depth} blocks,"
          f" vocab {args.vocab}), checkpoint {total:.0f} MiB of tensors; worst rank per row, MiB")
    print(f"{'ranks':>5} {'share':>7}  {'path':<9} {'save RSS':>9} {'save tensors':>13} {'load RSS':>9}"
          f" {'load tensors':>13}")
    for n, (ranks, _) in runs.items():
        for path in ("sharded", "gathered"):
            cells = [worst(ranks, path, op, key) for op in ("save", "load") for key in ("rss_peak", "tensor_peak")]
            print(f"{n:>5} {total / n:>7.1f}  {path:<9} {cells[0]:>9.1f} {cells[1]:>13.1f} {cells[2]:>9.1f}"
                  f" {cells[3]:>13.1f}")
    first = args.sizes[0]
    print("\nsharded / gathered, peak RSS above the start (worst rank); sharded load's tensors alive at once against"
          f" {first} ranks")
    for n, (ranks, _) in runs.items():
        save, load = (worst(ranks, "sharded", op, "rss_peak") / worst(ranks, "gathered", op, "rss_peak")
                      for op in ("save", "load"))
        scaling = (worst(ranks, "sharded", "load", "tensor_peak")
                   / worst(runs[first][0], "sharded", "load", "tensor_peak"))
        print(f"  {n} ranks: save {save:.3f}, load {load:.3f}; load tensors x{scaling:.2f} (1/N: x{first / n:.2f})")
    print("  (the sharded save writes the partitions in place, so its figures are bookkeeping, not a share of the"
          " model;\n   the profiler misses frees made on gloo's threads, which inflates the gathered path's tensor"
          " figures: compare RSS)")

if __name__ == "__main__":
    main()
