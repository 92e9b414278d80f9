"""Async checkpoints (async_checkpoint=True) on 2 CPU processes. Usage:

    async_checkpoint.py OUT compare KILLED_DIR   # per strategy: sync vs async saves and resumes; a full disk; resume
                                                  # from what the kill run left in KILLED_DIR
    async_checkpoint.py OUT kill DIR             # save step-000001, then SIGKILL every rank while step-000002 is
                                                  # being written (held by DISTTRAIN_HOLD_ASYNC_SAVE=2)
"""

import json
import os
import pickle
import re
import signal
import sys
from pathlib import Path

import lightning as L
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY

import disttrain  # noqa: F401  (registers the strategy names)
from disttrain.parallel.checkpoint import async_save as async_checkpoint
from disttrain.parallel.checkpoint.io import latest_checkpoint
from disttrain.parallel.guards.diskspace import FAIL_ENV

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, fabric_train, loader, tiny_llama, write_result  # noqa: E402

STRATEGIES = {"disttrain_fsdp": {}, "disttrain_ddp": {}, "disttrain_megatron": {"tensor_parallel_size": 2}}


def make_fabric(name: str, asynchronous: bool) -> L.Fabric:
    row = STRATEGY_REGISTRY[name]
    strategy = row["strategy"](**{**row["init_params"], **STRATEGIES[name], "async_checkpoint": asynchronous})
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def train(fabric: L.Fabric, model, optimizer, start: int, stop: int, folder: Path | None) -> list[float]:
    """Steps start..stop-1; after each a save of step-<n> (n = steps done) under ``folder``."""
    def save(step: int) -> None:  # after the optimizer step (the gradients are not part of a checkpoint)
        if folder is not None:
            fabric.save(folder / f"step-{step + 1:06d}", {"model": model, "optimizer": optimizer, "step": step + 1})

    return fabric_train(fabric, model, optimizer, stop, start=start, on_step=save)


def setup(fabric: L.Fabric):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return fabric.setup(model, optimizer)


def local_state(model, optimizer) -> list[torch.Tensor]:
    """This rank's parameters and optimizer moments (its shards), in a fixed order."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.to_local() if hasattr(v, "to_local") else v for _, v in sorted(state.items())]
    return [t.detach().clone() for t in tensors]


def same_folder(a: Path, b: Path, meta: bool = True) -> bool:
    """The same files, the same checksums of the shards and meta.pt, and the same DCP metadata. (Two saves of one
    state differ only in .metadata's storage_meta: the folder it was written to and a random save id.) ``meta``:
    compare meta.pt too (a Trainer's holds ModelCheckpoint's own folder)."""
    skip = {".metadata"} | (set() if meta else {"meta.pt"})
    files = [json.loads((f / "manifest.json").read_text())["files"] for f in (a, b)]
    metadata = [pickle.loads((f / ".metadata").read_bytes()) for f in (a, b)]
    return files[0].keys() == files[1].keys() and \
        all(files[0][k] == files[1][k] for k in files[0] if k not in skip) and \
        all(getattr(metadata[0], k) == getattr(metadata[1], k) for k in vars(metadata[0]) if k != "storage_meta")


def resume(name: str, asynchronous: bool, path: Path, steps: int = 5) -> tuple[list[float], list[torch.Tensor]]:
    fabric = make_fabric(name, asynchronous)
    model, optimizer = setup(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    after_load = local_state(model, optimizer)
    losses = train(fabric, model, optimizer, state["step"], steps, None)
    return losses, after_load + local_state(model, optimizer)


def compare(root: Path, killed: Path) -> dict:
    result: dict = {}
    for name in STRATEGIES:
        runs = {}
        for asynchronous in (False, True):
            folder = root / name / ("async" if asynchronous else "sync")
            fabric = make_fabric(name, asynchronous)
            model, optimizer = setup(fabric)
            losses = train(fabric, model, optimizer, 0, 3, folder)
            fabric.strategy.wait_checkpoint()
            runs[asynchronous] = (losses, folder)
        sync_folder, async_folder = runs[False][1], runs[True][1]
        resumed = {a: resume(name, a, runs[a][1] / "step-000002") for a in (False, True)}
        result[name] = {
            "losses_equal": runs[False][0] == runs[True][0],
            "folders": [sorted(p.name for p in f.iterdir()) for f in (sync_folder, async_folder)],
            "files": [sorted(p.name for p in (f / "step-000003").iterdir()) for f in (sync_folder, async_folder)],
            "same_folders": all(same_folder(sync_folder / s, async_folder / s)
                                for s in ("step-000001", "step-000002", "step-000003")),
            "resumed_losses": [resumed[False][0], resumed[True][0]],
            "state_bitwise": all(torch.equal(a, b) for a, b in zip(*(resumed[x][1] for x in (False, True)))),
            "state_count": len(resumed[False][1]),
        }

    # The Trainer: ModelCheckpoint saves through the strategy; fit returns once the last save is complete.
    for asynchronous in (False, True):
        folder = root / "trainer" / ("async" if asynchronous else "sync")
        row = StrategyRegistry["disttrain_fsdp"]
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, strategy=row["strategy"](
                                 **{**row["init_params"], "async_checkpoint": asynchronous}),
                             callbacks=[ModelCheckpoint(folder, "{step}", every_n_train_steps=1, save_top_k=-1)])
        trainer.fit(LlamaModule(step_indexed=True), loader())
        result[f"trainer_{'async' if asynchronous else 'sync'}"] = sorted(p.name for p in folder.iterdir())
    result["trainer_same_folders"] = all(same_folder(root / "trainer" / "sync" / f"step={s}.ckpt",
                                                     root / "trainer" / "async" / f"step={s}.ckpt", meta=False)
                                         for s in (1, 2, 3))

    # A full disk while the background write runs: the same one line as a synchronous save, at the next save/end.
    errors = {}
    for asynchronous in (False, True):
        fabric = make_fabric("disttrain_fsdp", asynchronous)
        model, optimizer = setup(fabric)
        folder = root / "full" / ("async" if asynchronous else "sync")
        os.environ[FAIL_ENV] = "shard"
        try:
            fabric.save(folder / "step-000001", {"model": model, "optimizer": optimizer})
            fabric.strategy.wait_checkpoint()
        except Exception as e:
            line = f"{type(e).__name__}: {e}".replace(str(folder), "FOLDER")
            errors[str(asynchronous)] = re.sub(r"[\d.]+ [KMGT]?i?B free", "N free", line)
        finally:
            os.environ.pop(FAIL_ENV)
        errors[f"{asynchronous}_left"] = sorted(p.name for p in folder.iterdir())
    result["full_disk"] = errors

    # What the kill run left: the previous checkpoint, found and loaded; the held save's .tmp is no checkpoint.
    latest = latest_checkpoint(killed)
    result["killed_latest"] = latest.name if latest else None
    result["killed_left"] = sorted(p.name for p in killed.iterdir())
    result["killed_matches_sync"] = same_folder(killed / "step-000001", root / "disttrain_fsdp" / "sync" / "step-000001")
    from_killed = resume("disttrain_fsdp", True, latest)
    from_sync = resume("disttrain_fsdp", False, root / "disttrain_fsdp" / "sync" / "step-000001")
    result["killed_resumed_losses"] = [from_killed[0], from_sync[0]]
    result["killed_state_bitwise"] = all(torch.equal(a, b) for a, b in zip(from_killed[1], from_sync[1]))
    return result


def kill(folder: Path) -> None:
    fabric = make_fabric("disttrain_fsdp", True)
    model, optimizer = setup(fabric)
    train(fabric, model, optimizer, 0, 2, folder)  # saves step-000001, then step-000002 (held)
    fabric.strategy.engine.wait_checkpoint(folder / "step-000001")  # no-op: step-000001 is complete already
    train(fabric, model, optimizer, 2, 3, None)  # training goes on while step-000002 is in flight
    if not async_checkpoint.held.wait(timeout=300):
        raise SystemExit("the held save never reached its hold point")
    print(f"rank {fabric.global_rank}: SIGKILL with step-000002 in flight", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    mode, where = sys.argv[2], Path(sys.argv[3])
    if mode == "kill":
        kill(where)
    else:
        write_result(compare(Path(os.path.dirname(sys.argv[1])), where))
