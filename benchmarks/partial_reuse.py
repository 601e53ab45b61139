"""Reuse with TensorRT-LLM's ``enable_partial_reuse`` on and off, same prompts (CPU, stand-in executor).

Conversations share a system prompt whose length is not a multiple of the block size; each turn
repeats the previous turn's prompt plus a reply, and between turns other traffic takes the
device's reusable blocks (``evict_device_cache``), as under load. Counts, per setting, the prompt
tokens the device reused, the connector loaded and the engine computed.

    python -m benchmarks.partial_reuse [--conversations 6] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import standin_on_path


def run(partial: bool, conversations: int, turns: int, url: str) -> dict[str, Any]:
    from tests.support.trtllm_executor import PromptRequest, StandinExecutor, connector_llm_args, make_prompt

    ex = StandinExecutor(connector_llm_args(f"partial-bench-{partial}", url), num_blocks=256,
                         enable_partial_reuse=partial)  # fmt: skip
    totals = {"prompt": 0, "device_reused": 0, "connector_loaded": 0, "computed": 0, "kv_mismatches": 0}
    try:
        system = make_prompt(1, 203)  # 12 blocks of 16 and 11 tokens
        prompts = [system + make_prompt(100 + c, 40) for c in range(conversations)]
        rid = 0
        for turn in range(turns):
            for c in range(conversations):
                rid += 1
                (r,) = ex.run([PromptRequest(rid, prompts[c], 2)])
                totals["prompt"] += len(prompts[c])
                totals["device_reused"] += r.device_reused_tokens
                totals["connector_loaded"] += r.connector_matched_tokens
                totals["computed"] += r.computed_prompt_tokens
                prompts[c] = prompts[c] + r.output_tokens + make_prompt(1000 * turn + c, 37)
                # Under load the conversation's own blocks are gone; the shared system prompt's stay.
                ex.evict_device_cache()
                ex.run([PromptRequest(100_000 + rid, system + make_prompt(5000 + rid, 9), 1)])
        totals["kv_mismatches"] = ex.kv_mismatches
    finally:
        ex.close()
    return {"enable_partial_reuse": partial, **totals}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args(argv)
    standin_on_path()
    from kvoffload import contract
    from tests.support.lmcache_server import LMCacheServer
    from tests.support.trtllm_executor import CHUNK

    os.environ.update({contract.ENV_PYTHONHASHSEED: "0", contract.ENV_BACKEND: contract.BACKEND_SIDECAR,
                       contract.ENV_LOOKUP_TIMEOUT_MS: "2000", contract.ENV_METRICS_ENABLED: "false"})  # fmt: skip
    server = LMCacheServer(chunk_size=CHUNK, log_dir=Path(tempfile.mkdtemp(prefix="kvo-partial-")))
    server.start()
    try:
        for partial in (True, False):
            print(json.dumps(run(partial, args.conversations, args.turns, server.url)), flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
