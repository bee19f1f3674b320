"""Another server's answer, read so that nothing in it can reach past the one call.

A decode server reads its peers' answers (a KV room's long poll, a prefill
server's ``/capabilities`` and ``/generate``), and ``bench-endpoint`` reads
whatever server it measures (its metrics pages, its streams). Neither peer
is trusted more than the request or the command line that named it, so an
answer is read the way a client's body is: bounded in bytes, bounded in
total time (httpx's timeouts bound each read, not a trickle of them), never
decompressed (a small body must not grow), and parsed so that a deeply
nested document is a bad answer, not a ``RecursionError`` that ends the
process. Whatever goes wrong is one exception, ``BadAnswer``, whose message
names the URL and what was wrong, for the caller to turn into that one
call's failure.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import trio

__all__ = ["Answer", "BadAnswer", "parse_json", "read_answer", "stream_lines"]


class BadAnswer(Exception):
    """The answer could not be had or used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def head(self) -> str:
        """The start of the body as text, for an error message."""
        return self.body[:200].decode("utf-8", "replace")

    def json(self) -> object:
        """The body parsed; ``None`` if it is not JSON (an error page), or nested too deep."""
        return parse_json(self.body)


def parse_json(data: str | bytes) -> object:
    """``json.loads``, with ``None`` for what is not JSON or is nested deeper than it goes."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


async def read_answer(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    max_bytes: int,
    within: float,
    **kwargs: Any,
) -> Answer:
    """``method url``, its whole answer within ``within`` seconds and ``max_bytes`` bytes.

    ``kwargs`` go to httpx (``json``, ``params``, ``timeout``: httpx's own
    bounds per connect and per read). ``BadAnswer`` if the call fails
    (including a URL httpx will not build), takes longer, or answers more,
    or compressed.
    """
    with trio.move_on_after(within):
        async with _streamed(client, method, url, kwargs) as (full, response):
            body = bytearray()
            async with aclosing(_raw(response)) as chunks:
                async for chunk in chunks:
                    body += chunk
                    if len(body) > max_bytes:
                        raise BadAnswer(f"{full}: an answer of more than {max_bytes} bytes")
            return Answer(response.status_code, bytes(body))
    raise BadAnswer(f"{_where(client, url)}: no answer in full within {within} s")


@asynccontextmanager
async def stream_lines(
    client: httpx.AsyncClient, method: str, url: str, *, max_line: int, **kwargs: Any
) -> AsyncIterator[tuple[httpx.Response, AsyncIterator[str]]]:
    """``method url`` as a stream of text lines (an SSE stream), each at most ``max_line``
    bytes: a longer one is a ``BadAnswer``, not a buffer that grows until memory runs out.

    The caller bounds the time (a stream may rightly last long).
    """
    async with _streamed(client, method, url, kwargs) as (full, response):
        lines = _lines(response, full, max_line)
        async with aclosing(lines):
            yield response, lines


@asynccontextmanager
async def _streamed(
    client: httpx.AsyncClient, method: str, url: str, kwargs: dict[str, Any]
) -> AsyncIterator[tuple[str, httpx.Response]]:
    headers = {**kwargs.pop("headers", {}), "accept-encoding": "identity"}
    full = _where(client, url)
    try:
        async with client.stream(method, full, headers=headers, **kwargs) as response:
            encoding = response.headers.get("content-encoding", "identity").lower()
            if encoding != "identity":
                raise BadAnswer(f"{full}: an answer with content-encoding {encoding!r:.40}")
            yield full, response
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise BadAnswer(f"{full}: {exc!r}") from exc


def _where(client: httpx.AsyncClient, url: str) -> str:
    """``url`` as the client will reach it (its base URL joined), for messages."""
    try:
        return str(client.base_url.join(url))
    except httpx.InvalidURL:
        return url


async def _raw(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    # An async generator (httpx types it as an iterator): closed, not left to GC.
    chunks: AsyncGenerator[bytes, None] = response.aiter_raw()  # type: ignore[assignment]
    async with aclosing(chunks):
        async for chunk in chunks:
            yield chunk


async def _lines(response: httpx.Response, url: str, max_line: int) -> AsyncGenerator[str, None]:
    pending = bytearray()
    async with aclosing(_raw(response)) as chunks:
        async for chunk in chunks:
            pending += chunk
            *lines, rest = pending.split(b"\n")
            for line in (*lines, rest):
                if len(line) > max_line:
                    raise BadAnswer(f"{url}: a line of more than {max_line} bytes")
            for line in lines:
                yield line.removesuffix(b"\r").decode("utf-8", "replace")
            pending = bytearray(rest)
    if pending:
        yield pending.decode("utf-8", "replace")
