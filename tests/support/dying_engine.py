"""An engine process that dies (SIGKILL) in the middle of a store: its first chunk group was PREPAREd
and copied, the next group PREPAREd and its copy started, no COMMIT sent.

    python -m tests.support.dying_engine <server_url> <model> <prompt_seed> <tokens>

It runs the stand-in engine with the connector env the operator injects, as the engine container
would; the test starts a new engine in its place beside the same (live) server.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from kvoffload import contract
from kvoffload.connector.backends import pool_transfers
from tests.support.trtllm_executor import PromptRequest, StandinExecutor, connector_llm_args, make_prompt

ENV = {
    contract.ENV_PYTHONHASHSEED: "0",
    contract.ENV_BACKEND: contract.BACKEND_SIDECAR,
    contract.ENV_LOOKUP_TIMEOUT_MS: "2000",
    contract.ENV_RETRIEVE_TIMEOUT_MS: "5000",
    contract.ENV_STORE_TIMEOUT_MS: "5000",
    contract.ENV_HEARTBEAT_INTERVAL_MS: "200",
}


def main(server_url: str, model: str, seed: int, tokens: int) -> None:
    os.environ.update(ENV)
    executor = StandinExecutor(connector_llm_args(model, server_url), num_blocks=64)
    copies = 0
    gather = pool_transfers.gather_chunks

    def gather_then_die(*args: Any, **kwargs: Any) -> Any:
        nonlocal copies
        copies += 1
        if copies == 2:  # the second group's copy: the engine container is killed
            os.kill(os.getpid(), signal.SIGKILL)
        return gather(*args, **kwargs)

    pool_transfers.gather_chunks = gather_then_die  # type: ignore[assignment]
    executor.run([PromptRequest(1, make_prompt(seed, tokens))])
    print("the prompt finished: the engine was not killed", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
