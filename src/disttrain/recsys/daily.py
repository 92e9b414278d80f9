"""The daily DeepFM job: warm-start from the published model, train every unprocessed day in order (catch-up),
evaluate on the newest day's held-out rows, publish atomically only when AUC did not regress, record each day.

Run by ``recipes/recsys/deepfm_daily.py`` and ``disttrain recsys daily``; one process by default (CPU/gloo or one
GPU), or ``torchrun --nproc_per_node N`` for N processes (the tables are then sharded across them).

Guarantees: a lock keeps two runs from overlapping; a finished day is not trained again unless ``--force``; a
restart after a crash resumes from the model saved after the last finished day (``work/staging``), so no day is
lost or trained twice; readers of ``current`` only ever see a complete model.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import socket
import sys
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import yaml

from disttrain.parallel import checkpoint as ckpt
from disttrain.recsys.data import BadDataError, Day, DayBatches, convert_day, list_days, load_day, parse_date, \
    split_rows
from disttrain.recsys.metrics import ClickMetrics
from disttrain.recsys.publish import LockedError, ModelStore

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "recsys" / "deepfm_tiny.yaml"
DAILY_DEFAULTS = {"eval_fraction": 0.1, "auc_tolerance": 0.005, "keep_versions": 3, "max_bad_fraction": 0.01}
TRAIN_DEFAULTS = {"batch_size": 512, "lr": 1e-3, "seed": 0}
# TEST ONLY: name a point of the run (after-day-YYYY-MM-DD, before-publish, before-pointer) and the job dies there
# with os._exit, as a killed process would (no cleanup); the tests use it to check that a restart recovers.
CRASH_ENV = "DISTTRAIN_DAILY_CRASH_AT"
EXIT_FAILED, EXIT_REJECTED = 1, 3


class DailyError(RuntimeError):
    """A failure of the daily job that the operator must act on (the message says what to do)."""


@dataclass
class DailyOptions:
    """What one run is asked to do (the command-line options of the recipe)."""

    data_root: Path
    model_root: Path
    config: Path = DEFAULT_CONFIG
    run_date: Optional[dt.date] = None
    force: bool = False
    accelerator: str = "auto"
    auc_tolerance: Optional[float] = None
    max_bad_fraction: Optional[float] = None
    keep_versions: Optional[int] = None


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config {str(path)!r} does not exist; pass e.g. configs/recsys/deepfm_tiny.yaml")
    recipe = yaml.safe_load(path.read_text()) or {}
    if "model" not in recipe:
        raise ValueError(f"config {str(path)!r} has no model: section (see configs/recsys/deepfm_tiny.yaml)")
    return recipe


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[deepfm-daily] {message}", flush=True)


def _crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        _log(f"crash injected at {name} ({CRASH_ENV}, test only)")
        sys.stdout.flush()
        os._exit(86)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _rank0(fn: Any, *args: Any) -> Any:
    """Run ``fn`` on rank 0 only and give every rank its result, or its error (so no rank hangs)."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn(*args)
        except Exception as e:  # re-raised below, on every rank
            error = e
    result, error = _broadcast((result, error))
    if error is not None:
        raise error
    return result


def init_processes(accelerator: str) -> torch.device:
    """One process by default (a gloo or nccl group of size 1, since DMP shards over a process group); under
    torchrun, the group of all its processes."""
    use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise DailyError(f"--accelerator {accelerator} but no CUDA device is visible; use --accelerator cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):  # torchrun
            dist.init_process_group(backend)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return device


class DailyJob:
    """One run of the daily job over a data root and a model root (see the module docstring)."""

    def __init__(self, options: DailyOptions) -> None:
        self.options = options
        self.recipe = load_recipe(options.config)
        self.daily = {**DAILY_DEFAULTS, **(self.recipe.get("daily") or {})}
        for key in ("auc_tolerance", "max_bad_fraction", "keep_versions"):
            if getattr(options, key) is not None:
                self.daily[key] = getattr(options, key)
        self.train = {**TRAIN_DEFAULTS, **(self.recipe.get("train") or {})}
        self.strategy_options = {k: v for k, v in (self.recipe.get("strategy") or {}).items() if v is not None}
        self.store = ModelStore(options.model_root)
        self.cache = self.store.root / "cache"

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.device = init_processes(self.options.accelerator)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        with ExitStack() as stack:
            _rank0(stack.enter_context, self.store.lock())  # rank 0 holds it; every rank gets its error
            return self._run_locked()

    def _run_locked(self) -> dict[str, Any]:
        started = time.time()
        days = {d.isoformat(): p for d, p in list_days(self.options.data_root).items()}
        if not days:
            raise DailyError(f"no day_YYYY-MM-DD.tsv[.gz] files in {self.options.data_root}")
        run_date = self.options.run_date.isoformat() if self.options.run_date else max(days)
        if run_date not in days:
            raise DailyError(f"no data for --run-date {run_date}: {self.options.data_root}/day_{run_date}.tsv[.gz]"
                             " is missing (is the upstream export late?); rerun when it has arrived")
        current = self.store.current()
        info = self.store.info(current)
        plan, trained, current_metrics, resume = self._plan(days, run_date, current, info)
        if not plan:
            _log(f"nothing to do: every day up to {run_date} is processed (--force retrains {run_date})")
            return {"status": "up-to-date", "run_date": run_date, "version": current.name if current else None}
        _log(f"run {run_date}: days {plan}" + (f" (resuming; trained: {trained})" if resume else ""))

        _rank0(lambda: [convert_day(days[d], self.cache) for d in plan])  # once, by one process
        loaded = {d: load_day(days[d], self.cache, self.daily["max_bad_fraction"]) for d in plan}
        for d in plan:
            if loaded[d].bad_rows:
                _log(f"{d}: skipped {loaded[d].bad_rows} malformed rows of {loaded[d].rows + loaded[d].bad_rows}")

        from disttrain.parallel.recsys import RecsysEngine, RecsysOptions
        from disttrain.recsys.model import DeepFM

        import lightning as L
        L.seed_everything(int(self.train["seed"]), verbose=False)
        module = DeepFM(self.recipe["model"], lr=float(self.train["lr"]))
        engine = RecsysEngine(RecsysOptions(**self.strategy_options))
        engine.parallelize(module, self.device)  # shard now, so the warm start loads straight into the shards
        newest = loaded[plan[-1]]
        if resume:
            self._load(engine, self.store.staging, module)
        elif current is not None:
            self._load(engine, current, module)
            current_metrics = self.evaluate(module, newest)  # the current model, on the gate's data
            _log(f"current model {current.name} on {plan[-1]} held-out rows: {_fmt(current_metrics)}")

        for d in plan:
            if d in trained:
                continue
            rows = self._fit_day(module, loaded[d])
            trained.append(d)
            progress = {"base_version": current.name if current else None, "plan": plan, "trained": trained,
                        "current_metrics": current_metrics, "run_date": run_date}
            engine.save(self.store.staging, module, {"progress": progress,
                                                     "dense_optimizer": module.configure_optimizers().state_dict()})
            _log(f"{d}: trained on {rows} rows")
            _crash_point(f"after-day-{d}")

        metrics = self.evaluate(module, newest)
        tolerance = float(self.daily["auc_tolerance"])
        accepted = current_metrics is None or metrics["auc"] >= current_metrics["auc"] - tolerance
        _log(f"new model on {plan[-1]} held-out rows: {_fmt(metrics)}")
        _crash_point("before-publish")
        record = {"run_date": run_date, "run_days": plan, "metrics": metrics, "current_metrics": current_metrics,
                  "previous_version": current.name if current else None, "auc_tolerance": tolerance,
                  "rows": {d: loaded[d].rows for d in plan}, "bad_rows": {d: loaded[d].bad_rows for d in plan},
                  "started_at": _now(started)}
        version = None
        if accepted:
            version = self._publish(engine, module, info, record)
            _log(f"published version {version} ({metrics['auc']:.4f} AUC)")
        else:
            _log(f"NOT published: AUC {metrics['auc']:.4f} < current {current_metrics['auc']:.4f} - {tolerance}"
                 f"; {current.name if current else None} stays current")
        status = "published" if accepted else "rejected"
        _rank0(self._finish, plan, {**record, "status": status, "version": version})
        return {"status": status, "run_date": run_date, "days": plan, "version": version, "metrics": metrics,
                "current_metrics": current_metrics}

    def _plan(self, days: dict[str, Path], run_date: str, current: Optional[Path],
              info: dict[str, Any]) -> tuple[list[str], list[str], Optional[dict], bool]:
        """(days to process, days of them already trained, the current model's metrics, resuming?)."""
        base = current.name if current else None
        progress = self._staging_progress()
        if progress is not None:
            if progress["base_version"] == base:
                return progress["plan"], list(progress["trained"]), progress["current_metrics"], True
            if info.get("previous") == progress["base_version"] and set(progress["plan"]) <= set(info["days"]):
                _log(f"the last run published {base} but stopped before its records; writing them")
                _rank0(self._finish, progress["plan"], {**info["record"], "status": "published", "version": base})
            else:
                _log(f"discarding work/staging: it was trained from {progress['base_version']}, current is {base}")
                _rank0(shutil.rmtree, self.store.work)
        processed = set(info.get("days", [])) | {d for d in days if self.store.record(d) is not None}
        plan = [d for d in sorted(days) if d <= run_date and d not in processed]
        if self.options.force and run_date not in plan:
            plan = sorted(plan + [run_date])
        return plan, [], None, False

    def _staging_progress(self) -> Optional[dict[str, Any]]:
        if not (self.store.staging / ckpt.META_FILE).is_file():
            return None
        return ckpt._read_meta(self.store.staging).get("progress")

    def _load(self, engine: Any, path: Path, module: Any) -> None:
        metadata = engine.load(path, module)
        module.configure_optimizers().load_state_dict(metadata["dense_optimizer"])

    def _fit_day(self, module: Any, day: Day) -> int:
        """One epoch over the day's training rows (all but the held-out tail); returns their number."""
        import lightning as L

        from disttrain.strategies import RecsysStrategy

        train_rows, _ = split_rows(day.rows, float(self.daily["eval_fraction"]))
        dataset = DayBatches(day, train_rows, int(self.train["batch_size"]), module.table_sizes,
                             drop_last=self.world > 1)
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=self.world, rank=self.rank, shuffle=True,
                                                      seed=int(self.train["seed"]) + day.date.toordinal())
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=sampler)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(num_workers|small|does not have many workers).*")
            trainer = L.Trainer(strategy=RecsysStrategy(**self.strategy_options),
                                accelerator="gpu" if self.device.type == "cuda" else "cpu", devices=local,
                                num_nodes=self.world // local, max_epochs=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                                num_sanity_val_steps=0)
            trainer.fit(module, loader)
        return dataset.rows

    def evaluate(self, module: Any, day: Day) -> dict[str, float]:
        return evaluate(module, day, float(self.daily["eval_fraction"]), int(self.train["batch_size"]), self.device)

    def _publish(self, engine: Any, module: Any, info: dict[str, Any], record: dict[str, Any]) -> str:
        version = _rank0(self.store.next_version)
        days = sorted(set(info.get("days", [])) | set(record["run_days"]))
        new_info = {"version": version.name, "days": days, "previous": record["previous_version"],
                    "metrics": record["metrics"], "published_at": _now(time.time()), "model": self.recipe["model"],
                    "world_size": self.world, "record": record}
        engine.save(self.store.partial(version), module,
                    {"dense_optimizer": module.configure_optimizers().state_dict(), "info": new_info})

        def swap() -> None:
            self.store.finish_version(version, new_info)
            _crash_point("before-pointer")
            self.store.point_at(version)
            removed = self.store.prune(int(self.daily["keep_versions"]))
            if removed:
                _log(f"removed old versions {removed}")

        _rank0(swap)
        return version.name

    def _finish(self, plan: list[str], record: dict[str, Any]) -> None:
        finished = _now(time.time())
        for d in plan:
            self.store.write_record(d, {**record, "day": d, "finished_at": finished})
        if self.store.work.exists():
            shutil.rmtree(self.store.work)


@torch.no_grad()
def evaluate(module: Any, day: Day, eval_fraction: float, batch_size: int,
             device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """Metrics of a DeepFM on the held-out rows of ``day``, over all ranks. Every rank runs the same number of
    forward passes of the same size (DMP's collectives need all ranks); a rank out of batches repeats one and does
    not count it."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    _, held = split_rows(day.rows, eval_fraction)
    dataset = DayBatches(day, held, batch_size, module.table_sizes)
    metrics = ClickMetrics(device=device)
    was_training = module.training
    module.eval()
    for step in range(-(-len(dataset) // world)):
        index = step * world + rank
        dense, sparse, labels = dataset[min(index, len(dataset) - 1)]
        valid = labels.shape[0] if index < len(dataset) else 0
        if world > 1 and labels.shape[0] < batch_size:  # the same batch size on every rank: pad with row 0
            pad = batch_size - labels.shape[0]
            dense, sparse = (torch.cat([t, t[:1].expand(pad, -1)]) for t in (dense, sparse))
        logits = module(dense.to(device), sparse.to(device))
        if valid:
            metrics.update(logits[:valid], labels.to(device))
    module.train(was_training)
    return metrics.compute()


def _now(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="seconds")


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def parser(prog: str = "deepfm_daily.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Daily DeepFM retraining: warm start, catch-up, gated atomic"
                                " publish. Exit 0: published or nothing to do; 3: trained but not published (AUC"
                                " regressed); 1: failed (the message says why).")
    p.add_argument("--data-root", required=True, type=Path, help="folder of day_YYYY-MM-DD.tsv[.gz] files")
    p.add_argument("--model-root", required=True, type=Path, help="folder of published versions, records, lock")
    p.add_argument("--run-date", type=parse_date, default=None,
                   help="process days up to this date, which must have data (default: the newest day present)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="recipe YAML (default: deepfm_tiny.yaml)")
    p.add_argument("--force", action="store_true", help="retrain --run-date even if it was processed already")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "gpu", "cuda"))
    p.add_argument("--auc-tolerance", type=float, default=None, help="override daily.auc_tolerance")
    p.add_argument("--max-bad-fraction", type=float, default=None, help="override daily.max_bad_fraction")
    p.add_argument("--keep-versions", type=int, default=None, help="override daily.keep_versions")
    return p


def main(argv: Optional[list[str]] = None, prog: str = "deepfm_daily.py") -> int:
    args = parser(prog).parse_args(argv)
    options = DailyOptions(**vars(args))
    try:
        result = DailyJob(options).run()
    except (DailyError, BadDataError, LockedError, FileNotFoundError, ValueError, ckpt.CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return EXIT_REJECTED if result["status"] == "rejected" else 0
