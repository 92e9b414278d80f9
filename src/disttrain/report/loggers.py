"""Lightning's standard loggers under a run folder, chosen by one ``--logger`` string, and the run's description
(``run.json``) that the report reads next to them.

Layout of a run folder ``RUN_DIR``::

    RUN_DIR/logs/csv/version_N/metrics.csv        Lightning's CSVLogger (one version per start; resumed runs add one)
    RUN_DIR/logs/tensorboard/version_N/events.*   Lightning's TensorBoardLogger (``tensorboard --logdir RUN_DIR/logs``)
    RUN_DIR/run.json                               recipe, strategy and options, world size, start/end, wall time
    RUN_DIR/report.png, RUN_DIR/report.md          the run report (``disttrain report RUN_DIR`` redraws them)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import time
from pathlib import Path
from typing import Any

LOGGER_NAMES = ("tensorboard", "csv")
DEFAULT_LOGGERS = "tensorboard,csv"
RUN_INFO = "run.json"


def parse_logger_spec(spec: str | None) -> list[str]:
    """``"tensorboard,csv"`` -> ``["tensorboard", "csv"]``; ``"none"`` or ``""`` -> ``[]``. An unknown name is a
    ``ValueError`` naming it and the choices."""
    spec = DEFAULT_LOGGERS if spec is None else spec
    names = [n.strip().lower() for n in spec.split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    for name in names:
        if name not in LOGGER_NAMES:
            close = difflib.get_close_matches(name, LOGGER_NAMES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"--logger {spec!r}: unknown logger {name!r}; {hint}choose from "
                             f"{', '.join(LOGGER_NAMES)} (comma-separated) or none")
    return list(dict.fromkeys(names))


def fabric_loggers(run_dir: str | os.PathLike, spec: str | None = None) -> list[Any]:
    """Fabric loggers (``L.Fabric(loggers=...)``) writing under ``RUN_DIR/logs``. They write on rank 0 only."""
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    root = Path(run_dir) / "logs"
    # flush every log call: the report of an interrupted run reads what was logged up to the interruption
    make = {"csv": lambda: CSVLogger(root, name="csv", flush_logs_every_n_steps=1),
            "tensorboard": lambda: TensorBoardLogger(root, name="tensorboard", default_hp_metric=False)}
    return [make[name]() for name in parse_logger_spec(spec)]


def trainer_loggers(run_dir: str | os.PathLike, spec: str | None = None, subdir: str = "logs") -> list[Any] | bool:
    """Trainer loggers (``L.Trainer(logger=...)``) writing under ``RUN_DIR/logs`` (``RUN_DIR/subdir``); ``False``
    for none."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    root = Path(run_dir) / subdir
    make = {"csv": lambda: CSVLogger(root, name="csv", flush_logs_every_n_steps=1),
            "tensorboard": lambda: TensorBoardLogger(root, name="tensorboard", default_hp_metric=False)}
    loggers = [make[name]() for name in parse_logger_spec(spec)]
    return loggers or False


def strategy_description(strategy: Any) -> dict[str, Any]:
    """Name, class, the options that differ from their defaults and the parallel degrees (once its processes exist)
    of a Lightning/Fabric strategy object."""
    engine = getattr(strategy, "engine", None)
    options = getattr(engine, "options", None)
    dims = getattr(engine, "dims", None)
    out: dict[str, Any] = {"name": getattr(strategy, "strategy_name", None) or type(strategy).__name__,
                           "class": type(strategy).__name__, "options": {}}
    if dims is not None:
        out["degrees"] = dims.degrees()
    if dataclasses.is_dataclass(options):
        from disttrain.parallel.registry import non_default

        out["options"] = {k: _plain(v) for k, v in non_default(options).items()}
    return out


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None), list, dict)) else str(value)


def write_run_info(run_dir: str | os.PathLike, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into ``RUN_DIR/run.json`` (rank 0 calls it at the start and at the end) and return it.
    Written through a temporary file, so a reader never sees half a file."""
    path = Path(run_dir) / RUN_INFO
    info = read_run_info(run_dir)
    info.update({k: _plain(v) if not isinstance(v, dict) else v for k, v in fields.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return info


def read_run_info(run_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(run_dir) / RUN_INFO
    return json.loads(path.read_text()) if path.is_file() else {}


def start_run(run_dir: str | os.PathLike, recipe: str, strategy: Any, world_size: int, device: str,
              **extra: Any) -> dict[str, Any]:
    """Describe a run that starts now (rank 0 only): recipe, strategy and options, world size, device."""
    return write_run_info(run_dir, recipe=recipe, strategy=strategy_description(strategy), world_size=world_size,
                          device=device, started_at=time.strftime("%Y-%m-%d %H:%M:%S"), finished=False,
                          wall_s=None, **extra)
