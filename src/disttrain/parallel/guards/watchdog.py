"""A heartbeat watchdog: when one rank stops (SIGSTOP, a process stuck in uninterruptible I/O, a wedged driver
that holds its interpreter, a kill), every live rank ends the run within ``timeout`` with one line naming the rank
that stopped and what the run was doing, instead of hanging until a collective times out (Lightning's default:
30 minutes) and then printing a transport error that names neither.

Collectives alone cannot tell a stopped rank from a slow one: a rank waiting in ``all_reduce`` sees only that its
peer has not arrived. So each rank runs a thread that bumps a counter of its own in the process group's store every
``timeout / 20`` seconds and reads its peers' counters; a peer whose counter has not moved for ``timeout`` (or a
store that has not answered that long: under Lightning's launcher rank 0 hosts it) has stopped. The thread prints
the line and ends its own process (``os._exit``, as a kill would; launchers then end the stopped one). The next run
resumes from the last checkpoint exactly as after a kill.

A live but stuck rank (a device kernel that never returns) keeps beating; the process group's own timeout, set a
little above the watchdog's (:func:`collective_timeout`), ends that case with torch's error, which
:func:`describe_collective_timeout` turns into one line.

Each rank marks itself done when it stops its watchdog (the end of the run, or interpreter exit), so a rank that
finishes early is not taken for a stopped one.

A stopped peer is also sent SIGKILL, so that the whole run ends now, but only when it is provably the same process on
this machine (:func:`is_this_process`): the same kernel boot and pid namespace (two containers, or two hosts cloned
from one image, share a hostname and number their processes independently), the same start time of that pid (a pid
reused by another process starts later) and the same launcher run (each rank announces itself under its run's keys
and with its run id). Anything less is left alone: the run still ends, through this rank's own exit and the
launcher.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

STALL_EXIT = 4  # the exit status of a rank the watchdog ends
# TEST ONLY: "POINT@RANK": that rank stops itself (SIGSTOP, as a wedged process would look to its peers) when it
# reaches POINT (the daily job's after-day-YYYY-MM-DD, the dialogue recipe's step-N); the tests check that every
# live rank ends within the timeout and that the next run resumes.
STALL_ENV = "DISTTRAIN_STALL_AT"
_KEY = "disttrain/watchdog"
_phase = ["", ""]  # what the run does (set by the job), and the step within it (set by the strategies)
_current: list[Optional["Watchdog"]] = [None]


def seconds(timeout: Any) -> float:
    """A timeout given as seconds (int/float/str) or a ``timedelta``, in seconds; anything else is one error."""
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    else:
        try:
            value = float(timeout)
        except (TypeError, ValueError):
            raise ValueError(f"timeout={timeout!r} is not a number of seconds; pass e.g. timeout=600 or"
                             " timeout=timedelta(minutes=10)") from None
    if not value > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (e.g. 600)")
    return value


def heartbeat_interval(timeout: float) -> float:
    return min(5.0, max(0.2, timeout / 20))


def collective_timeout(timeout: float) -> timedelta:
    """The process group's timeout for a watchdog ``timeout``: a few heartbeats later, so that a stopped rank is
    reported by the watchdog (which names it) before a collective gives up with a transport error."""
    return timedelta(seconds=timeout + max(5.0, 3 * heartbeat_interval(timeout)))


def stall_point(point: str) -> None:
    """TEST ONLY (:data:`STALL_ENV`): stop this process at ``point`` if it is the rank named there."""
    name, _, rank = os.environ.get(STALL_ENV, "").rpartition("@")
    if name == point and dist.is_initialized() and rank == str(dist.get_rank()):
        print(f"stall injected at {point} on rank {rank} at {time.time():.3f} ({STALL_ENV}, test only)", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def set_phase(text: str) -> None:
    """What the run is doing now, for the line the watchdog prints (``training day 2026-11-04``)."""
    _phase[:] = [text, ""]


def set_step(text: str) -> None:
    """The step within the phase (``training step 41``), set by the strategies."""
    _phase[1] = text


@contextmanager
def phase(text: str) -> Iterator[None]:
    before = list(_phase)
    _phase[:] = [text, ""]
    try:
        yield
    finally:
        _phase[:] = before


def current_phase() -> str:
    return ", ".join(p for p in _phase if p) or "starting"


class Watchdog:
    """Heartbeats of this rank and the check of its peers' (see the module docstring). ``on_stall(line)`` is
    called with the line when a peer stopped (default: print it on stderr and end the process with
    :data:`STALL_EXIT`); ``label`` starts the line, ``advice`` ends it."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float, label: str = "disttrain",
                 advice: str = "", on_stall: Optional[Callable[[str], None]] = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.interval = timeout, heartbeat_interval(timeout)
        self.label, self.advice = label, advice
        self.on_stall = on_stall or _end_process
        self.prefix = f"{_KEY}/{_run()}"
        self.group = dist.group.WORLD if dist.is_initialized() else None
        self._stop, self._stopped = threading.Event(), False
        self._thread = threading.Thread(target=self._loop, name="disttrain-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        """Stop watching and mark this rank done (its silence from now on is not a stall). Waits for the thread to
        end first: a daemon thread still inside a store call when the interpreter finalizes is ended by a forced
        unwind through C++ frames, which aborts the process ("terminate called without an active exception")."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 10.0)  # a store call gives up after its own short timeout
        if self._thread.is_alive():
            return
        # bounded: the store may be gone or cut off at exit (the peers are ending too)
        _Bounded(lambda: self.store.set(f"{self.prefix}/done/{self.rank}", "1")).wait(self._store_timeout)

    def _where(self, rank: int) -> dict[str, Any]:
        """What a rank announced of itself (:func:`process_identity`; host "?" and pid 0 when unknown)."""
        try:
            return {"host": "?", "pid": 0, **json.loads(self.store.get(f"{self.prefix}/pid/{rank}").decode())}
        except Exception:
            return {"host": "?", "pid": 0}

    @property
    def _store_timeout(self) -> float:
        return max(2.0, 2 * self.interval)

    def _exchange(self, peers: list[int], seen: dict[int, int], changed: dict[int, float], now: float) -> bool:
        """One heartbeat: this rank's beat, then each peer's (a peer that finished leaves ``peers``); True when the
        store answered every call."""
        self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
        for r in list(peers):
            if self._stop.is_set():
                return False
            if self.store.check([f"{self.prefix}/done/{r}"]):
                peers.remove(r)
                continue
            value = self.store.add(f"{self.prefix}/beat/{r}", 0)  # reads without waiting for the key
            if value != seen[r]:
                seen[r], changed[r] = value, now
        return True

    def _loop(self) -> None:
        try:
            self.store.set(f"{self.prefix}/pid/{self.rank}", json.dumps(process_identity()))
        except Exception:
            pass
        peers = [r for r in range(self.world_size) if r != self.rank]
        seen = {r: -1 for r in peers}
        changed = {r: time.monotonic() for r in peers}
        store_ok = time.monotonic()
        exchange: Optional[_Bounded] = None
        while not self._stop.wait(self.interval):
            if self.group is not None and (not dist.is_initialized() or dist.group.WORLD is not self.group):
                self._stop.set()  # the process group this watchdog was started for is gone
                return
            now = time.monotonic()
            # A store call can block for good when the store's host is cut off (a TCP request whose answer never
            # comes; the client's timeout does not cover it): the calls run in a thread of their own, and one
            # that has not returned leaves the store judged silent.
            if exchange is None or exchange.finished():
                exchange = _Bounded(lambda: self._exchange(peers, seen, changed, now))
            if exchange.wait(self._store_timeout) is True:
                store_ok = now
            if self._stop.is_set():
                return
            if not peers:
                return  # every other rank finished
            # Silent for the timeout less two heartbeats: a change is seen up to one heartbeat after it happened and
            # checked once a heartbeat, so the run ends within ``timeout`` of the moment the peer stopped.
            limit = self.timeout - 2 * self.interval
            silent = sorted(r for r in peers if now - changed[r] >= limit)
            host_done = 0 not in peers and self.rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            if now - store_ok >= limit and not host_done:
                self._stalled(f"the process group's store ({_store_host()}) has not answered for"
                              f" {now - store_ok:.0f} s")
                return
            if silent:
                where = {r: self._where(r) for r in silent}
                ranks = ", ".join(f"{r} (pid {w['pid']} on {w['host']})" for r, w in where.items())
                line = (f"rank{'s' if len(silent) > 1 else ''} {ranks} {'have' if len(silent) > 1 else 'has'} not"
                        f" answered for {now - max(changed[r] for r in silent):.0f} s")
                # A stopped process of this run on this machine is ended too (SIGKILL reaches a stopped process; a
                # launcher's SIGTERM waits 30 s for it before it kills), so the whole run ends now.
                for announced in where.values():
                    if is_this_process(announced):
                        try:
                            os.kill(int(announced["pid"]), signal.SIGKILL)
                        except OSError:
                            pass
                self._stalled(line)
                return

    def _stalled(self, what: str) -> None:
        line = (f"{self.label}: rank {self.rank}: {what} (timeout {self.timeout:g} s) while {current_phase()}: a"
                " process stopped, hung or was killed; ending the run"
                f"{'; ' + self.advice if self.advice else ''}")
        self.on_stall(line)


def _machine() -> Optional[str]:
    """This kernel boot and pid namespace: where a pid names one process (None where /proc cannot tell)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _started(pid: int) -> Optional[str]:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat; None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # the fields after the command name, which may hold spaces


def _run() -> str:
    """The launcher's run and attempt this process belongs to, as every rank of the attempt names it: torchrun's run
    id and the address of the attempt's store (each restarted attempt gets a fresh one). Not torchrun's restart
    count: after a lost node is replaced, the surviving agents count one restart and the newcomer none."""
    return (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('MASTER_ADDR', '')}:"
            f"{os.environ.get('MASTER_PORT', '')}")


def process_identity() -> dict[str, Any]:
    """What a rank announces of itself: its host name (for the line), its pid, the machine it runs on, when its
    process started and the launcher's run it belongs to (what :func:`is_this_process` checks)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "machine": _machine(), "started": _started(pid), "run": _run()}


def is_this_process(announced: dict[str, Any]) -> bool:
    """Whether a peer's announcement names a live process this rank may signal: another process of the same machine
    (kernel boot and pid namespace), still the one that made the announcement (its pid started when the announcement
    says: a reused pid starts later) and of this launcher run. A host name and a pid alone prove nothing: hosts cloned
    from one image, or containers, share names and number their pids independently."""
    pid = announced.get("pid")
    if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return False
    machine = _machine()
    return (machine is not None and announced.get("machine") == machine and announced.get("run") == _run()
            and announced.get("started") is not None and _started(pid) == announced.get("started"))


def _store_host() -> str:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"torchrun's agent at {where}"
    return f"rank 0's process at {where}"


class _Bounded:
    """``fn()`` in a daemon thread of its own, waited for a bounded time: its result, or None while it runs or
    after it raised (the store's host stopped or is gone)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="disttrain-watchdog-store", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except Exception:
            self._result = None
        finally:
            self._done.set()

    def wait(self, timeout: float) -> Any:
        return self._result if self._done.wait(timeout) else None

    def finished(self) -> bool:
        return self._done.is_set()


def _end_process(line: str) -> None:
    from disttrain.parallel.guards import reports

    try:
        sys.stdout.flush()
    except Exception:
        pass
    if not reports.leave(line):  # `disttrain run` prints a line it is left, instead of torchrun's report
        os.write(2, (line + "\n").encode())
    os._exit(STALL_EXIT)


def _store_client(timeout: float) -> Any:
    """A store connection of the watchdog's own, with a short timeout (the process group's connection waits as
    long as a collective may, and its thread must not block the main thread's use of it)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=max(2.0, 2 * heartbeat_interval(timeout))),
                             wait_for_workers=False)
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def start(timeout: float, label: str = "disttrain", advice: str = "",
          on_stall: Optional[Callable[[str], None]] = None) -> Optional[Watchdog]:
    """Start this rank's watchdog for the default process group (once per process; a second call returns the
    running one). None with one process (nothing to wait for)."""
    if _current[0] is not None and _current[0].group is dist.group.WORLD and _current[0].is_alive():
        return _current[0]
    stop()  # one of an earlier process group
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    dog = Watchdog(_store_client(timeout), dist.get_rank(), dist.get_world_size(), timeout, label, advice, on_stall)
    _current[0] = dog.start()
    atexit.unregister(stop)  # one registration per process
    atexit.register(stop)
    return dog


def stop() -> None:
    """Stop this process's watchdog (at the end of a run; also at interpreter exit)."""
    dog, _current[0] = _current[0], None
    if dog is not None:
        dog.stop()


def running() -> Optional[Watchdog]:
    return _current[0]


_TIMEOUT_TEXT = re.compile(r"[Tt]imed out|timeout|Connection closed by peer|Connection reset by peer|"
                           r"Broken pipe|NCCL communicator was aborted|Watchdog caught collective operation timeout")


def describe_collective_timeout(error: BaseException, timeout: Optional[float] = None) -> Optional[str]:
    """One line for a collective that failed because a peer did not join in time or went away (gloo's "Timed out
    waiting ... for recv", "Connection closed by peer", NCCL's watchdog abort), or None for any other error."""
    text = str(error)
    if not isinstance(error, (RuntimeError, dist.DistBackendError)) or not _TIMEOUT_TEXT.search(text):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's source location
    first = re.split(r"(?<=\.)\s", first)[0].rstrip(".")[:200]  # its first sentence
    limit = f" within {collective_timeout(timeout).total_seconds():g} s" if timeout else ""
    return (f"a collective did not complete{limit} while {current_phase()} ({first}): a peer stopped, crashed or"
            " is stuck on its device")
