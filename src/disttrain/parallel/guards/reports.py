"""The one-line failure a launched process leaves for its launcher (``disttrain run``), which prints it instead of
torchrun's report: a file ``rank<N>.txt`` in the folder ``$DISTTRAIN_LAUNCH_REPORTS`` names."""

from __future__ import annotations

import os
from pathlib import Path

# The folder where a launched process leaves its one-line failure for the launcher.
REPORT_ENV = "DISTTRAIN_LAUNCH_REPORTS"


def leave(line: str) -> bool:
    """Leave ``line`` for the launcher (written whole or not at all); whether there is a launcher to read it."""
    folder = os.environ.get(REPORT_ENV)
    if not folder:
        return False
    path = Path(folder) / f"rank{os.environ.get('RANK', '0')}.txt"
    try:
        path.with_suffix(".part").write_text(line)
        path.with_suffix(".part").replace(path)
    except OSError:  # the launcher's folder is gone: the line on stderr is all there is
        return False
    return True
