"""Fixtures of the sidecar integration tests (defined in ``sidecar_harness``)."""

from tests.support.sidecar_harness import make_sidecar, redis_server

__all__ = ["make_sidecar", "redis_server"]
