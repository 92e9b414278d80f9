"""The failures an operator causes or meets (strategy options or sizes that cannot run, a full disk, a rank that
stopped or a collective that never completed, a checkpoint that cannot be read) as the one line a recipe, a job or
``disttrain run`` prints instead of a traceback; anything else is a bug and keeps its traceback. ``DISTTRAIN_VERBOSE=1``
(``disttrain run --verbose``) keeps the traceback of every failure."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist

from disttrain.parallel.checkpoint.integrity import CheckpointError, unwrap_dcp_error
from disttrain.parallel.guards.diskspace import DiskFullError, disk_full_cause, full_disk_error
from disttrain.parallel.guards.reports import verbose
from disttrain.parallel.guards.watchdog import describe_collective_timeout
from disttrain.parallel.options import OptionError


def describe(error: BaseException, where: str = ".") -> Optional[str]:
    """One line for ``error`` when it is an operator's failure (see the module docstring), else None. ``where``: the
    folder the run writes to, named when a library's write met a full disk."""
    if isinstance(error, (OptionError, DiskFullError, CheckpointError)):
        return str(error)
    if disk_full_cause(error) is not None:
        return str(full_disk_error(error, where, "the run's files", exact=False))
    checkpoint = unwrap_dcp_error(error)
    if checkpoint is not None:
        return str(checkpoint)
    return describe_collective_timeout(error)


@contextmanager
def one_line_failures(prog: str, where: str = ".") -> Iterator[None]:
    """Around a recipe's set-up, training and export: an operator's failure (:func:`describe`) ends the process with
    exit status 1 and its line on stderr, printed once (rank 0; every rank raises it); anything else, and everything
    under ``DISTTRAIN_VERBOSE=1``, passes through with its traceback."""
    try:
        yield
    except Exception as e:
        line = None if verbose() else describe(e, where)
        if line is None:
            raise
        if first_rank():
            print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def first_rank() -> bool:
    """Whether this process is rank 0: of the process group, or, before one exists (options refused before any
    process group starts), of the launcher (``$RANK``; a process nobody launched is rank 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"
