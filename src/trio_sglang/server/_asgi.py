"""The few ASGI moves the server needs: read a bounded body, answer JSON, stream SSE."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, NoReturn, TypeVar

import trio

from .._protocol._json import dumps
from ._http_errors import HTTPError

__all__ = [
    "DRAIN_BYTES",
    "SSE_DONE",
    "SSE_HEARTBEAT",
    "ClientGone",
    "Receive",
    "Scope",
    "Send",
    "read_body_within",
    "read_json",
    "read_json_within",
    "send_json",
    "send_sse",
    "send_text",
    "start_sse",
]

T = TypeVar("T")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SSE_DONE = b"data: [DONE]\n\n"
#: Blank lines between events: an SSE parser dispatches nothing for them (the
#: openai SDK, httpx-sse, browsers), and so does a reader that takes every
#: non-empty line for a ``data:`` line (SGLang's ``bench_serving``), where an
#: SSE comment (``: keep-alive``) would be parsed as JSON and fail. Two, not
#: one, so that a reader splitting the body on ``\n\n`` gets an empty piece
#: rather than the next event with a newline before its ``data:``.
SSE_HEARTBEAT = b"\n\n"
#: How far past the limit a body is still read before its 413. Clients send the
#: whole body before they read the answer, and hypercorn closes a connection with
#: the body unread, which resets it and can lose the 413 already sent; so a body
#: a little over the limit is read to its end (Go's net/http drains as much).
#: Past that the 413 goes at once, and the client may see only the reset.
DRAIN_BYTES = 1 << 18
#: How long a connection a refusal closes stays to take what the client sent (seconds).
LINGER = 1.0
#: The most pieces (HTTP/1.1 chunks or reads, HTTP/2 DATA frames) a body may come in.
#: Each costs the server a few microseconds of parsing and handing over whatever its
#: size: a megabyte in 1-byte chunks once cost 16 s of CPU. A client sending a
#: megabyte in pieces of 256 bytes or more stays within it.
MAX_BODY_PIECES = 4096


#: Where a JSON body can hold a lone surrogate: a ``\\u`` escape of one (strict
#: UTF-8 decoding refuses them as bytes). Only a body with one is walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


#: What a JSON list of token ids holds: the types a lone surrogate cannot be in.
_NUMBERS = frozenset({int, float, bool, type(None)})


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def _not_json(constant: str) -> NoReturn:
    """``NaN`` and ``Infinity`` are Python's extensions, not JSON: refuse them."""
    raise ValueError(f"{constant} is not a JSON value")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body; 413 past ``limit`` bytes, 400 past ``MAX_BODY_PIECES`` pieces.

    A body past ``limit + DRAIN_BYTES`` (or declared so) gets its 413 at once.
    """
    too_large = HTTPError(413, f"request body over {limit} bytes")
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > limit + DRAIN_BYTES:
            raise too_large
    body = bytearray()
    for _ in range(MAX_BODY_PIECES):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body += message.get("body", b"")
        if len(body) > limit + DRAIN_BYTES:
            raise too_large
        if not message.get("more_body", False):
            break
    else:
        raise HTTPError(
            400,
            f"the request body came in more than {MAX_BODY_PIECES} pieces (chunks or frames)",
            headers=[(b"connection", b"close")],
        )
    if len(body) > limit:
        raise too_large
    return bytes(body)


async def read_json(scope: Scope, receive: Receive, limit: int) -> dict[str, Any]:
    """The request body (``read_body``) as a JSON object; 400 if it is not one.

    JSON over HTTP is UTF-8 (RFC 8259), decoded strictly: ``json.loads`` on
    bytes would guess UTF-16 or 32 too, and let a surrogate encoded in UTF-8
    through as half a pair. Whatever the parser can raise on a body that fits
    the limit is the client's fault: nesting too deep (``RecursionError``),
    and every ``ValueError`` (bad UTF-8, bad syntax, ``NaN``/``Infinity``, an
    integer past Python's digit limit for ``int()``).
    """
    body = await read_body(scope, receive, limit)
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_not_json)
    except RecursionError:
        raise HTTPError(400, "malformed JSON body: nested too deeply") from None
    except ValueError as exc:
        raise HTTPError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the JSON body must be an object")
    if _SURROGATE_ESCAPE.search(body):
        found = _lone_surrogate(data)
        if found is not None:
            where, field = found
            raise HTTPError(
                400,
                f"malformed JSON body: {where} holds a lone surrogate (an unpaired "
                "\\ud800-\\udfff escape), which is not a Unicode character",
                param=field,
            )
    return data


def _lone_surrogate(data: dict[str, Any]) -> tuple[str, str | None] | None:
    """The first string (or key) holding a lone surrogate: where, and its field; or ``None``.

    JSON's ``\\ud800`` alone parses to a string that no UTF-8 writer can
    write: past this check it would fail wherever the request goes next, the
    engine, a peer, the log, with the whole request in the error. Clients
    that escape every non-ASCII character send each emoji as a surrogate
    pair, so bodies with escapes are common: a path is made per container, not
    per value, and a list of numbers (token ids) is skipped whole.
    """
    for field, top in data.items():
        if not _encodes(field):
            return "a field's name", None
        stack: list[tuple[object, str, object]] = [(top, "", None)]
        while stack:
            value, parent, key = stack.pop()
            if isinstance(value, str):
                if not _encodes(value):
                    return _path(field, parent, key), field
            elif isinstance(value, dict):
                here = _path(field, parent, key)
                for name, item in value.items():
                    if not _encodes(name):
                        return f"a key of {here}", field
                    stack.append((item, here, name))
            elif isinstance(value, list) and not _NUMBERS.issuperset(map(type, value)):
                here = _path(field, parent, key)  # token ids are skipped whole
                stack.extend((item, here, index) for index, item in enumerate(value))
    return None


def _path(field: str, parent: str, key: object) -> str:
    """``'messages'[0]['content']``: as the body would be indexed to reach it."""
    return f"{parent or repr(field)}[{key!r}]" if key is not None else parent or repr(field)


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def read_json_within(
    scope: Scope, receive: Receive, limit: int, seconds: float
) -> dict[str, Any]:
    """``read_json``, all of it within ``seconds`` of the headers: 408 after it."""
    return await _within(seconds, read_json(scope, receive, limit))


async def read_body_within(scope: Scope, receive: Receive, limit: int, seconds: float) -> bytes:
    """``read_body``, all of it within ``seconds`` of the headers: 408 after it."""
    return await _within(seconds, read_body(scope, receive, limit))


async def _within(seconds: float, reading: Awaitable[T]) -> T:
    """What ``reading`` reads, or a 408 once ``seconds`` have passed.

    The rest of the body may still be coming, so the 408 closes the connection.
    """
    with trio.move_on_after(seconds):
        return await reading
    raise HTTPError(
        408,
        f"the request body did not arrive within {seconds}s",
        headers=[(b"connection", b"close")],
    )


async def send_early(
    receive: Receive,
    send: Send,
    seconds: float,
    status: int,
    data: object,
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    refusal: bool = False,
) -> None:
    """An answer given before the request's body was read (a refusal, a wrong route).

    A wrong route's body is read first and dropped, up to ``DRAIN_BYTES`` and
    within ``seconds``: answered with it unread, the HTTP/1.1 exchange is not
    over, so hypercorn closes the connection under a client that sent its
    next request already, and that request is lost with no answer. A body
    past those bounds is left, and the answer says ``connection: close``.

    A ``refusal`` (no key, a wrong Host or Content-Type, a bad framing) is
    not worth a wait for a body that may never come: it goes at once, says
    ``connection: close``, and the connection ends after at most ``LINGER``
    seconds, which drain what the client already sent so that the close
    does not reset the answer away before it is read.
    """
    if refusal:
        await send_json(send, status, data, [*headers, (b"connection", b"close")])
        await _drain(receive, min(seconds, LINGER))
        return
    drained = await _drain(receive, seconds)
    if drained is None:
        return  # nobody to answer
    if not drained:
        headers = [*headers, (b"connection", b"close")]
    await send_json(send, status, data, headers)


async def _drain(receive: Receive, seconds: float) -> bool | None:
    """Read the body to its end, up to ``DRAIN_BYTES`` within ``seconds``: whether it
    ended (``None``: the client disconnected)."""
    with trio.move_on_after(seconds):
        read = 0
        while read <= DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
    return False


def _headers(content_type: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type), (b"cache-control", b"no-cache")]


async def send_json(
    send: Send, status: int, data: object, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_headers(b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_text(send: Send, status: int, text: str, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _headers(content_type)})
    await send({"type": "http.response.body", "body": text.encode()})


async def start_sse(send: Send) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": _headers(b"text/event-stream")}
    )


async def send_sse(send: Send, payload: bytes, *, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": payload, "more_body": more})
