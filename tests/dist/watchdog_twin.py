"""The local host's side of tests/test_resilience.py::test_watchdog_never_signals_a_twin_on_another_host, run in a pid
and UTS namespace of its own beside a decoy: a sleeping process whose pid is the one the other host's stalled rank
announced, under the same host name. Usage: watchdog_twin.py ANNOUNCEMENT DECOY_PID

A rank-0 watchdog reads the other host's announcement as rank 1's and, rank 1 never beating, reports it. Prints JSON:
whether the rule of matching host name and pid would have signalled the decoy, whether ``is_this_process`` accepts the
announcement and (the control) the decoy's own identity, the watchdog's line, and the decoy's state after it."""

import json
import sys
import threading
from pathlib import Path

import torch.distributed as dist

from disttrain.parallel.guards.watchdog import Watchdog, _started, is_this_process, process_identity


def state(pid: int) -> str:
    """R/S/T... for a live process, Z for a killed one not yet reaped, "gone" once reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2:].split()[0]


announced, decoy = json.loads(sys.argv[1]), int(sys.argv[2])
mine = process_identity()
decoy_identity = {**mine, "pid": decoy, "started": _started(decoy)}
store, lines, fired = dist.HashStore(), [], threading.Event()
dog = Watchdog(store, 0, 2, timeout=2.0, label="twin", on_stall=lambda line: (lines.append(line), fired.set()))
store.set(f"{dog.prefix}/pid/1", json.dumps(announced))  # rank 1 announced itself from the other host, then stopped
dog.start()
fired.wait(15)
dog.stop()
print(json.dumps({"decoy": decoy, "same_host_and_pid": announced["host"] == mine["host"] and announced["pid"] == decoy,
                  "accepted": is_this_process(announced), "decoy_accepted": is_this_process(decoy_identity),
                  "lines": lines, "decoy_state": state(decoy)}))
