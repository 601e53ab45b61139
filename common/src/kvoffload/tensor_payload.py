"""Decode the chunk lists of LMCache's pickle transport (a COMMIT_STORE's ``cpu_data``) without pickle.

Why: any keyholder of a node cache can send a COMMIT_STORE, and ``pickle.loads`` with a restricted
``find_class`` still hands the payload real objects to act on. A 72-byte payload could ``BUILD`` new
``__defaults__`` onto ``torch._utils._rebuild_tensor_v2`` (every later pickled store on that server
came out negated), and torch's ``_load_from_bytes`` allocates a storage that the payload never has to
fill (the server stored, and handed back, stale heap memory). Here the payload is read opcode by
opcode (``pickletools.genops``) by a stack machine that knows only what ``pickle.dumps`` of a list
of CPU tensors emits: literals, tuples, one fresh list, memo references, and ``REDUCE`` of four
names (``_rebuild_tensor_v2``/``_v3``, ``_load_from_bytes``, ``OrderedDict``) that resolve to tokens
of this module, never to the functions themselves. No opcode reaches an existing object (no
``BUILD``, no ``SETITEM``, no ``INST``/``OBJ``/``NEWOBJ``, no extension registry); each storage is
built from exactly the bytes the payload carries (torch's legacy ``torch.save`` record, checked
field by field: magic, version, little-endian, one storage, declared element count == bytes sent);
each tensor's offset, shape and strides must lie inside its storage, with no autograd and no
metadata bits (``neg``/``conj``). Anything else raises :class:`TensorPayloadError` before a tensor
is built.
"""

from __future__ import annotations

import enum
import io
import pickle
import pickletools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
"""``torch.serialization.MAGIC_NUMBER``: the first record of a legacy ``torch.save``."""
LEGACY_PROTOCOL_VERSION = 1001
"""``torch.serialization.PROTOCOL_VERSION``: its second record."""
MAX_DIMS = 16
"""More dimensions than any KV chunk has; bounds the work of one tensor's checks."""

LEGACY_STORAGE_DTYPES: Mapping[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
}
"""Typed storages a KV chunk may come in (``torch.<name>`` in the legacy record) and their dtypes."""
REINTERPRETED_DTYPES: Mapping[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
"""Dtypes torch pickles as bytes plus a dtype (``_rebuild_tensor_v3`` over an ``UntypedStorage``)."""


class TensorPayloadError(pickle.UnpicklingError):
    """A payload that is not a pickled list of CPU tensors; refused before any tensor is built."""


class _Call(enum.Enum):
    """What a payload may ``REDUCE``: tokens standing for the names, never the functions."""

    REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
    REBUILD_TENSOR_V3 = ("torch._utils", "_rebuild_tensor_v3")
    LOAD_STORAGE = ("torch.storage", "_load_from_bytes")
    EMPTY_HOOKS = ("collections", "OrderedDict")


class _EmptyHooks:
    """``OrderedDict()`` as a tensor's ``backward_hooks``: the only value this payload may build there."""


_EMPTY_HOOKS = _EmptyHooks()


@dataclass(frozen=True)
class _Storage:
    """A storage built from the payload's own bytes: a 1-D tensor over exactly those bytes."""

    data: torch.Tensor
    untyped: bool


@dataclass(frozen=True)
class _StorageRecord:
    """The persistent id of a legacy ``torch.save`` of one storage."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype
    untyped: bool


_OUTER_GLOBALS: dict[tuple[str, str], object] = {call.value: call for call in _Call}
_OUTER_GLOBALS.update({("torch", name): dtype for name, dtype in REINTERPRETED_DTYPES.items()})
_STORAGE_GLOBALS: dict[tuple[str, str], object] = {
    ("torch", name): _StorageType(dtype, untyped=False) for name, dtype in LEGACY_STORAGE_DTYPES.items()
}
_STORAGE_GLOBALS[("torch.storage", "UntypedStorage")] = _StorageType(torch.uint8, untyped=True)

_LITERALS = frozenset(
    {"BININT", "BININT1", "BININT2", "LONG1", "SHORT_BINUNICODE", "BINUNICODE",
     "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}
)  # fmt: skip
_CONSTANTS: Mapping[str, object] = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_MARK = object()


def _refuse(message: str) -> TensorPayloadError:
    return TensorPayloadError(f"kvoffload refused a pickled tensor payload: {message}")


class _StackMachine:
    """Runs one pickle over the opcodes a tensor payload uses; builds only plain values and what
    ``reduce`` / ``persistent_load`` return for the vocabulary's tokens."""

    def __init__(
        self,
        names: Mapping[tuple[str, str], object],
        reduce: Callable[[object, tuple[Any, ...]], object] | None = None,
        persistent_load: Callable[[object], object] | None = None,
        dicts: bool = False,
    ) -> None:
        self._names = names
        self._reduce = reduce
        self._persistent_load = persistent_load
        self._dicts = dicts

    def run(self, stream: io.BytesIO) -> object:
        """The value of the pickle at ``stream``'s position; leaves ``stream`` just past its STOP."""
        stack: list[Any] = []
        memo: dict[int, Any] = {}
        try:
            for opcode, arg, pos in pickletools.genops(stream):
                name = opcode.name
                if name == "STOP":
                    if len(stack) != 1 or stack[0] is _MARK:
                        raise _refuse(f"STOP at byte {pos} leaves {len(stack)} values, not one")
                    return stack[0]
                self._step(name, arg, pos or 0, stack, memo)
        except TensorPayloadError:
            raise
        except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
            raise _refuse(f"malformed pickle ({exc})") from None
        raise _refuse("no STOP")

    def _step(self, name: str, arg: Any, pos: int, stack: list[Any], memo: dict[int, Any]) -> None:
        if name in _LITERALS:
            stack.append(arg)
        elif name in _CONSTANTS:
            stack.append(_CONSTANTS[name])
        elif name in ("PROTO", "FRAME"):
            return
        elif name == "MARK":
            stack.append(_MARK)
        elif name in ("MEMOIZE", "BINPUT", "LONG_BINPUT"):
            if stack[-1] is _MARK:
                raise _refuse(f"{name} at byte {pos} memoizes a MARK")
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            items = stack[-count:]
            del stack[-count:]
            if len(items) != count or _MARK in items:
                raise _refuse(f"{name} at byte {pos} without {count} values")
            stack.append(tuple(items))
        elif name == "TUPLE":
            stack.append(tuple(_pop_to_mark(stack, name, pos)))
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name in ("APPEND", "APPENDS"):
            items = [stack.pop()] if name == "APPEND" else _pop_to_mark(stack, name, pos)
            _fresh(stack, list, name, pos).extend(items)
        elif name == "EMPTY_DICT" and self._dicts:
            stack.append({})
        elif name in ("SETITEM", "SETITEMS") and self._dicts:
            items = stack[-2:] if name == "SETITEM" else _pop_to_mark(stack, name, pos)
            if name == "SETITEM":
                del stack[-2:]
            target = _fresh(stack, dict, name, pos)
            for key, value in zip(items[::2], items[1::2], strict=True):
                if not isinstance(key, str):
                    raise _refuse(f"{name} at byte {pos} with a key that is not a string")
                target[key] = value
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attribute = str(arg).partition(" ")
            else:
                attribute, module = stack.pop(), stack.pop()
            found = self._names.get((module, attribute)) if isinstance(module, str) else None
            if found is None:
                raise TensorPayloadError(
                    f"kvoffload refused a pickled global {module}.{attribute}: not a tensor payload"
                )
            stack.append(found)
        elif name == "REDUCE" and self._reduce is not None:
            args = stack.pop()
            call = stack.pop()
            if not isinstance(args, tuple):
                raise _refuse(f"REDUCE at byte {pos} with arguments that are not a tuple")
            stack.append(self._reduce(call, args))
        elif name == "BINPERSID" and self._persistent_load is not None:
            stack.append(self._persistent_load(stack.pop()))
        else:
            raise _refuse(f"opcode {name} at byte {pos} is not part of a list of CPU tensors")


def _pop_to_mark(stack: list[Any], name: str, pos: int) -> list[Any]:
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] is _MARK:
            items = stack[index + 1 :]
            del stack[index:]
            return items
    raise _refuse(f"{name} at byte {pos} without a MARK")


def _fresh(stack: list[Any], kind: type, name: str, pos: int) -> Any:
    """The container ``name`` writes into: one this payload created (lists and dicts are never
    anything else here), of the kind the opcode writes."""
    target = stack[-1] if stack else None
    if type(target) is not kind:
        raise _refuse(f"{name} at byte {pos} writes into a {type(target).__name__}, not a {kind.__name__}")
    return target


def _is_int(value: object, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _storage_record(pid: object) -> _StorageRecord:
    """A legacy record's persistent id: ``("storage", type, key, "cpu", numel, None)``."""
    if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
        raise _refuse(f"storage record {pid!r} is not ('storage', type, key, 'cpu', numel, None)")
    _, kind, key, location, numel, view = pid
    if not isinstance(kind, _StorageType) or not isinstance(key, str) or location != "cpu" or view is not None:
        raise _refuse(f"storage record {pid!r} is not ('storage', type, key, 'cpu', numel, None)")
    if not _is_int(numel):
        raise _refuse(f"storage record declares {numel!r} elements")
    return _StorageRecord(key, kind.dtype, numel)


def _storage_from_legacy_bytes(data: bytes) -> _Storage:
    """The storage in ``data`` (torch's legacy ``torch.save`` of one CPU storage, what
    ``torch.storage._load_from_bytes`` reads), built from exactly the bytes ``data`` carries."""
    if not isinstance(data, bytes):
        raise _refuse(f"a storage is {type(data).__name__}, not bytes")
    stream = io.BytesIO(data)
    plain = _StackMachine({}, dicts=True)
    if plain.run(stream) != LEGACY_MAGIC_NUMBER:
        raise _refuse("a storage does not start with torch's legacy magic number")
    if plain.run(stream) != LEGACY_PROTOCOL_VERSION:
        raise _refuse(f"a storage is not torch's legacy protocol {LEGACY_PROTOCOL_VERSION}")
    sys_info = plain.run(stream)
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
        raise _refuse("a storage was not written little-endian")
    record = _StackMachine(_STORAGE_GLOBALS, persistent_load=_storage_record).run(stream)
    if not isinstance(record, _StorageRecord):
        raise _refuse("a storage record holds something other than one storage")
    keys = plain.run(stream)
    if keys != [record.key]:
        raise _refuse(f"a storage's data section lists {keys!r}, not exactly its one storage {record.key!r}")
    header = stream.read(8)
    if len(header) != 8 or int.from_bytes(header, "little") != record.numel:
        raise _refuse(f"a storage's data does not begin with its element count {record.numel}")
    raw = memoryview(data)[stream.tell() :]
    expected = record.numel * record.dtype.itemsize
    if len(raw) != expected:
        raise _refuse(
            f"a storage of {record.numel} {record.dtype} elements needs {expected} bytes; the payload carries {len(raw)}"
        )
    if expected == 0:
        return _Storage(torch.empty(0, dtype=record.dtype), untyped=record.dtype is torch.uint8)
    # A copy the server owns, every byte of it from the payload (nothing left from the heap).
    tensor = torch.frombuffer(bytearray(raw), dtype=record.dtype)
    return _Storage(tensor, untyped=record.dtype is torch.uint8)


def _check_geometry(numel: int, offset: object, size: object, stride: object) -> None:
    if not _is_int(offset):
        raise _refuse(f"storage offset {offset!r} is not a non-negative int")
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride) <= MAX_DIMS):
        raise _refuse(f"shape {size!r} and strides {stride!r} are not tuples of one length (at most {MAX_DIMS})")
    if not all(_is_int(n) for n in (*size, *stride)):
        raise _refuse(f"shape {size!r} or strides {stride!r} hold something other than non-negative ints")
    if 0 in size:
        if offset > numel:  # type: ignore[operator]
            raise _refuse(f"storage offset {offset} lies past its storage of {numel} elements")
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= numel:
        raise _refuse(f"shape {size} strides {stride} at offset {offset} reach element {last} of a storage of {numel}")


def _rebuild_tensor(call: _Call, args: tuple[Any, ...]) -> torch.Tensor:
    arity = 6 if call is _Call.REBUILD_TENSOR_V2 else 7
    if len(args) != arity:
        what = "tensor metadata (neg/conj bits) is" if len(args) == arity + 1 else f"{len(args)} arguments are"
        raise _refuse(f"{what} not accepted for {call.value[1]}")
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    if not isinstance(storage, _Storage):
        raise _refuse(f"{call.value[1]} over {type(storage).__name__}, not a storage of this payload")
    if requires_grad is not False or hooks is not _EMPTY_HOOKS:
        raise _refuse("a tensor with autograd state (requires_grad or backward hooks)")
    data = storage.data
    if call is _Call.REBUILD_TENSOR_V3:
        dtype = args[6]
        if not storage.untyped or not isinstance(dtype, torch.dtype):
            raise _refuse("_rebuild_tensor_v3 needs an untyped storage and a dtype")
        if data.numel() % dtype.itemsize:
            raise _refuse(f"a storage of {data.numel()} bytes does not hold whole {dtype} elements")
        data = data.view(dtype)
    _check_geometry(data.numel(), offset, size, stride)
    return data.as_strided(size, stride, offset)


def _reduce_outer(call: object, args: tuple[Any, ...]) -> object:
    if call is _Call.LOAD_STORAGE:
        if len(args) != 1:
            raise _refuse("_load_from_bytes takes one bytes argument")
        return _storage_from_legacy_bytes(args[0])
    if call is _Call.EMPTY_HOOKS:
        if args:
            raise _refuse("backward hooks other than an empty OrderedDict")
        return _EMPTY_HOOKS
    if call in (_Call.REBUILD_TENSOR_V2, _Call.REBUILD_TENSOR_V3):
        return _rebuild_tensor(call, args)
    raise _refuse(f"REDUCE of {type(call).__name__}, which is not a callable name of a tensor payload")


def decode_tensor_list(data: bytes) -> list[torch.Tensor]:
    """The CPU tensors of ``pickle.dumps(list_of_tensors)``, each over a storage holding exactly the
    payload's bytes; raises :class:`TensorPayloadError` for anything else (nothing is built first)."""
    stream = io.BytesIO(data)
    value = _StackMachine(_OUTER_GLOBALS, reduce=_reduce_outer).run(stream)
    if stream.tell() != len(data):
        raise _refuse(f"{len(data) - stream.tell()} bytes after the pickle's STOP")
    if not isinstance(value, list) or not all(isinstance(item, torch.Tensor) for item in value):
        raise _refuse(f"the payload is a {type(value).__name__}, not a list of tensors")
    return value
