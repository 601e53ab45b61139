"""KV events from the cache server: a server module that LMCache 0.5.6's MP server loads.

LMCache's server-module extension point (``--server-module``, see ``command.KV_EVENTS_MODULE``);
the server internals it needs (key resolution, the event bus's names) sit behind
``kvoffload.lmcache_guard``. It runs inside the LMCache server process and:

- publishes vLLM's KV-event batches on a ZMQ XPUB socket it binds: three frames
  ``[topic, sequence as 8-byte big-endian, msgpack [timestamp, events, nil]]``, the events in
  the configured wire format (``kv_event_wire``: vLLM >= 0.24's maps by default);
- answers ``chunk_report.METHOD`` (the connector's report after a store's COMMIT was answered) by
  resolving the chunks' hashes with the server's own hasher (so LMCache's evictions name the same
  chunks) and announcing the unsalted ones, and the LoRA-scoped ones under their adapter
  (``kv_events.ChunkTracker``);
- follows LMCache's event bus (``lmcache_guard.subscribe_cache_key_events``): an L1 eviction is a
  removal from the host tier, a load from L2 back into L1 an announcement there again (where the
  server keeps loads in L1: ``command.L2_PREFETCH_POLICY``),
  an L2 adapter's store or delete an announcement or removal in its tier (``kv_events.l2_tier``);
- sends a subscriber, when it subscribes and to it alone (``XPUB_MANUAL_LAST_VALUE``), one batch:
  the blocks its predecessor left announced withdrawn per tier, ``AllBlocksCleared``, and the chunks
  it tracks, under the number of the last batch sent (a greeting takes no number of its own, so
  nobody else can miss one); before the first batch that number is the server's opening number,
  its predecessor's last + 1, kept for greetings alone, so that a subscriber of the predecessor that
  reconnects, before or after others were greeted, sees its next number (Dynamo's indexer logs
  every jump as lost batches, and drops a number it has seen: a subscriber that missed nothing drops
  its greeting, which tells it nothing new);
- keeps a journal (``journal`` in its config) of every block it announced and withdrew and of the
  last sequence number: a restarted server withdraws what its predecessor left announced, block by
  block (llm-d's index <= 0.8.1 ignores ``AllBlocksCleared``), and numbers on from where it stopped
  (Dynamo's indexer drops numbers it has seen and logs every jump as lost batches).

All tracker changes and all sends happen on one publisher thread, which owns the socket and the
journal; the server's request threads and the event bus's thread only queue changes (bounded; an
overflow or a lost eviction clears everything: routers under-count, never over-count).
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

import zmq

from kvoffload import chunk_report
from kvoffload.lmcache_guard import check_lmcache_version
from kvoffload.lmcache_guard.cache_key_events import (
    CacheKeysChanged,
    resolve_chunk_hashes,
    subscribe_cache_key_events,
)
from kvoffload.lmcache_guard.server_cli import server_module_handler

from .kv_event_wire import (
    FORMAT_VLLM,
    FORMATS,
    AllBlocksCleared,
    Event,
    JournalState,
    Tier,
    WireFormat,
    compacted_journal,
    encode_batch,
    fold_journal,
    journal_record,
    read_format,
    withdrawals,
)
from .kv_events import DEFAULT_CAPACITY_CHUNKS, ChunkTracker, StoredChunk, batches, l2_tier

logger = logging.getLogger("kvoffload.sidecar.kv_events")

_POLL_MS = 100
"""The publisher thread's longest sleep: a change wakes it at once (``_wake``); this bounds only how
late a rate-limited snapshot or a stop is seen."""
_QUEUE_CHANGES = 4096
_JOURNAL_COMPACT_BYTES = 64 << 20
"""A journal past this size is rewritten as the state it holds."""
_SUBSCRIBE = 1

Change = Callable[[ChunkTracker], list[Event]]


class KvEventsUnavailable(RuntimeError):
    """The server cannot publish events as configured; the message says why and what to change."""


def wire_format(raw: object) -> WireFormat:
    """The configured wire format, or the reason it is refused, naming what is allowed."""
    wire = read_format(raw) if isinstance(raw, str) else None
    if wire is None:
        raise KvEventsUnavailable(
            f"kvoffload KV events: format {raw!r} is not allowed; use one of {', '.join(FORMATS)}"
        )
    return wire


class EventJournal:
    """The journal file: read once at start (then rewritten as the state it held), appended per batch."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = -1

    def open(self) -> JournalState:
        """The predecessor's state; the file is rewritten to hold just it, and kept open for appends."""
        try:
            with open(self._path, "rb") as old:
                state = fold_journal(old.read())
        except FileNotFoundError:
            state = fold_journal(b"")
        self._rewrite(compacted_journal(state))
        return state

    def append(self, sequence: int, events: list[Event]) -> None:
        if self._fd < 0:
            return
        os.write(self._fd, journal_record(sequence, events))
        if os.fstat(self._fd).st_size > _JOURNAL_COMPACT_BYTES:
            with open(self._path, "rb") as current:
                self._rewrite(compacted_journal(fold_journal(current.read())))

    def _rewrite(self, data: bytes) -> None:
        temporary = self._path + ".tmp"
        with open(temporary, "wb") as out:
            out.write(data)
        os.replace(temporary, self._path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventPublisher:
    """The XPUB socket, the tracker and the journal, owned by one thread; others only ``submit`` changes."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        tracker: ChunkTracker,
        wire: WireFormat = FORMAT_VLLM,
        journal: EventJournal | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._topic = topic.encode()
        self._tracker = tracker
        self._wire: WireFormat = wire
        self._journal = journal
        self._changes: queue.Queue[Change] = queue.Queue(maxsize=_QUEUE_CHANGES)
        self._overflowed = threading.Event()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._sequence = 1
        """The number of the next batch; the one before it is a greeting's (at first the opening
        number: the predecessor's last + 1 from its journal, else 0)."""
        self._inherited: list[Event] = []
        """The predecessor's blocks still announced, withdrawn in every subscriber's first batch."""
        self._snapshot: bytes | None = None
        """The encoded first batch, until the tracker changes (a peer subscribing in a loop costs one
        encoding per change, not one per subscription)."""
        self.counts: Counter[str] = Counter()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._thread = threading.Thread(target=self._run, name="kvoffload-kv-events", daemon=True)

    def start(self, timeout_s: float = 5.0) -> None:
        """Read the journal, bind (on the publisher thread); raises when either failed."""
        if self._journal is not None:
            try:
                state = self._journal.open()
            except OSError as exc:
                raise KvEventsUnavailable(f"kvoffload KV events: cannot keep the journal: {exc!r}") from exc
            opening = state.last_sequence + 1
            self._journal.append(opening, [])  # the number only: a successor must not greet with it again
            self._sequence = opening + 1
            self._inherited = withdrawals(state)[:-1]
        self._thread.start()
        if not self._bound.wait(timeout_s) or self._error is not None:
            raise KvEventsUnavailable(f"kvoffload KV events: cannot bind {self._endpoint}: {self._error!r}")

    def submit(self, change: Change) -> None:
        """Queue a tracker change; never blocks (a full queue clears everything instead)."""
        try:
            self._changes.put_nowait(change)
        except queue.Full:
            self.counts["changes_dropped"] += 1
            self._overflowed.set()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the thread
            os.write(self._wake_write, b"\0")

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2.0)
        if self._journal is not None:
            self._journal.close()

    def _run(self) -> None:
        context: Any = zmq.Context.instance()
        sock = context.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # Subscriptions come to this thread, which applies each and sends the first message after
            # it to that subscriber alone (libzmq >= 4.3.3).
            sock.setsockopt(zmq.XPUB_MANUAL_LAST_VALUE, 1)
            sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            sock.close()
            self._bound.set()
            return
        self._bound.set()
        logger.info(
            "event=kv_events_bound endpoint=%s sequence=%d format=%s", self._endpoint, self._sequence, self._wire
        )
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self._wake_read in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_read, 4096):
                            pass
                self._apply_changes(sock)
                if sock in ready:
                    self._on_subscriptions(sock)
        except Exception:  # the server must outlive its event publisher
            logger.exception("event=kv_events_publisher_failed")
        finally:
            sock.close()

    def _on_subscriptions(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                message = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if message[:1] != bytes([_SUBSCRIBE]):
                continue  # an unsubscription: libzmq drops a closed pipe's filters itself
            sock.setsockopt(zmq.SUBSCRIBE, message[1:])
            self.counts["subscriptions"] += 1
            self._greet(sock)

    def _greet(self, sock: zmq.Socket[bytes]) -> None:
        """The first batch, to the subscriber just applied alone, under the last number sent (or the
        opening number): the others are sent nothing, so none of them sees a gap, and the joiner's
        next number follows on."""
        if self._snapshot is None:
            self._snapshot = encode_batch(time.time(), [*self._inherited, *self._tracker.snapshot()], self._wire)
        sequence = (self._sequence - 1).to_bytes(8, "big")
        try:
            sock.send_multipart([self._topic, sequence, self._snapshot], zmq.NOBLOCK)
        except zmq.Again:
            self.counts["batches_dropped"] += 1

    def _apply_changes(self, sock: zmq.Socket[bytes]) -> None:
        events: list[Event] = []
        if self._overflowed.is_set():  # a change was lost: what the tracker says may be wrong
            self._overflowed.clear()
            with contextlib.suppress(queue.Empty):
                while True:
                    self._changes.get_nowait()
            events += self._tracker.clear()
        while True:
            try:
                change = self._changes.get_nowait()
            except queue.Empty:
                break
            events += change(self._tracker)
        if any(isinstance(e, AllBlocksCleared) for e in events):
            events = [*self._inherited, *events]  # a clear withdraws the predecessor's blocks too
        if events:
            self._snapshot = None
            self._send(events, sock)

    def _send(self, events: list[Event], sock: zmq.Socket[bytes]) -> None:
        for batch in batches(events):
            if self._journal is not None:  # first: a successor withdraws what may have reached a router
                self._journal.append(self._sequence, batch)
            payload = encode_batch(time.time(), batch, self._wire)
            try:
                sock.send_multipart([self._topic, self._sequence.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.Again:
                self.counts["batches_dropped"] += 1
            self._sequence += 1
            self.counts["events_sent"] += len(batch)


class KvEventsModule:
    """The LMCache server module: the report handler, the eviction subscriber and the publisher."""

    def __init__(self, server_context: Any, publisher: EventPublisher, l1_keeps_loads: bool = False) -> None:
        self._ctx = server_context
        self._publisher = publisher
        self._l1_keeps_loads = l1_keeps_loads
        """The server keeps what it loads from L2 in L1; otherwise a load is a copy through L1 that
        LMCache drops at once (announcing it would withdraw it a moment later)."""
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
        """``chunk_report.METHOD``: a connector's store was committed; announce its chunks, unscoped or
        under their LoRA scope (a salted report without one is never announced)."""
        report = chunk_report.decode(payload)
        if report.salt != "" and report.lora is None:
            self.counts["reports_salted"] += 1
            return b"salted"
        chunk_size = int(self._ctx.chunk_size)
        first, last = -(-report.start // chunk_size), report.end // chunk_size
        if first >= last or chunk_size % report.tokens_per_block:
            self.counts["reports_empty"] += 1
            return b"empty"
        hashes = resolve_chunk_hashes(self._ctx, report.cache_model, report.world_size, report.token_ids,
                                      last * chunk_size, report.salt)  # fmt: skip
        chunks = [
            StoredChunk(hashes[i], report.token_ids[i * chunk_size : (i + 1) * chunk_size], i)
            for i in range(first, last)
        ]
        parent = hashes[first - 1] if first > 0 else None
        model, block, salt, lora = report.cache_model, report.tokens_per_block, report.salt, report.lora
        self._publisher.submit(lambda tracker: tracker.stored(model, chunks, parent, block, salt, lora))
        self.counts["reports"] += 1
        return b"ok"

    def on_keys_changed(self, change: CacheKeysChanged) -> None:
        """Event bus: a tier of the cache took or dropped these objects."""
        keys, tier = change.keys, Tier.HOST if change.tier == "l1" else l2_tier(change.backend, change.shared)
        if not change.stored:
            self._publisher.submit(lambda tracker: tracker.evicted(keys, tier))
        elif tier is Tier.HOST:
            if self._l1_keeps_loads:
                self._publisher.submit(lambda tracker: tracker.loaded(keys))
        else:
            self._publisher.submit(lambda tracker: tracker.l2_stored(keys, tier))

    def on_events_lost(self) -> None:
        """Event bus overflow: an eviction may be lost, so routers forget everything from here."""
        self.counts["bus_drops"] += 1
        self._publisher.submit(lambda tracker: tracker.clear())


def build_server_modules(build: Any) -> Any:
    """LMCache's server-module factory (``ExtServerModuleBuildContext`` in, the module out).

    ``build.config``: ``port`` (required), ``host`` (default all addresses), ``topic`` (default
    ``""``), ``capacity_chunks`` (default ``kv_events.DEFAULT_CAPACITY_CHUNKS``), ``format`` (one of
    ``kv_event_wire.FORMATS``, default ``vllm``), ``journal`` (a file path; default none: a restarted
    server then greets under 0 again and cannot withdraw its predecessor's blocks), ``l1_keeps_loads``
    (default false: the server runs LMCache's ``default`` prefetch policy, whose loads from L2 do not
    stay in L1, so they are not announced there).
    """
    check_lmcache_version("KV-event module", "its server internals; turn events off or use a supported LMCache")
    ctx = build.server_context
    if not ctx.event_bus.enabled:
        raise KvEventsUnavailable(
            "kvoffload KV events: LMCache's event bus is off (--disable-observability), so evictions "
            "cannot be announced; turn events off or the event bus on"
        )
    config = dict(build.config)
    host, port = str(config.get("host", "0.0.0.0")), int(config["port"])
    journal = config.get("journal")
    wire = wire_format(config.get("format", FORMAT_VLLM))
    publisher = EventPublisher(
        f"tcp://{host}:{port}",
        str(config.get("topic", "")),
        ChunkTracker(int(config.get("capacity_chunks", DEFAULT_CAPACITY_CHUNKS)), wire),
        wire,
        EventJournal(str(journal)) if journal else None,
    )
    module = KvEventsModule(ctx, publisher, bool(config.get("l1_keeps_loads", False)))
    publisher.start()
    subscribe_cache_key_events(ctx.event_bus, module.on_keys_changed)
    ctx.event_bus.subscribe_drops(module.on_events_lost)
    return module
