"""Deferred COMMITs: a lookup waits for the stores on its own chain, a session's end for its own COMMITs."""

from __future__ import annotations

import threading
import time

from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

from kvoffload.connector.backends.commits import DeferredCommit, PendingCommits, chain_of

CHUNK = 4


def _key(session: str, tokens: tuple[int, ...], salt: str = "") -> IPCCacheServerKey:
    return IPCCacheServerKey(
        model_name="m", world_size=1, worker_id=0, token_ids=tokens, start=0, end=len(tokens),
        request_id=session, cache_salt=salt, num_kv_readers=1,
    )  # fmt: skip


def _store(session: str, tokens: tuple[int, ...], salt: str = "") -> DeferredCommit:
    key = _key(session, tokens, salt)
    return DeferredCommit("store", None, key, chain_of(key, CHUNK))


def _retrieve(session: str, tokens: tuple[int, ...]) -> DeferredCommit:
    return DeferredCommit("retrieve", None, _key(session, tokens))


PROMPT_A = (1, 2, 3, 4, 5, 6, 7, 8)
PROMPT_B = (9, 9, 9, 9, 5, 6, 7, 8)


def test_waiting_returns_at_once_when_nothing_is_pending() -> None:
    pending = PendingCommits()
    assert pending.wait_idle(0.0)
    assert pending.wait_chain(chain_of(_key("s", PROMPT_A), CHUNK), 0.0)
    assert pending.wait_session("s", 0.0)


def test_waiting_ends_when_the_last_commit_is_answered() -> None:
    pending = PendingCommits()
    first, second = _store("a", PROMPT_A), _store("a2", (*PROMPT_A, 1, 1, 1, 1))
    pending.add(first)
    pending.add(second)
    chain = chain_of(_key("lookup", PROMPT_A[:6]), CHUNK)
    assert not pending.wait_chain(chain, 0.05)
    answered = threading.Timer(0.05, pending.done, args=(second,))
    pending.done(first)
    assert not pending.wait_chain(chain, 0.0), "one store on the chain is still pending"
    answered.start()
    started = time.monotonic()
    assert pending.wait_chain(chain, 5.0)
    assert pending.wait_idle(0.0)
    assert time.monotonic() - started < 4.0


def test_a_lookup_does_not_wait_for_other_chains_or_for_retrieve_commits() -> None:
    pending = PendingCommits()
    pending.add(_store("a", PROMPT_A))
    pending.add(_store("a-salted", PROMPT_B, salt="tenant-2"))  # same tokens as B, another salt
    pending.add(_retrieve("b-load", PROMPT_B))
    assert pending.wait_chain(chain_of(_key("lookup", PROMPT_B), CHUNK), 0.0)
    assert not pending.wait_chain(chain_of(_key("lookup", PROMPT_B, salt="tenant-2"), CHUNK), 0.0)
    assert not pending.wait_idle(0.0)


def test_a_session_waits_only_for_its_own_commits() -> None:
    pending = PendingCommits()
    load = _retrieve("b", PROMPT_B)
    pending.add(_store("a", PROMPT_A))
    pending.add(load)
    assert pending.wait_session("c", 0.0)
    assert not pending.wait_session("b", 0.0)
    pending.done(load)
    assert pending.wait_session("b", 0.0)
    assert not pending.wait_session("a", 0.0)


def test_waiting_gives_up_after_its_timeout() -> None:
    pending = PendingCommits()
    pending.add(_store("a", PROMPT_A))
    started = time.monotonic()
    assert not pending.wait_session("a", 0.1)
    assert 0.09 <= time.monotonic() - started < 2.0
