"""The cache server's decoder of pickled chunk lists: what ``pickle.dumps`` of CPU tensors sends comes
back bit-exact; a payload that would change the server's functions, leave a storage unfilled or reach
outside its storage is refused with a line that says why, and nothing is built from it."""

from __future__ import annotations

import pickle
import pickletools
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.tensor_payload import (
    LEGACY_MAGIC_NUMBER,
    LEGACY_PROTOCOL_VERSION,
    TensorPayloadError,
    decode_tensor_list,
)
from tests.support.fuzz_strategies import FUZZ
from tests.support.hostile_payloads import poisoning_payload, unfilled_storage_payload, unfilled_storage_record

pytestmark = pytest.mark.sidecar

KV_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
             torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2]  # fmt: skip


def _same_bits(got: torch.Tensor, sent: torch.Tensor) -> bool:
    return (
        got.dtype == sent.dtype
        and got.shape == sent.shape
        and got.stride() == sent.stride()
        and torch.equal(got.contiguous().view(torch.uint8), sent.contiguous().view(torch.uint8))
    )


class _Calls:
    """Pickles as ``func(*args)``."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_chunk_lists_as_lmcache_pickles_them_come_back_bit_exact(dtype: torch.dtype) -> None:
    base = torch.randint(0, 255, (4, 12), dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else (
        torch.randn(4, 12).to(dtype))  # fmt: skip
    chunks = [base, base[1:3], base.t(), base.reshape(-1)[5:], base[:, ::3], torch.empty(0, 7, dtype=dtype)]
    got = decode_tensor_list(pickle.dumps(chunks))
    assert len(got) == len(chunks)
    assert all(_same_bits(g, s) for g, s in zip(got, chunks, strict=True))


def test_the_legacy_constants_are_torchs() -> None:
    assert LEGACY_MAGIC_NUMBER == torch.serialization.MAGIC_NUMBER
    assert LEGACY_PROTOCOL_VERSION == torch.serialization.PROTOCOL_VERSION


def test_a_build_on_the_rebuild_function_is_refused_and_later_payloads_decode_unchanged() -> None:
    """Issue 42 item 2: the 72-byte payload that set ``_rebuild_tensor_v2.__defaults__`` (negating
    every later tensor) reaches no function: refused, and the next client's chunks decode bit-exact."""
    payload = poisoning_payload()
    assert len(payload) == 72 and "BUILD" in {op.name for op, _, _ in pickletools.genops(payload)}
    defaults_before = torch._utils._rebuild_tensor_v2.__defaults__
    with pytest.raises(TensorPayloadError, match="refused a pickled tensor payload: opcode EMPTY_DICT at byte 36"):
        decode_tensor_list(payload)
    assert torch._utils._rebuild_tensor_v2.__defaults__ == defaults_before
    sent = [torch.randn(2, 3, 8)]
    assert _same_bits(decode_tensor_list(pickle.dumps(sent))[0], sent[0])


@pytest.mark.parametrize(
    ("opcodes", "refused"),
    [
        (b"\x80\x02]}b.", "opcode EMPTY_DICT"),  # BUILD state onto the list
        (b"\x80\x02]N\x86b.", "opcode BUILD"),
        (b"\x80\x02]K\x01K\x02s.", "opcode SETITEM"),
        (b"\x80\x02](u.", "opcode SETITEMS"),
        (b"\x80\x02c__builtin__\nlist\n)\x81.", "pickled global __builtin__.list"),
        (b"\x80\x02\x82\x01.", "opcode EXT1"),
        (b"\x80\x02]N\x94h\x00.", "leaves 3 values"),
        (b"\x80\x02]", "exhausted before seeing STOP"),
        (b"\x80\x02].extra", "5 bytes after the pickle's STOP"),
        (b"\x80\x02K\x01.", "a int, not a list of tensors"),
    ],
)
def test_opcodes_outside_a_list_of_tensors_are_refused_by_name(opcodes: bytes, refused: str) -> None:
    with pytest.raises(TensorPayloadError, match=refused):
        decode_tensor_list(opcodes)


def test_a_storage_its_payload_never_fills_is_refused() -> None:
    """Issue 42 item 3: torch's loader allocates such a storage and never writes it (stale heap)."""
    with pytest.raises(TensorPayloadError, match=r"data section lists \[\], not exactly its one storage '0'"):
        decode_tensor_list(unfilled_storage_payload([(2, 2, 256, 64)], torch.float16))


def _with_record(record: bytes, numel: int) -> bytes:
    class Storage:
        def __reduce__(self) -> tuple[Any, tuple[bytes]]:
            return torch.storage._load_from_bytes, (record,)

    return pickle.dumps([_Calls(torch._utils._rebuild_tensor_v2, Storage(), 0, (numel,), (1,), False, OrderedDict())])


def _filled_record(numel: int, data: bytes) -> bytes:
    """``unfilled_storage_record`` with its data section listing the storage, followed by ``data``."""
    head = unfilled_storage_record(numel, torch.float16)
    empty_list = pickle.dumps([], protocol=2)
    assert head.endswith(empty_list)
    return head[: -len(empty_list)] + pickle.dumps(["0"], protocol=2) + numel.to_bytes(8, "little") + data


@pytest.mark.parametrize(("carried", "why"), [(10, "needs 16 bytes; the payload carries 10"),
                                              (18, "needs 16 bytes; the payload carries 18")])  # fmt: skip
def test_a_storage_whose_bytes_are_not_exactly_its_size_is_refused(carried: int, why: str) -> None:
    with pytest.raises(TensorPayloadError, match=why):
        decode_tensor_list(_with_record(_filled_record(8, b"\x01" * carried), 8))


def test_a_storage_filled_byte_for_byte_holds_exactly_those_bytes() -> None:
    data = bytes(range(16))
    (got,) = decode_tensor_list(_with_record(_filled_record(8, data), 8))
    assert got.dtype == torch.float16 and got.view(torch.uint8).tolist() == list(data)


def test_a_huge_declared_storage_is_refused_before_anything_is_allocated() -> None:
    with pytest.raises(TensorPayloadError, match="needs 2000000000000 bytes; the payload carries 0"):
        decode_tensor_list(_with_record(_filled_record(10**12, b""), 4))


def _tensor_payload(offset: object, size: object, stride: object, *more: Any, requires_grad: object = False) -> bytes:
    with warnings.catch_warnings():  # TypedStorage is deprecated; it still pickles as a tensor's storage does
        warnings.simplefilter("ignore", UserWarning)
        typed = torch.arange(12, dtype=torch.float32).storage()
    return pickle.dumps([_Calls(torch._utils._rebuild_tensor_v2, typed, offset, size, stride, requires_grad,
                                OrderedDict(), *more)])  # fmt: skip


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        ((0, (13,), (1,)), "reach element 12 of a storage of 12"),
        ((0, (4, 4), (4, 1)), "reach element 15 of a storage of 12"),
        ((11, (2,), (1,)), "reach element 12"),
        ((-1, (2,), (1,)), "storage offset -1"),
        ((0, (2,), (-1,)), "non-negative ints"),
        ((0, (2, 2), (1,)), "not tuples of one length"),
        ((0, [2], [1]), "not tuples of one length"),
        ((13, (0,), (1,)), "offset 13 lies past its storage of 12"),
        ((0, (2,), (1,), None), r"tensor metadata \(neg/conj bits\) is not accepted"),
    ],
)
def test_a_tensor_reaching_outside_its_storage_or_carrying_metadata_is_refused(args: tuple[Any, ...],
                                                                               refused: str) -> None:  # fmt: skip
    with pytest.raises(TensorPayloadError, match=refused):
        decode_tensor_list(_tensor_payload(*args))


def test_a_tensor_pickled_with_its_negation_bit_is_refused() -> None:
    with pytest.raises(TensorPayloadError, match="opcode EMPTY_DICT"):
        decode_tensor_list(pickle.dumps([torch.ones(3)._neg_view()]))


def test_a_tensor_with_autograd_state_is_refused() -> None:
    with pytest.raises(TensorPayloadError, match="autograd state"):
        decode_tensor_list(_tensor_payload(0, (2,), (1,), requires_grad=True))


def test_code_named_anywhere_in_the_payload_never_runs(tmp_path: Any) -> None:
    marker = tmp_path / "ran"
    import os

    inner = pickle.dumps(_Calls(os.system, f"touch {marker}"), protocol=2)
    for payload in (pickle.dumps([_Calls(os.system, f"touch {marker}")]),
                    pickle.dumps([_Calls(torch.storage._load_from_bytes, inner)])):  # fmt: skip
        with pytest.raises(TensorPayloadError, match=r"refused a pickled global posix\.system"):
            decode_tensor_list(payload)
    assert not marker.exists()


@FUZZ
@given(st.data())
def test_any_corruption_of_a_payload_is_refused_cleanly_or_decodes_inside_its_own_bytes(data: st.DataObject) -> None:
    """Flip, cut or insert bytes anywhere: the decoder raises ``TensorPayloadError`` and nothing else,
    or returns tensors whose every element lies in a storage built from the payload's bytes."""
    sent = [torch.arange(6, dtype=torch.float16).reshape(2, 3), torch.arange(4, dtype=torch.int32)]
    payload = bytearray(pickle.dumps(sent))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(payload) - 1))
        edit = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if edit == "flip":
            payload[at] ^= data.draw(st.integers(1, 255))
        elif edit == "cut":
            del payload[at : at + data.draw(st.integers(1, 8))]
        else:
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        got = decode_tensor_list(bytes(payload))
    except TensorPayloadError:
        return
    for tensor in got:
        storage_bytes = tensor.untyped_storage().nbytes()
        reach = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        assert tensor.numel() == 0 or (reach + 1) * tensor.element_size() <= storage_bytes
        assert not tensor.requires_grad and not tensor.is_neg() and not tensor.is_conj()
