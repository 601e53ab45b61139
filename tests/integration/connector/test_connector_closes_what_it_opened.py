"""A closed connector gives back the descriptors it opened: an engine process that builds and closes
its backends (a test session builds hundreds) does not run out of them, nor past 1024 (``select``)."""

from __future__ import annotations

import os

import pytest

from tests.support.direct_backend import backend_pair
from tests.support.lmcache_server import LMCacheServer

pytestmark = pytest.mark.connector

ENV = {"KVOFFLOAD_HEARTBEAT_INTERVAL_MS": "600000"}


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_closing_a_worker_and_a_scheduler_leaves_no_descriptor_behind(lmcache_server: LMCacheServer) -> None:
    """Each backend's zmq context (its epoll and eventfds, about ten descriptors a pair) goes with its
    ``close``, not whenever the garbage collector gets to it: eight pairs built, closed and still
    referenced cost less than one descriptor each (the first pair starts process-wide pools)."""
    closed = list(backend_pair(lmcache_server, "closes-model-0", ENV, 8))
    for backend in closed:
        backend.close()
    after_first = _open_descriptors()
    for i in range(1, 9):
        pair = backend_pair(lmcache_server, f"closes-model-{i}", ENV, 8)
        for backend in pair:
            backend.close()
        closed.extend(pair)
    assert _open_descriptors() - after_first < 8, "descriptors left behind by closed backends"
