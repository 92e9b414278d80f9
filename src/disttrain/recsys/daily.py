"""The daily DeepFM job: warm-start from the published model, train every unprocessed day in order (catch-up),
evaluate on the newest day's held-out rows, publish atomically only a healthy model whose AUC did not regress,
record each day.

Run by ``recipes/recsys/deepfm_daily.py`` and ``disttrain recsys daily``; one process by default (CPU/gloo or one
GPU), or ``torchrun --nproc_per_node N`` for N processes (the tables are then sharded across them).

Output: stdout carries the job's own lines (``[deepfm-daily] ...``, from rank 0), stderr its one-line error (rank 0)
and the warnings of disttrain's own code; the libraries' warnings and log records (once each), the training progress
lines of a run without a terminal and the error's traceback go to ``MODEL_ROOT/logs/job-YYYY-MM-DD.log`` (the UTC day
the run started; ``job-YYYY-MM-DD.rankN.log`` for rank N), see :mod:`disttrain.report.joblog`. ``--verbose`` puts
all of it on stderr too.

Guarantees: a lock keeps two runs from overlapping; a finished day is not trained again unless ``--force``; days
are trained in date order (a missing day stops the run unless it is explicitly skipped, and a day older than the
model's newest is not trained on top of it unless asked); each day is validated against the days before it; a day
set aside (``--skip-day``: quarantined) is never trained until it is released (``--release-day``); a
restart after a crash resumes from the model saved after the last finished day (``work/staging``), so no day is
lost or trained twice; a model with non-finite weights or metrics is never published nor warm-started from;
readers of ``current`` only ever see a complete model.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import getpass
import itertools
import logging
import math
import os
import re
import shutil
import socket
import sys
import time
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from disttrain.config import ConfigError
from disttrain.launch import check_options
from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.guards import watchdog
from disttrain.parallel.guards.diskspace import DiskFullError, ensure_free, remove
from disttrain.parallel.engines.managed_ids import finish_admissions, held_ids
from disttrain.parallel.guards.failures import describe
from disttrain.ports import free_port
from disttrain.recsys.data import CADENCES, BadDataError, Day, DayBatches, cache_size_estimate, cached, \
    convert_day, day_stats, folder_bytes, is_hour, list_periods, load_day, parse_period, period_key, period_start, \
    split_rows
from disttrain.recsys.defaults import DAILY_DEFAULTS, FULL_EVERY, TRAIN_DEFAULTS
from disttrain.recsys.ids import STATE_KEY as ID_COUNTS, IdCounts, count_evictions, describe_ids, \
    is_hashed_checkpoint, warm_start_from_hashed
from disttrain.recsys.metrics import ClickMetrics
from disttrain.recsys.publish import LockedError, ModelStore, StoreError
from disttrain.recsys.validate import ValidationBounds, check_day

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "recsys" / "deepfm_tiny.yaml"
STRATEGY = "disttrain_recsys"  # the recipe's strategy: section holds its options
# TEST ONLY: name a point of the run (after-day-YYYY-MM-DD[_HH], before-publish, after-delta-files, before-pointer)
# and the job dies there with os._exit, as a killed process would (no cleanup); the tests use it to check that a
# restart recovers.
CRASH_ENV = "DISTTRAIN_DAILY_CRASH_AT"
EXIT_FAILED, EXIT_REJECTED = 1, 3
# A day's record status; published and rejected days were trained (so not again without --force), the others not.
TRAINED_STATUSES = ("published", "rejected")
# A quarantined day was set aside (--skip-day, or daily.on_invalid_day: quarantine): nothing trains it, not even
# --force, until --release-day records it as released, which counts as unprocessed.
QUARANTINED, RELEASED = "quarantined", "released"
# daily.on_invalid_day: what a day that fails validation does to the run.
ON_INVALID_DAY = {"stop": "the run stops there and later days wait for the operator",
                  "quarantine": "the job sets the day aside itself and trains the later days"}
# Who sets a day aside or releases it, when user@host does not say it (e.g. the scheduler's user in a container).
OPERATOR_ENV = "DISTTRAIN_OPERATOR"


class DailyError(RuntimeError):
    """A failure of the daily job that the operator must act on (the message says what to do)."""


@dataclass
class DailyOptions:
    """What one run is asked to do (the command-line options of the recipe; None: the config's value)."""

    data_root: Path
    model_root: Path
    config: Path = DEFAULT_CONFIG
    run_date: Optional[dt.date | str] = None  # a day, or an hour (YYYY-MM-DD_HH) with every="1h"
    force: bool = False
    accelerator: str = "auto"
    auc_tolerance: Optional[float] = None
    min_auc: Optional[float] = None
    max_bad_fraction: Optional[float] = None
    keep_versions: Optional[int] = None
    skip_missing_days: Optional[bool] = None
    train_late_days: Optional[bool] = None
    skip_validation: bool = False
    skip_day: list[dt.date | str] = field(default_factory=list)
    reason: Optional[str] = None
    release_day: list[dt.date | str] = field(default_factory=list)
    verbose: bool = False
    logger: str = "tensorboard,csv"
    no_report: bool = False
    timeout: Optional[float] = None
    every: Optional[str] = None
    full: bool = False
    prog: str = "deepfm_daily.py"


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """A DeepFM recipe YAML (``model:``, ``train:``, ``strategy:``, ``daily:``) as a dict; an unknown section or key
    is one error naming the file, the section, the closest valid key and all valid keys."""
    from disttrain.recsys.model import DEEPFM_RECIPE

    return DEEPFM_RECIPE.read(path)


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[deepfm-daily] {message}", flush=True)


@contextmanager
def _quiet_root_logger(quiet: bool) -> Iterator[None]:
    """DCP logs a traceback on the root logger for each metadata file it fails to read before it raises; the job
    reports the failure itself in one line (``--verbose`` lets the tracebacks through)."""
    root = logging.getLogger()
    level = root.level
    if quiet:
        root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _crash_point(name: str) -> None:
    watchdog.stall_point(name)
    if os.environ.get(CRASH_ENV) == name:
        _log(f"crash injected at {name} ({CRASH_ENV}, test only)")
        sys.stdout.flush()
        os._exit(86)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


_rank0_calls = itertools.count()


def _rank0(fn: Any, *args: Any) -> Any:
    """Run ``fn`` on rank 0 only and give every rank its result, or its error (so no rank hangs). The others wait
    for it on the store, not in a collective, so that rank 0's work (converting a large day) may take longer than
    the collective timeout: a rank 0 that stopped is the watchdog's to report."""
    result, error = None, None
    key = f"disttrain/daily/rank0/{next(_rank0_calls)}"
    if dist.get_rank() == 0:
        try:
            result = fn(*args)
        except Exception as e:  # re-raised below, on every rank
            error = e
        if dist.get_world_size() > 1:
            _store().set(key, "done")
    else:
        while not _store().check([key]):
            time.sleep(0.05)
    result, error = _broadcast((result, error))
    if error is not None:
        raise error
    return result


def _store() -> Any:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def init_processes(accelerator: str, timeout: float = 300, prog: str = "deepfm_daily.py") -> torch.device:
    """One process by default (a gloo or nccl group of size 1, since DMP shards over a process group); under
    torchrun, the group of all its processes, watched by :mod:`disttrain.parallel.guards.watchdog`: a process silent for
    ``timeout`` seconds ends the run on every rank (exit status 4), and a collective waits a few seconds more."""
    use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise DailyError(f"--accelerator {accelerator} but no CUDA device is visible; use --accelerator cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        collective = watchdog.collective_timeout(timeout)
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):  # torchrun
            dist.init_process_group(backend, timeout=collective)
        else:
            port = free_port("127.0.0.1")
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    timeout=collective)
    watchdog.start(timeout, label=f"{prog}: error",
                   advice="nothing was published; the next run resumes from the last finished day (work/staging)")
    return device


@dataclass
class Plan:
    """The days a run trains and what it found on the way: ``days`` in order, the ``trained`` ones of them (a
    resumed run), the current model's metrics (a resumed run measured them before), and the days it skipped
    (missing), left untrained (late: older than the model's newest day; quarantined: set aside, and passed over by
    this run) or whose leftover versions it removed."""

    days: list[str]
    trained: list[str] = field(default_factory=list)
    current_metrics: Optional[dict] = None
    resume: bool = False
    skipped: list[str] = field(default_factory=list)
    late: list[str] = field(default_factory=list)
    removed_versions: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)

    def notes(self) -> dict[str, Any]:
        return {"skipped_days": self.skipped, "late_days": self.late, "removed_versions": self.removed_versions,
                "quarantined_days": self.quarantined}


class DailyJob:
    """One run of the daily job over a data root and a model root (see the module docstring)."""

    def __init__(self, options: DailyOptions) -> None:
        self.options = options
        self.recipe = load_recipe(options.config)
        daily = dict(self.recipe.get("daily") or {})
        self.bounds = ValidationBounds(**(daily.pop("validation", None) or {}))
        self.daily = {**DAILY_DEFAULTS, **daily}
        for key in ("auc_tolerance", "min_auc", "max_bad_fraction", "keep_versions", "skip_missing_days",
                    "train_late_days", "every"):
            if getattr(options, key) is not None:
                self.daily[key] = getattr(options, key)
        self.train = {**TRAIN_DEFAULTS, **(self.recipe.get("train") or {})}
        self.timeout = watchdog.seconds(options.timeout if options.timeout is not None else self.daily["timeout"])
        self.strategy_options = {k: v for k, v in (self.recipe.get("strategy") or {}).items() if v is not None}
        self.store = ModelStore(options.model_root)
        self.cache = self.store.root / "cache"
        from disttrain.report import parse_logger_spec

        parse_logger_spec(options.logger)  # a misspelt --logger fails before any work
        self._check_day_options()
        self.every = str(self.daily["every"])
        self.hourly = self.every == "1h"
        full_every = self.daily["full_every"]
        self.full_every = FULL_EVERY[self.every] if full_every is None else full_every
        if not isinstance(self.full_every, int) or isinstance(self.full_every, bool) or self.full_every < 0:
            raise ConfigError(f"daily.full_every: {full_every!r} in {options.config} is not a whole number >= 0 (the"
                              " delta versions between two full ones; 0 publishes every version in full)")
        self._base_prints: Optional[dict[str, Any]] = None  # rows of the version warm-started from (delta.py)
        self._base_meta: dict[str, Any] = {}  # and its metadata

    def _check_day_options(self) -> None:
        """daily.on_invalid_day is stop or quarantine; --skip-day needs --reason; --reason goes with a day; no day
        is both set aside and released."""
        if self.daily["every"] not in CADENCES:
            raise ConfigError(f"daily.every (--every): {self.daily['every']!r} is not a cadence; use "
                              + " or ".join(f"{k} ({v})" for k, v in CADENCES.items()))
        mode = self.daily["on_invalid_day"]
        if mode not in ON_INVALID_DAY:
            raise ConfigError(f"daily.on_invalid_day: {mode!r} in {self.options.config} is not one of "
                              + "; ".join(f"{k} ({v})" for k, v in ON_INVALID_DAY.items()))
        skip = sorted({_key(d) for d in self.options.skip_day})
        release = sorted({_key(d) for d in self.options.release_day})
        reason = (self.options.reason or "").strip()
        if skip and not reason:
            raise DailyError(f"--skip-day {skip[0]} needs --reason TEXT: say why the day is set aside (recorded with"
                             " who and when), e.g. --reason 'labels flipped upstream'")
        if self.options.reason is not None and not skip and not release:
            raise DailyError(f"--reason {self.options.reason!r} says why a day is set aside or released; pass the day"
                             " too (--skip-day DATE or --release-day DATE)")
        both = sorted(set(skip) & set(release))
        if both:
            raise DailyError(f"--skip-day and --release-day both name {both[0]}; pass one of them")

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.device = init_processes(self.options.accelerator, self.timeout, self.options.prog)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        with ExitStack() as stack:
            _rank0(stack.enter_context, self.store.lock())  # rank 0 holds it; every rank gets its error
            before = self.store.current()
            try:
                result = self._run_locked()
            except DiskFullError as e:  # where the models stand, after the write that failed
                after = self.store.current()
                state = f"version {after.name} was published; the next run writes what is missing" \
                    if after != before else \
                    f"nothing was published ({before.name + ' stays current' if before else 'no model is current'})"
                raise DiskFullError(f"{e.message}; {state}", e.filename) from e
            if not self.options.no_report and (result["status"] in ("published", "rejected") or self._report_stale()):
                try:
                    _rank0(self._history_report)
                except DiskFullError as e:
                    done = f"version {result['version']} was published" if result.get("version") else \
                        f"the run {result['status']}"
                    raise DiskFullError(f"{done}, but {e.message} (the next run draws it again)", e.filename) from e
            return result

    def _report_stale(self) -> bool:
        """Whether ``report.md`` is missing or older than a run record (a run that could not draw it)."""
        report = self.store.root / "report.md"
        records = list(self.store.runs.glob("*.json")) if self.store.runs.is_dir() else []
        if not records:
            return False
        return not report.is_file() or report.stat().st_mtime < max(r.stat().st_mtime for r in records)

    def _history_report(self) -> None:
        from disttrain.report.daily import write_history_report

        png, md = write_history_report(self.store.root)
        _log(f"model history: {png} and {md}")

    def _run_locked(self) -> dict[str, Any]:
        started = time.time()
        days = list_periods(self.options.data_root, self.every)
        pattern = "day_YYYY-MM-DD_HH.tsv[.gz]" if self.hourly else "day_YYYY-MM-DD.tsv[.gz]"
        if not days:
            raise DailyError(f"no {pattern} files in {self.options.data_root}" +
                             (" (--every 1h reads hour files)" if self.hourly else
                              "" if not list_periods(self.options.data_root, "1h") else
                              " (it holds hour files: pass --every 1h)"))
        run_date = _key(self.options.run_date) if self.options.run_date else max(days)
        if is_hour(run_date) != self.hourly:
            raise DailyError(f"--run-date {run_date} is {'an hour' if is_hour(run_date) else 'a day'} but the job runs"
                             f" every {'hour' if self.hourly else 'day'} (--every {self.every}); pass "
                             + ("YYYY-MM-DD_HH" if self.hourly else "YYYY-MM-DD or --every 1h"))
        if run_date not in days:
            raise DailyError(f"no data for --run-date {run_date}: {self.options.data_root}/day_{run_date}.tsv[.gz]"
                             " is missing (is the upstream export late?); rerun when it has arrived")
        removed = _rank0(self.store.remove_leftovers)
        if removed:
            _log(f"removed version(s) {', '.join(removed)}: complete but never made current (a run stopped before"
                 " its pointer swap)")
        current = self.store.current()
        info = self.store.info(current)
        plan = self._plan(days, run_date, current, info)
        plan.removed_versions = sorted(set(plan.removed_versions) | set(removed))
        if not plan.days:
            _log(f"nothing to do: every day up to {run_date} is processed (--force retrains {run_date})")
            return {"status": "up-to-date", "run_date": run_date, "version": current.name if current else None,
                    **plan.notes()}
        _log(f"run {run_date}: days {plan.days}" + (f" (resuming; trained: {plan.trained})" if plan.resume else ""))

        _rank0(self._check_space, [days[d] for d in plan.days], current)
        watchdog.set_phase(f"converting the day files of {', '.join(plan.days)}")
        _rank0(lambda: [convert_day(days[d], self.cache) for d in plan.days])  # once, by one process
        loaded = {d: load_day(days[d], self.cache, self.daily["max_bad_fraction"]) for d in plan.days}
        for d in plan.days:
            if loaded[d].bad_rows:
                _log(f"{d}: skipped {loaded[d].bad_rows} malformed rows of {loaded[d].rows + loaded[d].bad_rows}"
                     f" ({'; '.join(loaded[d].bad_examples)})")
        newest = loaded[plan.days[-1]]
        self._check_held_out(newest, days[plan.days[-1]])
        validation = self._validate(plan, days, run_date, info)
        if not plan.days:  # all set aside (daily.on_invalid_day: quarantine)
            _log(f"nothing left to train up to {run_date}: {', '.join(plan.quarantined)} set aside")
            return {"status": "up-to-date", "run_date": run_date, "version": current.name if current else None,
                    **plan.notes()}
        if loaded[plan.days[-1]] is not newest:  # the newest day was set aside: the gate's data is the newest left
            newest = loaded[plan.days[-1]]
            self._check_held_out(newest, days[plan.days[-1]])

        from disttrain.parallel.engines.recsys import RecsysEngine
        from disttrain.recsys.model import DeepFM

        import lightning as L
        L.seed_everything(int(self.train["seed"]), verbose=False)
        module = DeepFM(self.recipe["model"], lr=float(self.train["lr"]))
        # The recipe's strategy: section, as the launch layer reads it for the Trainer of each day (_fit_day).
        engine = RecsysEngine(check_options(STRATEGY, self.strategy_options), STRATEGY)
        engine.parallelize(module, self.device)  # shard now, so the warm start loads straight into the shards
        self.id_counts = IdCounts(self.recipe["model"])  # a warm start goes on from the model's own counts
        self._run_ids = [loaded[d].sparse for d in plan.days]  # what a hashed model's ids are migrated by
        current_metrics = plan.current_metrics
        back = (f"point current at an earlier version (ln -sfn versions/NNNNNN {self.store.pointer}) or remove"
                f" {self.store.pointer} to train from scratch")
        deltas = self._may_publish_delta(info)
        if current is not None and (not plan.resume or deltas):
            # a copy: the dense optimizer takes the loaded tensors as its state and trains them in place
            self._base_meta = copy.deepcopy(self._warm_start(engine, module, current, back, info))
            if deltas:  # the rows as published, to find the ones this run changes
                from disttrain.recsys.delta import fingerprints

                self._base_prints = fingerprints(module)
        if plan.resume:
            self._warm_start(engine, module, self.store.staging,
                             f"delete {self.store.work} to train the run's days again from the current model")
        elif current is not None:
            current_metrics = self.evaluate(module, newest)  # the current model, on the gate's data
            _log(f"current model {current.name} on {plan.days[-1]} held-out rows: {_fmt(current_metrics)}")

        progress = {"base_version": current.name if current else None, "plan": plan.days,
                    "current_metrics": current_metrics, "run_date": run_date, **plan.notes()}
        trained, diverged = self._train(engine, module, plan, loaded, progress)

        metrics = self.evaluate(module, newest)
        tolerance, min_auc = float(self.daily["auc_tolerance"]), float(self.daily["min_auc"])
        reason = rejection(metrics, current_metrics, diverged, tolerance, min_auc)
        _log(f"new model on {plan.days[-1]} held-out rows: {_fmt(metrics)}")
        _crash_point("before-publish")
        record = {"run_date": run_date, "run_days": plan.days, "metrics": _json_safe(metrics),
                  "current_metrics": _json_safe(current_metrics),
                  "previous_version": current.name if current else None, "auc_tolerance": tolerance,
                  "min_auc": min_auc, "rows": {d: loaded[d].rows for d in plan.days},
                  "bad_rows": {d: loaded[d].bad_rows for d in plan.days}, "trained_days": trained,
                  "validation": validation, "ids": {d: self.id_counts.days.get(d) for d in plan.days},
                  "started_at": _now(started), **plan.notes()}
        version = None
        if reason is None:
            version, record["publish"] = self._publish(engine, module, info, record, plan.removed_versions)
            shown = record["publish"]
            _log(f"published version {version} ({metrics['auc']:.4f} AUC; {shown['kind']}, {shown['bytes']:,} bytes"
                 + (f", {shown['fraction']:.2%} of the table rows changed)" if shown["kind"] == "delta" else ")"))
        else:
            _log(f"NOT published: {reason}; " + (f"{current.name} stays current" if current else "no model is current"))
        status = "published" if reason is None else "rejected"
        _rank0(self._finish, plan.days, {**record, "status": status, "version": version, "reason": reason})
        return {"status": status, "run_date": run_date, "days": plan.days, "version": version, "metrics": metrics,
                "current_metrics": current_metrics, "reason": reason, **plan.notes()}

    # -- which days --------------------------------------------------------------------------------------------
    def _plan(self, days: dict[str, Path], run_date: str, current: Optional[Path], info: dict[str, Any]) -> Plan:
        """The days to train: those of an unfinished run (resume), else every unprocessed day up to ``run_date``
        in date order, after refusing (or, when asked, skipping) missing days and leaving out late and quarantined
        ones (--skip-day and --release-day are applied first)."""
        base = current.name if current else None
        progress = self._staging_progress()
        unfinished = progress if progress is not None and progress["base_version"] == base else None
        self._set_days_aside(days, run_date, info, unfinished)
        if unfinished is not None:
            return Plan(progress["plan"], list(progress["trained"]), progress["current_metrics"], True,
                        progress.get("skipped_days", []), progress.get("late_days", []),
                        progress.get("removed_versions", []), progress.get("quarantined_days", []))
        records = self.store.records()
        last = info.get("record") or {}
        if base is not None and any(_older(records.get(d), last["started_at"]) for d in last.get("run_days", [])):
            # The last run published current but ended between the pointer swap and its records (with or without a
            # work/staging: a delta's last period keeps none); the version's info.json holds the record.
            _log(f"the last run published {base} but stopped before its records; writing them")
            _rank0(self._finish, last["run_days"], {**last, "status": "published", "version": base})
            records = self.store.records()
        elif progress is not None:
            _log(f"discarding work/staging: it was trained from {progress['base_version']}, current is {base}")
            _rank0(shutil.rmtree, self.store.work)
        in_model = set(info.get("days", []))
        processed = in_model | {d for d, r in records.items() if r.get("status") in TRAINED_STATUSES}
        quarantined = {d: r for d, r in records.items() if r.get("status") == QUARANTINED}
        if self.options.force and run_date in quarantined:
            raise DailyError(f"--force would train {run_date}, but it is quarantined"
                             f" ({_set_aside_by(quarantined[run_date])}) and a quarantined day is never trained;"
                             f" --release-day {run_date} releases it (then --force --run-date {run_date} trains it)")
        plan = Plan([d for d in sorted(days) if d <= run_date and d not in processed and d not in quarantined])
        plan.skipped = self._missing_days(days, run_date, records, in_model)
        newest = max(in_model, default=None)
        late = [d for d in plan.days if newest is not None and d < newest]
        if late and not self.daily["train_late_days"]:
            plan.days = [d for d in plan.days if d not in late]
            plan.late = late
            _log(f"not training {', '.join(late)}: older than {newest}, the newest day in the current model (a model"
                 " never learns an older day on top of a newer one); --train-late-days trains them")
            for d in late:
                if (records.get(d) or {}).get("status") != "late":
                    self._write_note(d, run_date, "late", f"arrived after {newest} was trained into the model; not"
                                     " trained (--train-late-days or daily.train_late_days: true trains it)")
        if self.options.force and run_date not in plan.days:
            plan.days = sorted(plan.days + [run_date])
        # The quarantined days this run passes over (older ones were passed over by earlier runs).
        plan.quarantined = [d for d in sorted(quarantined) if (newest is None or d > newest) and plan.days
                            and d < plan.days[-1]]
        just_set_aside = {_key(x) for x in self.options.skip_day}  # said so already
        for d in (x for x in plan.quarantined if x not in just_set_aside):
            _log(f"not training {d}: quarantined ({_set_aside_by(quarantined[d])}); later days go on"
                 f" (--release-day {d} releases it)")
        return plan

    def _missing_days(self, days: dict[str, Path], run_date: str, records: dict[str, dict],
                      in_model: set[str]) -> list[str]:
        """Dates up to ``run_date`` (from the first known day on) with neither a file nor a record: a
        :class:`DailyError` by default, or recorded as skipped with ``skip_missing_days``; returns those skipped."""
        # A released day counts as unprocessed: without a file it is missing again.
        known = set(days) | {d for d, r in records.items() if r.get("status") != RELEASED} | in_model
        known = {d for d in known if is_hour(d) == self.hourly}  # the other cadence's days have a calendar of their own
        step = dt.timedelta(hours=1) if self.hourly else dt.timedelta(days=1)
        first, last = period_start(min(known)), period_start(run_date)
        calendar = [period_key(first + i * step, self.hourly) for i in range(int((last - first) / step) + 1)]
        missing = [d for d in calendar if d not in known]
        if not missing:
            return []
        if not self.daily["skip_missing_days"]:
            raise DailyError(
                f"day {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: no day_{missing[0]}.tsv"
                f"[.gz] in {self.options.data_root} although later days are there; days are trained in order, so"
                " wait for it, or pass --skip-missing-days (daily.skip_missing_days: true) to go on without it"
                " (recorded as skipped)")
        _log(f"skipping missing day(s) {', '.join(missing)} (--skip-missing-days); recorded as skipped")
        for d in missing:
            self._write_note(d, run_date, "skipped", "no data file when the run started (skip_missing_days)")
        return missing

    def _write_note(self, day: str, run_date: str, status: str, reason: str, **details: Any) -> None:
        """The record of a day this run did not train (skipped, late, invalid, quarantined, released) and why."""
        _rank0(self._replace_record, day, {"day": day, "status": status, "reason": reason, "run_date": run_date,
                                           "version": None, "finished_at": _now(time.time()), **details})

    def _replace_record(self, day: str, record: dict[str, Any]) -> None:
        """Write a day's record; a release it replaces is kept in it (``released``), so that a day released and then
        found late or invalid still says who let it back in."""
        before = self.store.record(day) or {}
        if before.get("status") == RELEASED and record["status"] != QUARANTINED:
            record = {**record, "released": {k: before.get(k) for k in ("by", "at", "reason", "quarantine")}}
        self.store.write_record(day, record)

    def _set_days_aside(self, days: dict[str, Path], run_date: str, info: dict[str, Any],
                        unfinished: Optional[dict[str, Any]]) -> None:
        """--skip-day: record each day as quarantined (``reason``, ``by``, ``at`` and what validation found, if it
        did), so that nothing trains it; a day already trained, or in the unfinished run being resumed, cannot be set
        aside. --release-day: record a quarantined day as released, which counts as unprocessed (trained in order, or
        late when newer days are in the model). Every day is checked before any record is written."""
        skip = sorted({_key(d) for d in self.options.skip_day})
        release = sorted({_key(d) for d in self.options.release_day})
        if not skip and not release:
            return
        records = self.store.records()
        for d in skip:
            record = records.get(d) or {}
            if d in info.get("days", []) or record.get("status") in TRAINED_STATUSES:
                raise DailyError(self._trained_day_error(d, record, info))
            if unfinished is not None and d in unfinished["plan"]:
                raise DailyError(f"--skip-day {d}: the day is part of the unfinished run in {self.store.staging}"
                                 f" (days {', '.join(unfinished['plan'])}); rerun without --skip-day to finish it, or"
                                 f" delete {self.store.work} to drop it, then set the day aside")
        for d in release:
            status = (records.get(d) or {}).get("status")
            if status != QUARANTINED:
                raise DailyError(f"--release-day {d}: the day is not quarantined ({self.store.record_path(d)}: "
                                 f"{'status ' + status if status else 'no record'}); only a day set aside is released")
        by, at, reason = operator_name(), _now(time.time()), (self.options.reason or "").strip()
        for d in skip:
            record = records.get(d) or {}
            if record.get("status") == QUARANTINED:
                _log(f"{d} is quarantined already ({_set_aside_by(record)}); its record is kept")
                continue
            found = {k: record[k] for k in ("finding", "baseline_days") if k in record}  # an earlier invalid record's
            self._write_note(d, run_date, QUARANTINED, reason, by=by, at=at, previous_status=record.get("status"),
                             **found)
            _log(f"set {d} aside: quarantined by {by} ({reason}); it is never trained, later days go on"
                 f" (--release-day {d} releases it)" + ("" if d in days else "; it has no data file"))
        for d in release:
            record = records[d]
            self._write_note(d, run_date, RELEASED, f"released by {by} at {at}" + (f": {reason}" if reason else "")
                             + f"; it was quarantined ({_set_aside_by(record)})", by=by, at=at,
                             quarantine={k: record.get(k) for k in ("reason", "by", "at", "finding")})
            _log(f"released {d}: no longer quarantined; it counts as unprocessed (trained in date order, or late when"
                 " newer days are in the model)")

    def _trained_day_error(self, day: str, record: dict[str, Any], info: dict[str, Any]) -> str:
        """Why ``--skip-day day`` is refused: the day went into a model (or a rejected run) already."""
        if day in info.get("days", []) or record.get("status") == "published":
            version = info["version"] if day in info.get("days", []) else record.get("version")
            return (f"--skip-day {day}: the day is trained into version {version} already; setting it aside would not"
                    f" take it out: point current at a version from before it (ln -sfn versions/NNNNNN"
                    f" {self.store.pointer}) to stop serving it")
        kept = record.get("previous_version")
        return (f"--skip-day {day}: the day was trained already, in the run of {record.get('run_date')} that was"
                f" rejected ({'version ' + kept + ' stayed current' if kept else 'no version was published'}); it is"
                " not trained again unless --force, so there is nothing to set aside")

    def _staging_progress(self) -> Optional[dict[str, Any]]:
        if not (self.store.staging / ckpt.META_FILE).is_file():
            return None
        try:
            return ckpt.read_meta(self.store.staging).get("progress")
        except ckpt.CheckpointError as e:
            raise DailyError(f"the unfinished run's model cannot be read: {one_line(e)}; delete {self.store.work}"
                             " to train the run's days again from the current model") from e

    # -- checks before training ------------------------------------------------------------------------------
    def _check_held_out(self, day: Day, path: Path) -> None:
        """The gate's data (the newest day's held-out rows) must exist and hold both labels."""
        fraction = float(self.daily["eval_fraction"])
        _, held = split_rows(day.rows, fraction)
        count = held.stop - held.start
        if count == 0:
            raise DailyError(f"{path.name} has {day.rows} rows, so its held-out share (daily.eval_fraction="
                             f"{fraction}) is empty and the new model cannot be evaluated; is the export complete?"
                             " Rerun when the whole day has arrived, or raise daily.eval_fraction")
        clicks = int(day.labels[held].sum())
        if clicks in (0, count):
            raise DailyError(f"the {count} held-out rows of {path.name} all have label {int(clicks > 0)}, so AUC is"
                             " undefined and the gate cannot compare models; is the export complete? Rerun when the"
                             " whole day has arrived, or raise daily.eval_fraction")

    def _validate(self, plan: Plan, days: dict[str, Path], run_date: str, info: dict[str, Any]) -> dict[str, Any]:
        """Check each day of ``plan.days`` against the days before it that went into the model (see
        :mod:`disttrain.recsys.validate`). The first day out of bounds is recorded as invalid and stops the run; with
        ``daily.on_invalid_day: quarantine`` it is set aside instead (recorded as quarantined, taken out of
        ``plan.days``, added to ``plan.quarantined``) and the later days are checked without it in their baseline."""
        if self.options.skip_validation:
            _log("data validation skipped (--skip-validation)")
            return {d: "skipped (--skip-validation)" for d in plan.days}
        in_model = set(info.get("days", [])) & set(days)
        needed = {x for d in plan.days for x in sorted(x for x in in_model if x < d)[-self.bounds.days:]} - \
            set(plan.days)
        stats = _rank0(self._day_stats, plan.days, sorted(needed), days)
        accepted = set(x for x in in_model if x in stats)
        summary: dict[str, Any] = {}
        for d in list(plan.days):
            before = sorted(x for x in accepted if x < d)[-self.bounds.days:]
            finding = check_day(stats[d], [stats[x] for x in before], self.bounds)
            if finding is not None:
                problem = f"{days[d].name}: {finding.statistic} {finding.value:.4f} is beyond its bound {finding.bound}"
                # A day that a resumed run trained already is in its model: it cannot be set aside, only stop the run.
                if self.daily["on_invalid_day"] == "quarantine" and d not in plan.trained:
                    self._quarantine_invalid_day(d, run_date, problem, finding.as_dict(), before)
                    plan.days.remove(d)
                    plan.quarantined = sorted(plan.quarantined + [d])
                    continue
                # The safe ways out first: setting the day aside keeps its data out of the model for good.
                message = (f"{problem}; the day's data changed: fix the export and rerun, or set the day aside with"
                           f" --skip-day {d} --reason '...' (it is then never trained; later days go on); if the"
                           " change is real, loosen daily.validation or rerun with --skip-validation (which trains it)")
                self._write_note(d, run_date, "invalid", message, finding=finding.as_dict(), baseline_days=before)
                raise DailyError(message)
            summary[d] = {"baseline_days": before, "label_rate": round(stats[d]["label_rate"], 6)}
            accepted.add(d)
        return summary

    def _check_space(self, files: list[Path], current: Optional[Path]) -> None:
        """Before any work: the model root must hold the caches of the days still to convert and two models the size
        of the current one (the run's work/staging and the new version; the current one stays until the swap)."""
        caches = sum(cache_size_estimate(f) for f in files if not cached(f, self.cache))
        model = folder_bytes(current) if current is not None else 0
        parts = [f"the caches of {len(files)} day(s)"] if caches else []
        parts += ["work/staging and a new version as large as the current one"] if model else []
        if parts:
            ensure_free(self.store.root, caches + 2 * model, " and ".join(parts),
                        "free space there or move --model-root to a larger disk")

    def _quarantine_invalid_day(self, day: str, run_date: str, problem: str, finding: dict[str, Any],
                                baseline_days: list[str]) -> None:
        """daily.on_invalid_day: quarantine: record the invalid ``day`` as quarantined by the job (the validation
        finding is the reason) and warn in one line; the run goes on without it."""
        previous = (self.store.record(day) or {}).get("status")
        self._write_note(day, run_date, QUARANTINED, problem, by="daily job (daily.on_invalid_day: quarantine)",
                         at=_now(time.time()), previous_status=previous, finding=finding, baseline_days=baseline_days)
        _log(f"WARNING: {problem}; {day} is set aside (quarantined: never trained) and later days go on"
             f" (daily.on_invalid_day: quarantine; --release-day {day} releases it)")

    def _day_stats(self, plan: list[str], baseline: list[str], days: dict[str, Path]) -> dict[str, dict]:
        """Statistics of the plan's days and of the baseline days; a baseline day whose file can no longer be read
        is left out of the baseline (it was trained on already) rather than stopping the run."""
        stats = {d: day_stats(days[d], self.cache) for d in plan}
        for d in baseline:
            try:
                stats[d] = day_stats(days[d], self.cache)
            except (BadDataError, OSError, ValueError) as e:
                _log(f"{d} left out of the validation baseline: {one_line(e)}")
        return stats

    def _warm_start(self, engine: Any, module: Any, path: Path, fix: str, info: Optional[dict[str, Any]] = None) \
            -> dict[str, Any]:
        """Load ``path`` into the sharded module and refuse it when it cannot be read or holds non-finite values;
        returns its metadata. ``info``: the version's info.json (a delta version is loaded as its base and the
        deltas after it)."""
        from disttrain.recsys.delta import DELTA, DeltaError, load_chain

        watchdog.set_phase(f"loading {path}")
        try:
            with _quiet_root_logger(not self.options.verbose):
                if (info or {}).get("kind") == DELTA:
                    metadata = load_chain(module, self.store, info, lambda full: engine.load(full, module))
                elif is_hashed_checkpoint(path, module):  # ids: managed now, hashed in the model
                    _log(f"{path}: hashed tables into managed ones: the ids of {len(self._run_ids)} day(s) start"
                         " from their hashed rows")
                    metadata = warm_start_from_hashed(engine, module, path, self.recipe["model"], self._run_ids)
                else:
                    metadata = engine.load(path, module)
            module.configure_optimizers().load_state_dict(metadata["dense_optimizer"])
            self.id_counts.restore(metadata.get(ID_COUNTS))
        except (ckpt.CheckpointError, DeltaError, RuntimeError, KeyError, ValueError, OSError) as e:
            raise DailyError(f"{path} cannot be loaded: {one_line(e)}; {fix}") from e
        bad = self._nonfinite(module)
        if bad:
            raise DailyError(f"{path} has non-finite weights ({bad}); training from it would only spread them: {fix}")
        return metadata

    def _nonfinite(self, module: Any) -> Optional[str]:
        """None when every weight of ``module`` is finite, else how many are not and where (on every rank)."""
        from disttrain.recsys.model import nonfinite_values

        return describe_nonfinite(nonfinite_values(module, self.device))

    # -- training, evaluation, publishing ----------------------------------------------------------------------
    def _train(self, engine: Any, module: Any, plan: Plan, loaded: dict[str, Day],
               progress: dict[str, Any]) -> tuple[list[str], Optional[tuple[str, str]]]:
        """Train the plan's days not trained yet, saving the model to work/staging after each; returns the days
        trained and, when the weights went non-finite, (the day, what went non-finite): a diverged model is neither
        saved for a resume nor trained further. A run that publishes a delta skips the save after its last period:
        the publish follows at once, and a run ended between the two trains that period again (the same model: the
        job is deterministic) rather than every hour writing the whole model to work/ to publish a few percent of
        it."""
        trained = list(plan.trained)
        for d in plan.days:
            if d in trained:
                continue
            watchdog.set_phase(f"training day {d}")
            ids = self.id_counts.count_day(d, loaded[d].sparse)
            held = held_ids(module)
            rows = self._fit_day(module, loaded[d])
            finish_admissions(module)  # nothing pending in the saved model: a resume goes on as this run does
            if held:
                self.id_counts.add_evictions(d, count_evictions(held, held_ids(module), self.device))
            bad = self._nonfinite(module)
            if bad:
                _log(f"{d}: training diverged: {bad}")
                return trained, (d, bad)
            trained.append(d)
            if not (d == plan.days[-1] and self._base_prints is not None):
                engine.save(self.store.staging, module, {"progress": {**progress, "trained": trained},
                                                         "dense_optimizer": module.configure_optimizers().state_dict(),
                                                         ID_COUNTS: self.id_counts.state()})
            _log(f"{d}: trained on {rows} rows")
            _log(f"{d}: {describe_ids(ids)}")
            _crash_point(f"after-day-{d}")
        return trained, None

    def _fit_day(self, module: Any, day: Day) -> int:
        """One epoch over the day's training rows (all but the held-out tail); returns their number."""
        import lightning as L

        from disttrain.launch import build_strategy

        train_rows, _ = split_rows(day.rows, float(self.daily["eval_fraction"]))
        dataset = DayBatches(day, train_rows, int(self.train["batch_size"]), module.table_sizes,
                             drop_last=self.world > 1)
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=self.world, rank=self.rank, shuffle=True,
                                                      seed=int(self.train["seed"]) + day.seed_offset)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=sampler)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        from disttrain.callbacks import Throughput
        from disttrain.report import trainer_loggers, trainer_progress_callbacks

        # The logs of a day's training: MODEL_ROOT/logs/DAY/{csv,tensorboard}/version_N (a retrained day adds one).
        loggers = trainer_loggers(self.store.root / "logs" / day.key, self.options.logger,
                                  subdir="")
        # rows/s and per-rank memory; DeepFM's FLOPs are not counted, so no MFU.
        # Log about every 10 steps, and at least twice on a short day (a rate needs two steps).
        every = max(2, min(10, len(loader) // 2))
        # Without a terminal, the progress lines go to the job log (stdout keeps the job's lines).
        progress = logging.getLogger(__name__).info
        callbacks = [*trainer_progress_callbacks(write=lambda line: progress(f"{day.key}: {line}")),
                     Throughput(every_n_steps=every)]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(num_workers|small|does not have many workers).*")
            warnings.filterwarnings("ignore", message=".*FLOPs of a step are unknown.*")
            trainer = L.Trainer(strategy=build_strategy(STRATEGY, self.strategy_options, entry="trainer"),
                                accelerator="gpu" if self.device.type == "cuda" else "cpu", devices=local,
                                num_nodes=self.world // local, max_epochs=1, logger=loggers,
                                enable_checkpointing=False, callbacks=callbacks, log_every_n_steps=every,
                                enable_progress_bar=True, enable_model_summary=False, use_distributed_sampler=False,
                                num_sanity_val_steps=0)
            trainer.fit(module, loader)
        return dataset.rows

    def evaluate(self, module: Any, day: Day) -> dict[str, float]:
        watchdog.set_phase(f"evaluating on {day.key}'s held-out rows")
        return evaluate(module, day, float(self.daily["eval_fraction"]), int(self.train["batch_size"]), self.device)

    def _may_publish_delta(self, info: dict[str, Any]) -> bool:
        """Whether this run's version may be a delta on the current one: deltas are on (daily.full_every > 0), not
        --full, the current version's chain has fewer than daily.full_every deltas, and its model section is this
        run's."""
        from disttrain.recsys.delta import chain_of

        return bool(info) and not self.options.full and len(chain_of(info)) - 1 < self.full_every and \
            info.get("model") == self.recipe["model"]  # the same tables (not a migration to managed ids)

    def _publish(self, engine: Any, module: Any, info: dict[str, Any], record: dict[str, Any],
                 removed: list[str]) -> tuple[str, dict[str, Any]]:
        """Write the new version (a delta on the current one when :meth:`_may_publish_delta` and the tables are laid
        out as in its chain, else in full) and swap ``current`` to it; returns its name and what was published."""
        from disttrain.recsys import delta

        version = _rank0(self.store.next_version, removed)
        days = sorted(set(info.get("days", [])) | set(record["run_days"]))
        new_info = {"version": version.name, "days": days, "previous": record["previous_version"],
                    "metrics": record["metrics"], "published_at": _now(time.time()), "model": self.recipe["model"],
                    "world_size": self.world, "record": record}
        metadata = {"dense_optimizer": module.configure_optimizers().state_dict(), "info": new_info,
                    ID_COUNTS: self.id_counts.state()}
        # the base's rows were fingerprinted only when a delta may follow it (_may_publish_delta)
        as_delta = self._base_prints is not None and delta.same_layout(module, self.store, info)
        if as_delta:
            watchdog.set_phase(f"publishing delta version {version.name}")
            new_info.update(kind=delta.DELTA, base=info["version"], chain=delta.chain_of(info) + [version.name])
            summary = delta.save_delta(self.store.partial(version), module, self._base_prints, metadata,
                                       self._base_meta)
            new_info.update(files=summary.files, changed=delta.table_touch(summary))
            _crash_point("after-delta-files")
            published = {"kind": delta.DELTA, "bytes": summary.bytes, **new_info["changed"]}
        else:
            new_info.update(kind=delta.FULL, chain=[version.name])
            engine.save(self.store.partial(version), module, metadata)
            published = {"kind": delta.FULL, "bytes": _rank0(folder_bytes, self.store.partial(version))}

        def swap() -> None:
            try:
                self.store.finish_version(version, new_info)
            except BaseException:
                remove(self.store.partial(version))  # a full model's worth of space, on a disk that may be full
                raise
            _crash_point("before-pointer")
            self.store.point_at(version)
            pruned = self.store.prune(int(self.daily["keep_versions"]))
            if pruned:
                _log(f"removed old versions {pruned}")

        _rank0(swap)
        return version.name, published

    def _finish(self, plan: list[str], record: dict[str, Any]) -> None:
        _crash_point("before-records")
        finished = _now(time.time())
        for d in plan:
            self.store.write_record(d, {**record, "day": d, "finished_at": finished})
        if self.store.work.exists():
            shutil.rmtree(self.store.work)


def rejection(metrics: dict[str, float], current: Optional[dict[str, float]], diverged: Optional[tuple[str, str]],
              tolerance: float, min_auc: float) -> Optional[str]:
    """Why a new model must not be published, or None: weights that went non-finite while training ``diverged``
    (the day, what went non-finite), non-finite metrics, an AUC under the absolute floor ``min_auc`` (the only
    gate of a first model), or an AUC more than ``tolerance`` below the current model's."""
    if diverged is not None:
        day, bad = diverged
        return f"training diverged on {day}: {bad}; lower train.lr or model.sparse_optimizer.lr"
    broken = [f"{k} {v}" for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if broken:
        return f"non-finite metrics ({', '.join(broken)})"
    if metrics["auc"] < min_auc:
        first = " (a first model has no current model to compare with)" if current is None else ""
        return f"AUC {metrics['auc']:.4f} < daily.min_auc {min_auc}{first}"
    if current is not None and metrics["auc"] < current["auc"] - tolerance:
        return f"AUC {metrics['auc']:.4f} < current {current['auc']:.4f} - auc_tolerance {tolerance}"
    return None


def describe_nonfinite(counts: dict[str, tuple[int, int]]) -> Optional[str]:
    """None when no tensor holds a non-finite value, else e.g. "116,052 of 473,321 values are non-finite, in 26 of
    38 tensors (the most in net.ebc.embedding_bags.t_cat_3.weight)" from ``{name: (non-finite, all)}``."""
    bad = {name: n for name, (n, _) in counts.items() if n}
    if not bad:
        return None
    total = sum(t for _, t in counts.values())
    return (f"{sum(bad.values()):,} of {total:,} values are non-finite, in {len(bad)} of {len(counts)} tensors"
            f" (the most in {max(bad, key=bad.get)})")


def _json_safe(metrics: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Metrics for a JSON record: NaN and infinities as strings ("nan", "inf"), which strict JSON readers accept."""
    if metrics is None:
        return None
    return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def one_line(error: BaseException, limit: int = 300) -> str:
    """An error's message on one line: a message that embeds a traceback (DCP's CheckpointException does) keeps
    its first line and the exception line at the end of the traceback, each cut at ``limit`` characters."""
    text = re.sub(r"CheckpointException ranks:dict_keys\(\[[\d, ]*\]\)", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if len(lines) == 1:
        return lines[0]
    cut = [line if len(line) <= limit else line[:limit] + "..." for line in lines]
    last = next((i for i in reversed(range(len(lines))) if re.match(r"^[\w.]+(Error|Exception)\b", lines[i])),
                len(lines) - 1)
    return f"{cut[0]} {cut[last]}"


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
        # Every rank updates, with no rows where it had none: a metric no rank updated gathers nothing while the
        # others gather their rows (a mismatched collective when the held-out rows fill fewer batches than ranks).
        metrics.update(logits[:valid], labels[:valid].to(device))
    module.train(was_training)
    return metrics.compute()


def operator_name() -> str:
    """Who sets a day aside or releases it, as recorded: $DISTTRAIN_OPERATOR when set, else user@host."""
    named = os.environ.get(OPERATOR_ENV, "").strip()
    if named:
        return named
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (some containers)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def _set_aside_by(record: dict[str, Any]) -> str:
    """Who set a quarantined day aside, when and why, for messages."""
    return f"set aside by {record.get('by')} at {record.get('at')}: {record.get('reason')}"


def _older(record: Optional[dict[str, Any]], started_at: str) -> bool:
    """Whether a day's record is missing or written before a run that started at ``started_at`` (a later run's
    record of the day, e.g. a rejected ``--force`` retraining, is newer and stays)."""
    return record is None or (record.get("started_at") or record.get("finished_at") or "") < started_at


def _now(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="seconds")


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def _key(when: dt.date | str) -> str:
    """A period key from an option: a date (a day) or the key itself (``YYYY-MM-DD`` or ``YYYY-MM-DD_HH``)."""
    return when if isinstance(when, str) else when.isoformat()


def _date_option(text: str) -> str:
    try:
        return parse_period(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message, not "invalid value"
        raise argparse.ArgumentTypeError(str(e)) from None


def parser(prog: str = "deepfm_daily.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Daily DeepFM retraining: warm start, catch-up, data"
                                " validation, gated atomic publish. Exit 0: published or nothing to do; 3: trained"
                                " but not published (AUC gate, or the model diverged); 1: failed (the message says"
                                " why).")
    p.add_argument("--data-root", required=True, type=Path, help="folder of day_YYYY-MM-DD.tsv[.gz] files")
    p.add_argument("--model-root", required=True, type=Path, help="folder of published versions, records, lock")
    p.add_argument("--run-date", type=_date_option, default=None,
                   help="process days (hours: YYYY-MM-DD_HH with --every 1h) up to this one, which must have data"
                   " (default: the newest present)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="recipe YAML (default: deepfm_tiny.yaml)")
    p.add_argument("--force", action="store_true", help="retrain --run-date even if it was processed already")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "gpu", "cuda"),
                   help="where each process trains: auto is a GPU per process when there are GPUs, else the CPU"
                   " (default: auto)")
    p.add_argument("--auc-tolerance", type=float, default=None, help="override daily.auc_tolerance")
    p.add_argument("--min-auc", type=float, default=None, help="override daily.min_auc")
    p.add_argument("--max-bad-fraction", type=float, default=None, help="override daily.max_bad_fraction")
    p.add_argument("--keep-versions", type=int, default=None, help="override daily.keep_versions")
    p.add_argument("--skip-missing-days", action="store_true", default=None,
                   help="go on without a missing day (recorded as skipped) instead of stopping;"
                   " daily.skip_missing_days")
    p.add_argument("--train-late-days", action="store_true", default=None,
                   help="train days older than the model's newest day on top of it; daily.train_late_days")
    p.add_argument("--skip-validation", action="store_true",
                   help="train without checking the days against the days before them (a real change in the data)")
    p.add_argument("--skip-day", action="append", type=_date_option, default=[], metavar="DATE",
                   help="set DATE aside (repeatable; needs --reason): recorded as quarantined with who and when, never"
                   " trained (not by catch-up, --force, --skip-validation or --train-late-days); later days go on")
    p.add_argument("--reason", default=None, metavar="TEXT",
                   help="why the --skip-day days are set aside (or the --release-day days released)")
    p.add_argument("--release-day", action="append", type=_date_option, default=[], metavar="DATE",
                   help="undo --skip-day DATE (repeatable): the day counts as unprocessed again (late when newer days"
                   " are in the model)")
    p.add_argument("--verbose", action="store_true",
                   help="print the traceback of a failure, and the library warnings and progress lines that otherwise"
                   " only go to MODEL_ROOT/logs/job-DAY.log, on stderr too")
    p.add_argument("--logger", default="tensorboard,csv",
                   help="per-day training logs under MODEL_ROOT/logs/DAY: tensorboard,csv | csv | tensorboard | none")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="a process silent this long (stopped, hung) ends the run on every rank with exit status 4;"
                   " daily.timeout (300)")
    p.add_argument("--every", choices=sorted(CADENCES), default=None,
                   help="the cadence: 1d trains day files (day_YYYY-MM-DD.tsv[.gz]), 1h hour files"
                   " (day_YYYY-MM-DD_HH.tsv[.gz]) and publishes delta versions; daily.every (1d)")
    p.add_argument("--full", action="store_true",
                   help="publish this run's version in full, not as a delta (daily.full_every sets how often a full"
                   " version is due)")
    p.add_argument("--no-report", action="store_true",
                   help="do not redraw MODEL_ROOT/report.png (the model history) after a run")
    return p


ERRORS = (DailyError, BadDataError, LockedError, StoreError, ConfigError, FileNotFoundError, ValueError,
          ckpt.CheckpointError, DiskFullError)


def main(argv: Optional[list[str]] = None, prog: str = "deepfm_daily.py") -> int:
    from disttrain.report.joblog import job_log

    args = parser(prog).parse_args(argv)
    options = DailyOptions(**vars(args), prog=prog)
    # Library warnings and log records go to MODEL_ROOT/logs/job-DAY.log; stdout and stderr keep the job's lines.
    with job_log(options.model_root / "logs", verbose=options.verbose) as log:
        try:
            result = DailyJob(options).run()
        except ERRORS as e:
            log.error(f"{prog}: error: {one_line(e)}", exc_info=True)  # once (rank 0): every rank raises it
            return EXIT_FAILED
        except Exception as e:
            line = describe(e, options.model_root)  # a stuck collective, a full disk met by a library's own write
            if line is None:
                raise
            log.error(f"{prog}: error: {line}; nothing was published unless the lines above say so; the next run"
                      " resumes from the last finished day", exc_info=True)
            return EXIT_FAILED
        finally:
            watchdog.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
    return EXIT_REJECTED if result["status"] == "rejected" else 0
