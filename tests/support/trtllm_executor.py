"""A faithful stand-in for TensorRT-LLM's PyExecutor, for driving KV connectors on CPU.

What it keeps from TensorRT-LLM (reference: /work/shared/reference/trtllm-kv-connector.md):
- connector classes loaded by module/class NAME from ``kv_connector_config``; the scheduler only on
  rank 0, a worker on every rank; metadata pickled from rank 0 to the other ranks (broadcast);
- a KV pool of the real layout ``[num_blocks, num_layers, 2, num_kv_heads * tokens_per_block * head_dim]``
  (per layer and K/V: ``[num_kv_heads, tokens_per_block, head_dim]``, HND), block id = index on dim 0;
- one iteration in the order of §1.5: device prefix reuse -> ``get_num_new_matched_tokens`` ->
  allocation -> ``update_state_after_alloc`` -> ``build_connector_meta`` -> ``bind_connector_meta`` ->
  ``start_load_kv`` -> per layer ``wait_for_layer_load`` / layer / ``save_kv_layer`` -> ``wait_for_save``
  -> sampling -> ``request_finished`` -> ``get_finished`` (ids act only when every rank returned them);
- GPU prefix-block reuse (full blocks, chained hashes incl. cache salt) with LRU eviction, chunked
  prefill, ``RequestData`` with ``computed_position`` = device-reused prefix for the first chunk;
- a connector exception in a hook fails the requests of that iteration (TensorRT-LLM's error path).

Its "forward" writes each token's KV as a deterministic function of (token prefix, layer, K/V, head,
dim), so after every forward every valid position of every request is checked bit-exact, and it
counts the prompt tokens it had to compute. Sampling reads the KV from the pool, so wrong KV would
also change the output tokens. TP=2 runs rank 1 as a separate process (heads split across ranks).
Attention DP (``enable_attention_dp``, main only) runs each DP rank as a whole executor of its own
(``StandinExecutor(attention_dp_rank=r)``, ``AttentionDpRank`` for another process): its own scheduler,
worker and pool, whole KV heads, ``SchedulerOutput.attention_dp_rank``, no broadcast or allgather, and
a dummy forward on a page of every layer group, from the free pool, whenever the rank idles.

CLI (what the end-to-end test starts with the env the operator injects)::

    python -m tests.support.trtllm_executor --options extra-llm-api-options.yaml --model M \
        --prompts prompts.json [--tp 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

STANDIN_PATH = str(Path(__file__).resolve().parent.parent / "standin")
REPO_ROOT = str(Path(__file__).resolve().parent.parent.parent)
RANK_ENV = "KVOFFLOAD_STANDIN_RANK"
WORLD_ENV = "KVOFFLOAD_STANDIN_WORLD_SIZE"
_MOD = (1 << 61) - 1
_VALUE_MOD = 2039  # values < 2048 are exact in float16
VOCAB = 32000
CHUNK = 64
"""LMCache chunk size the connector tests use (small, so prompts of a few hundred tokens span chunks)."""
BLOCK = 16
"""tokens_per_block the connector tests use."""


def _ensure_paths() -> None:
    for path in (STANDIN_PATH, REPO_ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)


def _text_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % _MOD


def _adapter_bytes(directory: str) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(Path(directory).glob("*")) if p.is_file())


_ADAPTERS: dict[int, str] = {}


def standin_adapter(task_id: int) -> str:
    """A LoRA checkpoint directory for ``task_id`` (its config and weights), made once per process."""
    if task_id not in _ADAPTERS:
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix=f"standin-lora-{task_id}-"))
        (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "task": task_id}))
        (directory / "adapter_model.safetensors").write_bytes(hashlib.sha256(str(task_id).encode()).digest() * 64)
        _ADAPTERS[task_id] = str(directory)
    return _ADAPTERS[task_id]


def prefix_hashes(tokens: list[int], start: int = 0, prev: int = 0, extras: dict[int, int] | None = None) -> list[int]:
    """Rolling hash of every prefix: element i identifies ``tokens[:start+i+1]`` and the ``extras``
    (position -> value: a multimodal item's digest at its placeholder tokens) among them."""
    out = []
    h = prev
    for pos, tok in enumerate(tokens[start:], start):
        h = (h * 1000003 + tok + 1) % _MOD
        if extras and pos in extras:
            h = (h * 1000003 + extras[pos]) % _MOD
        out.append(h)
    return out


def multimodal_hash(content: bytes) -> list[int]:
    """A multimodal item's content hash as TensorRT-LLM's ``LlmRequest.multimodal_hashes`` holds it:
    a 256-bit digest as 8 signed int32, most significant first."""
    digest = hashlib.blake2b(content, digest_size=32).digest()
    return [int.from_bytes(digest[i : i + 4], "big", signed=True) for i in range(0, 32, 4)]


def kv_values(
    hashes: torch.Tensor,
    layer: int,
    head_offset: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """KV of tokens with these prefix hashes: ``[2, num_heads, n, head_dim]`` in ``dtype`` (integers
    within its range: exact in float16, rounded the same way every time in narrower types)."""
    kv = torch.arange(2, dtype=torch.int64).view(2, 1, 1, 1)
    heads = (torch.arange(num_heads, dtype=torch.int64) + head_offset).view(1, num_heads, 1, 1)
    dims = torch.arange(head_dim, dtype=torch.int64).view(1, 1, 1, head_dim)
    h = (hashes % 1000000007).view(1, 1, -1, 1)
    modulus = _VALUE_MOD if torch.finfo(dtype).max > _VALUE_MOD else int(torch.finfo(dtype).max)
    vals = (h * 31 + layer * 7919 + kv * 104729 + heads * 1299709 + dims * 15485863) % modulus
    return vals.to(torch.float32).to(dtype)


@dataclass
class PromptRequest:
    """One request to run: prompt tokens, generation length and optional tenant salt."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int = 2
    cache_salt: str | None = None
    cancel_after: int | None = None
    """Cancel (or client-abort) the request after this many iterations since admission."""
    arrive_after: int = 0
    """Admit the request this many iterations after ``run`` starts (a client's retry arrives later)."""
    replay_on_admission: bool = False
    """The scheduler destroys the request's first allocation in the pass that made it and replays it
    after the requests admitted with it (KVCacheManagerV2's MAX_UTILIZATION destroy + replay,
    ``reset_request_state``): its blocks go back to the pool, the connector is asked again."""
    lora_task_id: int | None = None
    """The LoRA adapter it runs under (``LoraConfig.task_id``): its KV differs at every position."""
    lora_path: str | None = None
    """The adapter's checkpoint (``LoRARequest.path``; the PyTorch backend sets ``py_lora_path`` on
    every request of an adapter). None with a task id: ``standin_adapter(task id)``'s directory."""
    lora_path_unset: bool = False
    """The request carries the task id only (no path, no weights), as a C++-path request whose
    adapter an earlier request already put in the PEFT cache."""
    prompt_table: tuple[float, ...] | None = None
    """A prompt-tuning table (``prompt_embedding_table``): its values change the KV at every position."""
    multimodal_embedding: tuple[float, ...] | None = None
    """Multimodal embeddings passed in (``py_multimodal_data``) with no content hash."""
    multimodal_hashes: list[list[int]] | None = None
    """Per multimodal item, its content hash (``multimodal_hash``); the item's placeholder tokens are
    ``prompt[multimodal_positions[i] : multimodal_positions[i] + multimodal_lengths[i]]``."""
    multimodal_positions: list[int] | None = None
    multimodal_lengths: list[int] | None = None


@dataclass
class RequestResult:
    """What happened to one request."""

    request_id: int
    output_tokens: list[int] = field(default_factory=list)
    computed_prompt_tokens: int = 0
    device_reused_tokens: int = 0
    connector_matched_tokens: int = 0
    failed: bool = False
    error: str = ""
    cancelled: bool = False


class StandinLlmRequest:
    """The parts of ``LlmRequest`` a connector reads."""

    def __init__(self, req: PromptRequest) -> None:
        self.request_id = req.request_id
        self.py_request_id = req.request_id
        self.prompt_len = len(req.prompt)
        self.salt = req.cache_salt  # the stand-in's own (device reuse, RequestData)
        # The C++ base LlmRequest the connector sees at lookup carries only the salt's id (a uint64
        # the LLM API derives from the string), never the string itself.
        self.cache_salt_id = (
            int.from_bytes(hashlib.blake2b(req.cache_salt.encode(), digest_size=8).digest(), "little")
            if req.cache_salt
            else None
        )
        self.tokens = list(req.prompt)
        self.max_new_tokens = req.max_new_tokens
        # What LlmRequest carries besides the tokens: None when absent, as its nanobind properties are.
        self.lora_task_id = req.lora_task_id
        self.py_lora_path = (
            None
            if req.lora_task_id is None or req.lora_path_unset
            else (req.lora_path or standin_adapter(req.lora_task_id))
        )
        self.lora_weights = self.lora_config = None
        self.prompt_embedding_table = None if req.prompt_table is None else torch.tensor(req.prompt_table)
        self.py_multimodal_data = (
            None
            if req.multimodal_embedding is None
            else {"multimodal_embedding": torch.tensor(req.multimodal_embedding)}
        )
        self.multimodal_hashes = req.multimodal_hashes
        self.multimodal_positions = req.multimodal_positions
        self.multimodal_lengths = req.multimodal_lengths
        # The forward's KV depends on them as a model's does: the adapter's weights at every position,
        # a prompt table's or an image's embeddings from their tokens on (``hashes``, the chain the KV
        # and the checks derive from). The device-reuse key (``reuse_hashes``) carries only what the
        # C++ BlockKey carries: loraTaskId and the items' hashes (extraKeys). So, as upstream, the
        # device hands KV across two adapters under one task id or two prompt tables (the checks
        # count it), never across task ids or hashed images.
        self.chain_seed = 0 if req.lora_task_id is None else (req.lora_task_id * 2654435761 + 1) % _MOD
        self.reuse_seed = self.chain_seed
        if req.lora_path is not None:  # another adapter under the same id: other weights, other KV
            self.chain_seed = (
                self.chain_seed * 1000003
                + _text_hash(
                    Path(req.lora_path).read_bytes() if Path(req.lora_path).is_file() else _adapter_bytes(req.lora_path)
                )
            ) % _MOD
        for source in (req.prompt_table, req.multimodal_embedding):
            if source is not None:
                self.chain_seed = (self.chain_seed * 1000003 + _text_hash(repr(source).encode())) % _MOD
        self.image_spans: list[tuple[int, int]] = []
        extras: dict[int, int] = {}
        for i, digest in enumerate(req.multimodal_hashes or ()):
            start = (req.multimodal_positions or [])[i]
            length = (req.multimodal_lengths or [])[i]
            self.image_spans.append((start, start + length))
            value = int.from_bytes(b"".join(d.to_bytes(4, "big", signed=True) for d in digest), "big") % _MOD
            extras.update((pos, value) for pos in range(start, start + length))
        self.hashes = prefix_hashes(self.tokens, prev=self.chain_seed, extras=extras)
        self.reuse_hashes = prefix_hashes(self.tokens, prev=self.reuse_seed, extras=extras)
        self.block_ids: list[int] = []
        self.group_pages: list[list[int]] = []
        """Several layer groups: the other groups' pages by ordinal (-1: none), ``StandinExecutor.sliding`` order."""
        self.reported_blocks = 0
        self.context_pos = 0  # tokens with KV (context_current_position)
        self.first_chunk_done = False
        self.generated: list[int] = []
        self.result = RequestResult(req.request_id)
        self.reused_blocks: list[int] = []
        self.cancel_after = req.cancel_after
        self.arrive_after = req.arrive_after
        self.iterations = 0
        self.finished_unseen = False
        """Overlap scheduler: sampled its last token, but the executor learns it one iteration later."""
        self.returning = False  # its asynchronous load finished: next scheduled as a new request
        self.replay_on_admission = req.replay_on_admission
        self.first_chunk_end: int | None = None  # KVCacheManagerV2: where the served first chunk ends
        self.parked_at = 0.0  # when its asynchronous load began (the attention-DP deadline counts from it)
        self.is_finished = False
        """``LlmRequest.is_finished``: set by ``finish_by_reason`` (cancel, error) and by the last token."""
        self.prefix_load: Any = None
        """Prefix reservations: its accepted ``PrefixLoad`` until every rank reported it finished (the
        load owns the allocation until then: a cancel waits for it)."""

    def get_tokens(self, beam: int = 0) -> list[int]:
        return list(self.tokens)

    def has_multimodal_in(self, start: int, end: int) -> bool:
        """Whether a multimodal item's placeholder tokens fall in ``[start, end)``."""
        return any(a < end and start < b for a, b in self.image_spans)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.hashes.extend(
            prefix_hashes(self.tokens, len(self.tokens) - 1, self.hashes[-1] if self.hashes else self.chain_seed)
        )
        self.reuse_hashes.extend(
            prefix_hashes(
                self.tokens, len(self.tokens) - 1, self.reuse_hashes[-1] if self.reuse_hashes else self.reuse_seed
            )
        )


class BlockManager:
    """Device KV blocks: free list, refcounts, and prefix reuse of full blocks with LRU eviction."""

    def __init__(self, num_blocks: int) -> None:
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refs: dict[int, int] = {}
        self.reuse: dict[tuple[str, int], int] = {}  # (salt, chain hash) -> block
        self.block_key: dict[int, tuple[str, int]] = {}
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # reusable, unreferenced, LRU first
        self.evicted: list[int] = []
        # Partial reuse: (salt, chain hash before the block) -> reusable blocks, with their tokens.
        self.children: dict[tuple[str, int], set[int]] = {}
        self.block_tokens: dict[int, tuple[tuple[str, int], tuple[int, ...]]] = {}

    def available(self) -> int:
        """Blocks an allocation may still take (free, or reusable and unreferenced)."""
        return len(self.free) + len(self.cached_free)

    def match(self, salt: str, hashes: list[int], tokens_per_block: int, max_tokens: int) -> list[int]:
        blocks = []
        for i in range(max_tokens // tokens_per_block):
            block = self.reuse.get((salt, hashes[(i + 1) * tokens_per_block - 1]))
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self.refs[block] = self.refs.get(block, 0) + 1
            self.cached_free.pop(block, None)
        return blocks

    def match_partial(self, salt: str, parent: int, tokens: list[int]) -> tuple[int | None, int]:
        """The reusable block after chain hash ``parent`` sharing the longest token prefix with ``tokens``
        (``findMatchingBlock`` with partial reuse): ``(block, matched tokens)``, referenced until released."""
        best, best_k = None, 0
        for block in self.children.get((salt, parent), ()):
            theirs = self.block_tokens[block][1]
            k = 0
            while k < min(len(theirs), len(tokens)) and theirs[k] == tokens[k]:
                k += 1
            if k > best_k:
                best, best_k = block, k
        if best is not None:
            self.refs[best] = self.refs.get(best, 0) + 1
            self.cached_free.pop(best, None)
        return best, best_k

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            elif self.cached_free:
                block, _ = self.cached_free.popitem(last=False)
                self._forget(block)
            else:
                raise RuntimeError("stand-in KV pool exhausted")
            self.refs[block] = 1
            out.append(block)
        return out

    def _forget(self, block: int) -> None:
        key = self.block_key.pop(block, None)
        if key is not None and self.reuse.get(key) == block:
            del self.reuse[key]
        parent = self.block_tokens.pop(block, None)
        if parent is not None:
            self.children.get(parent[0], set()).discard(block)
        self.evicted.append(block)

    def release(self, blocks: list[int], commit: dict[int, tuple[str, int, int, tuple[int, ...] | None]]) -> None:
        """Drop one reference per block; ``commit`` names full blocks that become reusable:
        ``(salt, chain hash, chain hash before it, its tokens)``; tokens None: never partially matched
        (a block holding a multimodal item: ``BlockKey::supportsPartialMatching``)."""
        for block in blocks:
            if block in commit and commit[block][:2] not in self.reuse:
                salt, chain, parent, tokens = commit[block]
                self.reuse[(salt, chain)] = block
                self.block_key[block] = (salt, chain)
                if tokens is not None:
                    self.children.setdefault((salt, parent), set()).add(block)
                    self.block_tokens[block] = ((salt, parent), tokens)
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                if block in self.block_key:
                    self.cached_free[block] = None
                else:
                    self.free.append(block)

    def evict_all(self) -> list[int]:
        """Drop every unreferenced reusable block (as if other traffic had evicted them)."""
        out = list(self.cached_free)
        for block in out:
            self._forget(block)
            self.free.append(block)
        self.cached_free.clear()
        return out


class EngineDied(RuntimeError):
    """An exception left TensorRT-LLM's executor loop: the engine stops serving (every request fails)."""


PREFERS_V2_FROM_RC22 = ("deepseek", "gpt-oss", "gemma", "qwen3-next", "kimi", "minimax")
"""Model families whose class answers ``get_preferred_kv_cache_manager_version() -> "V2"`` once "auto"
exists (PRs #15823, #16060, #16942, #17396, #17125, #17232, #17360; docs/connector.md, "TensorRT-LLM versions")."""

PREFERS_V2_FROM_SEPTEMBER = (*PREFERS_V2_FROM_RC22, "llama", "nemotron")
"""... and from September on, Llama 3.x/4 (#19004) and Nemotron multimodal (#19140)."""


@dataclass(frozen=True)
class ExecutorBehaviour:
    """Where supported TensorRT-LLM versions differ on the connector's paths (docs/connector.md table)."""

    request_finished_on_termination: bool
    """``_do_terminate_request`` calls ``request_finished`` for every ending (cancel, error included);
    otherwise only ``_send_kv_async`` does, for requests that finished normally."""
    prefers_kv_cache_manager_v2: tuple[str, ...] = ()
    """Model families that ``use_kv_cache_manager_v2: "auto"`` resolves to V2 (written back into
    ``llm_args``, ``llm_utils._resolve_kv_cache_manager_v2_auto``); empty: no "auto", V1 unless set."""
    kv_cache_manager_v2_with_connector: Literal["served", "demoted", "refused"] = "refused"
    """What a resolved V2 manager does with a connector: ``"served"`` (the V2 connector path, #18700/#18762),
    ``"demoted"`` (``KvCacheCreator._validate_or_fallback_kv_cache_manager_v2`` builds V1 and the flag
    stays True) or ``"refused"``."""
    records_honoured_tokens: bool = False
    """``commit_new_matched_tokens`` sets ``LlmRequest.py_num_connector_matched_tokens``."""
    attention_dp_with_connector: bool = False
    """A connector under ``enable_attention_dp`` (#19250; KVCacheManagerV2 only)."""
    prefix_reservations: bool = False
    """KVCacheManagerV2 asks a connector implementing the reservation trio ``reserve_prefix`` instead of
    ``get_num_new_matched_tokens``, hands accepted loads over as ``SchedulerOutput.prefix_loads`` and
    finishes them by reservation id (``get_finished_prefix_loads`` from every rank)."""


TRTLLM_VERSIONS = {
    "1.1": ExecutorBehaviour(request_finished_on_termination=True),
    "1.2": ExecutorBehaviour(request_finished_on_termination=False),
    "1.3.0rc": ExecutorBehaviour(
        request_finished_on_termination=False,
        prefers_kv_cache_manager_v2=PREFERS_V2_FROM_RC22,
        kv_cache_manager_v2_with_connector="demoted",
    ),
    "1.4.0rc1": ExecutorBehaviour(
        request_finished_on_termination=False,
        prefers_kv_cache_manager_v2=PREFERS_V2_FROM_SEPTEMBER,
        kv_cache_manager_v2_with_connector="served",
        records_honoured_tokens=True,
        attention_dp_with_connector=True,
    ),
    "main": ExecutorBehaviour(
        request_finished_on_termination=False,
        prefers_kv_cache_manager_v2=PREFERS_V2_FROM_SEPTEMBER,
        kv_cache_manager_v2_with_connector="served",
        records_honoured_tokens=True,
        attention_dp_with_connector=True,
        prefix_reservations=True,
    ),
}
"""1.3.0rc: the "auto" window before the V2 connector path (rc22-rc26); 1.4.0rc1 and main: the V2
connector path. Upstream commits per entry: docs/connector.md, "TensorRT-LLM versions"."""

KV_CACHE_MANAGER_V2_VERSIONS = tuple(
    v for v, b in TRTLLM_VERSIONS.items() if b.kv_cache_manager_v2_with_connector == "served"
)
"""The versions on which a connector runs on KVCacheManagerV2: every V2 test runs on each."""
V2_WITHOUT_RESERVATIONS = next(v for v in KV_CACHE_MANAGER_V2_VERSIONS if not TRTLLM_VERSIONS[v].prefix_reservations)
"""The newest version whose KVCacheManagerV2 frees a cancelled request at once (main's prefix
reservations keep a parked request's pages until its load finished on every rank:
test_connector_prefix_reservations)."""


def returned_by_every_rank(votes: dict[int, int], per_rank: list[list[int]], ranks: int) -> list[int]:
    """``KvCacheConnectorManager.get_finished``'s allgather and intersection: count this iteration's
    ids from each rank in ``votes``; the ids every rank has now returned leave ``votes``."""
    for ids in per_rank:
        for rid in ids:
            votes[rid] = votes.get(rid, 0) + 1
    done = [rid for rid, count in votes.items() if count >= ranks]
    for rid in done:
        del votes[rid]
    return done


ADP_LOAD_DEADLINE_S = 1.0
"""The stand-in's ``_KV_CONNECTOR_LOAD_TIMEOUT_SEC`` (main; its value was not found upstream, and a
test slows loads past this one)."""


def resolve_kv_cache_manager(llm_args: Any, version: str) -> bool:
    """``llm_utils._resolve_kv_cache_manager_v2_auto`` where ``"auto"`` exists: the model's preferred
    manager, written back into ``llm_args`` before the connector is built (1.1/1.2: V1). Returns whether
    the engine runs KVCacheManagerV2 with the connector (not so where V2 is demoted to V1)."""
    behaviour = TRTLLM_VERSIONS[version]
    cache = llm_args.kv_cache_config
    if cache.use_kv_cache_manager_v2 == "auto":
        model = str(llm_args.model).lower()
        cache.use_kv_cache_manager_v2 = any(f in model for f in behaviour.prefers_kv_cache_manager_v2)
    if cache.use_kv_cache_manager_v2 is not True:
        return False
    if behaviour.kv_cache_manager_v2_with_connector == "refused":
        raise ValueError(f"KVCacheManagerV2 with a KV connector does not exist on TensorRT-LLM {version}")
    return behaviour.kv_cache_manager_v2_with_connector == "served"


KV_CACHE_DTYPES = {"auto": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
                   "fp8": torch.float8_e4m3fn}  # fmt: skip
"""``kv_cache_config.dtype`` -> the pool's element type; ``auto`` follows the stand-in model (float16)."""


def kv_cache_dtype(llm_args: Any) -> torch.dtype:
    """The KV pool's element type for these ``llm_args``."""
    return KV_CACHE_DTYPES[getattr(llm_args.kv_cache_config, "dtype", "auto")]


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (1-byte float types have no ``torch.equal`` on CPU)."""
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def load_connector_classes(llm_args: Any) -> tuple[type, type]:
    """Import the connector the way TensorRT-LLM does: ``kv_connector_config`` module + class names."""
    cfg = llm_args.kv_connector_config
    module = importlib.import_module(cfg.connector_module)
    return getattr(module, cfg.connector_scheduler_class), getattr(module, cfg.connector_worker_class)


def layer_groups(geometry: dict[str, Any]) -> list[tuple[int | None, tuple[int, ...]]]:
    """KVCacheManagerV2's layer groups, ``(window, layers)`` in layer-group id order: one per distinct
    attention window of ``geometry["layer_windows"]`` (repeated over the layers, as
    ``max_attention_window``; None: full attention), in the order the layers first use them."""
    windows = geometry.get("layer_windows") or (geometry.get("window") or None,)
    groups: dict[int | None, list[int]] = {}
    for layer in range(geometry["num_layers"]):
        groups.setdefault(windows[layer % len(windows)], []).append(layer)
    return [(window, tuple(layers)) for window, layers in groups.items()]


class RankState:
    """One rank's pool, worker and forward; rank 0 holds it in-process, rank 1 in its own process."""

    def __init__(self, rank: int, llm_args: Any, geometry: dict[str, int], kv_manager_v2: bool) -> None:
        _ensure_paths()
        os.environ[RANK_ENV] = str(rank)
        self.rank = rank
        # Tensor parallelism splits KV heads across ranks; under attention DP every rank holds them all.
        # Multi-head latent attention's latent is computed before heads split: every TP rank holds
        # all of it, the same bytes (DeepseekV3's kv_a_proj_with_mqa is not tensor-parallel).
        self.tp = (
            1
            if getattr(llm_args, "enable_attention_dp", False) or geometry["kv_factor"] == 1
            else (llm_args.tensor_parallel_size)
        )
        self.block = llm_args.kv_cache_config.tokens_per_block
        self.layers = geometry["num_layers"]
        self.layers_without_hook: frozenset[int] = frozenset()
        """Layers whose forward pre-hook never calls ``wait_for_layer_load`` (a model or a compiled
        graph that skips it): a test sets it; TensorRT-LLM's decoder layers all call it."""
        self.heads = geometry["num_kv_heads"] // self.tp
        self.head_offset = (rank % self.tp) * self.heads
        self.head_dim = geometry["head_dim"]
        self.kv_factor = geometry["kv_factor"]
        self.dtype = kv_cache_dtype(llm_args)
        # One pool per KVCacheManagerV2 layer group (one for the whole model but with VSWA), each
        # [num_blocks, its layers, kv_factor, heads * tokens_per_block * head_dim].
        groups = layer_groups(geometry)
        self.windows = [window for window, _layers in groups]
        self.pools = [
            torch.zeros(
                geometry["num_blocks"], len(layers), self.kv_factor, self.heads * self.block * self.head_dim,
                dtype=self.dtype,
            )
            for _window, layers in groups
        ]  # fmt: skip
        self.pool = self.pools[0]
        self.place = {layer: (g, i) for g, (_w, layers) in enumerate(groups) for i, layer in enumerate(layers)}
        """Model layer -> (its layer group, its index in the group's pool)."""
        _, worker_cls = load_connector_classes(llm_args)
        self.worker = worker_cls(llm_args)
        self.worker.register_forward_pass_callable()
        if kv_manager_v2:  # KVCacheManagerV2 registers its pages as a layout
            from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import describe_pools

            pools = [(pool, layers, window) for pool, (window, layers) in zip(self.pools, groups, strict=True)]
            self.worker.register_kv_cache_layout(describe_pools(pools, self.block))
        elif len(groups) > 1:
            raise ValueError("variable sliding-window attention with a KV connector needs KVCacheManagerV2")
        else:
            self.worker.register_kv_caches(self.pool)
        self.mismatches = 0
        self.reservations = bool(geometry.get("prefix_reservations"))
        """The manager polls ``get_finished_prefix_loads`` (prefix reservations enabled)."""

    def _block_view(self, block: int, layer: int) -> torch.Tensor:
        group, index = self.place[layer]
        return self.pools[group][block, index].view(self.kv_factor, self.heads, self.block, self.head_dim)

    def _read_from(self, layer: int, start: int) -> int:
        """The first position the forward of tokens ``start`` on reads in ``layer``'s group: its
        sliding window's, from the first query's (0: full attention)."""
        window = self.windows[self.place[layer][0]]
        return 0 if window is None else max(0, start + 1 - window)

    def step(
        self,
        meta: Any,
        work: list[tuple[int, list[int], list[int], int, int]],
        overwritten: list[list[int]],
        block_copies: list[tuple[int, int]],
    ) -> dict[str, Any]:
        """``block_copies`` (partial reuse, from prepare_resources), bind metadata, start_load_kv,
        per-layer forward of ``work`` (hashes, blocks, [start, end)) and of other traffic that
        overwrites ``overwritten`` (so stale KV never passes a check), wait_for_save."""
        for src, dst in block_copies:  # partial reuse: one layer group only (the stand-in's VSWA has none)
            self.pool[dst].copy_(self.pool[src])
        self.worker.bind_connector_meta(meta)
        # _kv_connector_start_batch runs outside any try in both executor loops (py_executor.py):
        # an exception leaves the loop, _event_loop_wrapper re-raises, the engine stops.
        try:
            self.worker.start_load_kv(None)
        except Exception as exc:
            raise EngineDied(f"start_load_kv raised {type(exc).__name__}: {exc}") from exc
        try:  # _forward_step: hooks and wait_for_save inside its try; _handle_errors fails every active request
            for layer in range(self.layers):
                if layer not in self.layers_without_hook:
                    self.worker.wait_for_layer_load(layer, None)
                for _rid, hashes, blocks, start, end in work:
                    self._forward_layer(layer, hashes, blocks, start, end)
                group, index = self.place[layer]
                for block in overwritten[group]:
                    self.pools[group][block, index].fill_(-1.0)
                self.worker.save_kv_layer(layer, None)
            self.worker.wait_for_save(None)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.worker._clear_connector_meta()
        partial = {}
        for rid, hashes, blocks, start, end in work:
            self.mismatches += self._check(hashes, blocks, start, end)
            partial[rid] = self._attend(blocks, end)
        return {"partial": partial, "mismatches": self.mismatches}

    def finish(self, new_saving_ids: list[int], new_loading_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Step 6 on this rank: ``get_finished`` with the ids that started saving or loading this
        iteration, then (prefix reservations) ``get_finished_prefix_loads``."""
        done_saving, done_loading = self.worker.get_finished(new_saving_ids, new_loading_ids)
        done_prefix = list(self.worker.get_finished_prefix_loads()) if self.reservations else []
        return list(done_saving), list(done_loading), done_prefix

    def _forward_layer(self, layer: int, hashes: list[int], blocks: list[list[int]], start: int, end: int) -> None:
        h = torch.tensor(hashes[start:end], dtype=torch.int64)
        vals = kv_values(h, layer, self.head_offset, self.heads, self.head_dim, self.dtype)[: self.kv_factor]
        pages = blocks[self.place[layer][0]]
        for pos in range(start, end):
            page = pages[pos // self.block]
            if page < 0:
                raise RuntimeError(f"stand-in: the forward writes position {pos} of a block without a page")
            view = self._block_view(page, layer)
            view[:, :, pos % self.block, :] = vals[:, :, pos - start, :]

    def _check(self, hashes: list[int], blocks: list[list[int]], start: int, end: int) -> int:
        """KV positions (block x layer) the forward of ``[start, end)`` reads that differ from the
        deterministic forward: every block of a full-attention layer, a sliding layer's window."""
        bad = 0
        h = torch.tensor(hashes[:end], dtype=torch.int64)
        for layer in range(self.layers):
            expected = kv_values(h, layer, self.head_offset, self.heads, self.head_dim, self.dtype)[: self.kv_factor]
            pages = blocks[self.place[layer][0]]
            for b in range(self._read_from(layer, start) // self.block, (end + self.block - 1) // self.block):
                lo, hi = b * self.block, min(end, (b + 1) * self.block)
                if pages[b] < 0:
                    bad += 1  # the window reads a block without a page
                    continue
                got = self._block_view(pages[b], layer)[:, :, : hi - lo, :]
                if not _bit_equal(got, expected[:, :, lo:hi, :]):
                    bad += 1
        return bad

    def _attend(self, blocks: list[list[int]], end: int) -> int:
        """A stand-in for attention: a checksum of the KV the last position's query reads from the pools
        (a sliding layer: its window), whatever positions this forward computed."""
        total = 0
        for layer in range(self.layers):
            pages = blocks[self.place[layer][0]]
            for b in range(self._read_from(layer, end - 1) // self.block, (end + self.block - 1) // self.block):
                if pages[b] < 0:
                    continue
                n = min(self.block, end - b * self.block)
                view = self._block_view(pages[b], layer)
                total += int(view[:, :, :n, :].to(torch.int64).sum()) * (b + 1)
        return total

    def close(self) -> None:
        shutdown = getattr(self.worker, "shutdown", None)
        if callable(shutdown):
            shutdown()


@contextlib.contextmanager
def commits_lagging(seconds: float, on_first: Callable[[], None] | None = None) -> Iterator[None]:
    """Every COMMIT of this process reaches the server ``seconds`` late, as a busy rank's may
    (TensorRT-LLM's ranks never promise to finish a save together); ``on_first`` runs when the first
    one is due to leave, its PREPARE answered and its copies done (a fault can land there)."""
    from kvoffload.connector.backends.committer import Committer

    send = Committer.send
    first = [on_first]

    def late(self: Any, item: Any) -> None:
        hook, first[0] = first[0], None
        if hook is not None:
            hook()
        time.sleep(seconds)
        send(self, item)

    Committer.send = late  # type: ignore[method-assign]
    try:
        yield
    finally:
        Committer.send = send  # type: ignore[method-assign]


def _follower_main(
    conn: Any,
    rank: int,
    llm_args: Any,
    geometry: dict[str, int],
    kv_manager_v2: bool,
    env: dict[str, str],
    commit_lag_s: float,
) -> None:
    os.environ.update(env)
    lagging = commits_lagging(commit_lag_s) if commit_lag_s else contextlib.nullcontext()
    with lagging:
        _serve_rank(conn, rank, llm_args, geometry, kv_manager_v2)


def _serve_rank(conn: Any, rank: int, llm_args: Any, geometry: dict[str, int], kv_manager_v2: bool) -> None:
    try:
        state = RankState(rank, llm_args, geometry, kv_manager_v2)
        conn.send({"ready": True})
        while True:
            msg = conn.recv()
            if msg[0] == "step":
                conn.send(state.step(msg[1], msg[2], msg[3], msg[4]))
            elif msg[0] == "finish":
                conn.send(state.finish(msg[1], msg[2]))
            elif msg[0] == "stall_heartbeat":  # the heartbeat thread's beats do nothing from now on
                state.worker.backend.heartbeat_once = lambda: None
                conn.send(None)
            elif msg[0] == "stop":
                state.close()
                conn.send(None)
                return
    except EngineDied as exc:
        conn.send({"engine_died": str(exc)})
    except Exception:
        conn.send({"fatal": traceback.format_exc()})


def settle_commits(timeout_s: float = 10.0) -> bool:
    """Wait until this process's deferred COMMITs were answered: another process's lookup finds
    only committed chunks (a test's synchronisation, not the engine's)."""
    from kvoffload.connector.runtime import engine_process

    return engine_process().pending.wait_idle(timeout_s)


def _attention_dp_rank_main(conn: Any, llm_args: Any, rank: int, env: dict[str, str], kwargs: dict[str, Any]) -> None:
    os.environ.update(env)
    try:
        ex = StandinExecutor(llm_args, attention_dp_rank=rank, env=env, **kwargs)
    except Exception:
        conn.send({"fatal": traceback.format_exc()})
        return
    conn.send({"ready": True})
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "run":
                conn.send({"results": ex.run(arg)})
            elif cmd == "idle":
                ex.idle(arg)
                conn.send({})
            elif cmd == "evict":
                conn.send({"evicted": ex.evict_device_cache()})
            elif cmd == "report":
                conn.send(
                    {"kv_mismatches": ex.kv_mismatches, "tracked_requests": len(ex.scheduler.tracked_request_ids)}
                )
            elif cmd == "settle":
                conn.send({"settled": settle_commits()})
            elif cmd == "stop":
                ex.close()
                conn.send({})
                return
        except Exception:
            conn.send({"fatal": traceback.format_exc()})


class AttentionDpRank:
    """Another attention-DP rank: a whole ``StandinExecutor(attention_dp_rank=rank)`` in its own process,
    as each DP rank is its own MPI process with its own scheduler, worker and pool."""

    def __init__(self, llm_args: Any, rank: int, env: dict[str, str], **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_attention_dp_rank_main, args=(child, llm_args, rank, env, kwargs), daemon=True)
        self._proc.start()
        self._call(None)

    def _call(self, msg: tuple[str, Any] | None) -> dict[str, Any]:
        if msg is not None:
            self._conn.send(msg)
        reply = self._conn.recv()
        if "fatal" in reply:
            raise RuntimeError(f"attention-DP rank process failed:\n{reply['fatal']}")
        return dict(reply)

    def run(self, prompts: list[PromptRequest]) -> list[RequestResult]:
        return list(self._call(("run", prompts))["results"])

    def idle(self, iterations: int) -> None:
        self._call(("idle", iterations))

    def evict_device_cache(self) -> int:
        return int(self._call(("evict", None))["evicted"])

    def report(self) -> dict[str, Any]:
        return self._call(("report", None))

    def settle(self) -> bool:
        """Wait until this rank's deferred COMMITs were answered (what it stored is findable)."""
        return bool(self._call(("settle", None))["settled"])

    def close(self) -> None:
        with contextlib.suppress(EOFError, OSError, RuntimeError):
            self._call(("stop", None))
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


class StandinExecutor:
    """Runs requests through a connector like TensorRT-LLM's PyExecutor would (see module docstring)."""

    def __init__(
        self,
        llm_args: Any,
        *,
        num_blocks: int = 64,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_dim: int = 8,
        context_chunk_size: int | None = None,
        env: dict[str, str] | None = None,
        version: str = "main",
        enable_partial_reuse: bool | None = None,
        overlap_scheduler: bool = False,
        attention_dp_rank: int = 0,
        follower_commit_lag_s: float = 0.0,
        mla: bool = False,
        sliding_window: int = 0,
        layer_windows: tuple[int | None, ...] = (),
    ) -> None:
        """``follower_commit_lag_s``: ranks other than 0 send each COMMIT this much later (``commits_lagging``);
        ``mla``: DeepSeek's multi-head latent attention, one latent head of ``head_dim`` per layer and no
        value half (``kv_factor`` 1, the pool V1 builds for ``SELFKONLY`` and V2 registers with one "key"
        buffer), the same bytes on every tensor-parallel rank;
        ``sliding_window``: every layer attends to this many tokens (0: all), one V2 layer group with that
        ``window_size`` (the -1 pages of passed blocks are not modelled: the connector refuses the layout);
        ``layer_windows``: variable sliding-window attention (GPT-OSS, Gemma), each layer's window (None:
        full attention) repeated over the layers as ``max_attention_window``: one V2 layer group per
        window, each its own pages; a sliding group's pages behind its window go back to the pool after
        each forward and read -1 (:meth:`_release_stale`), device reuse holds only a sliding group's
        window before the match end (``_prune_match``), and a connector's loaded prefix gets sliding
        pages only inside the window at its end (``_resize_for_connector_prefix``). Partial reuse and
        asynchronous loads are not modelled with several groups (refused)."""
        _ensure_paths()
        self.llm_args = llm_args
        self.kv_manager_v2 = resolve_kv_cache_manager(llm_args, version)
        """KVCacheManagerV2 (main): pages per chunk, the honoured count may fall short of the offer
        (a grow that fails), the layout registration, ``block_hashes == []``."""
        self.attention_dp = bool(getattr(llm_args, "enable_attention_dp", False))
        """Attention DP (main; py_executor_creator + KvCacheConnectorManager): this executor is one DP
        rank, with its own scheduler and worker, its own requests and pool, whole KV heads; no
        broadcast of the scheduler's answers and no allgather in get_finished."""
        self.attention_dp_rank = attention_dp_rank if self.attention_dp else None
        self.version = version
        self.behaviour = TRTLLM_VERSIONS[version]
        self.partial_reuse = (
            bool(getattr(llm_args.kv_cache_config, "enable_partial_reuse", True))
            if enable_partial_reuse is None
            else enable_partial_reuse
        )
        """``KvCacheConfig.enable_partial_reuse`` (on by default, as upstream) unless given here."""
        self.overlap = overlap_scheduler
        self.overlap_extra_steps = 0
        """``_executor_loop_overlap`` (TensorRT-LLM's default): batch N+1 is scheduled and its forward
        enqueued before batch N's sampling is read, so a request that sampled its last token in N runs
        one more (discarded) decode step in N+1, and its ``request_finished`` comes after that forward."""
        self.block = llm_args.kv_cache_config.tokens_per_block
        self.chunk = context_chunk_size
        self.tp = llm_args.tensor_parallel_size
        geometry = {
            "num_blocks": num_blocks,
            "num_layers": num_layers,
            "num_kv_heads": 1 if mla else num_kv_heads,
            "head_dim": head_dim,
            "kv_factor": 1 if mla else 2,
            "window": sliding_window,
            "layer_windows": layer_windows,
        }
        groups = layer_groups(geometry)
        self.group_windows = [window for window, _layers in groups]
        self.primary_group = next((g for g, w in enumerate(self.group_windows) if w is None), 0)
        """The layer group ``self.blocks`` serves (``req.block_ids``): the first full-attention one."""
        self.sliding = [
            (g, w, BlockManager(num_blocks)) for g, w in enumerate(self.group_windows) if g != self.primary_group
        ]
        """The other layer groups (VSWA): ``(layer group id, window, its pages)``; ``req.group_pages`` aligned."""
        if self.sliding and not self.kv_manager_v2:
            raise ValueError("variable sliding-window attention with a KV connector needs KVCacheManagerV2")
        if self.sliding and self.partial_reuse:
            raise ValueError(
                "stand-in: partial reuse is not modelled across layer groups; pass enable_partial_reuse=False"
            )
        self._other_group_traffic: list[list[int]] = [[] for _ in self.sliding]
        os.environ[WORLD_ENV] = str(self.tp)
        self.blocks = BlockManager(num_blocks)
        self.followers: list[tuple[Any, Any]] = []
        child_env = dict(env or {})
        child_env[WORLD_ENV] = str(self.tp)
        ctx = mp.get_context("spawn")
        scheduler_cls, worker_cls = load_connector_classes(llm_args)
        self.reservations = False
        """Prefix reservations (main's KVCacheManagerV2 with a connector implementing the trio)."""
        if self.kv_manager_v2 and self.behaviour.prefix_reservations:
            from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import prefix_reservations_enabled

            self.reservations = prefix_reservations_enabled(worker_cls, scheduler_cls)
        geometry["prefix_reservations"] = self.reservations
        if self.attention_dp:
            if not self.behaviour.attention_dp_with_connector:
                raise ValueError(f"attention DP with a KV connector does not exist on TensorRT-LLM {version}")
            if not self.kv_manager_v2:  # main's test_adp_rejects_a_resolved_v1_manager
                raise ValueError("attention DP with a KV connector requires KVCacheManagerV2")
            from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import validate_attention_dp

            validate_attention_dp(worker_cls, scheduler_cls)  # KvCacheConnectorManager.__init__
        for rank in range(1, 1 if self.attention_dp else self.tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_follower_main,
                args=(child, rank, llm_args, geometry, self.kv_manager_v2, child_env, follower_commit_lag_s),
                daemon=True,
            )
            proc.start()
            self.followers.append((parent, proc))
        # TensorRT-LLM builds rank 0's scheduler and worker concurrently; sequential is equivalent here.
        self.rank0 = RankState(attention_dp_rank if self.attention_dp else 0, llm_args, geometry, self.kv_manager_v2)
        self.scheduler = scheduler_cls(llm_args)
        for parent, _proc in self.followers:
            reply = parent.recv()
            if "fatal" in reply:
                raise RuntimeError(f"rank process failed to start:\n{reply['fatal']}")
        self.scheduler.wait_for_initialization()
        self.saving: dict[int, StandinLlmRequest] = {}
        self.results: dict[int, RequestResult] = {}
        self.iterations = 0
        self._mismatches = 0
        self._announced: set[int] = set()
        self._paused: list[StandinLlmRequest] = []
        """KVCacheManagerV2 requests whose allocation was destroyed for want of pages: replayed next."""
        self._done_votes: dict[int, int] = {}
        self._other_traffic: list[int] = []
        self._other_ids = 0
        self.dummy_forwards = 0
        """Iterations an idle attention-DP rank ran with a dummy request (the others were busy)."""
        self.dummy_pages_taken = [0 for _ in self.group_windows]
        """Pages the dummy requests took, per layer group (in layer-group id order)."""
        self.parked: dict[int, StandinLlmRequest] = {}
        """Requests loading asynchronously (``(n, True)``): out of every batch until all ranks report the load."""
        self._loading_new: list[int] = []
        self._loading_votes: dict[int, int] = {}
        self._next_reservation_id = 1
        """Reservation ids only grow: a replayed allocation's stale completion names an old one."""
        self._reserved: dict[int, StandinLlmRequest] = {}
        """Accepted prefix loads not yet finished on every rank, by reservation id."""
        self._prefix_workers: dict[int, set[int]] = {}
        """Dispatched reservations not yet finished: the ranks that reported each finished."""
        self.ignored_prefix_completions = 0
        """Reports of reservation ids no dispatched load carried (upstream ignores them)."""
        self._terminating: dict[int, StandinLlmRequest] = {}
        """Cancelled requests whose prefix load still owns their allocation (``defer_load_termination``)."""
        self.reservations_asked: list[tuple[int, int, tuple[int, bool]]] = []
        """``(reservation id, num_computed_tokens, answer)`` of every ``reserve_prefix``."""
        self.reservation_releases: list[tuple[int, int, int]] = []
        """``(reservation id, start, end)`` of every ``release_prefix_reservation``, in order."""
        self.async_loads = 0
        self.short_honours = 0
        self.grow_fails_every = 0
        """Every n-th grow fails whatever the pool holds (other traffic's pressure, which the stand-in does
        not run); 0: grows fail only when the pool cannot give the pages."""
        self._grows = 0
        self.load_deadline_s = ADP_LOAD_DEADLINE_S
        self.pauses = 0
        """KVCacheManagerV2 allocations destroyed for want of pages (the request replayed)."""
        """KVCacheManagerV2 offers honoured in part (a grow the pool could not give)."""

    @property
    def kv_mismatches(self) -> int:
        """KV positions (block x layer) that differed from the deterministic forward, max over ranks."""
        return self._mismatches

    def evict_device_cache(self) -> int:
        """Evict every reusable-but-unused block on all ranks (request 1's KV leaves the GPU).

        As in TensorRT-LLM, evicted blocks are rewritten only when another request gets them: the
        next iteration hands them to "other traffic" (a request the connector sees in
        ``new_requests`` with those blocks, which then finishes), whose forward overwrites them.
        """
        evicted = self.blocks.evict_all()
        self._other_traffic.extend(evicted)
        for pending, (_g, _w, pages) in zip(self._other_group_traffic, self.sliding, strict=True):
            pending.extend(pages.evict_all())
        return len(evicted)

    def _dummy_pages(self) -> list[list[int]]:
        """``_pad_attention_dp_dummy_request``: an idle DP rank joins the other ranks' forward with a
        dummy generation request, which the connector never sees (``build_scheduler_output`` skips
        ``is_dummy_request``). KVCacheManagerV2's ``add_dummy_requests`` (@1fe0b08f) gives it a whole
        ``_KVCache``: one token of history plus the one it generates, so one page in every layer group
        (a sliding group's too: nothing is behind its window yet), each taken as any allocation takes
        it (a free page, else the least recently used reusable one, evicted) and written by the forward."""
        self.dummy_forwards += 1
        pages: list[list[int]] = [[] for _ in self.group_windows]
        pages[self.primary_group] = self.blocks.allocate(1)
        for g, _w, pool in self.sliding:
            pages[g] = pool.allocate(1)
        self.dummy_pages_taken = [taken + len(p) for taken, p in zip(self.dummy_pages_taken, pages, strict=True)]
        return pages

    def _other_traffic_request(self, output: Any) -> StandinLlmRequest | None:
        """Give this iteration's still-free evicted blocks to a request of other traffic."""

        taken = [b for b in self._other_traffic if b in self.blocks.free]
        self._other_traffic = []
        taken_groups = []
        for pending, (_g, _w, pages) in zip(self._other_group_traffic, self.sliding, strict=True):
            taken_groups.append([b for b in pending if b in pages.free])
            pending.clear()
        if not taken and not any(taken_groups):
            return None
        for block in taken:
            self.blocks.free.remove(block)
            self.blocks.refs[block] = 1
        for ids, (_g, _w, pages) in zip(taken_groups, self.sliding, strict=True):
            for block in ids:
                pages.free.remove(block)
                pages.refs[block] = 1
        self._other_ids -= 1
        req = StandinLlmRequest(PromptRequest(self._other_ids, []))
        width = max([len(taken), *map(len, taken_groups)])  # every group's list as long (-1: no page)
        req.block_ids = taken + [-1] * (width - len(taken))
        req.group_pages = [ids + [-1] * (width - len(ids)) for ids in taken_groups]
        output.new_requests.append(self._request_data(req, [], 0, 0, first=True))
        return req

    # --- layer groups (VSWA) ----------------------------------------------------------------------
    def pages_by_group(self, req: StandinLlmRequest) -> list[list[int]]:
        """The request's pages per layer group, in layer-group id order (``get_page_indices_by_layer_group``)."""
        out: list[list[int]] = [[] for _ in self.group_windows]
        out[self.primary_group] = list(req.block_ids)
        for (g, _w, _pages), ids in zip(self.sliding, req.group_pages, strict=True):
            out[g] = list(ids)
        return out

    def _request_data(self, req: StandinLlmRequest, tokens: list[int], computed: int, scheduled: int, *,
                      first: bool, new_blocks: list[int] | None = None,
                      new_group_pages: list[list[int]] | None = None) -> Any:  # fmt: skip
        """One ``RequestData``: a first report lists every page, a later one the pages added since; with
        several layer groups the flat list is empty and the per-group lists carry -1 in place."""
        from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData

        blocks = list(req.block_ids) if first else list(new_blocks or [])
        if not self.sliding:
            return RequestData(req.request_id, tokens, blocks, computed, scheduled, cache_salt=req.salt)
        by_group: list[list[int]] = [[] for _ in self.group_windows]
        by_group[self.primary_group] = blocks
        extra = req.group_pages if first else (new_group_pages or [[] for _ in self.sliding])
        for (g, _w, _pages), ids in zip(self.sliding, extra, strict=True):
            by_group[g] = list(ids)
        return RequestData(req.request_id, tokens, [], computed, scheduled, cache_salt=req.salt,
                           new_block_ids_by_layer_group=by_group)  # fmt: skip

    def _first_live(self, history: int, window: int) -> int:
        """``AttnLifeCycle.get_stale_range`` (_life_cycle_registry.py @1548780d, no sink tokens): a
        sliding group holds pages from this block on once ``history`` tokens have KV."""
        return max(0, (history + 1 - window) // self.block)

    def _prune_match(self, req: StandinLlmRequest, salt: str, reused: list[int]) -> list[int]:
        """``BlockRadixTree._prune_match`` (@065ff9e9): the device match is cut back until every sliding
        group holds its window before the match's end; those pages are taken (the others read -1)."""
        n = len(reused)
        while n > 0:
            short = [
                o for _g, window, pages in self.sliding
                for o in range(self._first_live(n * self.block, window), n)
                if pages.reuse.get((salt, req.reuse_hashes[(o + 1) * self.block - 1])) is None
            ]  # fmt: skip
            if not short:
                break
            n = min(short)
        self.blocks.release(reused[n:], {})
        req.group_pages = []
        for _g, window, pages in self.sliding:
            live = self._first_live(n * self.block, window)
            ids = [-1] * live + [
                pages.reuse[(salt, req.reuse_hashes[(o + 1) * self.block - 1])] for o in range(live, n)
            ]
            for page in ids[live:]:
                pages.refs[page] = pages.refs.get(page, 0) + 1
                pages.cached_free.pop(page, None)
            req.group_pages.append(ids)
        return reused[:n]

    def _grow_groups(self, req: StandinLlmRequest, history: int) -> list[list[int]]:
        """Pages of the other groups for the ordinals the primary group has and they do not yet: none
        for those already behind the window at ``history`` (``resize(capacity, history)``)."""
        added = []
        for (_g, window, pages), ids in zip(self.sliding, req.group_pages, strict=True):
            new = [
                -1 if o < self._first_live(history, window) else pages.allocate(1)[0]
                for o in range(len(ids), len(req.block_ids))
            ]
            ids.extend(new)
            added.append(new)
        return added

    def _release_stale(self, req: StandinLlmRequest, history: int) -> None:
        """``_unlock_stale_blocks``: once ``history`` tokens have KV, a sliding group's pages behind
        its window leave the request, committed (reusable until evicted) if full, else freed."""
        for (_g, window, pages), ids in zip(self.sliding, req.group_pages, strict=True):
            for o in range(min(self._first_live(history, window), len(ids))):
                if ids[o] >= 0:
                    pages.release([ids[o]], self._commit_keys(req, {o: ids[o]}))
                    ids[o] = -1

    def _release_pages(self, req: StandinLlmRequest, commit: bool) -> None:
        """Every page of the request goes back (full blocks committed for reuse when ``commit``)."""
        self.blocks.release([b for b in req.block_ids if b >= 0], self._commit_keys(req) if commit else {})
        for (_g, _w, pages), ids in zip(self.sliding, req.group_pages, strict=True):
            held = {o: page for o, page in enumerate(ids) if page >= 0}
            pages.release(list(held.values()), self._commit_keys(req, held) if commit else {})
        req.group_pages = [[] for _ in self.sliding]

    def _request_finished(self, req: StandinLlmRequest) -> bool:
        if self.sliding:
            return bool(self.scheduler.request_finished_by_layer_group(req, self.pages_by_group(req)))
        return bool(self.scheduler.request_finished(req, list(req.block_ids)))

    def run(self, prompts: list[PromptRequest], timeout_s: float = 300.0) -> list[RequestResult]:
        """Admit ``prompts`` (each ``arrive_after`` iterations from now) and iterate until every one
        finished (or failed) and no save or load is in flight."""
        arrivals = sorted((StandinLlmRequest(p) for p in prompts), key=lambda r: r.arrive_after)
        active: list[StandinLlmRequest] = []
        deadline = time.monotonic() + timeout_s
        step = 0
        while arrivals or active or self.saving or self.parked or self._paused or self._terminating:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"requests still running after {timeout_s}s; saving={sorted(self.saving)} parked={sorted(self.parked)}"
                    f" loads owning cancelled requests={sorted(self._terminating)}"
                )
            pending = [r for r in arrivals if r.arrive_after <= step]
            arrivals = arrivals[len(pending) :]
            if not pending and not active and not self._paused:
                time.sleep(0.002)  # only async saves or loads left: TensorRT-LLM keeps iterating, idle
            self._iteration(pending, active)
            step += 1
        return [self.results[p.request_id] for p in prompts]

    def idle(self, iterations: int) -> None:
        """Iterations with no request of this executor's own, as a DP rank idles while the others
        work (under attention DP each one is a dummy forward)."""
        for _ in range(iterations):
            self._iteration([], [])

    def _commit_keys(
        self, req: StandinLlmRequest, pages: dict[int, int] | None = None
    ) -> dict[int, tuple[str, int, int, tuple[int, ...] | None]]:
        """Reuse keys of the request's full blocks, by page: the primary group's, or ``pages`` (ordinal -> page)."""
        salt, b = req.salt or "", self.block
        full = min(req.context_pos, len(req.tokens)) // b
        if pages is None:
            pages = dict(enumerate(req.block_ids))
        return {
            page: (salt, req.reuse_hashes[(i + 1) * b - 1], req.reuse_hashes[i * b - 1] if i else req.reuse_seed,
                   None if req.has_multimodal_in(i * b, (i + 1) * b) else tuple(req.tokens[i * b : (i + 1) * b]))
            for i, page in pages.items() if i < full and page >= 0
        }  # fmt: skip

    def _iteration(self, new: list[StandinLlmRequest], active: list[StandinLlmRequest]) -> None:
        from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import SchedulerOutput

        self.iterations += 1
        self._check_load_deadline()
        output = SchedulerOutput(attention_dp_rank=self.attention_dp_rank)
        work: list[tuple[int, list[int], list[int], int, int]] = []
        scheduled: list[tuple[StandinLlmRequest, int, int]] = []
        block_copies: list[tuple[int, int]] = []
        # Step 2: first context chunk of new requests: device reuse -> connector -> allocate.
        new, self._paused = self._paused + list(new), []
        replays: list[StandinLlmRequest] = []
        for req in new:
            allocated = self._allocate(req, block_copies)
            if allocated is None:
                self._paused.append(req)  # V2's capacity scheduler admits a request once its first chunk fits
                continue
            matched, is_async = allocated
            if req.replay_on_admission:
                # MAX_UTILIZATION destroys the allocation it just made (reset_request_state): the blocks
                # go back to the pool, where the requests admitted after it may take them, and the
                # request is replayed: asked again, allocated again.
                req.replay_on_admission = False
                self._release_unstarted_prefix_load(req)
                dropped = [(src, dst) for src, dst in block_copies if dst in req.block_ids]
                block_copies[:] = [copy for copy in block_copies if copy not in dropped]
                self.blocks.release([src for src, _dst in dropped], {})
                self._release_pages(req, False)
                req.block_ids, req.context_pos = [], 0
                replays.append(req)
                continue
            self._admit(req, matched, is_async, output, scheduled, active)
        for req in replays:
            allocated = self._allocate(req, block_copies)
            if allocated is None:
                self._paused.append(req)
                continue
            self._admit(req, *allocated, output, scheduled, active)
        new_ids = {r.request_id for r in new}
        waiting: list[StandinLlmRequest] = []
        for req in active:
            if req.request_id in new_ids:
                continue
            if req.returning:  # back from an asynchronous load: first report, computed_position counts the load
                req.returning = False
                n = self._first_chunk_len(req)
                output.new_requests.append(self._request_data(req, list(req.tokens), req.context_pos, n, first=True))
                req.reported_blocks = len(req.block_ids)
                scheduled.append((req, req.context_pos, req.context_pos + n))
            elif req.context_pos < req.prompt_len:  # later context chunk
                n = self._chunk_len(req)
                if self.kv_manager_v2 and self._pages_short(req, req.context_pos + n):
                    waiting.append(req)  # V2 schedules a chunk only when its pages fit
                    continue
                new_pages = self._grow_to(req, req.context_pos + n) if self.kv_manager_v2 else []
                new_group_pages = self._grow_groups(req, req.context_pos)
                output.cached_requests.append(
                    self._request_data(req, [], req.context_pos, n, first=False, new_blocks=new_pages,
                                       new_group_pages=new_group_pages)
                )  # fmt: skip
                scheduled.append((req, req.context_pos, req.context_pos + n))
            else:  # generation: KV of the last sampled token
                pos = len(req.tokens) - 1
                new_blocks: list[int] = []
                if pos // self.block >= len(req.block_ids):
                    if self.kv_manager_v2 and self._pages_short(req, pos + 1):
                        waiting.append(req)
                        continue
                    new_blocks = self.blocks.allocate(1)
                    req.block_ids.extend(new_blocks)
                new_group_pages = self._grow_groups(req, pos)
                output.cached_requests.append(
                    self._request_data(req, [req.tokens[-1]], pos, 1, first=False, new_blocks=new_blocks,
                                       new_group_pages=new_group_pages)
                )  # fmt: skip
                scheduled.append((req, pos, pos + 1))
        if waiting and not scheduled:
            self._pause_for_pages(active)
        for req, start, end in scheduled:
            work.append((req.request_id, req.hashes, self.pages_by_group(req), start, end))
        other = self._other_traffic_request(output)
        overwritten: list[list[int]] = [[] for _ in self.group_windows]
        if other is not None:
            overwritten = [[b for b in ids if b >= 0] for ids in self.pages_by_group(other)]
        dummy = self._dummy_pages() if self.attention_dp and not active and not self.parked else None
        # Step 3: metadata on rank 0, "broadcast" to all ranks; steps 3-4 and 6 on every rank.
        meta = self.scheduler.build_connector_meta(output)
        for group, pages in enumerate(dummy or []):
            overwritten[group] += pages
        replies = self._step_all_ranks(meta, work, overwritten, block_copies)
        if dummy is not None:  # the dummy ends with the iteration: its pages go back, never committed
            self.blocks.release(dummy[self.primary_group], {})
            for g, _w, pages in self.sliding:
                pages.release(dummy[g], {})
        self.blocks.release([src for src, _dst in block_copies], {})
        if other is not None:  # other traffic's request ends: its blocks go back to the pool
            self._request_finished(other)
            self._release_pages(other, False)
        errors = [r["error"] for r in replies if "error" in r]
        if errors:  # _handle_errors(error_msg): every active request, not only this batch
            for req in list(active):
                self._fail(req, active, errors[0])
            return
        self._mismatches = max(r["mismatches"] for r in replies)
        # Forward done: positions computed, then sampling for requests whose prompt is complete.
        finished: list[StandinLlmRequest] = []
        for req, start, end in scheduled:
            if end <= req.prompt_len:
                req.result.computed_prompt_tokens += end - start
            req.context_pos = end
            self._release_stale(req, end)  # update_context_resources, after the forward
            if req.finished_unseen:  # overlap: the extra step ran; _update_requests now sees it finished
                self.overlap_extra_steps += 1
                finished.append(req)
                continue
            if end >= len(req.tokens):
                checksum = sum(r["partial"][req.request_id] for r in replies)
                token = (checksum + req.hashes[end - 1]) % VOCAB
                req.generated.append(token)
                req.result.output_tokens.append(token)
                if len(req.generated) >= req.max_new_tokens and not self.overlap:
                    finished.append(req)
                elif len(req.generated) >= req.max_new_tokens:
                    req.finished_unseen = True  # batch N+1 already holds it: one more decode step
                    req.append(token)
                else:
                    req.append(token)
        # Step 5: request_finished; True holds the blocks until every rank reports the save done.
        for req in finished:
            active.remove(req)
            req.is_finished = True
            self.results[req.request_id] = req.result
            if self._request_finished(req):
                self.saving[req.request_id] = req
            else:
                self._release_pages(req, True)
        # _handle_canceled_requests, after _send_kv_async: a cancelled (or client-aborted) request is
        # marked finished and _handle_responses frees its blocks; the next prepare_resources may
        # hand them to another request.
        for req in list(active):
            req.iterations += 1
            if req.cancel_after is not None and req.iterations >= req.cancel_after:
                req.result.cancelled = True
                self.results[req.request_id] = req.result
                active.remove(req)
                if req.prefix_load is not None:  # defer_load_termination: its load owns the allocation
                    self._terminating[req.request_id] = req
                    continue
                self._terminate(req, self._commit_keys(req))
        # A parked request is in active_requests too: _handle_canceled_requests finishes it and
        # _handle_responses -> _terminate_request frees its blocks in this same iteration (py_executor.py
        # @0004396 has no caller of has_pending_transfers), whatever its load is doing; the C++
        # storeBlocksForReuse keeps them for reuse under its prompt, its loaded tokens included.
        for req in list(self.parked.values()):
            req.iterations += 1
            if req.cancel_after is not None and req.iterations >= req.cancel_after:
                req.result.cancelled = True
                self.results[req.request_id] = req.result
                del self.parked[req.request_id]
                if req.prefix_load is not None:  # defer_load_termination: its load owns the allocation
                    self._terminating[req.request_id] = req
                    continue
                self._terminate(req, self._commit_keys(req))
        # Step 6: get_finished with the ids that started saving or loading now; act on ids every rank returned.
        newly_saving = [rid for rid in self.saving if rid not in self._announced]
        self._announced.update(newly_saving)
        newly_loading, self._loading_new = self._loading_new, []
        for parent, _ in self.followers:
            parent.send(("finish", newly_saving, newly_loading))
        per_rank = [self.rank0.finish(newly_saving, newly_loading)] + [parent.recv() for parent, _ in self.followers]
        ranks = 1 + len(self.followers)
        saved = returned_by_every_rank(self._done_votes, [ids for ids, _, _ in per_rank], ranks)
        self._finish_prefix_loads([prefix for _, _, prefix in per_rank], active)
        for rid in returned_by_every_rank(self._loading_votes, [loaded for _, loaded, _ in per_rank], ranks):
            req = self.parked.pop(rid, None)
            if req is None:  # cancelled while parked: freed at once, the late report is ignored
                continue
            req.returning = True  # CONTEXT_INIT again; should_add_sequence is False: no second lookup
            active.append(req)
        for rid in saved:
            req = self.saving.pop(rid)
            self._announced.discard(rid)
            self._release_pages(req, True)

    def _allocate(self, req: StandinLlmRequest, block_copies: list[tuple[int, int]]) -> tuple[int, bool] | None:
        """``prepare_resources`` for a first context chunk: device reuse, the connector's answer,
        allocation, ``update_state_after_alloc``; None when V2 cannot give its first chunk's pages
        (the request is not scheduled, so the connector is not asked)."""
        salt = req.salt or ""
        max_reuse = ((req.prompt_len - 1) // self.block) * self.block
        reused = self.blocks.match(salt, req.reuse_hashes, self.block, max_reuse)
        if self.sliding:
            reused = self._prune_match(req, salt, reused)
        num_reused = len(reused) * self.block
        partial_src, partial = self._match_partial(req, salt, len(reused))
        num_reused += partial
        first_chunk = min(req.prompt_len, num_reused + (self.chunk or req.prompt_len))
        short = self.kv_manager_v2 and -(-first_chunk // self.block) - len(reused) > self.blocks.available()
        reservation_id, matched, is_async = 0, 0, False
        if self.reservations:  # asked in the scheduling pass, once per allocation, before its pages fit
            reservation_id, matched, is_async = self._reserve(req, num_reused)
        elif not short:  # the binding query: only once the batch is final (prepare_resources)
            matched, is_async = self.scheduler.get_num_new_matched_tokens(req, num_reused)
        if short:
            # The candidate is not scheduled: release_unused_connector_reservations gives its whole
            # range back and drops the allocation; a later pass asks again under a newer id.
            if reservation_id and matched:
                self._release_reservation(req, reservation_id, num_reused, num_reused + matched)
            self.blocks.release(reused + ([partial_src] if partial_src is not None else []), {})
            for (_g, _w, pages), ids in zip(self.sliding, req.group_pages, strict=True):
                pages.release([page for page in ids if page >= 0], {})
            req.group_pages = [[] for _ in self.sliding]
            return None
        if is_async and matched == 0:
            raise RuntimeError("(0, True) is rejected by TensorRT-LLM")
        if is_async and self.sliding:
            raise NotImplementedError("stand-in: asynchronous loads under several layer groups are not modelled")
        if self.kv_manager_v2:
            honoured, page_tokens = self._v2_serve(req, num_reused, matched)
        else:  # V1 allocates the whole prompt at the first chunk and honours the whole offer
            honoured, page_tokens = matched, req.prompt_len
        if reservation_id and honoured < matched:  # trim_prefix_reservation: the unused tail goes back
            self._release_reservation(req, reservation_id, num_reused + honoured, num_reused + matched)
            is_async = is_async and honoured > 0
        req.block_ids = reused + self.blocks.allocate(-(-page_tokens // self.block) - len(reused))
        req.first_chunk_end = min(page_tokens, req.prompt_len) if self.kv_manager_v2 else None
        req.reused_blocks = reused
        if partial_src is not None:  # copy-on-partial-reuse, in prepare_resources (before start_load_kv)
            block_copies.append((partial_src, req.block_ids[len(reused)]))
        if self.behaviour.records_honoured_tokens:  # commit_new_matched_tokens records it on the request
            req.py_num_connector_matched_tokens = honoured
        if self.sliding:  # _resize_for_connector_prefix: history is the served end
            self._release_stale(req, num_reused + honoured)
            self._grow_groups(req, num_reused + honoured)
        if reservation_id and honoured:  # accept_prefix_load: the pages it writes, every layer group's
            from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import PrefixLoad

            req.prefix_load = PrefixLoad(
                reservation_id=reservation_id, request_id=req.request_id, start=num_reused,
                end=num_reused + honoured, is_async=is_async, block_ids_by_layer_group=self.pages_by_group(req),
                tokens=list(req.tokens), cache_salt=req.salt,
            )  # fmt: skip
        elif self.reservations:  # not read from upstream: the reservation path is not known to call it
            pass
        elif self.sliding:
            self.scheduler.update_state_after_alloc_by_layer_group(req, self.pages_by_group(req))
        else:
            self.scheduler.update_state_after_alloc(req, list(req.block_ids))
        req.context_pos = num_reused + honoured
        req.result.device_reused_tokens = num_reused
        req.result.connector_matched_tokens = honoured
        return honoured, is_async

    def _reserve(self, req: StandinLlmRequest, num_reused: int) -> tuple[int, int, bool]:
        """``KvCacheConnectorManager.reserve_prefix``: a new id (ids only grow), the connector's answer
        checked as the manager checks it: ``(reservation id, tokens, is_async)``."""
        from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import check_reservation_answer

        reservation_id, self._next_reservation_id = self._next_reservation_id, self._next_reservation_id + 1
        matched, is_async = check_reservation_answer(self.scheduler.reserve_prefix(req, num_reused, reservation_id))
        self.reservations_asked.append((reservation_id, num_reused, (matched, is_async)))
        return reservation_id, matched, is_async

    def _v2_serve(self, req: StandinLlmRequest, local: int, offer: int) -> tuple[int, int]:
        """KVCacheManagerV2's ``_apply_connector_matched_prefix`` (kv_cache_manager_v2.py @10b8fbd9 and
        its tests, test_kv_connector_v2_prefix.py): ``(honoured tokens, tokens its pages hold)``.

        Pages cover the local match plus one chunk (``resize_context``); an offer inside them is
        honoured whole; one reaching past them needs a grow to offer + chunk, and when the pool cannot
        give it, the largest whole block inside the pages already held that leaves a token to compute."""
        offer = min(offer, max(0, req.prompt_len - 1 - local))  # the last prompt token stays local
        chunk = self.chunk or req.prompt_len
        capacity = min(req.prompt_len, local + chunk)
        if offer == 0 or local + offer < capacity or self.chunk is None:
            return offer, max(capacity, local + offer + 1)
        target = min(req.prompt_len, local + offer + chunk)
        self._grows += 1
        squeezed = self.grow_fails_every > 0 and self._grows % self.grow_fails_every == 0
        if not squeezed and self.blocks.available() >= -(-target // self.block) - local // self.block:
            return offer, target
        self.short_honours += 1
        fallback_end = ((capacity - 1) // self.block) * self.block
        return max(0, fallback_end - local), capacity

    def _first_chunk_len(self, req: StandinLlmRequest) -> int:
        """The first scheduled chunk: V2 keeps it inside the pages it served (the scheduler's chunk end,
        or the end a grow reached); V1 chunks from the served position."""
        if req.first_chunk_end is not None and req.first_chunk_end > req.context_pos:
            return req.first_chunk_end - req.context_pos
        return self._chunk_len(req)

    def _check_load_deadline(self) -> None:
        """Under attention DP, main's ``_kv_connector_start_batch`` fails the engine on every rank
        when a parked load is not reported by ``get_finished`` within ``_KV_CONNECTOR_LOAD_TIMEOUT_SEC``."""
        if not self.attention_dp:
            return
        now = time.monotonic()
        late = [rid for rid, req in self.parked.items() if now - req.parked_at > self.load_deadline_s]
        if late:
            raise EngineDied(f"KV connector failed: loads of requests {late} timed out (attention DP)")

    def _pause_for_pages(self, active: list[StandinLlmRequest]) -> None:
        """No request can run for want of pages: MAX_UTILIZATION destroys the allocation of the
        context request holding the most (its blocks stored for reuse up to its KV, as a release
        does) and replays it next iteration (``reset_request_state``; the connector is asked again). With
        none to pause, it waits while finished requests' saves or parked loads still hold blocks."""
        candidates = [r for r in active if r.context_pos < r.prompt_len and not r.generated]
        if not candidates and (self.saving or self.parked):
            return  # blocks come back once those saves or loads are reported: the engine waits for them
        if not candidates:
            raise RuntimeError("stand-in KV pool exhausted: no context request to pause")
        victim = max(candidates, key=lambda r: len(r.block_ids))
        active.remove(victim)
        self._release_pages(victim, True)
        victim.block_ids, victim.context_pos, victim.first_chunk_end = [], 0, None
        self._paused.append(victim)
        self.pauses += 1

    def _pages_short(self, req: StandinLlmRequest, tokens: int) -> bool:
        """Whether the pool cannot give the pages a chunk ending at ``tokens`` still needs."""
        return -(-tokens // self.block) - len(req.block_ids) > self.blocks.available()

    def _grow_to(self, req: StandinLlmRequest, tokens: int) -> list[int]:
        """KVCacheManagerV2 allocates per chunk: the pages a chunk ending at ``tokens`` still needs."""
        need = -(-tokens // self.block) - len(req.block_ids)
        new = self.blocks.allocate(need) if need > 0 else []
        req.block_ids.extend(new)
        return new

    def _admit(
        self,
        req: StandinLlmRequest,
        matched: int,
        is_async: bool,
        output: Any,
        scheduled: list[tuple[StandinLlmRequest, int, int]],
        active: list[StandinLlmRequest],
    ) -> None:
        """Schedule an allocated new request, or park it while its asynchronous load runs."""
        if req.prefix_load is not None:  # build_scheduler_output: the accepted load, with the batch
            output.prefix_loads.append(req.prefix_load)
            self._reserved[req.prefix_load.reservation_id] = req
            self._prefix_workers[req.prefix_load.reservation_id] = set()  # the tracker's track()
        if is_async and self.reservations:  # take_scheduled_requests_pending_load: out until it finishes
            self.parked[req.request_id] = req
            self.async_loads += 1
            req.parked_at = time.monotonic()
            return
        if is_async:
            # new_async_requests.loading: build_scheduler_output skips it and
            # take_scheduled_requests_pending_load takes it out of this batch (no forward) until
            # get_finished reports the load from every rank; then it is a new request again.
            self.parked[req.request_id] = req
            self._loading_new.append(req.request_id)
            self.async_loads += 1
            req.parked_at = time.monotonic()
            return
        n = self._first_chunk_len(req)
        output.new_requests.append(self._request_data(req, list(req.tokens), req.context_pos - matched, n, first=True))
        req.reported_blocks = len(req.block_ids)
        scheduled.append((req, req.context_pos, req.context_pos + n))
        active.append(req)

    def _release_reservation(self, req: StandinLlmRequest, reservation_id: int, start: int, end: int) -> None:
        self.reservation_releases.append((reservation_id, start, end))
        self.scheduler.release_prefix_reservation(req, reservation_id, start, end)

    def _release_unstarted_prefix_load(self, req: StandinLlmRequest) -> None:
        """``release_unstarted_prefix_loads`` + ``reset_request_state``: a load accepted but never
        dispatched goes back whole; the request is asked again with a new reservation id."""
        load, req.prefix_load = req.prefix_load, None
        if load is not None:
            self._release_reservation(req, load.reservation_id, load.start, load.end)

    def _finish_prefix_loads(self, per_rank: list[list[int]], active: list[StandinLlmRequest]) -> None:
        """``PrefixLoadCompletionTracker`` (prefix_load_completion.py @785b0128) + ``finish_prefix_loads``:
        a dispatched reservation every rank reported finished releases its range; its request resumes,
        or ends if it was cancelled meanwhile. A rank's report counts once however often it repeats it;
        an id no dispatched load carries (a replayed allocation's stale completion, a repeat after the
        load finished) is ignored, as ``_record`` skips untracked ids: counted in
        ``ignored_prefix_completions``."""
        for rank, ids in enumerate(per_rank):
            for rid in ids:
                workers = self._prefix_workers.get(rid)
                if workers is None:
                    self.ignored_prefix_completions += 1
                    continue
                workers.add(rank)
        done = sorted(rid for rid, workers in self._prefix_workers.items() if len(workers) == len(per_rank))
        for rid in done:
            del self._prefix_workers[rid]
            req = self._reserved.pop(rid)
            load, req.prefix_load = req.prefix_load, None
            self._release_reservation(req, rid, load.start, load.end)
            if req.request_id in self._terminating:
                del self._terminating[req.request_id]
                self._terminate(req, self._commit_keys(req))
            elif self.parked.pop(req.request_id, None) is not None:
                req.returning = True
                active.append(req)

    def _match_partial(self, req: StandinLlmRequest, salt: str, full_blocks: int) -> tuple[int | None, int]:
        """With ``enable_partial_reuse``: a reusable block matching the start of the next block
        (up to the prompt's last token, which is never reused). KVCacheManagerV2 does the same: its
        radix tree matches into a block and the page is copied at the first ``resume()``, before the
        forward (_kv_cache.py @00f6bd6 ``_setup_for_reuse``)."""
        if not self.partial_reuse:
            return None, 0
        start = full_blocks * self.block
        limit = min(start + self.block, req.prompt_len - 1)
        if start >= limit or req.has_multimodal_in(start, start + self.block):
            return None, 0
        parent = req.reuse_hashes[start - 1] if full_blocks else req.reuse_seed
        src, k = self.blocks.match_partial(salt, parent, req.tokens[start:limit])
        if src is not None and k == 0:
            self.blocks.release([src], {})
            return None, 0
        return src, k

    def _chunk_len(self, req: StandinLlmRequest) -> int:
        remaining = req.prompt_len - req.context_pos
        return remaining if self.chunk is None else min(remaining, self.chunk)

    def _step_all_ranks(
        self, meta: Any, work: list[Any], overwritten: list[list[int]], block_copies: list[tuple[int, int]]
    ) -> list[dict[str, Any]]:
        for parent, _ in self.followers:
            parent.send(("step", meta, work, overwritten, block_copies))
        replies = [self.rank0.step(meta, work, overwritten, block_copies)]
        for parent, _ in self.followers:
            reply = parent.recv()
            if "engine_died" in reply:
                raise EngineDied(reply["engine_died"])
            if "fatal" in reply:
                raise RuntimeError(f"rank process died:\n{reply['fatal']}")
            replies.append(reply)
        return replies

    def stall_follower_heartbeats(self) -> None:
        """Ranks other than 0 stop beating (a CPU-starved rank's heartbeat thread): their connection's
        state changes only through what the connector's own hooks do."""
        for parent, _proc in self.followers:
            parent.send(("stall_heartbeat",))
            parent.recv()

    def _fail(self, req: StandinLlmRequest, active: list[StandinLlmRequest], error: str) -> None:
        req.result.failed = True
        req.result.error = error
        self.results[req.request_id] = req.result
        if req in active:
            active.remove(req)
        self._terminate(req, {})

    def _terminate(self, req: StandinLlmRequest, commit: dict[int, tuple[str, int, int, tuple[int, ...]]]) -> None:
        """A request ended other than by finishing: ``request_finished`` only where this version's
        ``_do_terminate_request`` calls it; otherwise its blocks are simply freed."""
        req.is_finished = True  # finish_by_reason(CANCELLED) or the error path, before the blocks go
        if self.behaviour.request_finished_on_termination and self._request_finished(req):
            self.saving[req.request_id] = req
            return
        self._release_pages(req, bool(commit))

    def close(self) -> None:
        """Stop rank processes and the connectors' threads."""
        for parent, proc in self.followers:
            try:
                parent.send(("stop",))
                parent.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.rank0.close()
        close = getattr(self.scheduler, "_backend", None)
        if close is not None:
            close.close()


def connector_llm_args(
    model: str,
    server_url: str | None,
    tp: int = 1,
    block: int = BLOCK,
    attention_dp: bool = False,
    kv_cache_manager_v2: bool | str = "auto",
    kv_dtype: str = "auto",
) -> Any:
    """``TorchLlmArgs`` naming the kvoffload connector in ``kv_connector_config``, as the operator writes it
    (``kv_cache_manager_v2``: ``kv_cache_config.use_kv_cache_manager_v2``, main's default ``"auto"``;
    ``kv_dtype``: ``kv_cache_config.dtype``)."""
    _ensure_paths()
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

    from kvoffload import contract

    return TorchLlmArgs(
        model=model,
        tensor_parallel_size=tp,
        enable_attention_dp=attention_dp,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=block,
            enable_block_reuse=True,
            use_kv_cache_manager_v2=kv_cache_manager_v2,
            dtype=kv_dtype,
        ),
        kv_connector_config=KvCacheConnectorConfig(
            connector_module=contract.CONNECTOR_MODULE,
            connector_scheduler_class=contract.CONNECTOR_SCHEDULER_CLASS,
            connector_worker_class=contract.CONNECTOR_WORKER_CLASS,
            server_url=server_url,
        ),
    )


def make_prompt(seed: int, length: int) -> list[int]:
    """Deterministic prompt tokens."""
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(length)]


def llm_args_from_options(options_path: str, model: str, tp: int) -> Any:
    """``TorchLlmArgs`` from a trtllm-serve ``--extra_llm_api_options`` YAML, as trtllm-serve would."""
    _ensure_paths()
    import yaml
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    options = yaml.safe_load(Path(options_path).read_text()) or {}
    return TorchLlmArgs.from_options(model, options, tensor_parallel_size=tp)


REPORTED_MODULES = (
    "kvoffload.connector", "kvoffload.contract", "lmcache", "torch", "numpy", "zmq", "pydantic", "fastapi", "prometheus_client", "cachetools", "numba",
)  # fmt: skip


def module_origins() -> dict[str, str]:
    """Where each of ``REPORTED_MODULES`` was loaded from, or would be on this ``sys.path`` (TensorRT-LLM
    itself imports pydantic and fastapi; the stand-in does not)."""
    import importlib.util

    origins = {}
    for name in REPORTED_MODULES:
        module = sys.modules.get(name)
        spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
        origins[name] = str(
            spec.origin if spec and spec.origin else list(spec.submodule_search_locations or []) if spec else None
        )
    return origins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", required=True, help="trtllm-serve extra-llm-api-options YAML")
    parser.add_argument("--model", default="standin-model")
    parser.add_argument(
        "--prompts", required=True, help="JSON: list of phases; a phase is a list of requests or 'evict'"
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--context-chunk-size", type=int, default=None)
    parser.add_argument("--attention-dp-rank", type=int, default=0, help="with enable_attention_dp: this rank")
    parser.add_argument("--out", default="-")
    args = parser.parse_args(argv)
    llm_args = llm_args_from_options(args.options, args.model, args.tp)
    executor = StandinExecutor(
        llm_args,
        num_blocks=args.num_blocks,
        context_chunk_size=args.context_chunk_size,
        env=dict(os.environ),
        attention_dp_rank=args.attention_dp_rank,
    )
    phases = json.loads(Path(args.prompts).read_text())
    report: dict[str, Any] = {"phases": []}
    try:
        for phase in phases:
            if phase == "evict":
                report["phases"].append({"evicted": executor.evict_device_cache()})
                continue
            results = executor.run([PromptRequest(**p) for p in phase])
            report["phases"].append({"results": [asdict(r) for r in results]})
        report["kv_mismatches"] = executor.kv_mismatches
        report["modules"] = module_origins()
        report["extension_files"] = {
            name: str(m.__file__)
            for name, m in list(sys.modules.items())
            if str(getattr(m, "__file__", "")).endswith(".so")
        }
    finally:
        executor.close()
    text = json.dumps(report)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
