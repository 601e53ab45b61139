"""The decoder the sidecar puts in LMCache's server in place of ``pickle.loads``: tensor payloads load,
nothing else runs (``test_tensor_payload`` pins the decoder itself)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload import lmcache_guard
from kvoffload.lmcache_guard import LMCacheVersionError, retrieve_slots, transfer_guard, unpickling
from kvoffload.lmcache_guard.unpickling import restricted_loads

pytestmark = pytest.mark.sidecar


class _Calls:
    """Pickles as a call of ``func(*args)``."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int8])
def test_pickled_tensor_lists_load_as_lmcache_sends_them(dtype: torch.dtype) -> None:
    """Every KV dtype plain pickle round-trips (float8 too: ``test_tensor_payload``)."""
    base = torch.arange(48).reshape(4, 12).to(dtype)
    chunks = [base, base[1:3], base.t(), base.reshape(-1)[5:]]
    loaded = restricted_loads(pickle.dumps(chunks))
    assert len(loaded) == len(chunks)
    for got, sent in zip(loaded, chunks, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got.float(), sent.float())


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda marker: [_Calls(os.system, f"touch {marker}")], id="os.system"),
        pytest.param(lambda marker: _Calls(eval, f"open({str(marker)!r}, 'w')"), id="builtins.eval"),
        pytest.param(lambda marker: _Calls(Path.touch, Path(marker)), id="pathlib"),
    ],
)
def test_a_payload_that_would_run_code_is_refused_before_it_runs(payload: Any, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    data = pickle.dumps(payload(marker))
    with pytest.raises(pickle.UnpicklingError, match="refused a pickled global"):
        restricted_loads(data)
    assert not marker.exists()


def test_code_hidden_in_a_tensor_storage_is_refused(tmp_path: Path) -> None:
    """torch's own storage hook reads its bytes with a full unpickler; ours reads a storage record
    with no names but the storage types."""
    marker = tmp_path / "ran"
    inner = pickle.dumps(_Calls(os.system, f"touch {marker}"), protocol=2)
    buf = io.BytesIO()
    pickle.Pickler(buf).dump(_Calls(torch.storage._load_from_bytes, inner))
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(buf.getvalue())
    assert not marker.exists()


def test_an_lmcache_version_it_was_not_written_for_stops_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmcache_guard.importlib.metadata, "version", lambda _name: "0.5.7")
    with pytest.raises(LMCacheVersionError, match=r"LMCache 0\.5\.7 is installed.*0\.5\.6"):
        unpickling.install_restricted_unpickler()


def test_lmcache_server_unpickles_request_data_through_the_guard_once_installed() -> None:
    unpickling.install_restricted_unpickler()
    assert unpickling.unpickler_is_restricted()
    import lmcache.v1.multiprocess.modules.server_transfer as site

    assert site.pickle.loads is restricted_loads
    assert site.pickle.dumps is pickle.dumps


def test_an_lmcache_version_it_was_not_written_for_gets_no_transfer_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmcache_guard.importlib.metadata, "version", lambda _name: "0.5.7")
    with pytest.raises(LMCacheVersionError, match=r"LMCache 0\.5\.7 is installed"):
        transfer_guard.install_transfer_guard()


def test_the_transfer_guard_replaces_the_release_that_publishes_pending_reservations_once() -> None:
    from lmcache.v1.multiprocess.modules.engine_driven_transfer import EngineDrivenTransferModule

    transfer_guard.install_transfer_guard()
    release = EngineDrivenTransferModule._release_entry
    transfer_guard.install_transfer_guard()  # a second install (the in-process server's) changes nothing
    assert release.__module__ == transfer_guard.__name__, "LMCache's release is replaced by the guard's"
    assert EngineDrivenTransferModule._release_entry is release


def test_an_lmcache_version_it_was_not_written_for_keeps_its_own_retrieve_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lmcache_guard.importlib.metadata, "version", lambda _name: "0.5.7")
    with pytest.raises(LMCacheVersionError, match=r"LMCache 0\.5\.7 is installed"):
        retrieve_slots.install_retrieve_slots()


def test_the_sidecars_server_describes_retrieve_slots_from_metadata_once_guarded() -> None:
    from lmcache.v1.multiprocess.modules.server_transfer import ShmTransferStrategy

    from kvoffload.sidecar.lmcache_server import guard_server

    guard_server({})
    prepare = ShmTransferStrategy.prepare_retrieve
    retrieve_slots.install_retrieve_slots()  # a second install (the in-process server's) changes nothing
    assert prepare.__module__ == retrieve_slots.__name__, "LMCache's prepare_retrieve is replaced"
    assert ShmTransferStrategy.prepare_retrieve is prepare
