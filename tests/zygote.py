"""Start the ranks of a multi-process test by forking pre-imported Python processes instead of exec'ing fresh ones.

Most of a 2-process torchrun launch on a 2-core machine is three interpreters importing torch, Lightning,
transformers and DeepSpeed (~7 s of CPU each). A zygote is a Python process that has imported them once and forks
one child per rank on request; the child takes torchrun's environment for its rank and runs the script with
``runpy``, exactly as ``python -u script.py args`` would from there on.

Why a fork is the same process as a fresh one for the scripts (checked by tests/test_launcher.py against torchrun):
- the zygote never runs a tensor operation, a collective or a thread before forking: it only imports, so no
  OpenMP pool, process group or lock exists to be copied half-held (it checks it has one thread);
- the ranks take two zygotes in turn, so neighbouring ranks differ in their string-hash seed as fresh interpreters
  do (a set iterated in another order on another rank shows between ranks 0 and 1; ranks 2 and 3 repeat their
  seeds, and a zygote costs seconds of CPU), and the child reseeds ``random``, numpy's and torch's global generators
  from the OS as interpreter start does;
- what the imported libraries read from the environment at import is the same: the zygote starts with the
  launch environment, and the one rank-dependent import-time value (Lightning's ``rank_zero_only.rank``, read
  from RANK) is recomputed in the child;
- the objects the zygote imported are frozen out of the cyclic GC (``gc.freeze``), so that a child's collections
  and shutdown do not copy every inherited page; what the script itself creates is collected as usual;
- the child starts a new session (torchrun's workers do too, so a failure kills a rank with its own children),
  has stdin on /dev/null, stdout and stderr on its log file, the script's folder first on ``sys.path``, runs in
  a module ``__main__`` of its own, and ends through normal interpreter shutdown (non-daemon threads joined, atexit
  handlers, exit code of an uncaught exception or ``sys.exit``); the ranks of ``run_dist``, whose results are the
  files they write, skip the last part of it, the teardown of the modules the zygote imported (``run_and_exit``).

The processes a fork starts with ``sys.executable`` are forks of the zygotes as well where a fork is the same process
(``Launcher.forks``, tests/forward.py).

Run as a script it is the zygote (one JSON request per line on stdin); imported, it is the client used by
``conftest.run_dist``. The script's ranks host their own store (rank 0, ``TORCHELASTIC_USE_AGENT_STORE=False``)
where torchrun's ranks use the agent's: the rendezvous ``init_process_group`` does is otherwise the same.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

# What the test scripts import; deepspeed, timm and torchrec are imported here too (by the scripts that need them)
# because a third of the launches use one of them and each costs seconds of CPU per rank. The rest are what most
# ranks import after the fork (recorded over the suite's forks), ~1.1 s of CPU each: transformers and disttrain
# load their parts lazily (a Llama model: transformers' modelling code, ~0.45 s; the strategies: disttrain's
# engines), and DeepSpeed's engine imports its Muon optimizer, and so networkx, when it starts (~0.6 s).
PRELOAD = ("torch", "lightning", "transformers", "disttrain", "deepspeed", "timm", "torchrec",
           "transformers.models.llama.modeling_llama", "disttrain.strategies", "disttrain.fabric",
           "deepspeed.runtime.zero.muon.muon_optimizer")
# torchrun gives a worker these besides its own environment (torch/distributed/elastic/agent/server).
GRACE_S = 30  # torchrun's grace between SIGTERM and SIGKILL for the ranks left when one fails
ZYGOTES = 2  # the ranks of a launch take them in turn: ranks 0 and 1 have hash seeds of their own
# The processes a forked process starts as `sys.executable [-u] script|-m module|-c code args` (the GPU check's
# recipes, `disttrain calibrate`'s and `plan --trial`'s launcher and its ranks, Lightning's second rank, torchrun's
# workers) are forked from the zygotes too, through tests/forward.py (``Launcher.forks``): it stands in for
# ``sys.executable`` in every forked process, and for torchrun's PYTHON_EXEC in the launchers the tests start
# (conftest.child_env), and runs the real interpreter where a fork would not be the same process (more file
# descriptors than stdin/out/err, an interpreter option, an environment the zygotes did not import in). A process on
# a host of tools/hosts.py gets a fork that joins the host (``join_host``). DISTTRAIN_TEST_FORK_EXECS=0: they start
# fresh.
FORKS_VAR = "DISTTRAIN_TEST_FORKS"
FORK_EXECS = os.environ.get("DISTTRAIN_TEST_FORK_EXECS", "1") != "0"
# What a launcher adds to a process's environment and the process reads only after its imports (torchrun's worker
# variables, Lightning's for its second rank): a process started with them is still the one the zygotes serve.
AFTER_IMPORT = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTEST_CURRENT_TEST", FORKS_VAR,
                "DISTTRAIN_LAUNCH_REPORTS", "DISTTRAIN_TIMEOUT", "DISTTRAIN_VERBOSE",  # `disttrain run`'s
                "DISTTRAIN_CACHE",  # where calibrations are kept, read when one is
                "PYTHON_EXEC",  # torchrun's interpreter for its workers (conftest.child_env: the stand-in)
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",  # read by torchrun's agent (`disttrain run --max-restarts`)
                "PWD", "OLDPWD", "SHLVL", "_",  # what a shell sets (the documented commands run under bash)
                "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")  # a node's interface (tools/hosts.py)
AFTER_IMPORT_PREFIXES = ("TORCHELASTIC_", "LT_", "PL_")
# The namespaces a process on a host of tools/hosts.py has of its own (hosts.HOST_NAMESPACES): a fork joins them.
HOST_NAMESPACES = {"net", "uts", "mnt", "pid", "pid_for_children"}
# The signals a launcher sends to stop its processes (tests/forward.py passes them on to the fork it stands for).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int, error_file: str, nodes: int = 1,
             master: str = "127.0.0.1") -> dict[str, str]:
    """torchrun's worker environment for ``rank`` of a run of ``nproc`` processes on ``nodes`` nodes (as many on
    each, node by node), whose rendezvous is at ``master``."""
    local = nproc // nodes
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank % local), "GROUP_RANK": str(rank // local),
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(local), "WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": master,
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file}


def namespaces_of(pid: int | str) -> dict[str, int]:
    """The namespaces process ``pid`` is in (name -> inode)."""
    folder = f"/proc/{pid}/ns"
    return {name: os.stat(f"{folder}/{name}").st_ino for name in os.listdir(folder)}


def import_time_env(env: dict[str, str], after: tuple[str, ...] = ()) -> dict[str, str]:
    """``env`` without what its process reads only after its imports (``AFTER_IMPORT``, and ``after``)."""
    return {k: v for k, v in env.items()
            if k not in AFTER_IMPORT and k not in after and not k.startswith(AFTER_IMPORT_PREFIXES)}


# ---------------------------------------------------------------------------------------------------------------
# The zygote (this file run as a script)


def importing_without_gc() -> None:
    """No cyclic collection from now until :func:`freeze_imported`, while a process imports its libraries: every
    object an import creates lives on, so each collection of the oldest generation (triggered again and again as
    they pile up) examines ever more objects and frees none, ~20% of an import of Lightning's CPU."""
    gc.disable()


def freeze_imported() -> None:
    """One collection, then everything alive now frozen out of every later collection (``gc.freeze``), and the GC
    back on: what the process creates from here on is collected as usual."""
    gc.collect()
    gc.freeze()
    gc.enable()


def preload() -> None:
    import importlib

    importing_without_gc()
    for name in PRELOAD:
        importlib.import_module(name)
    # Each DeepSpeed rank on CPU probes which ops can build (compiler runs) when it starts its communication
    # backend; the result is per machine, not per process, so it is computed once here and the children find it
    # where DeepSpeed keeps it.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__  # noqa: B018  (computed on first access, then kept in the module)
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, f"an import started {threads - 1} thread(s): forking now would copy them half-done"
    # The children inherit every imported object. Python's cyclic GC writes to the header of each object it
    # examines, and a child's collections and interpreter shutdown would so copy nearly every inherited page
    # (~1.5 s of CPU per child, most of a short rank's cost); gc.freeze(), CPython's tool for pre-fork servers,
    # leaves what exists now out of every later collection. What a script creates is collected as before.
    freeze_imported()


def write(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def serve(requests: int, replies: int) -> dict | None:
    """Fork a child per request; report each child's pid, then its exit code. Returns the request in the child,
    None in the zygote when the client closes its end."""
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        ready, _, _ = select.select([requests, *children], [], [])
        for fd in ready:
            if fd != requests:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                write(replies, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)})
                continue
            data = os.read(requests, 1 << 16)
            if not data:
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    for child_fd in (requests, replies, *children):
                        os.close(child_fd)
                    return request
                children[os.pidfd_open(pid)] = pid
                write(replies, {"pid": pid})


def become(request: dict) -> tuple[str, str]:
    """Turn this fork into the rank ``python -u <script> <args>`` would have started under torchrun (or the one
    process of ``python -u [-m|-c] <script|module|code> <args>``); returns what to run: ("path"|"module"|"code",
    target)."""
    import random

    os.setsid()
    stdin = os.open(request.get("stdin", os.devnull), os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for fd, path in ((1, request["log"]), (2, request.get("err", request["log"]))):
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, fd)
        os.close(log)
    if request.get("host"):  # a rank of a host of tools/hosts.py: its network, hostname and /etc/hosts
        tools_hosts().enter(**request["host"])
    elif request.get("join"):  # the process a process on such a host starts (tests/forward.py)
        join_host(request["join"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("forks"):  # the processes this one starts with sys.executable are forks of the zygotes too
        os.environ[FORKS_VAR] = json.dumps(request["forks"])
        sys.executable = request["forks"]["python"]
    kind = {"-m": "module", "-c": "code"}.get(request["argv"][0], "path")
    if kind == "module":  # `python -m module args`: runpy puts the module's file in sys.argv[0]
        target = request["argv"][1]
        sys.argv = list(request["argv"][1:])
        sys.path[0] = os.getcwd()
    elif kind == "code":  # `python -c code args`: sys.argv[0] is "-c", the current folder first on sys.path
        target = request["argv"][1]
        sys.argv = ["-c", *request["argv"][2:]]
        sys.path[0] = ""
    else:
        target = os.path.abspath(request["argv"][0])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(target)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.modules["torch"].default_generator.seed()
    from lightning.fabric.utilities.rank_zero import _get_rank
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = _get_rank() or 0
    return kind, target


def tools_hosts():
    """tools/hosts.py, imported without leaving its name to the script's own modules."""
    tools = str(Path(__file__).resolve().parents[1] / "tools")
    sys.path.insert(0, tools)
    try:
        import hosts
    finally:
        sys.path.remove(tools)
    del sys.modules["hosts"]
    return hosts


def join_host(pid: int) -> None:
    """This fork becomes a process started on the host where ``pid`` runs (its network, hostname, mounts and
    process ids: tools/hosts.py's ``join``). Process ids are a fork's own from its start, so where the host has
    its own the process is this one's child, in the host's pid namespace; this one stays as its parent and ends as
    it ends (its exit code, or the signal that ended it), ignoring what a launcher sends their session (the child
    gets it) and taking the child with it when it is killed."""
    import ctypes

    own_pids = namespaces_of(pid)["pid"] != namespaces_of("self")["pid"]
    tools_hosts().join(pid)
    if not own_pids:  # a network namespace alone (`ip netns exec`)
        return
    child = os.fork()
    if child == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the parent's SIGKILL is the child's too
        if os.getppid() != 0:  # the parent (outside the host's pid namespace, so pid 0 here) is already gone
            os._exit(128 + signal.SIGKILL)
        return
    for sig in FORWARDED:
        signal.signal(sig, lambda *_: None)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def zygote_main() -> dict | None:
    requests, replies = os.dup(0), os.dup(1)
    # What imports and DeepSpeed's op loader print goes to the zygote's log, not into the replies.
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    preload()
    sys.stdout.flush()
    sys.stderr.flush()
    write(replies, {"ready": os.getpid()})
    return serve(requests, replies)


# ---------------------------------------------------------------------------------------------------------------
# The client (conftest.run_dist)


class Zygote:
    """One pre-imported process that forks ranks (every other one of a launch). What it says (ready; a child's pid
    once forked; a child's exit) is read by its :class:`Launcher` and sorted here."""

    def __init__(self, env: dict[str, str], cwd: Path, log: Path) -> None:
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, cwd=cwd)
        self.env, self.log, self.pending = env, log, b""
        self.ready: bool = False
        self.started: deque[int] = deque()  # the children forked for requests not yet answered, in order
        self.exits: dict[int, int] = {}  # pid -> exit code, until the waiting launch takes it
        self.stopped: str | None = None  # why it can serve no more
        self.sending = threading.Lock()  # one request at a time awaits its child's pid

    def send(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def feed(self) -> None:
        """Read what has arrived (its stdout is readable) and sort the messages."""
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            self.stopped = (f"the zygote stopped (exit {self.proc.wait()}); its log: {self.log}\n"
                            f"{self.log.read_text()[-4000:]}")
            return
        self.pending += data
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            message = json.loads(line)
            if "ready" in message:
                self.ready = True
            elif "exit" in message:
                self.exits[message["pid"]] = message["exit"]
            else:
                self.started.append(message["pid"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Launcher:
    """Zygotes started on first use (``ZYGOTES``, ranks taking them in turn), all with the environment of the first
    launch. Several threads may launch through them at once (a zygote forks a child per request, whoever asks): the
    thread that waits first reads every zygote's messages for all of them (:meth:`_await`)."""

    def __init__(self, cwd: Path, log_dir: Path) -> None:
        self.cwd, self.log_dir = cwd, log_dir
        self.zygotes: list[Zygote] = []
        self._launches = itertools.count(1)
        self._growing = threading.Lock()
        self._cond = threading.Condition()
        self._reading = False
        self._wake_read, self._wake_write = os.pipe()  # a zygote added: the reader's select starts again
        self._forks: dict | None = None  # where forked processes ask for forks of their own (``forks``)
        self._env: dict[str, str] | None = None  # the zygotes' environment where a forwarded start comes first
        self._server: socket.socket | None = None
        self._serving = threading.Lock()
        self._turns = itertools.count()

    def logs(self, script: str, nproc: int) -> list[Path]:
        """Fresh log files for the ranks of the next launch of ``script``."""
        folder = self.log_dir / f"{next(self._launches):03d}-{Path(script).stem}"
        folder.mkdir(parents=True)
        return [folder / f"rank{rank}.log" for rank in range(nproc)]

    def serves(self, env: dict[str, str]) -> bool:
        """Whether the zygotes imported their modules in this environment (what is read only after the imports
        aside: pytest's note of the current test, ...), so that the ranks they fork are the ones a fresh interpreter
        would start."""
        return not self.zygotes or import_time_env(self.zygotes[0].env) == import_time_env(env)

    def forks(self, after: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict | None:
        """What a forked process needs to have the processes it starts with ``sys.executable`` forked too (the
        ``forks`` of a request, see ``FORKS_VAR``): this launcher's socket, the program standing in for the
        interpreter, and ``after``, the variables of the launch read only after the imports. Starts the socket's
        server on first use. None under DISTTRAIN_TEST_FORK_EXECS=0. ``env``: the environment of the launches, which
        the zygotes start in if a forwarded start needs them first (a launcher a test starts before any launch)."""
        if not FORK_EXECS:
            return None
        with self._serving:
            if self._env is None and env is not None:
                self._env = dict(env)
            if self._forks is None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                path = self.log_dir / "forks.sock"
                self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._server.bind(str(path))
                self._server.listen(64)
                python = self.log_dir / "bin" / "python"
                python.parent.mkdir()
                # -S -E: the stand-in imports nothing beyond the standard library it needs and reads no PYTHON*
                # variable; it hands those on untouched to what it runs
                python.write_text(f"#!{sys.executable} -SE\n" + (Path(__file__).parent / "forward.py").read_text())
                python.chmod(0o755)
                self._forks = {"socket": str(path), "python": str(python)}
                threading.Thread(target=self._accept, name="zygote-forks", daemon=True).start()
        return {**self._forks, "after": sorted(after)}

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed: the session ends
                return
            threading.Thread(target=self._forward, args=(conn,), name="zygote-fork", daemon=True).start()

    def _forward(self, conn: socket.socket) -> None:
        """One process's request (tests/forward.py): fork it from a zygote and answer its pid, then its exit
        code; or answer why it must start fresh. The child gets the signals the requester passes on, and is killed
        when the requester goes first (SIGKILL)."""
        with conn:
            requests = conn.makefile("rb")
            line = requests.readline()
            if not line:
                return
            request = json.loads(line)
            # the requester's pid as this process sees it (the requester's own differs on a host of its own)
            peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            after = tuple(request.get("after", ()))
            base = self.zygotes[0].env if self.zygotes else self._env or {}
            ours, theirs = import_time_env(base, after), import_time_env(request["env"], after)
            if ours != theirs or not base:
                differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
                self._fresh(conn, request, f"the zygotes imported in another environment: {differ}")
                return
            try:
                others = namespaces_of("self").items() ^ namespaces_of(peer).items()
            except OSError:  # gone already
                return
            if {name for name, _ in others} - HOST_NAMESPACES:
                self._fresh(conn, request, f"other namespaces: {sorted({name for name, _ in others})}")
                return
            try:
                zygote = self._zygotes(ZYGOTES, base)[next(self._turns) % ZYGOTES]
                stdin, out, err = (f"/proc/{peer}/fd/{fd}" for fd in range(3))
                pid = self._start(zygote, {"argv": request["argv"], "cwd": request["cwd"], "stdin": stdin,
                                           "log": out, "err": err, "env": request["env"],
                                           "join": peer if others else None, "forks": self.forks(after)})
            except RuntimeError as e:
                self._fresh(conn, request, str(e).splitlines()[0])
                return
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
            done = threading.Event()

            def watch() -> None:  # the requester passes on signals; EOF means it is gone
                try:
                    for line in requests:
                        self._signal([pid], {}, signal.Signals(json.loads(line)["signal"]))
                except OSError:  # closed here: the child ended
                    return
                if not done.is_set():
                    self._signal([pid], {}, signal.SIGKILL)

            threading.Thread(target=watch, name="zygote-fork-watch", daemon=True).start()
            _, code = self._next_exit([zygote], [pid], {}, time.monotonic() + 10 ** 7)
            done.set()
            try:
                conn.sendall((json.dumps({"exit": code}) + "\n").encode())
            except OSError:  # the requester is gone
                pass

    def _fresh(self, conn: socket.socket, request: dict, why: str) -> None:
        conn.sendall((json.dumps({"fresh": why}) + "\n").encode())
        if os.environ.get("DISTTRAIN_TEST_FORKS_LOG"):  # which starts were fresh, and why
            with open(os.environ["DISTTRAIN_TEST_FORKS_LOG"], "a") as log:
                log.write(json.dumps({"argv": request["argv"][:3], "why": why}) + "\n")

    def _zygotes(self, nproc: int, env: dict[str, str]) -> list[Zygote]:
        """The zygote of each of ``nproc`` ranks (``ZYGOTES`` of them, in turn), started and ready."""
        with self._growing:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            while len(self.zygotes) < min(nproc, ZYGOTES):
                self.zygotes.append(Zygote(env, self.cwd, self.log_dir / f"zygote{len(self.zygotes)}.log"))
                os.write(self._wake_write, b"z")
            zygotes = [self.zygotes[rank % ZYGOTES] for rank in range(nproc)]
        for zygote in zygotes[:ZYGOTES]:  # a first DeepSpeed op build in a fresh environment takes minutes
            if self._await([zygote], lambda z=zygote: z.ready or None, time.monotonic() + 900) is None:
                raise RuntimeError(f"the zygote did not start in 900 s; its log: {zygote.log}")
        return zygotes

    def _await(self, zygotes: list[Zygote], ready, until: float):
        """``ready()``'s first value other than None, or None at ``until``; RuntimeError when one of ``zygotes``
        stops. While no other thread does, the caller reads what every zygote says (for every thread)."""
        with self._cond:
            while True:
                value = ready()
                if value is not None:
                    return value
                stopped = next((z.stopped for z in zygotes if z.stopped), None)
                if stopped:
                    raise RuntimeError(stopped)
                left = until - time.monotonic()
                if left <= 0:
                    return None
                if self._reading:
                    self._cond.wait(left)
                    continue
                self._reading = True
                listening = {z.proc.stdout.fileno(): z for z in self.zygotes if z.stopped is None}
                self._cond.release()
                try:
                    readable = select.select([self._wake_read, *listening], [], [], left)[0]
                finally:
                    self._cond.acquire()
                    self._reading = False
                    self._cond.notify_all()
                for fd in readable:
                    if fd == self._wake_read:
                        os.read(self._wake_read, 1 << 10)
                    else:
                        listening[fd].feed()

    def _start(self, zygote: Zygote, request: dict) -> int:
        """Ask ``zygote`` for a child; its pid."""
        with zygote.sending:
            zygote.send(request)
            pid = self._await([zygote], lambda: zygote.started.popleft() if zygote.started else None,
                              time.monotonic() + 60)
        if pid is None:
            raise RuntimeError(f"the zygote did not start {request['argv']} in 60 s; its log: {zygote.log}")
        return pid

    def run(self, argv: list[str], env: dict[str, str], nproc: int, port: int, logs: list[Path],
            timeout: float, run_env: dict[str, str] | None = None, errs: list[Path] | None = None,
            cwd: Path | None = None, full_exit: bool = True, hosts: list[dict] | None = None) -> list[int]:
        """Run ``argv`` (script, args) on ``nproc`` ranks; return their exit codes. As torchrun does, when a rank
        fails the others get SIGTERM, then SIGKILL after a grace period. Raises TimeoutError past ``timeout``.
        ``run_env``: variables read only after the imports (a launcher's LT_*); ``errs``: stderr files apart from
        the logs; ``cwd``: where the ranks run (default: the launcher's folder); ``full_exit=False``: the ranks end
        without the teardown of the modules (see ``run_and_exit``), for scripts whose output is what they write.
        ``hosts``: the ranks are spread over these nodes, as many on each, node by node: each node a dict with the
        ``placement`` of a host of tools/hosts.py (the rank enters it) and the ``env`` of its processes (there the
        rendezvous address, ``MASTER_ADDR``)."""
        zygotes = self._zygotes(nproc, env)
        deadline = time.monotonic() + timeout
        pids = []
        nodes = len(hosts) if hosts else 1
        for rank, (zygote, log) in enumerate(zip(zygotes, logs)):
            node = hosts[rank * nodes // nproc] if hosts else {}
            pids.append(self._start(zygote, {
                "argv": argv, "cwd": str(cwd or self.cwd), "log": str(log), "err": str((errs or logs)[rank]),
                "full_exit": full_exit, "host": node.get("placement"),
                "env": {**rank_env(env, rank, nproc, port, str(log.with_suffix(".error.json")), nodes,
                                   node.get("env", {}).get("MASTER_ADDR", "127.0.0.1")),
                        **(run_env or {}), **node.get("env", {})},
                "forks": self.forks(tuple(run_env or ()))}))
        codes: dict[int, int] = {}
        stop_at = deadline  # moves closer when a rank fails
        while len(codes) < nproc:
            exited = self._next_exit(zygotes, pids, codes, stop_at)
            if exited is None:  # the grace period or the timeout ran out
                self._signal(pids, codes, signal.SIGKILL)
                while len(codes) < nproc:
                    rank, code = self._next_exit(zygotes, pids, codes, time.monotonic() + 60) or (None, None)
                    if rank is None:
                        raise RuntimeError(f"ranks of {argv[0]} survived SIGKILL: {pids}")
                    codes[rank] = code
                if stop_at >= deadline:
                    raise TimeoutError(f"{' '.join(argv)} did not end in {timeout:.0f} s")
                break
            rank, code = exited
            codes[rank] = code
            if code != 0 and stop_at == deadline:
                self._signal(pids, codes, signal.SIGTERM)
                stop_at = min(deadline, time.monotonic() + GRACE_S)
        return [codes[rank] for rank in range(nproc)]

    @staticmethod
    def exit_code(codes: list[int]) -> int:
        """The launch's exit code from its ranks' (in rank order): the lowest rank's own failing status, else the
        lowest rank's signal (negative), else 0. A rank ended by a signal was mostly ended by someone else (this
        launcher's SIGTERM after another rank failed, a watchdog's SIGKILL of a stalled peer): the status of a rank
        that exited by itself is the one that says why."""
        return next((code for code in codes if code > 0), next((code for code in codes if code), 0))

    def run_one(self, argv: list[str], env: dict[str, str], run_env: dict[str, str], timeout: float,
                cwd: Path | None = None, forks: bool = True) -> subprocess.CompletedProcess:
        """``python argv...`` as one plain process (no launcher variables), its exit code, stdout and stderr as
        ``subprocess.run(capture_output=True, text=True)`` gives them (``subprocess.TimeoutExpired`` past
        ``timeout``). ``run_env``: variables the program reads only after its imports (they are not the zygote's);
        ``cwd``: where it runs (default: the launcher's folder); ``forks=False``: what it starts with
        ``sys.executable`` starts fresh (a test of that start itself)."""
        out, err = self.logs("code" if argv[0] == "-c" else Path(argv[1] if argv[0] == "-m" else argv[0]).stem, 2)
        zygote = self._zygotes(1, env)[0]
        pid = self._start(zygote, {"argv": argv, "cwd": str(cwd or self.cwd), "log": str(out), "err": str(err),
                                   "env": {**env, **run_env},
                                   "forks": self.forks(tuple(run_env)) if forks else None})
        exited = self._next_exit([zygote], [pid], {}, time.monotonic() + timeout)
        if exited is None:
            self._signal([pid], {}, signal.SIGKILL)
            self._next_exit([zygote], [pid], {}, time.monotonic() + 60)
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        return subprocess.CompletedProcess([sys.executable, *argv], exited[1], out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def _next_exit(self, zygotes: list[Zygote], pids: list[int], done: dict[int, int],
                   until: float) -> tuple[int, int] | None:
        """(rank, exit code) of the next rank to end (``pids[rank]``, forked by ``zygotes[rank]``), or None at
        ``until``."""
        def ended() -> tuple[int, int] | None:
            for rank, (zygote, pid) in enumerate(zip(zygotes, pids)):
                if rank not in done and pid in zygote.exits:
                    return rank, zygote.exits.pop(pid)
            return None

        return self._await(zygotes, ended, until)

    @staticmethod
    def _signal(pids: list[int], done: dict[int, int], sig: signal.Signals) -> None:
        for rank, pid in enumerate(pids):
            if rank not in done:
                try:
                    os.killpg(pid, sig)  # the rank's session: its own children too
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with self._growing:
            for zygote in self.zygotes:
                zygote.close()
            self.zygotes = []


def run(kind: str, target: str) -> None:
    """Run the script (``path``), module (``module``) or code (``code``) as ``python`` does: in a new module
    ``__main__``, which stays in ``sys.modules`` after it ends, so that the shutdown clears it first and in order
    (runpy.run_path's module is dropped when the script ends, and what its globals hold is then freed by the cyclic
    GC in any order: a file the script left open can be closed under its unflushed text). ``dont_inherit``: the
    script's code is compiled without this file's ``from __future__ import annotations``."""
    import builtins
    import runpy
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    if kind == "module":  # what `python -m` calls: the module's code in the __main__ module's globals
        runpy._run_module_as_main(target, alter_argv=True)
    elif kind == "code":
        exec(compile(target, "<string>", "exec", dont_inherit=True), main.__dict__)
    else:
        main.__file__, main.__cached__ = target, None
        with open(target, "rb") as f:
            source = f.read()
        exec(compile(source, target, "exec", dont_inherit=True), main.__dict__)


def clear_main() -> None:
    """What the interpreter's shutdown does to ``__main__``'s globals: names starting with one underscore set to
    None first, then the others (``__builtins__`` kept), so that the script's objects are freed in that order."""
    globals_ = sys.modules["__main__"].__dict__
    for first in (True, False):
        for name in list(globals_):
            if name != "__builtins__" and (not first or (name.startswith("_") and not name.startswith("__"))):
                globals_[name] = None


def run_and_exit(kind: str, target: str) -> None:
    """Run the script, then end as the interpreter's shutdown begins: its exit status (``sys.exit``'s code, 1 and
    the traceback for an uncaught exception), the non-daemon threads joined, the exit handlers run, the script's
    globals cleared (its open files flushed and closed); then ``os._exit``, without the teardown of every other
    module. That teardown releases every object the zygote imported, and each release writes to a page the child
    shares with the zygote: it copies ~350 MB, 0.5 s of CPU per rank (0.06 s without), a fifth of a short rank's
    cost. A launch whose subject is the exit itself asks for the full shutdown (``Launcher.run(full_exit=True)``)."""
    import atexit
    import threading

    code = 0
    try:
        run(kind, target)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (printed as the interpreter prints an uncaught exception)
        sys.excepthook(*sys.exc_info())
        code = 130 if sys.exc_info()[0] is KeyboardInterrupt else 1
    try:
        threading._shutdown()  # as the interpreter's shutdown does first: wait for the non-daemon threads
        atexit._run_exitfuncs()
        clear_main()
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    _request = zygote_main()
    if _request is not None:  # a rank: from here on, the script as `python -u` runs it
        _kind, _target = become(_request)
        _full_exit = _request.get("full_exit", True)
        del _request
        if _full_exit:
            run(_kind, _target)
        else:
            run_and_exit(_kind, _target)
