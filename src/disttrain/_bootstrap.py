"""Started by torchrun in every process of ``disttrain run`` / ``lightning run model``: register the disttrain
strategy names in this process, then run the user's script as ``__main__`` with its own arguments. A failure with a
one-line description (strategy options the world cannot run, a full disk, a stalled rank: ``parallel.guards.failures``)
is handed to the launcher, which prints that line alone, instead of a traceback per process (``--verbose`` keeps
them)."""

import os
import runpy
import sys
from datetime import timedelta
from pathlib import Path

import disttrain  # noqa: F401
from disttrain.ports import free_port


def _fresh_store_after_restart() -> None:
    """After an elastic restart, give the new process group a store of its own.

    The workers' process group normally lives in torchrun's agent store, which outlives a failed attempt together
    with the dead attempt's keys: a restarted rank can read a dead peer's gloo/nccl address from it ("Connection
    refused"). Rank 0 picks a free port and announces it under a key of this attempt; every rank then creates the
    process group on a new store that rank 0 hosts there.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from torch.distributed import TCPStore

    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(minutes=5))
    key = f"disttrain/attempt_{attempt}/master_port"
    if os.environ.get("RANK") == "0":
        port = free_port(os.environ["MASTER_ADDR"])
        agent.set(key, str(port))
    port = int(agent.get(key))
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def _say_restart() -> None:
    """On a restarted attempt, one line from the node's first process: which restart this is and the failure it
    follows (the line a process of the failed attempt left; torchrun itself says nothing at its default log level)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from disttrain.parallel.guards import reports

    line = reports.left(attempt - 1)
    cause = line or "a process ended without a line (killed, or its node was lost)"
    print(f"disttrain run: restart {attempt} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}, after: {cause}",
          file=sys.stderr, flush=True)


_fresh_store_after_restart()
_say_restart()
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).resolve().parent))
try:
    runpy.run_path(script, run_name="__main__")
except Exception as e:
    from disttrain.cli import leave_report

    if not leave_report(e):
        raise
    sys.exit(1)
