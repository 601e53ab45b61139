"""The operator's periodic work, on one thread beside kopf's event handlers: retries whose backoff
elapsed, the policies' status, edited options ConfigMaps, node caches and pod alignment (a missed
event must not strand a cache pod or an uninjected pod), and the full resync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvoffload.operator.control.reconcile import Reconciler

log = logging.getLogger("kvoffload.operator")
POLICY_STATUS_INTERVAL_S = 2.0
NODE_CACHE_RECHECK_S = 30.0


def start_background(reconciler: Reconciler, resync_seconds: float, align: Callable[[], object] | None
                     ) -> threading.Event:  # fmt: skip
    """Start the loop on a daemon thread; setting the returned event stops it. ``align`` evicts pods
    created without the injection (admission mode; None in template mode)."""
    stop = threading.Event()
    threading.Thread(target=_loop, args=(reconciler, resync_seconds, align, stop), name="kvoffload-background",
                     daemon=True).start()  # fmt: skip
    return stop


def _loop(reconciler: Reconciler, resync_seconds: float, align: Callable[[], object] | None,
          stop: threading.Event) -> None:  # fmt: skip
    elapsed = 0.0
    since_node_check = 0.0
    while not stop.wait(POLICY_STATUS_INTERVAL_S):
        try:
            reconciler.run_due_retries()
        except Exception:
            log.exception("retries failed")
        reconciler.policies.flush_status()
        try:
            reconciler.check_options_sources()
        except Exception:
            log.exception("options ConfigMap check failed")
        since_node_check += POLICY_STATUS_INTERVAL_S
        if since_node_check >= NODE_CACHE_RECHECK_S:  # a missed pod event must not strand a cache pod
            since_node_check = 0.0
            try:
                reconciler.policies.recheck_node_caches()
            except Exception:
                log.exception("node cache recheck failed")
            if align is not None:  # backed-off evictions are due, or a pod event was missed
                try:
                    align()
                except Exception:
                    log.exception("aligning pods created without the injection failed")
        elapsed += POLICY_STATUS_INTERVAL_S
        if resync_seconds and elapsed >= resync_seconds:
            elapsed = 0.0
            try:
                reconciler.resync()
            except Exception:
                log.exception("resync failed")
