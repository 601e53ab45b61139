"""Prefix reservations, the scheduler's book of them and the manager's rules the stand-in follows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvoffload.connector.scheduler_state import PrefixReservations

STANDIN = str(Path(__file__).resolve().parents[2] / "standin")
if STANDIN not in sys.path:
    sys.path.insert(0, STANDIN)


def test_a_reservation_closes_once_every_range_of_it_was_released() -> None:
    """TensorRT-LLM's trim releases [16, 32) and [64, 96) of [16, 96), then [32, 64) after the load."""
    book = PrefixReservations()
    book.open(7, 3, 16, 96)
    assert book.request_of(7) == 3
    assert book.release(7, 16, 32) is False
    assert book.release(7, 64, 96) is False
    assert book.release(7, 32, 64) is True
    assert book.request_of(7) is None
    assert book.release(7, 32, 64) is None, "a closed reservation is unknown"


def test_the_shipped_connector_opts_into_reservations_and_a_partial_set_is_refused() -> None:
    from tensorrt_llm._torch.pyexecutor.connectors import kv_cache_connector as upstream

    from kvoffload import contract

    module = __import__(contract.CONNECTOR_MODULE, fromlist=["_"])
    worker = getattr(module, contract.CONNECTOR_WORKER_CLASS)
    scheduler = getattr(module, contract.CONNECTOR_SCHEDULER_CLASS)
    assert upstream.prefix_reservations_enabled(worker, scheduler)
    assert not upstream.prefix_reservations_enabled(upstream.KvCacheConnectorWorker, upstream.KvCacheConnectorScheduler)
    with pytest.raises(ValueError, match="prefix reservations require"):
        upstream.prefix_reservations_enabled(upstream.KvCacheConnectorWorker, scheduler)


@pytest.mark.parametrize("answer", [(-1, False), (True, False), (0, True), (32, 1), (32,)])
def test_the_manager_rejects_an_invalid_reservation_answer(answer: object) -> None:
    """Upstream's own cases (``test_invalid_reservation_answer_is_rejected``), plus a wrong arity."""
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import check_reservation_answer

    with pytest.raises(ValueError):
        check_reservation_answer(answer)
    assert check_reservation_answer((32, False)) == (32, False)
