"""Trimming a sized filesystem L2 tier before a server start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.sidecar.command import build_server_command, l2_adapter_specs
from kvoffload.sidecar.l2fs import CacheFile, plan_trim, trim_before_start
from kvoffload.sidecar.settings import FsTier, load_settings

pytestmark = pytest.mark.sidecar
MI = 2**20


def test_nothing_to_trim_under_half_the_size() -> None:
    plan = plan_trim([CacheFile("a.data", 2 * MI, 1.0)], 10 * MI)
    assert plan.delete == () and plan.kept_bytes == 2 * MI and plan.capacity_bytes == 8 * MI


def test_oldest_files_go_first_until_half_is_left() -> None:
    files = [
        CacheFile("new.data", 3 * MI, 30.0),
        CacheFile("old.data", 3 * MI, 10.0),
        CacheFile("mid.data", 3 * MI, 20.0),
    ]
    plan = plan_trim(files, 10 * MI)
    assert plan.delete == ("old.data", "mid.data")
    assert (plan.kept_bytes, plan.capacity_bytes) == (3 * MI, 7 * MI)


@given(st.lists(st.tuples(st.integers(0, 10 * MI), st.floats(0, 1e9)), max_size=30), st.integers(1, 100 * MI))
def test_old_files_plus_lmcache_capacity_never_exceed_the_size(entries: list[tuple[int, float]], size: int) -> None:
    files = [CacheFile(f"f{i}.data", s, t) for i, (s, t) in enumerate(entries)]
    plan = plan_trim(files, size)
    assert plan.kept_bytes <= size // 2
    assert plan.kept_bytes + plan.capacity_bytes == size
    kept = [f for f in files if f.name not in plan.delete]
    assert sum(f.size for f in kept) == plan.kept_bytes
    if plan.delete and kept:  # whatever stays is never older than what went
        assert min(f.mtime for f in kept) >= max(f.mtime for f in files if f.name in plan.delete)


def test_trim_before_start_deletes_only_old_data_files(tmp_path: Path) -> None:
    for i, name in enumerate(["a.data", "b.data", "c.data"]):
        (tmp_path / name).write_bytes(b"x" * MI)
        os.utime(tmp_path / name, (100 + i, 100 + i))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "notes.txt").write_bytes(b"x" * MI)
    capacity = trim_before_start(str(tmp_path), 4 * MI)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.data", "c.data", "notes.txt", "tmp"]
    assert capacity == 2 * MI
    assert trim_before_start(str(tmp_path / "absent"), 4 * MI) == 4 * MI


def test_capacity_reaches_the_fs_native_spec() -> None:
    s = load_settings({"KVOFFLOAD_L2_FS_PATH": "/l2", "KVOFFLOAD_L2_FS_SIZE": "1Gi"}, None)
    assert s.l2_fs == FsTier("/l2", 2**30)
    assert l2_adapter_specs(s, fs_capacity_bytes=2**29)[0]["max_capacity_gb"] == 0.5
    argv = build_server_command(s, {}, None, fs_capacity_bytes=2**28).argv
    assert '"max_capacity_gb": 0.25' in argv[argv.index("--l2-adapter") + 1]
