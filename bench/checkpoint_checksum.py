"""What checksums cost a checkpoint: DCP save/load with and without disttrain's manifest, side by side in one run.

    python bench/checkpoint_checksum.py                    # 1 GiB in 64 tensors, 3 rounds (~1 min on 2 cores)
    python bench/checkpoint_checksum.py --mib 256 --rounds 5
    python bench/checkpoint_checksum.py --smoke            # tiny sizes: checks that it runs

Baselines are DCP's own FileSystemWriter/FileSystemReader on the same state and folder; "checked" is what
``save_sharded``/``load_sharded`` use: ChecksumWriter (shards hashed as they are written) + write_manifest, and
CheckpointReader (every chunk verified before its items are deserialized). Rounds alternate plain/checked; medians
are printed with their ratio, next to the CPU seconds the process spent (all threads): a load's hashing overlaps its
reads where a core is free; on a busy machine both add their hashing's CPU time. The hash table shows one core's throughput of the candidates over the same bytes. Files stay in the
page cache (a warm restart); on a cold disk the I/O grows and the ratios fall.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from disttrain.parallel.checkpoint.integrity import CheckpointReader, ChecksumWriter, write_manifest  # noqa: E402
from harness import parse_smoke  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    return parse_smoke(p, mib=8, tensors=4, rounds=1)


def hash_rates(data: bytes) -> dict[str, float]:
    view, rates = memoryview(data), {}
    import xxhash

    makers = {"xxh3_128 (used)": xxhash.xxh3_128, **{n: (lambda n=n: hashlib.new(n)) for n in ("sha256", "blake2b", "sha1")}}
    for name, make in makers.items():
        start, h = time.perf_counter(), make()
        for i in range(0, len(data), 4 << 20):
            h.update(view[i:i + (4 << 20)])
        rates[name] = len(data) / (time.perf_counter() - start) / 1e9
    start, crc = time.perf_counter(), 0
    for i in range(0, len(data), 4 << 20):
        crc = zlib.crc32(view[i:i + (4 << 20)], crc)
    rates["crc32 (zlib)"] = len(data) / (time.perf_counter() - start) / 1e9
    return rates


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def save(state: dict, folder: Path, checked: bool) -> float:
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    if checked:
        writer = ChecksumWriter(folder)
        dcp.save(state, storage_writer=writer, no_dist=True)
        write_manifest(folder, writer.digests)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    return time.perf_counter() - start


def load(targets: dict, folder: Path, checked: bool) -> float:
    start = time.perf_counter()
    reader = CheckpointReader(folder) if checked else dcp.FileSystemReader(folder)
    dcp.load(targets, storage_reader=reader, no_dist=True)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    numel = args.mib * (1 << 20) // 4 // args.tensors
    state = {f"layer{i}.weight": torch.randn(numel) for i in range(args.tensors)}
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-"))
    print(f"state: {args.mib} MiB in {args.tensors} tensors; {os.cpu_count()} cores; folder {root}")
    rates = hash_rates(os.urandom(min(256, args.mib) << 20))
    print("one core, GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
    times: dict[str, list[float]] = {k: [] for k in ("save", "save+checksum", "load", "load+verify")}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    try:
        for _ in range(args.rounds):
            for checked in (False, True):
                folder = root / ("checked" if checked else "plain")
                for name, run in (("save+checksum" if checked else "save", lambda: save(state, folder, checked)),
                                  ("load+verify" if checked else "load", lambda: load(targets, folder, checked))):
                    before = cpu_seconds()
                    times[name].append(run())
                    cpu[name].append(cpu_seconds() - before)
        assert all(torch.equal(targets[k], state[k]) for k in state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    gb = args.mib / 1024 * 1.073741824
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'':12} {'median s':>9} {'GB/s':>6} {'ratio':>6} {'cpu s':>7} {'ratio':>6}")
    for plain, checked in (("save", "save+checksum"), ("load", "load+verify")):
        for name in (plain, checked):
            print(f"{name:12} {med[name]:9.3f} {gb / med[name]:6.2f} {med[name] / med[plain]:6.2f}"
                  f" {med_cpu[name]:7.3f} {med_cpu[name] / med_cpu[plain]:6.2f}")


if __name__ == "__main__":
    main()
