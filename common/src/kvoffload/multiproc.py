"""prometheus_client multiprocess files shared by the writers (connector processes) and the one
process that serves them (the sidecar, or without one, a connector process).

Liveness follows the contract's ``METRICS_LIVE_LOCK_TEMPLATE``: a writer holds an exclusive
``flock`` on ``live_<pid>.lock`` for its whole life (``hold_liveness_lock``); the kernel drops it
when the process dies, so the server can remove a dead writer's live-gauge files
(``clean_dead_writers``) even from another container's PID namespace. Counters and histograms of
dead writers stay: they are part of the pod's totals.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from kvoffload import contract

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_DB_FILE = re.compile(r"^[a-z_]+_(?P<pid>[0-9]+)\.db$")
_LOCK_FILE = re.compile(
    "^" + re.escape(contract.METRICS_LIVE_LOCK_TEMPLATE).replace(r"\{pid\}", "(?P<pid>[0-9]+)") + "$"
)
_HELD: dict[str, int] = {}


def writer_pids(filenames: Iterable[str]) -> tuple[set[int], set[int]]:
    """PIDs that have multiprocess ``.db`` files, and PIDs that have a liveness lock file."""
    with_files: set[int] = set()
    with_locks: set[int] = set()
    for name in filenames:
        if match := _DB_FILE.match(name):
            with_files.add(int(match["pid"]))
        elif match := _LOCK_FILE.match(name):
            with_locks.add(int(match["pid"]))
    return with_files, with_locks


def clean_dead_writers(directory: str) -> list[int]:
    """Remove live-gauge files of writers whose liveness lock is free; returns their PIDs."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    with_files, with_locks = writer_pids(names)
    cleaned: list[int] = []
    for pid in sorted(with_files & with_locks):
        lock_path = os.path.join(directory, contract.METRICS_LIVE_LOCK_TEMPLATE.format(pid=pid))
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # held: the writer is alive
            if any(n.startswith("gauge_live") and n.endswith(f"_{pid}.db") for n in names):
                mark_process_dead(pid, directory)
                cleaned.append(pid)
                log.info("event=metrics_writer_dead pid=%d action=removed_live_gauges", pid)
        finally:
            os.close(fd)  # releases our flock
    return cleaned


def hold_liveness_lock(directory: str) -> bool:
    """Take this process's liveness lock in ``directory`` (once; held until the process exits)."""
    if directory in _HELD:
        return True
    path = os.path.join(directory, contract.METRICS_LIVE_LOCK_TEMPLATE.format(pid=os.getpid()))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        log.warning("event=metrics_liveness_lock_failed path=%s error=%s", path, exc)
        return False
    _HELD[directory] = fd
    return True


def render_multiprocess(directory: str) -> bytes:
    """Every writer's series in ``directory`` (dead writers' live gauges removed first)."""
    registry = CollectorRegistry(auto_describe=False)
    if os.path.isdir(directory):
        clean_dead_writers(directory)
        MultiProcessCollector(registry, path=directory)
    return generate_latest(registry)
