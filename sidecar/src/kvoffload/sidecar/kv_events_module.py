"""KV events from the cache server: a server module that LMCache 0.5.6's MP server loads.

LMCache's server-module extension point (``--server-module``, see ``command.KV_EVENTS_MODULE``);
the server internals it needs (key resolution, the event bus's names) sit behind
``kvoffload.lmcache_guard``. It runs inside the LMCache server process and:

- publishes vLLM's KV-event batches on a ZMQ XPUB socket it binds: three frames
  ``[topic, sequence as 8-byte big-endian, msgpack [timestamp, events, dp_rank]]``;
- answers ``chunk_report.METHOD`` (the connector's report after a store's COMMIT was answered) by
  resolving the chunks' hashes with the server's own hasher (so LMCache's evictions name the same
  chunks) and announcing the unsalted ones (``kv_events.ChunkTracker``);
- follows LMCache's event bus (``lmcache_guard.subscribe_cache_key_events``): an L1 eviction is a
  removal from the host tier, an L2 adapter's store or delete an announcement or removal in its
  tier (``kv_events.l2_medium``);
- sends every subscriber, when it subscribes, ``AllBlocksCleared`` and then the chunks it tracks:
  a restarted (empty) server clears what a router believed, and a router that connects late
  catches up. XPUB reports each subscription (``XPUB_VERBOSE``), which solves ZMQ's slow joiner.

All tracker changes and all sends happen on one publisher thread, which owns the socket; the
server's request threads and the event bus's thread only queue changes (bounded; an overflow
clears and re-sends the snapshot, a lost eviction clears everything: routers under-count, never
over-count).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvoffload import chunk_report
from kvoffload.lmcache_guard import (
    SUPPORTED_LMCACHE_VERSIONS,
    CacheKeysChanged,
    installed_lmcache_version,
    resolve_chunk_hashes,
    server_module_handler,
    subscribe_cache_key_events,
)

from .kv_events import DEFAULT_CAPACITY_CHUNKS, MEDIUM_HOST, ChunkTracker, Event, StoredChunk, batches, l2_medium

logger = logging.getLogger("kvoffload.sidecar.kv_events")

_POLL_MS = 100
"""The publisher thread's longest sleep: a change wakes it at once (``_wake``); this bounds only how
late a rate-limited snapshot or a stop is seen."""
_SNAPSHOT_EVERY_S = 0.5
"""At most this often a full snapshot goes out, however fast peers subscribe (the port is open to the
pod network: a peer subscribing in a loop must not make the server send its whole state in a loop)."""
_QUEUE_CHANGES = 4096
_SUBSCRIBE = 1

Change = Callable[[ChunkTracker], list[Event]]


class KvEventsUnavailable(RuntimeError):
    """The server cannot publish events as configured; the message says why and what to change."""


def check_lmcache_version(version: str) -> None:
    """Refuse an LMCache this module was not written against, naming both."""
    if version not in SUPPORTED_LMCACHE_VERSIONS:
        raise KvEventsUnavailable(
            f"kvoffload KV events: LMCache {version} is installed; this module is written for LMCache "
            f"{', '.join(SUPPORTED_LMCACHE_VERSIONS)} (its server internals); turn events off or use a supported LMCache"
        )


class EventPublisher:
    """The XPUB socket and the tracker, owned by one thread; others only ``submit`` changes."""

    def __init__(self, endpoint: str, topic: str, tracker: ChunkTracker) -> None:
        self._endpoint = endpoint
        self._topic = topic.encode()
        self._tracker = tracker
        self._changes: queue.Queue[Change] = queue.Queue(maxsize=_QUEUE_CHANGES)
        self._resend = threading.Event()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        # Routers drop a batch whose sequence is below one they saw (Dynamo's indexer ignores a
        # restarted publisher's 0), so a server starts at the wall clock in microseconds: above what
        # its predecessor reached unless that one sent more than a batch per microsecond.
        self._sequence = time.time_ns() // 1000
        self._snapshot_at = float("-inf")
        self.counts: Counter[str] = Counter()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._thread = threading.Thread(target=self._run, name="kvoffload-kv-events", daemon=True)

    def start(self, timeout_s: float = 5.0) -> None:
        """Bind (on the publisher thread) and announce the empty start; raises when binding failed."""
        self._thread.start()
        if not self._bound.wait(timeout_s) or self._error is not None:
            raise KvEventsUnavailable(f"kvoffload KV events: cannot bind {self._endpoint}: {self._error!r}")

    def submit(self, change: Change) -> None:
        """Queue a tracker change; never blocks (a full queue re-sends the snapshot instead)."""
        try:
            self._changes.put_nowait(change)
        except queue.Full:
            self.counts["changes_dropped"] += 1
            self._resend.set()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the thread
            os.write(self._wake_write, b"\0")

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        context: Any = zmq.Context.instance()
        sock = context.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
            sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            sock.close()
            self._bound.set()
            return
        self._bound.set()
        # No event now: a socket just bound has no subscriber to hear it. Each subscriber gets
        # AllBlocksCleared first, with the snapshot, as the first sequence number it sees.
        logger.info("event=kv_events_bound endpoint=%s", self._endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if sock in ready:
                    self._on_subscriptions(sock)
                if self._wake_read in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_read, 4096):
                            pass
                self._apply_changes(sock)
                if self._resend.is_set() and time.monotonic() - self._snapshot_at >= _SNAPSHOT_EVERY_S:
                    self._resend.clear()
                    self._snapshot_at = time.monotonic()
                    self._send(self._tracker.snapshot(), sock)
        except Exception:  # the server must outlive its event publisher
            logger.exception("event=kv_events_publisher_failed")
        finally:
            sock.close()

    def _on_subscriptions(self, sock: zmq.Socket[bytes]) -> None:
        joined = False
        while True:
            try:
                message = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            joined = joined or message[:1] == bytes([_SUBSCRIBE])
        if joined:
            self.counts["subscriptions"] += 1
            self._resend.set()  # the snapshot goes after the changes queued before the join

    def _apply_changes(self, sock: zmq.Socket[bytes]) -> None:
        events: list[Event] = []
        while True:
            try:
                change = self._changes.get_nowait()
            except queue.Empty:
                break
            events += change(self._tracker)
        if events:
            self._send(events, sock)

    def _send(self, events: list[Event], sock: zmq.Socket[bytes]) -> None:
        for batch in batches(events):
            payload = msgspec.msgpack.encode([time.time(), batch, 0])
            try:
                sock.send_multipart([self._topic, self._sequence.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.Again:
                self.counts["batches_dropped"] += 1
            self._sequence += 1
            self.counts["events_sent"] += len(batch)


class KvEventsModule:
    """The LMCache server module: the report handler, the eviction subscriber and the publisher."""

    def __init__(self, server_context: Any, publisher: EventPublisher) -> None:
        self._ctx = server_context
        self._publisher = publisher
        self.counts: Counter[str] = Counter()

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict[str, Any]:
        return {"kvoffload_kv_events": {**self.counts, **self._publisher.counts}}

    def close(self) -> None:
        self._publisher.close()

    @server_module_handler(chunk_report.METHOD)
    def chunks_stored(self, payload: bytes) -> bytes:
        """``chunk_report.METHOD``: a connector's store was committed; announce its unsalted chunks."""
        report = chunk_report.decode(payload)
        if report.salt != "":
            self.counts["reports_salted"] += 1
            return b"salted"
        chunk_size = int(self._ctx.chunk_size)
        first, last = -(-report.start // chunk_size), report.end // chunk_size
        if first >= last or chunk_size % report.tokens_per_block:
            self.counts["reports_empty"] += 1
            return b"empty"
        hashes = resolve_chunk_hashes(self._ctx, report.cache_model, report.world_size, report.token_ids,
                                      last * chunk_size)  # fmt: skip
        chunks = [
            StoredChunk(hashes[i], report.token_ids[i * chunk_size : (i + 1) * chunk_size], i)
            for i in range(first, last)
        ]
        parent = hashes[first - 1] if first > 0 else None
        model, block = report.cache_model, report.tokens_per_block
        self._publisher.submit(lambda tracker: tracker.stored(model, chunks, parent, block, ""))
        self.counts["reports"] += 1
        return b"ok"

    def on_keys_changed(self, change: CacheKeysChanged) -> None:
        """Event bus: a tier of the cache took or dropped these objects."""
        keys, medium = change.keys, MEDIUM_HOST if change.tier == "l1" else l2_medium(change.backend, change.shared)
        if change.stored and change.tier == "l2":
            self._publisher.submit(lambda tracker: tracker.l2_stored(keys, medium))
        elif not change.stored:
            self._publisher.submit(lambda tracker: tracker.evicted(keys, medium))

    def on_events_lost(self) -> None:
        """Event bus overflow: an eviction may be lost, so routers forget everything from here."""
        self.counts["bus_drops"] += 1
        self._publisher.submit(lambda tracker: tracker.clear())


def build_server_modules(build: Any) -> Any:
    """LMCache's server-module factory (``ExtServerModuleBuildContext`` in, the module out).

    ``build.config``: ``port`` (required), ``host`` (default all addresses), ``topic`` (default
    ``""``), ``capacity_chunks`` (default ``kv_events.DEFAULT_CAPACITY_CHUNKS``).
    """
    check_lmcache_version(installed_lmcache_version())
    ctx = build.server_context
    if not ctx.event_bus.enabled:
        raise KvEventsUnavailable(
            "kvoffload KV events: LMCache's event bus is off (--disable-observability), so evictions "
            "cannot be announced; turn events off or the event bus on"
        )
    config = dict(build.config)
    host, port = str(config.get("host", "0.0.0.0")), int(config["port"])
    publisher = EventPublisher(
        f"tcp://{host}:{port}",
        str(config.get("topic", "")),
        ChunkTracker(int(config.get("capacity_chunks", DEFAULT_CAPACITY_CHUNKS))),
    )
    module = KvEventsModule(ctx, publisher)
    publisher.start()
    subscribe_cache_key_events(ctx.event_bus, module.on_keys_changed)
    ctx.event_bus.subscribe_drops(module.on_events_lost)
    return module
