"""A stand-in LMCache server for drain tests: health, in-flight work on demand, SIGTERM record.

Usage: ``fake_lmcache.py HTTP_PORT REQUEST_PORT STATE_DIR``. Reports 3 in-flight L2 stores
until ``STATE_DIR/done`` exists; on SIGTERM writes ``STATE_DIR/sigterm`` holding whether
``done`` existed at that moment, then exits 0.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

HTTP_PORT, REQUEST_PORT, STATE = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/healthcheck":
            body = b'{"status":"healthy"}'
        elif self.path == "/metrics":
            pending = 0 if (STATE / "done").exists() else 3
            body = f'lmcache_mp_num_inflight_l2_stores{{l2_name="fs"}} {pending}.0\n'.encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def on_term(_signum: int, _frame: FrameType | None) -> None:
    (STATE / "sigterm").write_text(str((STATE / "done").exists()))
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
listener = socket.create_server(("127.0.0.1", REQUEST_PORT))
server = ThreadingHTTPServer(("127.0.0.1", HTTP_PORT), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    signal.pause()
