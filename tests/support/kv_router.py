"""Real KV-aware routers for tests: Dynamo's standalone KV indexer (``python -m dynamo.indexer``)
and llm-d's kv-cache index (``hack/llmd-index``).

Both are installed by ``hack/setup.sh python``: Dynamo's into ``$KVOFFLOAD_CACHE/kv-router``
(pinned in ``hack/kv-router/requirements.txt``), llm-d's built to ``$KVOFFLOAD_CACHE/bin/llmd-index``
(its module pinned in ``hack/llmd-index/go.mod``). Each subscribes to every worker's KV-event
endpoint and answers ``POST /query`` with every worker's longest prefix match per tier.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hack.ports import free_port

ROUTER_MODEL = "m"


def _cache() -> Path:
    return Path(os.environ.get("KVOFFLOAD_CACHE") or str(Path.home() / ".cache" / "kvoffload"))


def router_python() -> Path:
    """The indexer's interpreter; raises (never skips) when the setup did not install it."""
    python = _cache() / "kv-router" / "bin" / "python"
    check = subprocess.run([str(python), "-c", "import dynamo.indexer"], capture_output=True, text=True) if (
        python.exists()
    ) else None  # fmt: skip
    if check is None or check.returncode != 0:
        detail = check.stderr[-2000:] if check is not None else f"{python} does not exist"
        raise RuntimeError(f"Dynamo's indexer is not installed (run hack/setup.sh python): {detail}")
    return python


@dataclass
class DynamoIndexer:
    """One indexer process subscribed to ``workers`` (worker id, or ``"id:dp_rank"`` for a second
    stream of one worker, -> ZMQ endpoint)."""

    workers: Mapping[int | str, str]
    block_size: int
    log_path: Path
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self.port = self.port or free_port()
        workers = ",".join(f"{wid}={endpoint}" for wid, endpoint in self.workers.items())
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [str(router_python()), "-m", "dynamo.indexer", "--block-size", str(self.block_size),
                 "--port", str(self.port), "--model-name", ROUTER_MODEL, "--workers", workers, "--threads", "1"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited: {self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                self.host_tier_matches([1])
                return
            except OSError:
                time.sleep(0.25)
        self.stop()  # the caller never learns of a process whose start failed
        raise TimeoutError(f"dynamo.indexer did not answer within {timeout_s}s")

    def host_tier_matches(self, tokens: Sequence[int], lora_name: str | None = None) -> dict[int, int]:
        """Worker id -> tokens of ``tokens``' prefix it holds in its host (CPU) tier; absent workers hold none."""
        return self.tier_matches(tokens, "cpu", lora_name)

    def tier_matches(self, tokens: Sequence[int], tier: str, lora_name: str | None = None) -> dict[int, int]:
        """Worker id -> tokens of ``tokens``' prefix it holds down to ``tier``: the indexer's columns are
        cumulative (``cpu``: device or host memory; ``disk``: also media ``DISK``, ``EXTERNAL``,
        ``SHARED``, as indexer 1.6.1 answers); absent workers hold none. ``lora_name``: asked for a
        request of that LoRA adapter (the query's ``lora_name``, which 1.6.1 matches against the
        events' ``lora_name``); None: an unscoped request."""
        query: dict[str, object] = {"token_ids": list(tokens), "model_name": ROUTER_MODEL}
        if lora_name is not None:
            query["lora_name"] = lora_name
        body = json.dumps(query).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/query", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            instances = json.loads(answer.read())["instances"]
        return {int(wid): int(scores.get(tier, 0)) for wid, scores in instances.items() if scores.get(tier, 0)}

    def stop(self) -> None:
        _stop_group(self._proc)
        self._proc = None


def _stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@dataclass
class LlmdIndex:
    """llm-d's kv-cache index (``hack/llmd-index``) subscribed to ``pods`` (pod id -> ZMQ endpoint);
    each pod's publisher must send the topic ``kv@<pod id>@<model>``, as llm-d's pods do."""

    pods: Mapping[str, str]
    block_size: int
    log_path: Path
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binary() -> Path:
        """The built index; raises (never skips) when the setup did not build it."""
        path = _cache() / "bin" / "llmd-index"
        if not path.exists():
            raise RuntimeError(f"llm-d's index is not built (run hack/setup.sh python): {path} does not exist")
        return path

    def start(self, timeout_s: float = 30.0) -> None:
        self.port = self.port or free_port()
        pods = ",".join(f"{pod}={endpoint}" for pod, endpoint in self.pods.items())
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [str(self.binary()), "--port", str(self.port), "--block-size", str(self.block_size), "--pods", pods],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llmd-index exited: {self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                self.tier_matches([1] * self.block_size, "cpu", "m")
                return
            except OSError:
                time.sleep(0.25)
        self.stop()  # the caller never learns of a process whose start failed
        raise TimeoutError(f"llmd-index did not answer within {timeout_s}s: {self.log_path.read_text()[-2000:]}")

    def tier_matches(self, tokens: Sequence[int], tier: str, model: str) -> dict[str, int]:
        """Pod id -> tokens of ``tokens``' prefix it holds in ``tier`` (llm-d's device tier: the
        event's medium lowercased, ``cpu``, ``disk``, ``external``); absent pods hold none. ``model``:
        the served model, or a LoRA adapter's name for a request of that adapter (llm-d 0.8.1 keys an
        event with a ``lora_name`` under that name instead of the topic's model)."""
        body = json.dumps({"token_ids": list(tokens), "model": model}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/query", data=body)
        with urllib.request.urlopen(request, timeout=5) as answer:
            pods = json.loads(answer.read())
        return {pod: int(tiers[tier]) for pod, tiers in pods.items() if tiers.get(tier, 0)}

    def stop(self) -> None:
        _stop_group(self._proc)
        self._proc = None
