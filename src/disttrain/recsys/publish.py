"""The model store of the daily job: published versions, the ``current`` pointer, run records, the work folder
of a run in progress, and the lock.

    MODEL_ROOT/
      versions/000003/     a published model (DCP folder: table shards, fused optimizer state, meta.pt) + info.json
      current -> versions/000003     symlink, swapped atomically (readers never see a half-written model)
      runs/2026-11-29.json one record per processed day
      work/staging/        the model after the days trained so far in an unfinished run (what a restart resumes)
      .lock                flock held by the running job
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from disttrain.parallel.guards.diskspace import writing

VERSION_DIGITS = 6


class LockedError(RuntimeError):
    """Another run of the daily job holds the lock."""


class StoreError(RuntimeError):
    """A file of the model store that cannot be read (the message names it and what to do)."""


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the folders themselves, so a rename after it publishes durable data."""
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path, fix: str) -> Any:
    """The JSON in ``path``; a corrupt file is one clear error that names it and ``fix``."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{path} cannot be read ({e}); {fix}") from None


def write_json_atomic(path: Path, data: Any, what: str = "", point: str = "") -> None:
    """``data`` as JSON in ``path``, which readers see whole or not at all (a full disk: one line, the old file
    kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, what or path.name, point, cleanup=tmp):
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class ModelStore:
    """Versions, pointer, records and lock under one model root (see the module docstring)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.versions = self.root / "versions"
        self.runs = self.root / "runs"
        self.work = self.root / "work"
        self.staging = self.work / "staging"
        self.pointer = self.root / "current"

    # -- lock -------------------------------------------------------------------------------------------------
    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold ``.lock`` for the whole run; a second run fails at once instead of waiting or overlapping. The
        kernel drops a flock when its process dies, so a crashed run never leaves a stale lock."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                raise LockedError(f"another daily run holds {self.root / '.lock'} (pid {holder}); wait for it to"
                                  " finish (runs never overlap)") from None
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- versions -----------------------------------------------------------------------------------------------
    def current(self) -> Optional[Path]:
        """The published version folder ``current`` points at, or None before the first publish."""
        if not self.pointer.is_symlink() and not self.pointer.exists():
            return None
        target = self.pointer.resolve()
        if not target.is_dir():
            raise FileNotFoundError(f"{self.pointer} points at {target}, which does not exist; point it at a"
                                    f" folder under {self.versions} (ln -sfn versions/NNNNNN current)")
        return target

    def info(self, version: Optional[Path]) -> dict[str, Any]:
        """The ``info.json`` of a published version ({} for None)."""
        if version is None:
            return {}
        return read_json(version / "info.json", f"point current at an earlier version (ln -sfn versions/NNNNNN"
                                                f" {self.pointer})")

    def next_version(self, after: Iterable[str] = ()) -> Path:
        """The folder of the next version: one past the highest existing number and the names in ``after``
        (versions removed in this run, so that one name never means two models in one run's record)."""
        self.versions.mkdir(parents=True, exist_ok=True)
        numbers = [int(p.name) for p in self.versions.iterdir() if p.name.isdigit()]
        numbers += [int(name) for name in after]
        return self.versions / f"{max(numbers, default=0) + 1:0{VERSION_DIGITS}d}"

    def published_versions(self) -> set[str]:
        """The versions some run record names as published (made current at some point)."""
        return {r["version"] for r in self.records().values() if r.get("status") == "published" and r.get("version")}

    def remove_leftovers(self) -> list[str]:
        """Remove versions that are complete but were never made current: a run that stopped between writing its
        version and swapping the pointer leaves one, newer than ``current`` and named in no run record. (Older
        unrecorded versions are kept: an operator may have pointed ``current`` back past them.) Returns their
        names."""
        if not self.versions.is_dir():
            return []
        for partial in self.versions.glob(".*.partial"):  # a publish that stopped while writing its version
            shutil.rmtree(partial)
        current = self.current()
        floor = int(current.name) if current is not None and current.name.isdigit() else 0
        published = self.published_versions()
        removed = []
        for folder in sorted(p for p in self.versions.iterdir() if p.name.isdigit()):
            if int(folder.name) > floor and folder.name not in published and \
                    (current is None or folder.resolve() != current):
                shutil.rmtree(folder)
                removed.append(folder.name)
        if removed:
            fsync_dir(self.versions)
        return removed

    def partial(self, version: Path) -> Path:
        return version.with_name(f".{version.name}.partial")

    def finish_version(self, version: Path, info: dict[str, Any]) -> None:
        """Rank 0: the model is in ``partial(version)``; add info.json, fsync, rename to ``version``."""
        partial = self.partial(version)
        write_json_atomic(partial / "info.json", info, f"version {version.name}'s info.json", "info")
        fsync_tree(partial)
        partial.rename(version)
        fsync_dir(self.versions)

    def point_at(self, version: Path) -> None:
        """Swap ``current`` to ``version`` atomically (a new symlink renamed over the old one)."""
        tmp = self.root / ".current.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        with writing(self.pointer, "the current pointer", "pointer", cleanup=tmp):
            tmp.symlink_to(Path("versions") / version.name)
        os.replace(tmp, self.pointer)
        fsync_dir(self.root)

    def prune(self, keep: int) -> list[str]:
        """Remove all but the newest ``keep`` versions (never the current one, nor a version that a kept delta
        version is built on) and leftover partial folders."""
        current = self.current()
        folders = sorted(p for p in self.versions.iterdir() if p.name.isdigit())
        kept = (folders[-keep:] if keep > 0 else []) + ([current] if current is not None else [])
        needed = {name for folder in kept for name in self.chain(folder)}
        removed = []
        for folder in folders[:-keep] if keep > 0 else folders:
            if (current is not None and folder.resolve() == current) or folder.name in needed:
                continue
            shutil.rmtree(folder)
            removed.append(folder.name)
        for partial in self.versions.glob(".*.partial"):
            shutil.rmtree(partial)
        return removed

    def chain(self, version: Path) -> list[str]:
        """The versions ``version`` is built from (its full base first, itself last; itself for a full version)."""
        info = read_json(version / "info.json", "point current at an earlier version") \
            if (version / "info.json").is_file() else {}
        return list(info.get("chain") or [version.name])

    # -- run records --------------------------------------------------------------------------------------------
    def record_path(self, day: str) -> Path:
        return self.runs / f"{day}.json"

    def record(self, day: str) -> Optional[dict[str, Any]]:
        path = self.record_path(day)
        return read_json(path, "restore it from a backup or delete it (the day then counts as unprocessed)") \
            if path.is_file() else None

    def records(self) -> dict[str, dict[str, Any]]:
        """Every day's record, by day."""
        if not self.runs.is_dir():
            return {}
        return {path.stem: self.record(path.stem) for path in sorted(self.runs.glob("*.json"))}

    def write_record(self, day: str, record: dict[str, Any]) -> None:
        write_json_atomic(self.record_path(day), record, f"the record of {day}", "record")
