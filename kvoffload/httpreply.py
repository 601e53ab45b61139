"""One HTTP reply for the components' small stdlib servers: status, body, its type and length."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


def send_reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    """Answer the request ``handler`` serves with ``body``."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
