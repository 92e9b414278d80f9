"""Several hosts on one machine: Linux network namespaces, each with its own network stack, address and hostname,
joined by a bridge, for trying and testing multi-node runs where traffic really crosses a network interface.

Host ``i`` is the namespace ``<name>-h<i>`` with one interface, ``eth0``, at ``10.<net>.0.<i+1>/24``, cabled (a veth
pair) to a port of a bridge that lives in a namespace of its own (``<name>-sw``, the switch), so nothing is added to
the machine's own network: a program in a host reaches the other hosts' addresses and nothing else. Programs run in
a host under a hostname of their own (``host<i>``, a UTS namespace; every host's name resolves to its address) and
with process ids of their own (a pid namespace), as on separate machines; they share the file system, as nodes share
a network volume.

Faults and links: :meth:`Hosts.isolate` takes a host's cable out (a partition: no traffic to or from it) and
:meth:`Hosts.reconnect` puts it back; :meth:`Hosts.shape` limits the rate of what a host sends (``tc tbf``) and
delays and drops its frames (a forwarder in the switch, :func:`hub`, in place of the bridge); :meth:`Hosts.kill`
SIGKILLs every process of a host; :meth:`Hosts.sent_bytes` reads the interface's own counter.

Everything it creates is removed on exit, also after an error or a signal (SIGTERM, SIGINT); namespaces left by an
earlier run that was killed outright (SIGKILL) are removed before it creates its own, and a run whose hosts of the
same name are in use is refused. It needs root (``ip netns``).

From the command line, one command per host, ``{rank}``, ``{main}`` (host 0's address) and ``{hosts}`` filled in::

    python tools/hosts.py --hosts 2 -- disttrain run --num-nodes {hosts} --node-rank {rank} --main-address {main} \\
        --accelerator cpu --devices 1 --strategy disttrain_fsdp recipes/demo/tiny_llama.py --max-steps 20
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Optional

IFNAME = "eth0"  # each host's interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name it
# The environment docs/multi-node.md prescribes for a node: the interface collectives use.
LINK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


class HostsError(RuntimeError):
    """The hosts cannot be built here (no root, no ``ip``) or a command of the harness failed."""


def _ip(*args: str, namespace: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", namespace] if namespace else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def _tc(namespace: str, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HostsError(f"`tc {' '.join(args)}` in {namespace} failed: {proc.stderr.strip()}")


def namespaces() -> list[str]:
    """Every named network namespace on the machine."""
    proc = _ip("-j", "netns", "list", check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        return []
    return [entry["name"] for entry in json.loads(proc.stdout)]


def _pids(namespace: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def remove(name: str) -> list[str]:
    """Remove the namespaces of the harness ``name`` (hosts and switch) and end their processes; returns the
    namespaces removed. Their veth pairs and qdiscs go with them."""
    mine = [ns for ns in namespaces() if ns == f"{name}-sw" or ns.startswith(f"{name}-h")]
    for ns in mine:
        for pid in _pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)
    return mine


class Hosts:
    """``count`` hosts on a private link (see the module docstring). A context manager::

        with Hosts(2) as hosts:
            procs = [hosts.popen(i, ["python", "train.py"]) for i in range(2)]
    """

    def __init__(self, count: int, name: str = "dthost", net: int = 213) -> None:
        if count < 1:
            raise ValueError(f"count={count}: a harness needs at least one host")
        if not 0 < net < 255:
            raise ValueError(f"net={net} is not an octet: the hosts get 10.<net>.0.<i+1>")
        self.count, self.name = count, name
        self.addresses = [f"10.{net}.0.{i + 1}" for i in range(count)]
        self.switch = f"{name}-sw"
        self.procs: list[subprocess.Popen] = []
        self._previous: dict[int, object] = {}
        self._impairments = [(0.0, 0.0, 0.0)] * count  # per host: delay ms, jitter ms, loss % of what it sends
        self._hub: Optional[subprocess.Popen] = None
        self._lock: Optional[IO[str]] = None
        # the hosts' /etc/hosts: every host's name and address (each host sees it in place of the machine's)
        self._names = os.path.join(tempfile.gettempdir(), f"disttrain-hosts-{name}.hosts")

    def host(self, i: int) -> str:
        """The namespace of host ``i``."""
        if not 0 <= i < self.count:
            raise ValueError(f"host {i} does not exist: the harness has hosts 0..{self.count - 1}")
        return f"{self.name}-h{i}"

    @property
    def main(self) -> str:
        """Host 0's address: the rendezvous address (``--main-address`` / ``MASTER_ADDR``)."""
        return self.addresses[0]

    # -- building and removing ---------------------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise HostsError("the host harness needs root and iproute2's `ip` (network namespaces)")
        # One harness per name at a time: a lock the kernel drops when its holder dies, so namespaces of this name
        # whose lock is free are an earlier, killed run's leftovers, and one that is held belongs to a live run.
        self._lock = open(os.path.join(tempfile.gettempdir(), f"disttrain-hosts-{self.name}.lock"), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise HostsError(f"hosts named {self.name!r} are in use by another run on this machine; wait for it or"
                             " pass another name") from None
        remove(self.name)  # what an earlier, killed run left behind
        with open(self._names, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} host{i}\n" for i, a in enumerate(self.addresses)))
        for sig in (signal.SIGTERM, signal.SIGINT):  # removed also when the harness is stopped
            if threading.current_thread() is threading.main_thread():
                self._previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
        _ip("link", "set", "br0", "up", namespace=self.switch)
        for i in range(self.count):
            ns = self.host(i)
            _ip("netns", "add", ns)
            # the cable: eth0 in the host, port p<i> on the switch
            _ip("link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("link", "set", f"p{i}", "master", "br0", "up", namespace=self.switch)
            _ip("addr", "add", f"{self.addresses[i]}/24", "dev", IFNAME, namespace=ns)
            _ip("link", "set", IFNAME, "up", namespace=ns)
            _ip("link", "set", "lo", "up", namespace=ns)
        self._wait_for_links()

    def _wait_for_links(self, timeout: float = 10.0) -> None:
        """Until every switch port forwards (a bridge port may listen a moment after it comes up)."""
        deadline = time.monotonic() + timeout
        for i in range(self.count):
            while True:
                info = json.loads(_ip("-j", "-d", "link", "show", f"p{i}", namespace=self.switch).stdout)[0]
                if info.get("linkinfo", {}).get("info_slave_data", {}).get("state") == "forwarding":
                    break
                if time.monotonic() > deadline:
                    raise HostsError(f"the switch port of host {i} does not forward after {timeout:g} s")
                time.sleep(0.05)

    def _on_signal(self, sig: int, frame: object) -> None:
        self.close()
        previous = self._previous.get(sig)
        if callable(previous):
            previous(sig, frame)
        raise SystemExit(128 + sig)

    def close(self) -> None:
        """End every process the hosts run and remove the namespaces (idempotent)."""
        for proc in [*self.procs, *([self._hub] if self._hub is not None else [])]:
            if proc.poll() is None:
                proc.kill()
        self._hub = None
        remove(self.name)
        if self._lock is not None and os.path.exists(self._names):
            os.remove(self._names)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous = {}
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running ---------------------------------------------------------------------------------------------
    def env(self, i: int, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """The environment of a process of host ``i``: ``base`` (default: this process's) with :meth:`variables`."""
        return {**(os.environ if base is None else base), **self.variables(i)}

    def variables(self, i: int) -> dict[str, str]:
        """What a process of host ``i`` finds in its environment besides its own: the interface collectives use
        (``GLOO_SOCKET_IFNAME``, ...), the rendezvous address and the node rank."""
        self.host(i)
        return {**{key: IFNAME for key in LINK_ENV}, "MASTER_ADDR": self.main, "NODE_RANK": str(i)}

    def placement(self, i: int) -> dict[str, str]:
        """What :func:`enter` needs to make a running process one of host ``i``'s (JSON: it may travel to the process
        that calls it)."""
        return {"namespace": self.host(i), "hostname": f"host{i}", "names": self._names}

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on host ``i``: in its network namespace, under its own hostname ``host<i>``, which resolves to
        its address as the other hosts' names do (its own ``/etc/hosts``, in a mount namespace: torchrun's c10d
        rendezvous looks its hostname up), and with process ids of its own (a pid namespace, its own ``/proc``), so
        that no host mistakes another's processes for its own (they share the boot id); it ends with the harness's
        process that started it."""
        return ["ip", "netns", "exec", self.host(i), "unshare", "--uts", "--pid", "--fork", "--mount-proc",
                "--kill-child", "sh", "-c", f'hostname host{i} && mount --bind {self._names} /etc/hosts && exec "$@"',
                "sh", *argv]

    def popen(self, i: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (its environment: :meth:`env` of ``env``); ended by :meth:`close`."""
        proc = subprocess.Popen(self.command(i, argv), env=self.env(i, env), start_new_session=True,
                                **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    # -- links and faults --------------------------------------------------------------------------------------
    def isolate(self, i: int) -> None:
        """Take host ``i``'s cable out: nothing it sends arrives and nothing reaches it (a partition)."""
        self.host(i)
        _ip("link", "set", f"p{i}", "down", namespace=self.switch)

    def reconnect(self, i: int) -> None:
        self.host(i)
        _ip("link", "set", f"p{i}", "up", namespace=self.switch)

    def shape(self, i: int, delay_ms: float = 0, jitter_ms: float = 0, loss_percent: float = 0,
              rate_mbit: float = 0) -> None:
        """What host ``i`` sends is limited to ``rate_mbit`` (a token bucket on its interface, ``tc tbf``), delayed by
        ``delay_ms`` +- ``jitter_ms`` (uniform) and dropped with probability ``loss_percent`` (the switch: see
        :func:`hub`). Replaces host ``i``'s earlier shape; all zero removes it."""
        ns = self.host(i)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFNAME, "root"], capture_output=True)
        if rate_mbit:
            _tc(ns, "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb",
                "latency", "1s")
        self._impairments[i] = (float(delay_ms), float(jitter_ms), float(loss_percent))
        self._rewire()

    def _rewire(self) -> None:
        """The bridge while no link is delayed or lossy, else :func:`hub` forwarding between the switch ports."""
        if self._hub is not None:
            self._hub.kill()
            self._hub.wait()
            self._hub = None
        impaired = any(any(x) for x in self._impairments)
        for i in range(self.count):
            _ip("link", "set", f"p{i}", *(["nomaster"] if impaired else ["master", "br0"]), namespace=self.switch)
        if not impaired:
            self._wait_for_links()
        else:
            spec = json.dumps({"ports": [f"p{i}" for i in range(self.count)], "impairments": self._impairments})
            self._hub = subprocess.Popen(["ip", "netns", "exec", self.switch, sys.executable, os.path.abspath(__file__),
                                          "--hub", spec], stdout=subprocess.PIPE, text=True)
            if self._hub.stdout is None or self._hub.stdout.readline().strip() != "ready":
                raise HostsError("the switch's forwarder did not start (it needs AF_PACKET sockets: root)")

    def pids(self, i: int) -> list[int]:
        """The processes running on host ``i``."""
        return _pids(self.host(i))

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process running on host ``i`` (the whole host fails); returns their pids."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def sent_bytes(self, i: int) -> int:
        """Bytes host ``i``'s interface has sent (its kernel counter, IP headers included)."""
        proc = _ip("-j", "-s", "link", "show", IFNAME, namespace=self.host(i))
        return int(json.loads(proc.stdout)[0]["stats64"]["tx"]["bytes"])


# Linux's flags for unshare/setns and mount (sched.h, sys/mount.h); Python 3.11's os module has neither call.
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x04000000, 0x40000000, 0x20000000
MS_BIND, MS_REC, MS_SLAVE, MNT_DETACH = 0x1000, 0x4000, 0x80000, 2
# What a host's processes have of their own (Hosts.command); they share the rest (users, IPC, cgroups) with the
# machine.
HOST_NAMESPACES = {"net": CLONE_NEWNET, "uts": CLONE_NEWUTS, "mnt": CLONE_NEWNS, "pid": CLONE_NEWPID}


def join(pid: int) -> None:
    """Make this process one of the host where process ``pid`` runs (a pid as this process sees it): its network,
    hostname and mounts (its ``/etc/hosts``, ``/sys`` and ``/proc``), and its process ids for the children this
    process starts from now on (a process keeps its own pid namespace: the child of the next fork is the host's
    process). The working folder is the host's root afterwards. The process must have one thread (a mount
    namespace is refused to a threaded one)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fds = {name: os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name in HOST_NAMESPACES}  # before /proc moves
    try:
        for name, fd in fds.items():
            if libc.setns(fd, HOST_NAMESPACES[name]) != 0:
                errno = ctypes.get_errno()
                raise HostsError(f"joining the {name} namespace of process {pid} failed: {os.strerror(errno)}")
    finally:
        for fd in fds.values():
            os.close(fd)


def enter(namespace: str, hostname: str, names: str) -> None:
    """Make this process one of a host's (the arguments: :meth:`Hosts.placement`), as :meth:`Hosts.command` starts a
    new one: its network namespace, a UTS namespace under the host's name, and a mount namespace where ``/etc/hosts``
    is the hosts' file and ``/sys`` shows the host's own interfaces (what ``ip netns exec`` mounts). For a process
    that is already running, such as the fork of one that has imported its libraries; it keeps the machine's pid
    namespace. The process must have one thread (a mount namespace of its own is refused to a threaded one)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise HostsError(f"{what} failed for host {hostname} ({namespace}): {os.strerror(errno)}")

    fd = os.open(os.path.join("/run/netns", namespace), os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "joining the network namespace")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWUTS | CLONE_NEWNS), "unshare")
    socket.sethostname(hostname)
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "making the mounts private")
    libc.umount2(b"/sys", MNT_DETACH)  # the machine's sysfs, whose net/ is the machine's network namespace
    check(libc.mount(namespace.encode(), b"/sys", b"sysfs", 0, None), "mounting /sys")
    check(libc.mount(names.encode(), b"/etc/hosts", None, MS_BIND, None), "binding /etc/hosts")


def hub(ports: Sequence[str], impairments: Sequence[Sequence[float]], seed: int = 0) -> None:
    """The switch when a link is delayed or lossy (run in the switch namespace; never returns): every frame that
    arrives on port ``i`` is dropped with probability ``impairments[i][2]`` percent, else sent out of every other
    port ``impairments[i][0] +- impairments[i][1]`` ms later (uniform jitter: frames may overtake each other). A hub,
    not a learning switch: each host's interface ignores frames for other addresses.

    Userspace, because ``tc netem`` is a kernel module that many kernels (containers, CI machines) do not have. The
    frames are read and written with their virtio-net header (``PACKET_VNET_HDR``), so the large segments the
    interfaces hand over (TSO/GSO) go out whole and the kernel cuts them as a wire would."""
    import heapq
    import random
    import select
    import socket

    eth_p_all, sol_packet, packet_vnet_hdr = 0x0003, 263, 15
    sockets = []
    for port in ports:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(eth_p_all))
        sock.setsockopt(sol_packet, packet_vnet_hdr, 1)
        sock.bind((port, 0))
        sock.setblocking(False)
        sockets.append(sock)
    rng = random.Random(seed)
    queue: list[tuple[float, int, int, bytes]] = []  # (when, order, out port, frame)
    order = 0
    print("ready", flush=True)
    while True:
        wait = max(0.0, queue[0][0] - time.monotonic()) if queue else None
        readable, _, _ = select.select(sockets, [], [], wait)
        for sock in readable:
            i = sockets.index(sock)
            delay, jitter, loss = impairments[i]
            while True:
                try:
                    frame, address = sock.recvfrom(1 << 17)
                except (BlockingIOError, OSError):
                    break
                if address[2] == socket.PACKET_OUTGOING or (loss and rng.random() * 100 < loss):
                    continue  # what this forwarder sent out of the port, or a lost frame
                when = time.monotonic() + max(0.0, delay + rng.uniform(-jitter, jitter)) / 1000
                for j in range(len(sockets)):
                    if j != i:
                        heapq.heappush(queue, (when, order, j, frame))
                        order += 1
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, j, frame = heapq.heappop(queue)
            try:
                sockets[j].send(frame)
            except OSError:  # the port is down (a pulled cable): the frame is lost
                pass


@contextmanager
def hosts(count: int, name: str = "dthost", net: int = 213) -> Iterator[Hosts]:
    with Hosts(count, name, net) as made:
        yield made


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command on each of N hosts made of network namespaces on this machine (needs root);"
                    " {rank}, {main} and {hosts} in the command are replaced by the host's rank, host 0's address"
                    " and N. Removes the hosts afterwards.")
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument("--delay-ms", type=float, default=0, help="delay on what every host sends")
    parser.add_argument("--jitter-ms", type=float, default=0, help="+- this much on each frame's delay")
    parser.add_argument("--loss", type=float, default=0, help="percent of packets every host's link drops")
    parser.add_argument("--rate-mbit", type=float, default=0, help="every host's sending rate limit, Mbit/s")
    parser.add_argument("--hub", default=None, help=argparse.SUPPRESS)  # the switch's forwarder (see hub())
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ... run on every host")
    args = parser.parse_args(argv)
    if args.hub is not None:
        spec = json.loads(args.hub)
        hub(spec["ports"], spec["impairments"])
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run on every host after --")
    try:
        with Hosts(args.hosts) as made:
            for i in range(made.count):
                made.shape(i, args.delay_ms, args.jitter_ms, args.loss, args.rate_mbit)
            fill = {"main": made.main, "hosts": str(made.count)}
            procs = [made.popen(i, [part.format(rank=i, **fill) for part in command]) for i in range(made.count)]
            codes = [proc.wait() for proc in procs]
            for i in range(made.count):
                print(f"host {i} ({made.addresses[i]}): exit {codes[i]}, sent {made.sent_bytes(i) / 1e6:.1f} MB")
    except HostsError as e:
        print(f"hosts: {e}", file=sys.stderr)
        return 2
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
