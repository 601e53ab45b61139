"""A node cache's CURVE keys: what the operator writes into a policy's Secret, and what the cache
server and the connector read back from the files it is mounted as.

Why CURVE: LMCache's request port is ZeroMQ, and ZeroMQ's CURVE mechanism (Curve25519 keys,
encrypted and authenticated per connection) is checked by libzmq before a single request frame
reaches LMCache. The node cache server knows its own secret key and accepts exactly one client
public key, the policy's; only pods the operator injects for that policy mount the client's secret.

Keys travel as Z85 text (40 characters for 32 bytes), which ZeroMQ's socket options take as is.
Standard library only: the operator encodes, the sidecar and the connector read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvoffload import contract

KEY_BYTES = 32
Z85_KEY_LENGTH = 40
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_INDEX = {ch: i for i, ch in enumerate(_Z85)}


class CacheKeysError(ValueError):
    """A key file is missing or not a Z85-encoded 32-byte key; the message names the file."""


def z85_encode(raw: bytes) -> str:
    """ZeroMQ's Z85 text of ``raw`` (its length a multiple of 4)."""
    if len(raw) % 4:
        raise ValueError(f"Z85 encodes whole 4-byte words, got {len(raw)} bytes")
    out: list[str] = []
    for i in range(0, len(raw), 4):
        value = int.from_bytes(raw[i : i + 4], "big")
        word = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            word.append(_Z85[digit])
        out.extend(reversed(word))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    """The bytes of Z85 ``text``; ``ValueError`` for a length not a multiple of 5 or a foreign character."""
    if len(text) % 5:
        raise ValueError(f"Z85 text comes in 5-character words, got {len(text)} characters")
    out = bytearray()
    for i in range(0, len(text), 5):
        value = 0
        for ch in text[i : i + 5]:
            if ch not in _Z85_INDEX:
                raise ValueError(f"{ch!r} is not a Z85 character")
            value = value * 85 + _Z85_INDEX[ch]
        if value >= 2**32:
            raise ValueError(f"{text[i : i + 5]!r} is not a Z85 word")
        out += value.to_bytes(4, "big")
    return bytes(out)


@dataclass(frozen=True)
class ServerKeys:
    """What the node cache server holds: its keypair and the one client key it accepts."""

    public: str
    secret: str
    allowed_clients: frozenset[str]


@dataclass(frozen=True)
class ClientKeys:
    """What a policy's engine holds: its keypair and the server key it expects to meet."""

    public: str
    secret: str
    server_public: str


def _read_key(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except FileNotFoundError:
        raise CacheKeysError(
            f"{contract.ENV_CACHE_KEYS_DIR}: {path} is missing; the directory must hold the policy's "
            f"{name} (the operator mounts its Secret there)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CacheKeysError(f"{contract.ENV_CACHE_KEYS_DIR}: {path} cannot be read as text ({exc})") from None
    try:
        if len(text) != Z85_KEY_LENGTH or len(z85_decode(text)) != KEY_BYTES:
            raise ValueError(f"{len(text)} characters")
    except ValueError as exc:
        raise CacheKeysError(
            f"{contract.ENV_CACHE_KEYS_DIR}: {path} is not a CURVE key ({exc}); it must hold "
            f"{Z85_KEY_LENGTH} Z85 characters (32 bytes)"
        ) from None
    return text


def read_server_keys(directory: str) -> ServerKeys:
    """The node cache server's keys from ``directory``; ``CacheKeysError`` naming the bad file."""
    return ServerKeys(
        public=_read_key(directory, contract.CACHE_KEY_SERVER_PUBLIC),
        secret=_read_key(directory, contract.CACHE_KEY_SERVER_SECRET),
        allowed_clients=frozenset({_read_key(directory, contract.CACHE_KEY_CLIENT_PUBLIC)}),
    )


def read_client_keys(directory: str) -> ClientKeys:
    """An engine's keys from ``directory``; ``CacheKeysError`` naming the bad file."""
    return ClientKeys(
        public=_read_key(directory, contract.CACHE_KEY_CLIENT_PUBLIC),
        secret=_read_key(directory, contract.CACHE_KEY_CLIENT_SECRET),
        server_public=_read_key(directory, contract.CACHE_KEY_SERVER_PUBLIC),
    )
