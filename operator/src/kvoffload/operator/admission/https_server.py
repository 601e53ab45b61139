"""An HTTPS server for hostile peers, the webhook's. One I/O thread owns every connection while it
is slow: the TLS handshake, the request head and body, and the reply going out, all non-blocking
under a deadline. A fixed pool of handler threads answers complete requests. So an idle or
dribbling peer costs a socket and at most one request's bytes, never a thread, and delays no one.

One request per connection (``Connection: close``), HTTP/1.1 with a Content-Length body only.
"""

from __future__ import annotations

import collections
import contextlib
import http
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload import contract as c

log = logging.getLogger("kvoffload.operator")

REQUEST_DEADLINE_S = 5.0
"""From accept to the request's last byte (handshake, head, body). The apiserver waits for a
webhook 5 s at most (its ``timeoutSeconds``), so a request slower than that helps no one."""
REPLY_DEADLINE_S = 5.0
"""For the reply to go out and the peer to close (unread body bytes are discarded meanwhile)."""
MAX_HEAD_BYTES = 16 * 2**10
"""The request line and headers, their blank line included."""
MAX_CONNECTIONS = 512
"""Connections held at once; at the cap a new one drops the oldest still arriving."""
BUFFER_BUDGET_BYTES = 32 * 2**20
"""Request bytes held at once (arriving, waiting or being answered), all connections together; at
the cap the oldest connection still arriving is dropped."""
HANDLER_THREADS = 4
"""Requests answered at once: a pod's review is CPU-bound (the GIL) and, at the body cap, takes
tens of MiB while it is answered, so a few threads are as fast as many and bound the memory."""
MAX_WAITING = 16
"""Complete requests waiting for a handler thread; beyond that a request gets 503."""
_CHUNK = 64 * 2**10
_CHUNKS_PER_WAKE = 64
_TICK_S = 0.2


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes
    client_certified: bool = False
    """The peer presented a client certificate the server's context verified."""
    forwarded: bool = False
    """It carries ``HEADER_FORWARDED_REVIEW``: another replica forwarded it (anyone may set it; it only
    keeps the receiver from forwarding it on)."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "text/plain"

    def encode(self) -> bytes:
        """The reply as sent: status line, headers, body."""
        head = (f"HTTP/1.1 {self.status} {http.HTTPStatus(self.status).phrase}\r\nContent-Type: {self.content_type}"
                f"\r\nContent-Length: {len(self.body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
        return head.encode("latin-1") + self.body


def refusal(status: int, reason: str) -> Reply:
    return Reply(status, reason.encode() + b"\n")


@dataclass(frozen=True)
class RequestHead:
    method: str
    path: str
    body_length: int
    forwarded: bool = False


def parse_head(head: bytes, max_body: int) -> RequestHead | Reply:
    """The request line and body length of a request head (the bytes before its blank line), or
    the refusal: 400 malformed, 411 no Content-Length on a POST (chunked included), 413 over ``max_body``."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        return refusal(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        key = name.lower()
        if not colon or not name or name != name.strip() or (key in headers and key == "content-length"):
            return refusal(400, "malformed or repeated header")
        headers[key] = value.strip()
    if "transfer-encoding" in headers:
        return refusal(411, "a Content-Length body is required, not Transfer-Encoding")
    length = headers.get("content-length", "0" if parts[0] != "POST" else None)
    if length is None:
        return refusal(411, "a POST needs a Content-Length")
    if not (length.isascii() and length.isdigit()):
        return refusal(400, "Content-Length is not a number")
    if len(length) > len(str(max_body)) or int(length) > max_body:  # int() of 5,000 digits raises
        return refusal(413, f"the body is {length[:20]} bytes; at most {max_body} are read")
    return RequestHead(parts[0], parts[1], int(length), c.HEADER_FORWARDED_REVIEW.lower() in headers)


class _Connection:
    """One peer's socket and where it stands: ``handshake``, ``read``, ``handling`` (at a handler
    thread), ``write`` (the reply going out), ``drain`` (reply sent, input discarded until EOF)."""

    def __init__(self, sock: ssl.SSLSocket, now: float) -> None:
        self.sock, self.accepted, self.deadline = sock, now, now + REQUEST_DEADLINE_S
        self.state = "handshake"
        self.events = 0
        self.buffer = bytearray()
        self.head: RequestHead | None = None
        self.held = 0  # request bytes counted against BUFFER_BUDGET_BYTES
        self.outgoing = b""


class HttpsServer:
    """Serves ``handle`` over TLS on ``host:port``; ``handle`` runs in one of the handler threads."""

    def __init__(self, context: ssl.SSLContext, host: str, port: int, handle: Callable[[Request], Reply],
                 max_body: int) -> None:  # fmt: skip
        self._context, self._handle, self._max_body = context, handle, max_body
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._requests: queue.Queue[tuple[_Connection, Request] | None] = queue.Queue(MAX_WAITING)
        self._replies: collections.deque[tuple[_Connection, Reply]] = collections.deque()
        self._connections: dict[int, _Connection] = {}  # by id; the I/O thread's alone
        self._buffered = 0  # request bytes held, all connections together
        self._again: list[_Connection] = []  # read data may wait inside TLS, where no select sees it
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._serve, name="kvoffload-webhook", daemon=True)] + [
            threading.Thread(target=self._answer_requests, name=f"kvoffload-webhook-handler-{i}", daemon=True)
            for i in range(HANDLER_THREADS)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake()
        for _ in range(HANDLER_THREADS):
            with contextlib.suppress(queue.Full):  # a handler stuck with a full queue: it is a daemon
                self._requests.put(None, timeout=1)
        for thread in self._threads:
            thread.join(timeout=10)

    # --- handler threads ------------------------------------------------------------

    def _answer_requests(self) -> None:
        while (item := self._requests.get()) is not None:
            connection, request = item
            try:
                reply = self._handle(request)
            except Exception:
                log.exception("webhook: answering %s %s failed", request.method, request.path)
                reply = refusal(500, "internal error")
            self._replies.append((connection, reply))
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # already woken
            self._wake_write.send(b"\0")

    # --- the I/O thread -------------------------------------------------------------

    def _serve(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            next_expiry = time.monotonic()
            while not self._stopping.is_set():
                for key, _ in self._selector.select(0 if self._again else _TICK_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_read:
                        self._wake_read.recv(4096)
                    else:
                        self._advance(key.data)
                again, self._again = self._again, []
                for connection in again:
                    self._advance(connection)
                while self._replies:
                    self._reply(*self._replies.popleft())
                if (now := time.monotonic()) >= next_expiry:
                    self._expire(now)
                    next_expiry = now + _TICK_S
        finally:
            for connection in list(self._connections.values()):
                self._close(connection)
            self._selector.close()
            self._listener.close()
            self._wake_read.close()
            self._wake_write.close()

    def _accept(self) -> None:
        for _ in range(_CHUNKS_PER_WAKE):
            try:
                raw, _address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits
                log.warning("webhook: accept failed: %s", exc)
                return
            while len(self._connections) >= MAX_CONNECTIONS and self._drop_oldest_arriving():
                pass
            if len(self._connections) >= MAX_CONNECTIONS:
                raw.close()  # every one is being answered
                continue
            raw.setblocking(False)
            try:
                sock = self._context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            except OSError:
                raw.close()  # gone already
                continue
            connection = _Connection(sock, time.monotonic())
            self._connections[id(connection)] = connection
            self._watch(connection, selectors.EVENT_READ)

    def _drop_oldest_arriving(self) -> bool:
        """Close the connection accepted first of those still arriving; whether there was one."""
        oldest = next((x for x in self._connections.values() if x.state in ("handshake", "read")), None)
        if oldest is None:
            return False
        log.debug("webhook: at a cap (%d connections, %d bytes): dropped the oldest still arriving",
                  len(self._connections), self._buffered)  # fmt: skip
        self._close(oldest)
        return True

    def _advance(self, connection: _Connection) -> None:
        if id(connection) not in self._connections:
            return  # closed earlier in this turn (dropped at a cap)
        try:
            if connection.state == "handshake":
                connection.sock.do_handshake()
                connection.state = "read"
            if connection.state == "read":
                self._read(connection)
            elif connection.state == "write":
                self._write(connection)
            elif connection.state == "drain":
                self._drain(connection)
        except ssl.SSLWantReadError:
            self._watch(connection, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._watch(connection, selectors.EVENT_WRITE)
        except OSError as exc:  # a failed handshake, a reset
            log.debug("webhook: connection closed in %s: %s", connection.state, exc)
            self._close(connection)
        except Exception:  # our bug: this connection goes, the server stays
            log.exception("webhook: connection failed in %s", connection.state)
            self._close(connection)

    def _read(self, connection: _Connection) -> None:
        for _ in range(_CHUNKS_PER_WAKE):
            head, buffer = connection.head, connection.buffer
            if head is not None and len(buffer) >= head.body_length:
                certified = bool(connection.sock.getpeercert())
                self._dispatch(
                    connection,
                    Request(head.method, head.path, bytes(buffer[: head.body_length]), certified, head.forwarded),
                )
                return
            # up to the head's cap, then up to the body's length: nothing past a request is read
            wanted = min(_CHUNK, (MAX_HEAD_BYTES if head is None else head.body_length) - len(buffer))
            data = connection.sock.recv(wanted)
            if not data:
                self._close(connection)  # the peer left before its request was whole
                return
            searched_to = max(0, len(buffer) - 3)
            buffer += data
            connection.held += len(data)
            self._buffered += len(data)
            while self._buffered > BUFFER_BUDGET_BYTES and self._drop_oldest_arriving():
                pass
            if id(connection) not in self._connections:
                return
            if head is None:
                end = buffer.find(b"\r\n\r\n", searched_to)
                if end < 0 and len(buffer) >= MAX_HEAD_BYTES:
                    self._refuse(connection, refusal(431, f"the request head is over {MAX_HEAD_BYTES} bytes"))
                    return
                if end >= 0 and not self._take_head(connection, bytes(buffer[:end])):
                    return
                if end >= 0:
                    del buffer[: end + 4]
        self._again.append(connection)  # more may be waiting: read it after the others had a turn

    def _take_head(self, connection: _Connection, head: bytes) -> bool:
        """Whether the request goes on to its body (else it was refused before any body byte is read)."""
        parsed = parse_head(head, self._max_body)
        if isinstance(parsed, Reply):
            self._refuse(connection, parsed)
            return False
        connection.head = parsed
        return True

    def _dispatch(self, connection: _Connection, request: Request) -> None:
        connection.buffer = bytearray()
        try:
            self._requests.put_nowait((connection, request))
        except queue.Full:
            self._refuse(connection, refusal(503, "too many requests waiting; try again"))
            return
        connection.state = "handling"
        self._watch(connection, 0)

    def _refuse(self, connection: _Connection, reply: Reply) -> None:
        log.debug("webhook: refused with %d: %s", reply.status, reply.body.decode(errors="replace").strip())
        self._reply(connection, reply)

    def _reply(self, connection: _Connection, reply: Reply) -> None:
        if id(connection) not in self._connections:
            return  # closed meanwhile (the server stopping)
        self._release(connection)
        connection.state, connection.outgoing = "write", reply.encode()
        connection.deadline = time.monotonic() + REPLY_DEADLINE_S
        self._advance(connection)

    def _write(self, connection: _Connection) -> None:
        while connection.outgoing:
            sent = connection.sock.send(connection.outgoing)  # or SSLWantWriteError: the same bytes again
            connection.outgoing = connection.outgoing[sent:]
        connection.sock.shutdown(socket.SHUT_WR)  # no TLS close_notify: from here the socket is plain
        connection.state = "drain"
        self._drain(connection)

    def _drain(self, connection: _Connection) -> None:
        """Discard what the peer still sends (a refused body) until it closes: closing first would
        reset the connection, and the peer might lose the reply."""
        for _ in range(_CHUNKS_PER_WAKE):
            try:
                if not connection.sock.recv(_CHUNK):
                    self._close(connection)
                    return
            except BlockingIOError:
                self._watch(connection, selectors.EVENT_READ)
                return

    def _watch(self, connection: _Connection, events: int) -> None:
        if events == connection.events:
            return
        if connection.events and events:
            self._selector.modify(connection.sock, events, connection)
        elif events:
            self._selector.register(connection.sock, events, connection)
        else:
            self._selector.unregister(connection.sock)
        connection.events = events

    def _expire(self, now: float) -> None:
        for connection in [x for x in self._connections.values() if x.deadline <= now and x.state != "handling"]:
            log.debug("webhook: connection cut off in %s after %.1f s", connection.state, now - connection.accepted)
            self._close(connection)

    def _release(self, connection: _Connection) -> None:
        self._buffered -= connection.held
        connection.held = 0

    def _close(self, connection: _Connection) -> None:
        if self._connections.pop(id(connection), None) is None:
            return
        self._release(connection)
        if connection.events:
            self._selector.unregister(connection.sock)
            connection.events = 0
        connection.sock.close()
