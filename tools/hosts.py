"""Several hosts on one machine: Linux network namespaces, each with its own network stack, address and hostname,
joined by a bridge, for trying and testing multi-node runs where traffic really crosses a network interface.

Host ``i`` is the namespace ``<name>-h<i>`` with one interface, ``eth0``, at ``10.<net>.0.<i+1>/24``, cabled (a veth
pair) to a port of a bridge that lives in a namespace of its own (``<name>-sw``, the switch), so nothing is added to
the machine's own network: a program in a host reaches the other hosts' addresses and nothing else. Programs run in
a host under a hostname of their own (``host<i>``, a UTS namespace) and with process ids of their own (a pid
namespace), as on separate machines; they share the file system, as nodes share a network volume.

Faults and links: :meth:`Hosts.isolate` takes a host's cable out (a partition: no traffic to or from it) and
:meth:`Hosts.reconnect` puts it back; :meth:`Hosts.shape` limits the rate of what a host sends (``tc tbf``) and
adds delay, jitter and loss where the kernel has ``tc netem``; :meth:`Hosts.kill` SIGKILLs every process of a host;
:meth:`Hosts.sent_bytes` reads the interface's own counter.

Everything it creates is removed on exit, also after an error or a signal (SIGTERM, SIGINT); namespaces left by an
earlier run that was killed outright (SIGKILL) are removed before it creates its own. It needs root (``ip netns``).

From the command line, one command per host, ``{rank}``, ``{main}`` (host 0's address) and ``{hosts}`` filled in::

    python tools/hosts.py --hosts 2 -- disttrain run --num-nodes {hosts} --node-rank {rank} --main-address {main} \\
        --accelerator cpu --devices 1 --strategy disttrain_fsdp recipes/demo/tiny_llama.py --max-steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Optional

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
        remove(self.name)  # what an earlier, killed run left behind
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
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        remove(self.name)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous = {}

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running ---------------------------------------------------------------------------------------------
    def env(self, i: int, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """The environment of a process of host ``i``: ``base`` (default: this process's) with the interface
        collectives use (``GLOO_SOCKET_IFNAME``, ...), the rendezvous address and the node rank."""
        env = dict(os.environ if base is None else base)
        env.update({key: IFNAME for key in LINK_ENV})
        env.update(MASTER_ADDR=self.main, NODE_RANK=str(i))
        return env

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on host ``i``: in its network namespace, under its own hostname ``host<i>`` and with process
        ids of its own (a pid namespace, its own ``/proc``), so that no host mistakes another's processes for its
        own (they share the boot id); it ends with the harness's process that started it."""
        return ["ip", "netns", "exec", self.host(i), "unshare", "--uts", "--pid", "--fork", "--mount-proc",
                "--kill-child", "sh", "-c", f'hostname host{i} && exec "$@"', "sh", *argv]

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
        """What host ``i`` sends is limited to ``rate_mbit`` (a token bucket, ``tc tbf``), and delayed (``delay_ms``
        +- ``jitter_ms``) and dropped (``loss_percent``) by ``tc netem`` where the kernel has it. Replaces an earlier
        shape; all zero removes it."""
        ns = self.host(i)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFNAME, "root"], capture_output=True)
        netem = []
        if delay_ms or jitter_ms:
            netem += ["delay", f"{delay_ms}ms", *([f"{jitter_ms}ms"] if jitter_ms else [])]
        if loss_percent:
            netem += ["loss", f"{loss_percent}%"]
        if netem:
            if rate_mbit:
                netem += ["rate", f"{rate_mbit}mbit"]
            try:  # a queue with room for what a rate holds back (netem's default of 1000 packets drops it)
                _tc(ns, "qdisc", "add", "dev", IFNAME, "root", "netem", *netem, "limit", "100000")
            except HostsError as e:
                if "unknown" not in str(e):
                    raise
                raise HostsError("this kernel has no netem queueing discipline (sch_netem): delay and loss cannot"
                                 " be added to the link here; a rate limit alone works (tbf)") from e
        elif rate_mbit:
            _tc(ns, "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb",
                "latency", "1s")

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process running on host ``i`` (the whole host fails); returns their pids."""
        pids = _pids(self.host(i))
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
    parser.add_argument("--loss", type=float, default=0, help="percent of packets every host's link drops")
    parser.add_argument("--rate-mbit", type=float, default=0, help="every host's sending rate limit, Mbit/s")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ... run on every host")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run on every host after --")
    try:
        with Hosts(args.hosts) as made:
            for i in range(made.count):
                made.shape(i, args.delay_ms, loss_percent=args.loss, rate_mbit=args.rate_mbit)
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
