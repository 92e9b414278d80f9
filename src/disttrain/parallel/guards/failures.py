"""The failures an operator causes or meets while a run is under way (a full disk, a rank that stopped or a
collective that never completed, a checkpoint that cannot be read) as the one line a recipe or job prints instead
of a traceback; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist

from disttrain.parallel.checkpoint.integrity import CheckpointError, unwrap_dcp_error
from disttrain.parallel.guards.diskspace import DiskFullError, disk_full_cause, full_disk_error
from disttrain.parallel.guards.watchdog import describe_collective_timeout


def describe(error: BaseException, where: str = ".") -> Optional[str]:
    """One line for ``error`` when it is an operator's failure (see the module docstring), else None. ``where``: the
    folder the run writes to, named when a library's write met a full disk."""
    if isinstance(error, (DiskFullError, CheckpointError)):
        return str(error)
    if disk_full_cause(error) is not None:
        return str(full_disk_error(error, where, "the run's files", exact=False))
    checkpoint = unwrap_dcp_error(error)
    if checkpoint is not None:
        return str(checkpoint)
    return describe_collective_timeout(error)


@contextmanager
def one_line_failures(prog: str, where: str = ".") -> Iterator[None]:
    """Around a recipe's training and export: an operator's failure (:func:`describe`) ends the process with exit
    status 1 and its line on stderr, printed once (rank 0; every rank raises it); anything else passes through."""
    try:
        yield
    except Exception as e:
        line = describe(e, where)
        if line is None:
            raise
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
