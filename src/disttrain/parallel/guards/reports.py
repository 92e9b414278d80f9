"""The one-line failure a launched process leaves for its launcher (``disttrain run``), which prints it instead of
torchrun's report: a file ``attempt<A>.rank<N>.txt`` (the restart count of torchrun's agent, the rank) in the folder
``$DISTTRAIN_LAUNCH_REPORTS`` names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# The folder where a launched process leaves its one-line failure for the launcher.
REPORT_ENV = "DISTTRAIN_LAUNCH_REPORTS"
# Set (``disttrain run --verbose``) to keep every failure's traceback instead of its one line. Here rather than in
# guards.failures, whose imports (torch's checkpointing, DTensor: ~0.5 s) the launcher does not need.
VERBOSE_ENV = "DISTTRAIN_VERBOSE"


def verbose() -> bool:
    """Whether ``$DISTTRAIN_VERBOSE`` asks for tracebacks (1, true, yes or on)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def leave(line: str) -> bool:
    """Leave ``line`` for the launcher (written whole or not at all); whether there is a launcher to read it."""
    folder = os.environ.get(REPORT_ENV)
    if not folder:
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = Path(folder) / f"attempt{attempt}.rank{os.environ.get('RANK', '0')}.txt"
    try:
        path.with_suffix(".part").write_text(line)
        path.with_suffix(".part").replace(path)
    except OSError:  # the launcher's folder is gone: the line on stderr is all there is
        return False
    return True


def _attempt_and_rank(path: Path) -> tuple[int, int]:
    """A report's order: the newest attempt of a restarted run first (an earlier attempt's failure was recovered
    from), then the lowest rank."""
    attempt, rank = path.name.split(".")[:2]
    return -int(attempt.removeprefix("attempt")), int(rank.removeprefix("rank"))


def first(folder: Path, attempt: str = "*") -> Optional[str]:
    """The line the lowest rank of the newest attempt left in ``folder`` (``attempt``: of that attempt only; None:
    no process left one)."""
    found = sorted(folder.glob(f"attempt{attempt}.rank*.txt"), key=_attempt_and_rank)
    return found[0].read_text() if found else None


def left(attempt: int) -> Optional[str]:
    """The line a process of this node left in ``attempt`` (None: none did, or there is no launcher)."""
    folder = os.environ.get(REPORT_ENV)
    return first(Path(folder), str(attempt)) if folder else None
