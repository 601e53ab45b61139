"""A webhook that accepts connections and never answers (its endpoint Ready, the apiserver's traffic
dropped: a NetworkPolicy slip) costs nothing to workloads that are not kvoffload's (issue 46, item 3).

The chart's registration points at a listener that accepts and never speaks; the apiserver waits
out ``timeoutSeconds`` on every call it makes there. Which writes it calls for is counted by the
listener: before, every Deployment and StatefulSet write in the cluster.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, trtllm_deployment
from kvoffload import contract as c
from tests.support.operator_support import register_webhook_as_the_chart_does

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


class SilentListener:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte; counts them."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.socket.getsockname()[1])
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._held.append(conn)

    def count(self) -> int:
        with self._lock:
            return self.accepted

    def close(self) -> None:
        self.socket.close()
        with self._lock:
            for conn in self._held:
                conn.close()


@pytest.fixture
def silent_webhook(cluster: LocalCluster) -> Iterator[SilentListener]:
    listener = SilentListener()
    register_webhook_as_the_chart_does(cluster, listener.port)
    try:
        yield listener
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", c.WEBHOOK_CONFIGURATION_NAME, check=False)
        listener.close()


def test_a_silent_webhook_is_never_called_for_workloads_that_are_not_kvoffloads(
    cluster: LocalCluster, namespace: str, silent_webhook: SilentListener
) -> None:
    plain = trtllm_deployment("plain", namespace, replicas=0)
    apply(cluster, plain)
    plain["spec"]["replicas"] = 2
    apply(cluster, plain)
    cluster.kubectl("annotate", "deployment", "plain", "-n", namespace, "team=serving")
    assert silent_webhook.count() == 0, "a write of a workload without kvoffload's marks went to the webhook"

    apply(cluster, trtllm_deployment("opted-in", namespace, replicas=0, annotations={c.ANN_ENABLED: "true"}))
    assert silent_webhook.count() >= 1, "an opted-in workload's write never reached the webhook"
    called = silent_webhook.count()
    cluster.kubectl("annotate", "deployment", "opted-in", "-n", namespace, f"{c.ANN_ENABLED}-")
    assert silent_webhook.count() > called, "opting out (the mark only on the object before the write) was not sent"
