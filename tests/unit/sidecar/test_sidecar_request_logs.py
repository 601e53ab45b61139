"""The guarded server's log: LMCache's per-request INFO lines left out, every other line kept."""

from __future__ import annotations

import logging

import pytest

from kvoffload.lmcache_guard.request_logs import PER_REQUEST_LINES, PerRequestLines, quiet_per_request_lines


def record(logger: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(logger, level, __file__, 1, msg, args, None)


@pytest.fixture
def clean_loggers() -> object:
    yield
    for name in PER_REQUEST_LINES:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, PerRequestLines)]:
            logger.removeFilter(f)


def test_lmcaches_per_request_info_lines_are_left_out_and_its_other_lines_kept(clean_loggers: object) -> None:
    quiet_per_request_lines({})
    quiet_per_request_lines({})  # idempotent
    transfer = logging.getLogger("lmcache.v1.multiprocess.modules.engine_driven_transfer")
    storage = logging.getLogger("lmcache.v1.distributed.storage_manager")
    assert sum(isinstance(f, PerRequestLines) for f in transfer.filters) == 1
    name = transfer.name
    assert not transfer.filter(record(name, logging.INFO, "Retrieved %d tokens in %.3f seconds", 1024, 0.001))
    assert not transfer.filter(record(name, logging.INFO, "Stored %d tokens in %.3f seconds", 1024, 0.001))
    assert not storage.filter(record(storage.name, logging.INFO, "Prefetch request completed (L1+L2): %d", 4))
    assert transfer.filter(record(name, logging.INFO, "Unregistered non-CUDA context for instance ID %d", 7))
    assert transfer.filter(record(name, logging.WARNING, "Retrieved %d tokens in %.3f seconds", 1, 0.1))
    assert storage.filter(record(storage.name, logging.INFO, "Added L2 adapter %d (%s)", 0, "fs"))


def test_lmcache_log_level_debug_keeps_every_line(clean_loggers: object) -> None:
    quiet_per_request_lines({"LMCACHE_LOG_LEVEL": "debug"})
    transfer = logging.getLogger("lmcache.v1.multiprocess.modules.engine_driven_transfer")
    assert transfer.filter(record(transfer.name, logging.INFO, "Retrieved %d tokens in %.3f seconds", 1, 0.1))
