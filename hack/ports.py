"""TCP ports for the local processes that tests, the demo and benchmarks start.

A port from ``bind(("127.0.0.1", 0))`` is free only until the socket closes: the kernel may hand
the same port to the next ``bind(0)`` (a second ``free_port()`` call, or another process) or to an
outgoing connection as its source port, all from the ephemeral range. An operator given two such
ports as ``--metrics-port`` and ``--health-port`` got the same one twice and died with
``Address already in use`` (a CI run). So ports come from below the kernel's ephemeral range,
where neither ``bind(0)`` nor ``connect()`` ever picks, and one process never hands out a port
twice.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
"""Below this sit well-known services (etcd's 2379, the apiserver's 6443, ...)."""


def ephemeral_range(path: Path = _EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for ``bind(0)`` and outgoing connections (Linux's default where unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = (int(x) for x in path.read_text().split())
        return low, high
    return 32768, 60999


def port_pool(ephemeral: tuple[int, int]) -> range:
    """Ports to hand out: those between ``_LOWEST`` and the ephemeral range, or, where that range
    starts lower, those above it."""
    low, high = ephemeral
    if low - _LOWEST >= 2048:
        return range(_LOWEST, low)
    return range(high + 1, 65536)


class PortAllocator:
    """Hands out ports from ``pool`` that were free when handed out and never the same one twice."""

    def __init__(self, pool: range, seed: int | None = None) -> None:
        self._pool = pool
        # A random start per process (seed None: from the OS): processes allocating at once rarely
        # walk the same ports.
        self._next = random.Random(seed).randrange(len(pool))
        self._handed_out: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            for _ in range(len(self._pool)):
                port = self._pool[self._next % len(self._pool)]
                self._next += 1
                if port not in self._handed_out and is_free(port):
                    self._handed_out.add(port)
                    return port
        raise RuntimeError(f"no free TCP port left in {self._pool.start}-{self._pool.stop - 1}")


def is_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every address now (a TIME_WAIT counts as taken)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


_ALLOCATOR = PortAllocator(port_pool(ephemeral_range()))


def free_port() -> int:
    """A TCP port free on every address now, outside the ephemeral range, new to this process."""
    return _ALLOCATOR.take()
