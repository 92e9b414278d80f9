"""Training time lost per checkpoint: async_checkpoint=True against synchronous saves, side by side in one run.

    python bench/async_checkpoint.py            # Llama 13 x 1024 (157M parameters), disttrain_fsdp, 2 CPU processes
    python bench/async_checkpoint.py --smoke    # a tiny model, a few steps: checks that the bench runs

One Fabric, one model and optimizer (AdamW: a checkpoint holds parameters and both moments, ~12 bytes a parameter
over the ranks); the strategy's ``set_async_checkpoint`` switches between the two kinds of save. Each round is
``--every`` training steps without a checkpoint (the baseline step time), then ``--saves`` times "save, then
``--every`` steps" synchronously, then the same asynchronously, ending with the wait for the last background write.
Time lost per checkpoint = (the stretch's seconds - its steps x the baseline step time) / saves. An async save costs
its staging copy (the state to host memory) and whatever the background write takes from the training steps it
overlaps (on a CPU machine the same cores train and write); the save call alone (the time training is blocked) is
printed beside it. On a loaded machine the step times vary by more than a save costs: compare rounds, or rerun quiet. Checkpoints go to --dir (default: a temporary folder).

The floor: a third stretch writes the same bytes per rank as a checkpoint (one file, fsynced, like DCP's) from a
buffer in host memory on a background thread, and nothing else: no staging, no DCP, no checksums. What that costs
the training steps is what any background write costs on this machine (the cores it shares, and on a virtual machine
whatever the hypervisor charges for fresh page-cache memory), so no async checkpoint can lose less; the bench prints
floor over sync beside async over sync.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import build_model, count_params, torchrun  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=13)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="micro batch per rank")
    p.add_argument("--every", type=int, default=4, help="training steps between two checkpoints")
    p.add_argument("--saves", type=int, default=2, help="checkpoints per stretch")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: torch's); fewer than the cores leaves some free for the"
                        " background write, as a GPU machine's idle host cores are")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps (checks that the bench runs)")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.seq, args.every, args.saves, args.rounds = 64, 2, 32, 2, 2, 1
    return args


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # launch ourselves on N processes (a free port: a smoke run may overlap)
        torchrun([os.path.abspath(__file__), *sys.argv[1:]], args.devices)
        return
    import lightning as L

    import disttrain  # noqa: F401  (registers the strategy names)

    if args.threads:
        torch.set_num_threads(args.threads)

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="disttrain_fsdp")
    fabric.launch()  # processes exist already (torchrun): this only connects Fabric to them
    with fabric.init_module(empty_init=True):
        model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(100 + fabric.global_rank)
    ids = torch.randint(0, 4096, (args.batch, args.seq), generator=g)
    root = Path(fabric.broadcast(args.dir or tempfile.mkdtemp(prefix="async-checkpoint-bench-")))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    shard_bytes: list[int] = []  # this rank's bytes in a checkpoint (its DCP shard file), from the first sync save

    def write_plainly(path: Path, buffer: torch.Tensor) -> None:
        """The floor's write: the buffer's bytes into one new file, fsynced (as DCP's writer syncs its files)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        view = memoryview(buffer.numpy()).cast("B")
        with open(path, "wb") as f:
            for start in range(0, len(view), 64 << 20):
                f.write(view[start:start + (64 << 20)])
            f.flush()
            os.fsync(f.fileno())

    def stretch(kind: str, round_: int) -> tuple[float, list[float]]:
        """--saves x (save, then --every steps); the seconds of the whole and of each save call."""
        fabric.strategy.set_async_checkpoint(kind == "async")
        if kind == "floor":
            buffer = torch.ones(shard_bytes[0], dtype=torch.uint8)  # resident, as DCP's staging buffers are
        calls, writer = [], None
        fabric.barrier()
        start = time.perf_counter()
        for save in range(args.saves):
            called = time.perf_counter()
            path = root / kind / f"step-{round_}-{save}"
            if kind == "floor":  # at most one write in flight, as for async saves
                if writer is not None:
                    writer.join()
                writer = threading.Thread(target=write_plainly, args=(path / f"rank{fabric.global_rank}", buffer))
                writer.start()
            else:
                fabric.save(path, {"model": model, "optimizer": optimizer})
            if not shard_bytes:
                shard_bytes.append((path / f"__{fabric.global_rank}_0.distcp").stat().st_size)
            calls.append(time.perf_counter() - called)
            for _ in range(args.every):
                step()
        if writer is not None:
            writer.join()
        fabric.strategy.wait_checkpoint()
        fabric.barrier()
        return time.perf_counter() - start, calls

    step()  # warm-up
    kinds = ("sync", "async", "floor")
    base, lost, calls = [], {kind: [] for kind in kinds}, {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        for _ in range(args.every):
            fabric.barrier()
            start = time.perf_counter()
            step()
            fabric.barrier()
            base.append(time.perf_counter() - start)
        t_step = statistics.median(base)
        for kind in kinds:
            seconds, call = stretch(kind, round_)
            lost[kind].append((seconds - args.saves * args.every * t_step) / args.saves)
            calls[kind] += call
        if fabric.is_global_zero:
            for kind in kinds:
                shutil.rmtree(root / kind, ignore_errors=True)
    if fabric.is_global_zero:
        n_params = count_params(args)
        sync_lost, async_lost, floor_lost = (statistics.median(lost[kind]) for kind in kinds)
        print(f"\nasync_checkpoint: {args.devices} x cpu, disttrain_fsdp, Llama {args.layers}x{args.hidden}"
              f" ({n_params / 1e6:.1f}M params, AdamW: {12 * n_params / 2**30:.2f} GiB a checkpoint), micro batch"
              f" {args.batch}x{args.seq}, a checkpoint every {args.every} steps, {args.rounds} rounds x"
              f" {args.saves} saves")
        print(f"  step time without checkpoints  {statistics.median(base):8.3f} s")
        print(f"  {'':<14} {'save call (s)':>14} {'lost per checkpoint (s)':>24}")
        for kind, value in zip(kinds, (sync_lost, async_lost, floor_lost)):
            print(f"  {kind:<14} {statistics.median(calls[kind]):14.3f} {value:24.3f}")
        print(f"  (floor: the same {shard_bytes[0] / 2**30:.2f} GiB per rank written plainly in the background:"
              " what any background write costs the steps here)")
        calls_ratio = statistics.median(calls["async"]) / statistics.median(calls["sync"])
        print(f"  ratio async / sync (time lost per checkpoint): {async_lost / sync_lost:.3f}   (target <= 0.2)")
        print(f"  ratio async / sync (save call, training blocked): {calls_ratio:.3f}")
        print(f"  ratio floor / sync (the least any background write loses here): {floor_lost / sync_lost:.3f}")
        spread = (max(base) - min(base)) / statistics.median(base)
        if min(sync_lost, async_lost, floor_lost) < 0 or spread > 0.2:
            print(f"  note: step times varied by {spread:.0%} of the median (a loaded machine): the time lost is"
                  " within that noise; rerun on a quiet machine or with more --rounds")
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    fabric.barrier()


if __name__ == "__main__":
    main()
