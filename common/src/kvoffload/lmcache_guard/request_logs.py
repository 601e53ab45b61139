"""LMCache's per-request INFO lines, left out of a guarded server's log (``quiet_per_request_lines``).

LMCache 0.5.6 logs a line at INFO for every hit's prefetch (``Prefetch request completed``), every
store's COMMIT (``Stored %d tokens``) and every retrieve's COMMIT (``Retrieved %d tokens``), on the
thread that answers the request, through a stream handler and OpenTelemetry's: a line per request in
the pod's log and time on a hit's lookup (docs/results/cpu-lookup/secured-lookup.md). The server's
other INFO lines (start, registrations, shutdown) stay. ``LMCACHE_LOG_LEVEL=DEBUG`` keeps them all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

PER_REQUEST_LINES: Mapping[str, tuple[str, ...]] = {
    "lmcache.v1.distributed.storage_manager": ("Prefetch request completed",),
    "lmcache.v1.multiprocess.modules.engine_driven_transfer": ("Stored %d tokens in", "Retrieved %d tokens in"),
}
"""Logger name → the message templates of its per-request INFO lines."""


class PerRequestLines(logging.Filter):
    """Drops INFO records whose message template starts with one of ``templates``."""

    def __init__(self, templates: tuple[str, ...]) -> None:
        super().__init__()
        self.templates = templates

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno == logging.INFO and isinstance(record.msg, str) and record.msg.startswith(self.templates)
        )


def quiet_per_request_lines(env: Mapping[str, str] = os.environ) -> None:
    """Leave LMCache's per-request INFO lines out of this process's log, unless ``LMCACHE_LOG_LEVEL``
    is ``DEBUG``. Idempotent."""
    if env.get("LMCACHE_LOG_LEVEL", "").upper() == "DEBUG":
        return
    for name, templates in PER_REQUEST_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, PerRequestLines) for f in logger.filters):
            logger.addFilter(PerRequestLines(templates))
