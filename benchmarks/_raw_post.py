"""A POST over a socket of its own: the one raw client of the benchmarks and the tests.

A client that must be able to leave at any moment, before the headers or
between two chunks, with a FIN or with unread data: no HTTP library in the
way, only the request written out.
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["post_raw"]


def post_raw(url: str, path: str, body: dict[str, Any], timeout: float) -> socket.socket:
    """``body`` as JSON, POSTed to ``url`` + ``path``; the socket, nothing of the answer read."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(head.encode() + payload)
    return sock
