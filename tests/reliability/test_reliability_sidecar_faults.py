"""Sidecar faults under a continuous request stream: LMCache server killed, whole sidecar killed, L2 disk full.

The sidecar runs as a real process (``python -m kvoffload.sidecar``, real LMCache server child);
requests go through the real connector inside the TensorRT-LLM stand-in executor
(tests/support/trtllm_executor.py), whose bit-exact KV check and output comparison catch wrong KV.
Every request evicts the device cache first, so each one asks the sidecar for the prompt's KV:
a hit proves the cache serves, a miss recomputes (still correct).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import contract
from kvoffload.connector.settings import DEFAULT_HEARTBEAT_INTERVAL_MS
from tests.support.connector_env import set_connector_env
from tests.support.scale import count
from tests.support.sidecar_harness import Sidecar, sample_sum, sidecar_env
from tests.support.trtllm_executor import (
    CHUNK,
    PromptRequest,
    StandinExecutor,
    commits_lagging,
    connector_llm_args,
    make_prompt,
)

# The soak's 20 kills of a whole sidecar take a few minutes: allow more than pytest's default 900 s.
pytestmark = [pytest.mark.reliability, pytest.mark.sidecar, pytest.mark.timeout(count(ci=900, soak=3600))]
SERVER_KILLS = count(ci=5, soak=20)
SIDECAR_KILLS = count(ci=3, soak=20)
WARM_KILLS = count(ci=2, soak=20)
RECOVERY_BOUND_S = 120.0
"""Kill -> first hit again: LMCache start-up (a server that was serving restarts at once) and the
connector's re-registration, on a loaded 2-core box; a generous bound, the figures are printed."""
PROMPT_LEN = 200


@pytest.fixture
def connector_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The env the operator injects into the engine (short timeouts so a dead sidecar costs little;
    the heartbeat at the product's default, since it bounds how soon a restart is found)."""
    return set_connector_env(
        monkeypatch, lookup_ms=1000, retrieve_ms=3000, store_ms=3000, heartbeat_ms=DEFAULT_HEARTBEAT_INTERVAL_MS
    )


_CONNECTOR_WARNINGS: collections.deque[str] = collections.deque(maxlen=12)


class _KeepWarnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _CONNECTOR_WARNINGS.append(f"{record.created:.3f} {record.getMessage()}")


@pytest.fixture(autouse=True)
def connector_warnings() -> Iterator[None]:
    """Keep the connector's last warnings for a failure message (``Stream.why_no_hit``)."""
    _CONNECTOR_WARNINGS.clear()
    handler = _KeepWarnings(logging.WARNING)
    logging.getLogger("kvoffload.connector").addHandler(handler)
    yield
    logging.getLogger("kvoffload.connector").removeHandler(handler)


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    yield started
    for sidecar in started:
        sidecar.stop()


def start_sidecar(workdir: Path, started: list[Sidecar], env: dict[str, str] | None = None, **extra: str) -> Sidecar:
    workdir.mkdir(exist_ok=True)
    sidecar = Sidecar(
        workdir=workdir, env=env or sidecar_env(workdir, **{contract.ENV_CHUNK_SIZE: str(CHUNK), **extra})
    )
    started.append(sidecar)
    sidecar.start().wait_ready()
    return sidecar


@dataclass
class Stream:
    """Runs requests for one prompt back to back and records each outcome with its time."""

    executor: StandinExecutor
    prompt: list[int]
    reference: list[int] = field(default_factory=list)
    outcomes: list[tuple[float, bool, int]] = field(default_factory=list)  # (end time, failed, matched tokens)
    errors: list[str] = field(default_factory=list)
    wrong_outputs: int = 0
    next_id: int = 1
    sidecar: Sidecar | None = None
    """Whose log tail a failure message quotes."""
    warnings: collections.deque[str] = field(default_factory=lambda: _CONNECTOR_WARNINGS)
    """The connector's last warnings (backend down, store failed: with reasons), for a failure message."""

    def why_no_hit(self) -> str:
        """What the connector and the sidecar said last: the cause of a stream that stopped hitting."""
        recent = self.outcomes[-5:]
        tail = self.sidecar.log_tail(12) if self.sidecar is not None else ""
        events = "\n".join(line for line in tail.splitlines() if "event=" in line)
        return f"last outcomes {recent}; connector warnings:\n" + "\n".join(self.warnings) + f"\nsidecar:\n{events}"

    def one(self) -> tuple[bool, int]:
        self.executor.evict_device_cache()
        (result,) = self.executor.run([PromptRequest(self.next_id, self.prompt, 2)], timeout_s=60)
        self.next_id += 1
        if result.failed:
            self.errors.append(result.error)
        elif self.reference and result.output_tokens != self.reference:
            self.wrong_outputs += 1
        elif not self.reference:
            self.reference = result.output_tokens
        self.outcomes.append((time.monotonic(), result.failed, result.connector_matched_tokens))
        return result.failed, result.connector_matched_tokens

    def until_hit(self, after: float, timeout: float) -> float:
        """Keep the stream going until a hit that started after ``after``; returns when it came."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            started = time.monotonic()
            _failed, matched = self.one()
            if matched > 0 and started > after:
                return time.monotonic()
        raise AssertionError(f"no cache hit within {timeout:.0f} s of the fault; {self.why_no_hit()}")


def _kill_soon(pid_of: Any, rng: random.Random) -> tuple[threading.Thread, list[float]]:
    """SIGKILL ``pid_of()`` after a random delay, from another thread, so it lands mid-request."""
    when: list[float] = []

    def run() -> None:
        time.sleep(rng.uniform(0.0, 0.15))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid_of(), signal.SIGKILL)
        when.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, when


def _run_stream_through_kills(
    stream: Stream, kills: int, kill: Any, after_kill: Any, before_kill: Any = lambda: True
) -> list[float]:
    """Kill ``kills`` times, each once the stream hit again (and ``before_kill()`` holds, the
    stream going on meanwhile); the seconds from each kill to the next hit."""
    rng = random.Random(20)
    recoveries = []
    stream.until_hit(0.0, RECOVERY_BOUND_S)
    for _ in range(kills):
        deadline = time.monotonic() + RECOVERY_BOUND_S
        while not before_kill():
            assert time.monotonic() < deadline, "the condition to kill under never held"
            stream.one()
        thread, when = _kill_soon(kill, rng)
        while thread.is_alive():  # requests keep flowing while the kill lands
            stream.one()
        after_kill()
        hit_at = stream.until_hit(when[0], RECOVERY_BOUND_S)
        recoveries.append(hit_at - when[0])
        for _ in range(2):
            stream.one()
    return recoveries


def _summary(what: str, stream: Stream, recoveries: list[float]) -> str:
    hits = sum(1 for _t, failed, matched in stream.outcomes if matched > 0 and not failed)
    return (f"{what}: {len(recoveries)} kills, {len(stream.outcomes)} requests, {hits} hits, "
            f"{len(stream.errors)} failed, {stream.wrong_outputs} wrong outputs, "
            f"{stream.executor.kv_mismatches} KV mismatches, recovery to first hit max {max(recoveries):.1f} s "
            f"mean {sum(recoveries) / len(recoveries):.1f} s, all {sorted(round(r, 1) for r in recoveries)}")  # fmt: skip


def _assert_no_kv_or_prompt(exposition: str, prompt: list[int]) -> None:
    """/metrics samples carry counts and sizes only: no chunk hashes, no token ids, no label that could hold text.

    HELP lines are the libraries' own prose (LMCache's may name ``empty_chunk_hashes`` as a reason), so
    the check reads the samples, not the raw text.
    """
    samples = [s for f in text_string_to_metric_families(exposition) for s in f.samples]
    assert samples
    label_names = {name for s in samples for name in s.labels}
    assert not {n for n in label_names if "hash" in n or "key" in n.lower() or "token" in n}, label_names
    values = {v for s in samples for v in s.labels.values()}
    assert all(len(v) <= 128 for v in values), [v for v in values if len(v) > 128]
    assert not {v for v in values if "ObjectKey" in v or "chunk_hash" in v}, values
    for sep in (" ", ",", ", "):
        assert not {v for v in values if sep.join(map(str, prompt[:3])) in v}


def _check(stream: Stream, kills: int = 0) -> None:
    """No wrong output, no wrong KV, no failed request (the engine died if ``executor.run`` raised):
    a load promised before a kill was secured at lookup, so it still arrives."""
    assert stream.wrong_outputs == 0
    assert stream.executor.kv_mismatches == 0
    assert stream.errors == [], f"{len(stream.errors)} failed requests over {kills} kills: {stream.errors[:3]}"


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_lmcache_server_killed_repeatedly_during_a_request_stream(
    tmp_path: Path, sidecars: list[Sidecar], connector_env: dict[str, str], manager_v2: bool
) -> None:
    sidecar = start_sidecar(tmp_path / "sidecar", sidecars)
    url = contract.server_url(sidecar.request_port)
    executor = StandinExecutor(
        connector_llm_args(f"server-kill-{manager_v2}-model", url, kv_cache_manager_v2=manager_v2)
    )
    try:
        stream = Stream(executor, make_prompt(31, PROMPT_LEN), sidecar=sidecar)
        recoveries = _run_stream_through_kills(stream, SERVER_KILLS, sidecar.server_pid, lambda: None)
        print(_summary("LMCache server SIGKILL", stream, recoveries), stream.errors)
        _check(stream, SERVER_KILLS)
        assert max(recoveries) < RECOVERY_BOUND_S
        exposition = sidecar.metrics()
        assert f"{contract.M_SIDECAR_SERVER_RESTARTS}_total {float(SERVER_KILLS)}" in exposition
        _assert_no_kv_or_prompt(exposition, stream.prompt)
    finally:
        executor.close()


def test_a_server_killed_beside_a_warm_standby_is_replaced_by_it(
    tmp_path: Path, sidecars: list[Sidecar], connector_env: dict[str, str]
) -> None:
    """A crash that finds the standby warm (not one right after the last): the standby serves at
    once; the recovery is printed beside the back-to-back kills above."""
    sidecar = start_sidecar(tmp_path / "sidecar", sidecars)
    executor = StandinExecutor(connector_llm_args("warm-standby-model", contract.server_url(sidecar.request_port)))
    try:
        stream = Stream(executor, make_prompt(41, PROMPT_LEN), sidecar=sidecar)
        recoveries = _run_stream_through_kills(stream, WARM_KILLS, sidecar.server_pid, lambda: None,
                                               sidecar.standby_is_warm)  # fmt: skip
        print(_summary("LMCache server SIGKILL beside a warm standby", stream, recoveries), stream.errors)
        _check(stream, WARM_KILLS)
        promotions = [ln for ln in sidecar.log_path.read_text().splitlines() if "event=standby_promoted" in ln]
        assert len(promotions) == WARM_KILLS and all("warm=True" in ln for ln in promotions), promotions
        assert len({ln.split("pid=")[1].split()[0] for ln in promotions}) == 1, "one standby forked every server"
    finally:
        executor.close()


def test_a_restarted_server_is_found_without_waiting_out_the_heartbeat_interval(
    tmp_path: Path, sidecars: list[Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the backend is down it tries to reconnect every fraction of a second, not once per
    heartbeat interval (here 10 minutes): hits come back while the engine keeps serving."""
    set_connector_env(monkeypatch, lookup_ms=1000, retrieve_ms=3000, store_ms=3000, heartbeat_ms=600_000)
    sidecar = start_sidecar(tmp_path / "sidecar", sidecars)
    executor = StandinExecutor(connector_llm_args("reconnect-model", contract.server_url(sidecar.request_port)))
    try:
        stream = Stream(executor, make_prompt(37, PROMPT_LEN), sidecar=sidecar)
        recoveries = _run_stream_through_kills(stream, 2, sidecar.server_pid, lambda: None)
        _check(stream, 2)
        assert max(recoveries) < RECOVERY_BOUND_S
    finally:
        executor.close()


STALL_S = 13.0
"""A server stall long enough for the heartbeat to declare it down and reset the connection (two
missed PINGs of at least 2 s each), and longer than ``COMMIT_LAG_S``."""
COMMIT_LAG_S = 9.0
"""The stalled store's COMMIT leaves this long after its PREPARE was answered: after the reset."""


def test_a_store_whose_commit_outlived_a_connection_reset_is_committed_to_the_same_server(
    tmp_path: Path, sidecars: list[Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stalls (SIGSTOP) after a store's PREPARE was answered and before its COMMIT left;
    the heartbeat resets the connection; the same server comes back. The COMMIT goes to it: dropped,
    its reservation would stay and LMCache would refuse to store those chunks again for 600 s, so
    the prompt would miss for ten minutes."""
    set_connector_env(monkeypatch, lookup_ms=1000, retrieve_ms=3000, store_ms=3000, heartbeat_ms=500)
    sidecar = start_sidecar(tmp_path / "sidecar", sidecars)
    executor = StandinExecutor(connector_llm_args("stall-commit-model", contract.server_url(sidecar.request_port)))
    server = sidecar.server_pid()
    stall_over = threading.Event()

    def stall_the_server() -> None:  # on the committer thread, the first COMMIT due to leave
        os.kill(server, signal.SIGSTOP)

        def resume() -> None:
            os.kill(server, signal.SIGCONT)
            stall_over.set()

        threading.Timer(STALL_S, resume).start()

    try:
        stream = Stream(executor, make_prompt(43, PROMPT_LEN), sidecar=sidecar)
        with commits_lagging(COMMIT_LAG_S, on_first=stall_the_server):
            stream.one()  # a miss that stores; returns once its save was reported
        assert stall_over.wait(STALL_S + 30)
        assert sidecar.server_pid() == server, "the same server, stalled, not a restarted one"
        stream.until_hit(0.0, RECOVERY_BOUND_S)
        assert "event=backend_down" in "\n".join(stream.warnings), "the stall reset the connection"
        _check(stream)
    finally:
        executor.close()


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_whole_sidecar_killed_and_restarted_like_kubelet_during_a_request_stream(
    tmp_path: Path, sidecars: list[Sidecar], connector_env: dict[str, str], manager_v2: bool
) -> None:
    current = [start_sidecar(tmp_path / "sidecar", sidecars)]
    env = dict(current[0].env)  # same ports, same instance id: the container restarts in the same pod
    url = contract.server_url(current[0].request_port)
    executor = StandinExecutor(
        connector_llm_args(f"sidecar-kill-{manager_v2}-model", url, kv_cache_manager_v2=manager_v2)
    )

    def kill_group() -> int:
        assert current[0].proc is not None
        return -current[0].proc.pid  # negative pid: the process group, the sidecar and its LMCache child

    def restart() -> None:
        assert current[0].proc is not None
        current[0].proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(current[0].proc.pid, signal.SIGKILL)  # a container's processes die together
        sidecar = Sidecar(workdir=current[0].workdir, env=env)
        sidecars.append(sidecar)
        current[0] = sidecar.start()  # not waited for: the stream keeps going while it starts

    try:
        stream = Stream(executor, make_prompt(32, PROMPT_LEN))
        recoveries = _run_stream_through_kills(stream, SIDECAR_KILLS, kill_group, restart)
        print(_summary("whole sidecar SIGKILL + restart", stream, recoveries), stream.errors)
        _check(stream, SIDECAR_KILLS)
        assert max(recoveries) < RECOVERY_BOUND_S
    finally:
        executor.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root can mount here); unmounted afterwards."""
    mount = tmp_path / "l2"
    mount.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                         text=True, check=False)  # fmt: skip
    if out.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here ({out.stderr.strip()}); the disk-full case needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("fault", ["full", "read-only", "healthy"])
def test_l2_disk_full_or_read_only_keeps_serving_l1_and_counts_the_error(
    fault: str, small_tmpfs: Path, tmp_path: Path, sidecars: list[Sidecar], connector_env: dict[str, str]
) -> None:
    if fault == "full":
        filler = small_tmpfs / "filler.bin"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k", "count=64"], capture_output=True, check=False)
    elif fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    sidecar = start_sidecar(tmp_path / "sidecar", sidecars, **{contract.ENV_L2_FS_PATH: str(small_tmpfs),
                                                               contract.ENV_L2_FS_SIZE: "64Mi"})  # fmt: skip
    executor = StandinExecutor(connector_llm_args(f"disk-{fault}-model", contract.server_url(sidecar.request_port)))
    try:
        stream = Stream(executor, make_prompt(33, PROMPT_LEN))
        stream.until_hit(0.0, 60)
        for i in range(10):  # new prompts too: every store goes to L1 and is offered to the broken L2
            stream.one()
            Stream(executor, make_prompt(100 + i, PROMPT_LEN), next_id=10_000 + i * 10).one()
        _check(stream)
        assert not stream.errors
        hits = sum(1 for _t, _f, matched in stream.outcomes if matched > 0)
        # Every repeat of the prompt hits (the first computes): a broken L2 costs L1 nothing, and no
        # lookup is misread as a miss (the LOOKUP/WAIT race fixed in the connector, docs/reliability.md).
        assert hits == len(stream.outcomes) - 1, f"L1 stopped serving or a lookup missed: {stream.outcomes}"
        assert sidecar.proc is not None and sidecar.proc.poll() is None and sidecar.ready()
        deadline = time.monotonic() + 60
        while True:  # L2 stores finish in the background, after the COMMITs were answered
            metrics = sidecar.metrics()
            submitted = sample_sum(metrics, "lmcache_mp_l2_store_submitted_objects_chunks_total") or 0.0
            stored = sample_sum(metrics, "lmcache_mp_l2_store_completed_objects_chunks_total") or 0.0
            log = sidecar.log_path.read_text(errors="replace")
            error_lines = [line for line in log.splitlines() if "to adapter" in line and "failed" in line]
            settled = bool(error_lines) if fault != "healthy" else 0 < submitted == stored
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        print(f"L2 {fault}: {len(stream.outcomes)} requests, {hits} hits, {len(stream.errors)} failed; "
              f"L2 chunks submitted {submitted:.0f}, stored {stored:.0f}, failed {submitted - stored:.0f}; "
              f"{len(error_lines)} 'Store task .. to adapter 0 failed' log lines")  # fmt: skip
        assert submitted > 0
        if fault == "healthy":
            assert stored == submitted and not error_lines
        else:
            assert stored < submitted and error_lines, "the L2 error is neither counted in /metrics nor logged"
    finally:
        executor.close()
