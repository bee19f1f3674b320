"""The few ASGI moves the server needs: read a bounded body, answer JSON, stream SSE."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._errors import HTTPError

__all__ = [
    "SSE_DONE",
    "ClientGone",
    "Receive",
    "Scope",
    "Send",
    "read_json",
    "send_json",
    "send_sse",
    "send_text",
    "sse_event",
    "start_sse",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SSE_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its request was read."""


async def read_json(scope: Scope, receive: Receive, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``limit`` bytes, 400 if not an object."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise HTTPError(413, f"request body over {limit} bytes")
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body += message.get("body", b"")
        if len(body) > limit:
            raise HTTPError(413, f"request body over {limit} bytes")
        if not message.get("more_body", False):
            break
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HTTPError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the JSON body must be an object")
    return data


def _headers(content_type: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type), (b"cache-control", b"no-cache")]


async def send_json(send: Send, status: int, data: object) -> None:
    body = json.dumps(data).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": _headers(b"application/json")}
    )
    await send({"type": "http.response.body", "body": body})


async def send_text(send: Send, status: int, text: str, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _headers(content_type)})
    await send({"type": "http.response.body", "body": text.encode()})


async def start_sse(send: Send) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": _headers(b"text/event-stream")}
    )


def sse_event(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def send_sse(send: Send, payload: bytes, *, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": payload, "more_body": more})
