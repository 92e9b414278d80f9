"""Free TCP ports for a rendezvous store, chosen where no other program's connection can take them.

``bind(("", 0))`` asks the kernel for a free port from its ephemeral range (``net.ipv4.ip_local_port_range``), the
range every outgoing connection's local port also comes from. Between that check and the store's ``listen``, any
process connecting anywhere (a gloo process group opens a connection per peer) can be given the same port, and the
rendezvous fails with ``EADDRINUSE``. A port below the ephemeral range is only ever taken by a program that listens
on it, which :func:`free_port` checks.
"""

from __future__ import annotations

import errno
import random
import socket
from typing import Optional

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_EPHEMERAL = range(32768, 61000)  # the kernel's default, where the file cannot be read
SPAN = 2768  # ports below the ephemeral range free_port picks from by default (30000-32767 with Linux's default)

_next: dict[tuple[int, int], int] = {}


def ephemeral_ports() -> range:
    """The kernel's ephemeral port range (outgoing connections' local ports)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            low, high = (int(word) for word in f.read().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL
    return range(low, high + 1)


def port_taken(port: int, host: str = "") -> bool:
    """Whether a program on this machine already listens on ``port``, so that the rendezvous store cannot."""
    with socket.socket() as probe:
        # bound as torchrun's store binds (address reuse): a finished run's connections in TIME_WAIT do not count
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def free_port(host: str = "", within: Optional[range] = None) -> int:
    """A port nothing on ``host`` listens on, from ``within`` (default: the ``SPAN`` ports right below the ephemeral
    range), tried in turn from a random start, so that successive calls in a process give different ports and two
    processes rarely try the same one."""
    if within is None:
        low = ephemeral_ports().start
        within = range(max(1024, low - SPAN), low)
    if not within:  # an ephemeral range that starts at the bottom: nothing lies below it
        with socket.socket() as probe:
            probe.bind((host, 0))
            return probe.getsockname()[1]
    key = (within.start, within.stop)
    start = _next[key] if key in _next else random.randrange(len(within))
    for i in range(len(within)):
        port = within[(start + i) % len(within)]
        if not port_taken(port, host):
            _next[key] = (start + i + 1) % len(within)
            return port
    raise RuntimeError(f"every port from {within.start} to {within.stop - 1} is in use: free some, or pass a port")
