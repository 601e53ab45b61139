"""TensorRT-LLM stand-in for tests (never ships).

Only what the kvoffload connector touches: the KV connector ABCs and data
classes (``_torch.pyexecutor.connectors.kv_cache_connector``), minimal
``llmapi.llm_args`` objects and ``mpi_rank()``. The stand-in executor in
``tests/support/trtllm_executor.py`` sets the rank of each process.
"""

from __future__ import annotations

import os

_RANK_ENV = "KVOFFLOAD_STANDIN_RANK"


def mpi_rank() -> int:
    """This process's rank (TensorRT-LLM reads it from MPI; the stand-in from env)."""
    return int(os.environ.get(_RANK_ENV, "0"))


def mpi_world_size() -> int:
    """Number of ranks in this stand-in run."""
    return int(os.environ.get("KVOFFLOAD_STANDIN_WORLD_SIZE", "1"))
