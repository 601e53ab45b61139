"""What both role backends (the scheduler's client, each worker's backend) share: their error, the pool's
geometry, a load's result and a worker's instance id."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvoffload.connector")


class BackendError(RuntimeError):
    """A backend operation failed; ``operation``/``reason`` are bounded metric labels."""

    def __init__(self, operation: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{operation} failed ({reason}){': ' + detail if detail else ''}")
        self.operation = operation
        self.reason = reason


@dataclass(frozen=True)
class KvGeometry:
    """How one block of TensorRT-LLM's pool splits: ``[num_kv_heads, tokens_per_block, head_dim]`` per layer and K/V."""

    num_kv_heads: int
    tokens_per_block: int
    head_dim: int

    def layout_hints(self) -> dict[str, Any]:
        """LMCache ``LayoutHints`` for TensorRT-LLM's HND block layout."""
        return {
            "kv_layout": "HND",
            "num_kv_heads": self.num_kv_heads,
            "tokens_per_block": self.tokens_per_block,
            "head_dim": self.head_dim,
        }


def kv_geometry(block_elems: int, tokens_per_block: int, hf_config: dict[str, Any] | None, tp_size: int) -> KvGeometry:
    """Split the pool's last dim (``num_kv_heads*tokens_per_block*head_dim``) using the HF config when it fits.

    Without a usable config the block is treated as one head: store/retrieve stay
    bit-exact (whole blocks move), only LMCache's internal token-major view differs.
    """
    if block_elems % tokens_per_block != 0:
        raise ValueError(
            f"KV pool block of {block_elems} elements is not a multiple of tokens_per_block={tokens_per_block}"
        )
    per_token = block_elems // tokens_per_block
    if hf_config:
        heads = hf_config.get("num_key_value_heads") or hf_config.get("num_attention_heads")
        head_dim = hf_config.get("head_dim")
        if not head_dim and hf_config.get("hidden_size") and hf_config.get("num_attention_heads"):
            head_dim = int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])
        if heads and head_dim and int(heads) % tp_size == 0:
            local_heads = int(heads) // tp_size
            if local_heads * int(head_dim) == per_token:
                return KvGeometry(local_heads, tokens_per_block, int(head_dim))
    return KvGeometry(1, tokens_per_block, per_token)


def read_hf_config(model: str) -> dict[str, Any] | None:
    """``config.json`` of a local model directory, or None (no network, no transformers import)."""
    path = Path(model) / "config.json"
    try:
        if path.is_file():
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        logger.debug("event=hf_config_unreadable path=%s", path)
    return None


@dataclass(frozen=True)
class LoadResult:
    """One load of a batch: bytes moved, or the error that stopped it; seconds from its start to its end."""

    nbytes: int
    seconds: float
    error: BackendError | None = None


def instance_id() -> int:
    """A worker instance id unique across the pod's containers (PIDs may repeat across PID namespaces)."""
    return (os.getpid() << 20) ^ int.from_bytes(os.urandom(2), "little")
