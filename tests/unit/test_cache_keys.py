"""The node cache's key files: ZeroMQ's own Z85 and keypairs read back; a bad file named in the error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

from kvoffload import contract as c
from kvoffload.cache_keys import CacheKeysError, read_client_keys, read_server_keys, z85_decode, z85_encode
from tests.support.cache_keys import policy_keys

pytestmark = [pytest.mark.operator, pytest.mark.sidecar, pytest.mark.connector]


def test_z85_is_zeromqs() -> None:
    for _ in range(50):
        raw = os.urandom(32)
        assert z85_encode(raw) == z85.encode(raw).decode() and z85_decode(z85_encode(raw)) == raw


def test_the_operators_keypairs_are_curve_keypairs(tmp_path: Path) -> None:
    server_dir, engine_dir = policy_keys(tmp_path, "llama")
    server, client = read_server_keys(str(server_dir)), read_client_keys(str(engine_dir))
    assert zmq.curve_public(server.secret.encode()).decode() == server.public == client.server_public
    assert zmq.curve_public(client.secret.encode()).decode() == client.public
    assert server.allowed_clients == {client.public}
    assert (
        not (server_dir / c.CACHE_KEY_CLIENT_SECRET).exists() and not (engine_dir / c.CACHE_KEY_SERVER_SECRET).exists()
    )


def test_a_missing_or_malformed_key_file_is_named(tmp_path: Path) -> None:
    server_dir, _ = policy_keys(tmp_path, "llama")
    (server_dir / c.CACHE_KEY_CLIENT_PUBLIC).write_text("not-a-key")
    with pytest.raises(CacheKeysError, match=r"client\.public is not a CURVE key"):
        read_server_keys(str(server_dir))
    (server_dir / c.CACHE_KEY_CLIENT_PUBLIC).unlink()
    with pytest.raises(CacheKeysError, match=rf"{c.ENV_CACHE_KEYS_DIR}: .*client\.public is missing"):
        read_server_keys(str(server_dir))
