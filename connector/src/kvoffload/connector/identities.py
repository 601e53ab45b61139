"""What identifies the weights a chunk's KV was computed with, beyond names a deployment picks.

A LoRA task id is an integer each deployment numbers its adapters with, and a model is named by a
path or a hub id; in a cache shared by several deployments (node mode, a shared L2) neither says
which weights made the KV. So keys carry digests of the weights themselves:

- a model: its checkpoint directory's ``config.json`` and weights index read whole, and every
  weights file by its size and 64 KiB sampled at 16 evenly spaced offsets (the pinned ``revision``
  where the model is a hub id; the name alone where neither exists);
- a LoRA adapter: the same digest of the adapter's checkpoint (``LlmRequest.py_lora_path``, which
  the PyTorch backend sets on every request of an adapter), or of the ``lora_weights`` and
  ``lora_config`` tensors a request carries, remembered per task id for the requests that carry
  only the id; an adapter known by neither is unknown and its requests are not cached;
- a prompt-tuning table (``prompt_embedding_table``): its bytes.

Sampled bytes identify weights that differ anywhere a fine-tune or a re-export touches (all of
them, in practice) without reading gigabytes; a checkpoint edited in place at unsampled offsets
only, same sizes, is not told apart. Digests are remembered by path and file sizes and times.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 * 1024
WHOLE_FILE_BYTES = 1 << 20
"""Files up to this size (configs, indexes, tokenizers) are read whole."""
DIGEST_BYTES = 16
MAX_REMEMBERED = 4096
"""Checkpoint digests and adapters remembered per process, at most."""


def sample_offsets(size: int) -> list[int]:
    """Where a file of ``size`` bytes above ``WHOLE_FILE_BYTES`` is read, ``SAMPLE_BYTES`` each: evenly
    spaced from its first byte to its last."""
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)]


def _file_digest(path: Path, size: int) -> bytes:
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    hasher.update(size.to_bytes(8, "little"))
    with path.open("rb") as handle:
        if size <= WHOLE_FILE_BYTES:
            hasher.update(handle.read())
            return hasher.digest()
        for offset in sample_offsets(size):
            handle.seek(offset)
            hasher.update(handle.read(SAMPLE_BYTES))
    return hasher.digest()


def _files_of(root: Path) -> list[tuple[str, Path, os.stat_result]]:
    """The regular files of a checkpoint (a file, or a directory's files, one level down too)."""
    if root.is_file():
        return [(root.name, root, root.stat())]
    found = []
    for path in sorted([*root.glob("*"), *root.glob("*/*")]):  # never deeper: no walk of a whole tree
        if path.is_file() and not path.name.startswith("."):
            found.append((str(path.relative_to(root)), path, path.stat()))
    return found


class CheckpointDigests:
    """Digests of checkpoints on disk, remembered by path and each file's size and modification time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}

    def digest(self, location: str) -> str | None:
        """The checkpoint at ``location`` (a directory or one file) as a hex digest; None when it
        cannot be read here."""
        try:
            files = _files_of(Path(location))
        except OSError:
            return None
        if not files:
            return None
        signature = tuple((name, st.st_size, st.st_mtime_ns) for name, _path, st in files)
        key = (location, signature)
        with self._lock:
            known = self._known.get(key)
        if known is not None:
            return known
        hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
        try:
            for name, path, st in files:
                hasher.update(json.dumps(name).encode())
                hasher.update(_file_digest(path, st.st_size))
        except OSError:
            return None
        digest = hasher.hexdigest()
        with self._lock:
            if len(self._known) >= MAX_REMEMBERED:
                self._known.clear()  # bounded: digests are computed again, never wrong
            self._known[key] = digest
        return digest


CHECKPOINTS = CheckpointDigests()
"""This process's checkpoint digests."""


def model_identity(model: str, revision: str | None = None) -> str:
    """What names a model's weights in keys: the checkpoint's digest where ``model`` is a directory
    or file here, else the pinned ``revision``, else nothing (the name alone identifies it)."""
    if model and os.path.exists(model):
        digest = CHECKPOINTS.digest(model)
        if digest is not None:
            return f"w{digest}"
    return f"r{revision}" if revision else ""


def tensor_digest(value: Any) -> bytes:
    """A tensor's (or array's) dtype, shape and bytes, digested."""
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    hasher.update(str(getattr(value, "dtype", "")).encode())
    hasher.update(json.dumps(list(getattr(value, "shape", ()))).encode())
    if hasattr(value, "detach"):  # torch: raw bytes of any dtype (bfloat16 has no numpy twin)
        import torch

        flat = value.detach().to("cpu").contiguous().reshape(-1)
        hasher.update(flat.view(torch.uint8).numpy().tobytes())
    elif hasattr(value, "tobytes"):
        hasher.update(value.tobytes())
    else:
        hasher.update(json.dumps(value, default=str).encode())
    return hasher.digest()


class AdapterIdentities:
    """The identity of each LoRA adapter a request runs under, as digests of its weights."""

    def __init__(self, checkpoints: CheckpointDigests = CHECKPOINTS) -> None:
        self._checkpoints = checkpoints
        self._by_task: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def of(self, request: Any) -> bytes | None:
        """``b""`` for a request without an adapter, the adapter's digest, or None when the adapter
        cannot be identified here (its KV must not be cached)."""
        task = getattr(request, "lora_task_id", None)
        if task is None:
            task = getattr(request, "py_lora_task_id", None)
        if task is None:
            return b""
        path = getattr(request, "py_lora_path", None)
        if path:
            checkpoint = self._checkpoints.digest(str(path))
            return None if checkpoint is None else bytes.fromhex(checkpoint)
        weights, config = getattr(request, "lora_weights", None), getattr(request, "lora_config", None)
        if weights is not None and config is not None:
            carried = hashlib.blake2b(tensor_digest(weights) + tensor_digest(config), digest_size=DIGEST_BYTES).digest()
            with self._lock:
                if len(self._by_task) >= MAX_REMEMBERED:
                    self._by_task.clear()  # an id then seen without weights is uncached until it comes with them
                self._by_task[int(task)] = carried
            return carried
        with self._lock:
            return self._by_task.get(int(task))


_TABLE_ATTRS = ("prompt_embedding_table", "py_prompt_embedding_table")


def prompt_table_digest(request: Any) -> bytes:
    """The digest of a request's prompt-tuning table (``b""`` without one)."""
    for attr in _TABLE_ATTRS:
        table = getattr(request, attr, None)
        if table is not None:
            return tensor_digest(table)
    return b""
