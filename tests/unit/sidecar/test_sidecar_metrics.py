"""The pod's /metrics pieces: LMCache filtering, in-flight work, dead-writer cleanup, own series."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from kvoffload import contract
from kvoffload.multiproc import clean_dead_writers, writer_pids
from kvoffload.sidecar.metrics import (
    ServerTransferState,
    SidecarMetricsState,
    filter_lmcache_families,
    inflight_work,
    render_pod_metrics,
    transfer_state,
)

pytestmark = pytest.mark.sidecar

LMCACHE_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 8257.0
process_open_fds 32.0
target_info{service_instance_id="try"} 1.0
# HELP lmcache_mp_l1_usage_ratio L1 usage
# TYPE lmcache_mp_l1_usage_ratio gauge
lmcache_mp_l1_usage_ratio{backend="dram",l1_tag="_default"} 0.25
# HELP lmcache_mp_num_submitted_stores_total stores
# TYPE lmcache_mp_num_submitted_stores_total counter
lmcache_mp_num_submitted_stores_total 5.0
# HELP lmcache_mp_num_finished_stores_total stores
# TYPE lmcache_mp_num_finished_stores_total counter
lmcache_mp_num_finished_stores_total 3.0
# HELP lmcache_mp_num_inflight_l2_stores pending
# TYPE lmcache_mp_num_inflight_l2_stores gauge
lmcache_mp_num_inflight_l2_stores{l2_name="fs"} 4.0
"""


def test_only_lmcache_mp_families_pass() -> None:
    out = filter_lmcache_families(LMCACHE_TEXT)
    assert "python_gc" not in out and "process_open_fds" not in out and "target_info" not in out
    assert 'lmcache_mp_l1_usage_ratio{backend="dram",l1_tag="_default"} 0.25' in out
    assert "# TYPE lmcache_mp_l1_usage_ratio gauge" in out
    assert filter_lmcache_families("") == ""


def test_inflight_work_counts_unfinished_requests_and_l2_transfers() -> None:
    assert inflight_work(LMCACHE_TEXT) == 2 + 4
    assert inflight_work("lmcache_mp_l1_usage_ratio 0.0\n") == 0
    assert inflight_work("not { prometheus") == 0


def test_writer_pids_from_file_names() -> None:
    names = ["counter_12.db", "gauge_livesum_12.db", "histogram_7.db", "live_12.lock", "live_99.lock", "x.txt"]
    assert writer_pids(names) == ({12, 7}, {12, 99})


def _touch(d: Path, name: str) -> None:
    (d / name).write_bytes(b"")


def test_dead_writer_loses_live_gauges_keeps_counters_and_live_writer_is_untouched(tmp_path: Path) -> None:
    for pid in (101, 202, 303):
        _touch(tmp_path, f"counter_{pid}.db")
        _touch(tmp_path, f"gauge_livesum_{pid}.db")
        _touch(tmp_path, f"gauge_all_{pid}.db")
    _touch(tmp_path, contract.METRICS_LIVE_LOCK_TEMPLATE.format(pid=101))  # dead: lock file, nobody holds it
    _touch(tmp_path, contract.METRICS_LIVE_LOCK_TEMPLATE.format(pid=202))  # alive: lock held below
    # 303 has no lock file: never treated as dead.
    held = os.open(tmp_path / contract.METRICS_LIVE_LOCK_TEMPLATE.format(pid=202), os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert clean_dead_writers(str(tmp_path)) == [101]
    finally:
        os.close(held)
    left = set(os.listdir(tmp_path))
    assert "gauge_livesum_101.db" not in left
    assert {"counter_101.db", "gauge_all_101.db", "gauge_livesum_202.db", "gauge_livesum_303.db"} <= left
    assert clean_dead_writers(str(tmp_path / "missing")) == []


def test_render_has_own_series_and_lmcache_series(tmp_path: Path) -> None:
    state = SidecarMetricsState(server_restarts=3, server_up=True, config={"eviction_policy": "LRU"})
    body = render_pod_metrics(lambda: state, str(tmp_path), LMCACHE_TEXT).decode()
    assert f"{contract.M_SIDECAR_SERVER_RESTARTS}_total 3.0" in body
    assert f"{contract.M_SIDECAR_SERVER_UP} 1.0" in body
    assert f'{contract.M_SIDECAR_CONFIG_INFO}_info{{eviction_policy="LRU"}} 1.0' in body
    assert "lmcache_mp_l1_usage_ratio" in body and "python_gc" not in body
    without = render_pod_metrics(lambda: state, None, None).decode()
    assert "lmcache_mp_" not in without and contract.M_SIDECAR_SERVER_UP in without


STATUS = {
    "active_prefetch_jobs": 2,
    "storage_manager": {"l1_manager": {"read_locked_count": 8, "write_locked_count": 3, "memory_used_bytes": 1}},
}


def test_the_servers_locks_reservations_and_prefetch_jobs_are_read_from_its_status_page() -> None:
    assert transfer_state(json.dumps(STATUS).encode()) == ServerTransferState(8, 3, 2)
    assert transfer_state(b"{}") is None and transfer_state(b"not json") is None


def test_render_shows_the_servers_locks_only_when_its_status_answered(tmp_path: Path) -> None:
    answered = SidecarMetricsState(3, True, {}, ServerTransferState(8, 3, 2))
    body = render_pod_metrics(lambda: answered, None, None).decode()
    assert f"{contract.M_SIDECAR_SERVER_READ_LOCKED_CHUNKS} 8.0" in body
    assert f"{contract.M_SIDECAR_SERVER_RESERVED_CHUNKS} 3.0" in body
    assert f"{contract.M_SIDECAR_SERVER_PREFETCH_JOBS} 2.0" in body
    silent = render_pod_metrics(lambda: SidecarMetricsState(3, True, {}), None, None).decode()
    assert contract.M_SIDECAR_SERVER_READ_LOCKED_CHUNKS not in silent
