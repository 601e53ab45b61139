"""The secured lookup's wire and its server side's hashing: a request and an answer survive the trip,
a malformed one is refused naming what is wrong, and the prompt hashed once gives exactly LMCache's
chunk hashes (the keys a store filed the chunks under)."""

from __future__ import annotations

import json
import random
from array import array
from typing import Any

import pytest
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from kvoffload import secured_lookup as wire
from kvoffload.connector import planning
from kvoffload.lmcache_guard.secured_lookups import SERVER_MODULE_ARGS, PromptHashes, blake3_chain, with_secured_lookups

FIELDS = {
    "model_name": "m",
    "world_size": 2,
    "worker_id": None,
    "request_id": "s",
    "cache_salt": "",
    "num_kv_readers": 1,
}


def request(**changes: Any) -> wire.SecuredLookupRequest:
    values: dict[str, Any] = {
        "lookup_key": FIELDS,
        "rank_keys": (dict(FIELDS, worker_id=0), dict(FIELDS, worker_id=1)),
        "token_ids": (0, 1, 150_000, (1 << 32) - 1),
        "start": 256, "cap": 1024, "instance_id": 7, "wait_s": 2.0, "budget_s": 1.5, "give_back_s": 4.0,
    }  # fmt: skip
    return wire.SecuredLookupRequest(**{**values, **changes})


def test_a_request_survives_the_trip_with_its_tokens_as_uint32() -> None:
    sent = request()
    decoded, tokens = wire.decode_request(wire.encode_request(sent))
    assert tuple(tokens) == sent.token_ids
    assert decoded == request(token_ids=())


def test_a_token_id_outside_uint32_is_refused_when_encoding() -> None:
    with pytest.raises(OverflowError):
        wire.encode_request(request(token_ids=(1 << 32,)))


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        (b"no header", "no header line"),
        (b"[1]\n", "header: expected an object"),
        (b'{"ranks": []}\n', "ranks"),
        (wire.encode_request(request()).replace(b'"start":256', b'"start":-1'), "start"),
        (wire.encode_request(request()).replace(b'"wait_s":2.0', b'"wait_s":"2"'), "wait_s"),
        (wire.encode_request(request()).replace(b'"cache_salt":""', b'"salt":""', 1), "lookup"),
        (wire.encode_request(request()) + b"\x00", "multiple of 4"),
    ],
)
def test_a_malformed_request_is_refused_naming_what_is_wrong(payload: bytes, names: str) -> None:
    with pytest.raises(wire.SecuredLookupError, match=names):
        wire.decode_request(payload)


def test_an_answer_survives_the_trip_with_each_ranks_slots() -> None:
    rank0 = (
        wire.SlotDescription(0, 4096, (2, 4, 8, 16), "bfloat16"),
        wire.SlotDescription(4096, 4096, (2, 4, 8, 16), "bfloat16"),
    )
    rank1 = (wire.SlotDescription(8192, 2048, (2, 4, 8, 8), "float16"),)
    for answer in (
        wire.SecuredLookupAnswer(hit=512, end=512, slots=(rank0, rank1), prepare_s=0.25, server_s=0.5),
        wire.SecuredLookupAnswer(hit=512, end=512, slots=(rank0, None)),
        wire.SecuredLookupAnswer(hit=None),
        wire.SecuredLookupAnswer(hit=256, end=256, held=True),
        wire.SecuredLookupAnswer(hit=256, end=256, given_back=True),
    ):
        assert wire.decode_answer(wire.encode_answer(answer)) == answer


def test_an_answer_from_a_server_that_does_not_say_its_time_reads_as_zero() -> None:
    body = json.loads(wire.encode_answer(wire.SecuredLookupAnswer(hit=256, end=256, held=True, server_s=0.5)))
    del body["server_s"]
    assert wire.decode_answer(json.dumps(body).encode()) == wire.SecuredLookupAnswer(hit=256, end=256, held=True)


def test_a_malformed_answer_is_refused() -> None:
    with pytest.raises(wire.SecuredLookupError, match="answer"):
        wire.decode_answer(b'{"hit": 1, "end": 1, "slots": [[[0, 1, 3]]], "layouts": []}')


def test_the_prompt_hashed_once_gives_lmcaches_chunk_hashes() -> None:
    hasher = TokenHasher(chunk_size=16)
    chain = blake3_chain(hasher)
    assert chain is not None, "LMCache's default hasher is blake3"
    prompt = [random.randrange(200_000) for _ in range(16 * 9 + 5)]
    assert chain(array("I", prompt), 9) == hasher.compute_chunk_hashes(prompt)
    assert chain(array("I", prompt), 4) == hasher.compute_chunk_hashes(prompt, end=64)


def test_a_hasher_that_is_not_blake3_is_left_to_lmcache() -> None:
    assert blake3_chain(TokenHasher(chunk_size=16, hash_algorithm="builtin")) is None


def test_lookups_on_the_secured_lookups_thread_get_its_hashes_and_others_lmcaches() -> None:
    hasher = TokenHasher(chunk_size=16)
    chain = blake3_chain(hasher)
    assert chain is not None
    prompt = [random.randrange(200_000) for _ in range(16 * 6)]
    hints = PromptHashes(hasher)
    hints.hashed(len(prompt), [b"marked-%d" % i for i in range(6)])
    answered = hints.compute_chunk_hashes(list(prompt), start=32, end=80)
    assert answered == [b"marked-2", b"marked-3", b"marked-4"], "its own prompt: the hashes it was given"
    other = prompt[:-16]
    assert hints.compute_chunk_hashes(other) == hasher.compute_chunk_hashes(other), "another prompt: LMCache's"
    hints.hashed(len(prompt), chain(array("I", prompt), 6))
    for start, end in ((0, None), (0, 96), (16, 48), (48, 50), (0, 15)):
        assert hints.compute_chunk_hashes(prompt, start=start, end=end) == hasher.compute_chunk_hashes(
            prompt, start=start, end=end
        ), (start, end)
    hints.hashed(0, None)
    assert hints.chunk_size == 16


@pytest.mark.parametrize("block", [16, 32, 64])
def test_a_secured_range_for_any_hit_is_the_range_decide_load_retrieves(block: int) -> None:
    chunk = 256
    for prompt in (1, 255, 256, 257, 1000, 1024, 1025, 4096):
        for computed in range(0, prompt, 37):
            start, cap = planning.retrieve_bounds(prompt, computed, block, chunk)
            for hit in range(0, prompt // chunk * chunk + 1, chunk):  # a hit never passes the lookup's end
                decision = planning.decide_load(prompt, computed, hit, block, chunk)
                if decision.loads:
                    assert (decision.retrieve_start, decision.retrieve_end) == (start, min(hit, cap)), (
                        prompt,
                        computed,
                        hit,
                    )


def test_the_servers_arguments_load_secured_lookups_once() -> None:
    plain = ["server", "--port", "1"]
    loaded = with_secured_lookups(plain)
    assert loaded == [*plain, *SERVER_MODULE_ARGS] and plain == ["server", "--port", "1"]
    assert with_secured_lookups(loaded) == loaded


def test_a_server_without_the_lmcache_modules_it_runs_refuses_to_load_it() -> None:
    from types import SimpleNamespace

    from kvoffload.lmcache_guard import LMCacheVersionError
    from kvoffload.lmcache_guard.secured_lookups import build_server_modules

    build = SimpleNamespace(modules=(), server_context=SimpleNamespace())
    with pytest.raises(LMCacheVersionError, match="EngineDrivenTransferModule"):
        build_server_modules(build)
