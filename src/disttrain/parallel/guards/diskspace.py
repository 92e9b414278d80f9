"""Disk space: a write that cannot fit is refused before it starts, and a disk that fills during one ends in one line
(:class:`DiskFullError`) that names the path, the space needed and the space free, never in a library's traceback.

Every writer of the project goes through here: checkpoints (``parallel/checkpoint/io.py``: DCP shards, ``meta.pt``, the
manifest, single files, safetensors exports), the daily job's day caches, versions, records, pointer and report.
Each writes into a temporary name and renames it into place, so a failed write leaves nothing a reader would take
for complete; :func:`writing` removes what the failed write left.

Libraries report a full disk in different ways: Python's ``OSError`` with ``ENOSPC`` (or ``EDQUOT``), numpy's
``OSError("N requested and M written")`` or ``"Not enough free space to write N bytes"`` without an errno, torch.save's ``RuntimeError("... file write failed")``,
safetensors' ``StorageFull``, DCP's ``CheckpointException`` around any of them; :func:`disk_full_cause` finds them.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

# TEST ONLY: a comma-separated list of write points (cache, shard, metadata, manifest, checkpoint, export, info,
# pointer, record, report) at which the write fails with ENOSPC as on a full disk; the tests use it to check that
# every write ends in one line and leaves the previous state loadable.
FAIL_ENV = "DISTTRAIN_FAIL_WRITE"
# Kept free beyond a write's own size: the manifest, metadata and logs written around it.
RESERVE_BYTES = 4 << 20
_FULL = (errno.ENOSPC, errno.EDQUOT)
# How libraries that lose the errno say it: safetensors (Rust's io::ErrorKind), torch.save's stream writer, numpy's
# ndarray.tofile (a short write; a large one is checked against the free space first), and the OS's own message when
# it is quoted in another exception's text.
_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|StorageFull|QuotaExceeded|"
                        r"Not enough free space|"
                        r"\d+ requested and \d+ written|file write failed|unexpected pos \d+")


class DiskFullError(OSError):
    """A write that does not fit on its disk (before it starts) or that the disk refused (``ENOSPC``); the message
    names the path, the space needed or free, and what to do."""

    def __init__(self, message: str, path: str | os.PathLike = "") -> None:
        super().__init__(errno.ENOSPC, message, str(path))
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> Any:  # crosses processes (all_gather_object) with its message
        return (DiskFullError, (self.message, self.filename))


def human(n: float) -> str:
    """Bytes as people read them: ``1.4 GiB``, ``820 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def existing_parent(path: str | os.PathLike) -> Path:
    """``path`` or its nearest folder that exists (where a write to ``path`` would land)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged write may still use on the filesystem holding ``path``."""
    return shutil.disk_usage(existing_parent(path)).free


def ensure_free(path: str | os.PathLike, needed: int, what: str, fix: str = "") -> None:
    """Raise :class:`DiskFullError` unless ``needed`` bytes (plus a small reserve) fit where ``path`` is written."""
    free = free_bytes(path)
    if needed + RESERVE_BYTES > free:
        folder = existing_parent(path)
        raise DiskFullError(f"not enough disk space for {what} at {path}: it needs {human(needed + RESERVE_BYTES)},"
                            f" {folder} has {human(free)} free; {fix or 'free space there or write elsewhere'}",
                            path)


def tensor_bytes(state: Any, plain: bool = True) -> int:
    """Bytes this process writes for the tensors of a (nested) state in a DCP save: its ShardedTensor shards, its
    DTensor shard divided among the ranks that replicate it, and plain tensors (replicated: DCP writes them once)
    only when ``plain`` (rank 0)."""
    if isinstance(state, Mapping):
        return sum(tensor_bytes(v, plain) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v, plain) for v in state)
    local = getattr(state, "_local_tensor", None)  # DTensor
    if local is not None:
        copies = 1
        for dim, placement in enumerate(state.placements):
            copies *= state.device_mesh.size(dim) if placement.is_replicate() else 1
        return local.numel() * local.element_size() // copies
    shards = getattr(state, "local_shards", None)  # ShardedTensor
    if callable(shards):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in shards())
    if plain and isinstance(state, torch.Tensor) and not state.is_meta:
        return state.numel() * state.element_size()
    return 0


def disk_full_cause(error: BaseException) -> Optional[BaseException]:
    """The exception in ``error``'s chain that says the disk is full (see the module docstring), or None. Follows
    ``__cause__``/``__context__`` and the per-rank failures DCP's ``CheckpointException`` carries."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        failures = getattr(e, "failures", None)  # DCP's wrapper quotes its inner errors: look at them instead
        if isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in _FULL) or \
                (not failures and _FULL_TEXT.search(str(e))):
            return e
        todo += [e.__cause__, e.__context__]
        for failure in (failures or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def full_disk_error(error: BaseException, path: str | os.PathLike, what: str, kept: str = "",
                    exact: bool = True) -> DiskFullError:
    """One line for a write of ``what`` to ``path`` that failed because its disk is full; ``exact=False``: ``path``
    is only the folder the run writes to, and the file the library names (if any) is shown instead."""
    if isinstance(error, DiskFullError):
        return error
    cause = disk_full_cause(error) or error
    where = path if exact else getattr(cause, "filename", None) or path
    return DiskFullError(f"disk full while writing {what} ({where}; {human(free_bytes(path))} free there)"
                         f"{'; ' + kept if kept else ''}; free space on that disk and rerun", where)


@contextmanager
def writing(path: str | os.PathLike, what: str, point: str = "", kept: str = "",
            cleanup: Optional[str | os.PathLike] = None) -> Iterator[None]:
    """Around a write of ``what`` to ``path``: a full disk ends in :class:`DiskFullError` (other errors pass
    through), and ``cleanup`` (the write's temporary file or folder) is removed on any failure so the space comes
    back. ``point`` names the write for :data:`FAIL_ENV`; ``kept`` says what stays as it was (for the message)."""
    try:
        fail_point(point, path)
        yield
    except BaseException as e:
        if cleanup is not None:
            remove(cleanup)
        # BaseException: DCP's CheckpointException is one; an interrupt or exit is never a full disk.
        if not isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)) and disk_full_cause(e) is not None:
            raise full_disk_error(e, path, what, kept) from e
        raise


def remove(path: str | os.PathLike) -> None:
    """Remove a file or folder if it is there (best effort: the error being handled matters more)."""
    p = Path(path)
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists() or p.is_symlink():
            p.unlink()
    except OSError:
        pass


def fail_point(point: str, path: str | os.PathLike = "") -> None:
    """TEST ONLY (:data:`FAIL_ENV`): raise the ``OSError(ENOSPC)`` a full disk would at the write ``point``."""
    if point and point in os.environ.get(FAIL_ENV, "").split(","):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
