"""The one leaving client of the benchmarks and the tests: a streaming request, then gone.

Over a socket of its own (``post_raw``), a client that must be able to leave
at any moment, before the headers or between two chunks, with a FIN or with
unread data: no HTTP library in the way, only the request written out. Over
httpx (``stream_then_leave``), the client an OpenAI SDK user is. How it
leaves is part of what is measured (a close with unread bytes is a reset,
one after reading all is a FIN), so each way a caller leaves on purpose is a
function of its own here.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx

__all__ = ["close_after", "post_head", "post_raw", "stream_then_leave"]


def post_raw(url: str, path: str, body: dict[str, Any], timeout: float) -> socket.socket:
    """``body`` as JSON, POSTed to ``url`` + ``path``; the socket, nothing of the answer read."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(post_head(f"{host}:{port}", path, len(payload)) + payload)
    return sock


def post_head(authority: str, path: str, length: int) -> bytes:
    """The head of an HTTP/1.1 POST of ``length`` bytes of JSON, for the raw clients to send
    with its body, or ahead of it."""
    return (
        f"POST {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def close_after(url: str, body: dict[str, Any], after: float, chunks: int) -> float:
    """A streaming ``/generate`` of ``body``, closed ``after`` s from the send and ``chunks``
    data chunks in (what else came stays unread); the moment it closed (``time.monotonic``)."""
    with post_raw(url, "/generate", {**body, "stream": True}, timeout=30) as client:
        time.sleep(after)
        seen = b""
        while seen.count(b"data: {") < chunks:
            received = client.recv(65536)
            if not received:
                break
            seen += received
        return time.monotonic()


def stream_then_leave(
    url: str,
    path: str,
    body: dict[str, Any],
    *,
    chunks: int = 0,
    after: float = 0.0,
    timeout: float = 30.0,
) -> float:
    """``body`` streamed over httpx: ``chunks`` data events read, ``after`` s more waited,
    then the connection closed with the rest unread; the moment before the close
    (``time.monotonic``)."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:500]!r}")
        # Held, not left to the collector: a finalised line iterator closes the response.
        data = (line for line in response.iter_lines() if line.startswith("data: {"))
        for _ in range(chunks):
            if next(data, None) is None:
                raise RuntimeError(f"the stream ended before {chunks} data events")
        if after:
            time.sleep(after)
        return time.monotonic()
