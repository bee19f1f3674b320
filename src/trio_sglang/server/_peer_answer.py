"""``read_answer``: a peer's JSON answer, read so that nothing in it can reach past the request.

A decode server reads answers from other servers: a KV room's long poll, a
prefill server's ``/capabilities`` and its ``/generate``. Each of those
peers is only as trusted as the request that named it (a port-less
``--allowed-bootstrap-hosts`` entry admits every port of that host), so an
answer is read the way a client's body is: bounded in bytes, bounded in
total time (httpx's timeouts bound each read, not a trickle of them), never
decompressed (a small body must not grow), and parsed so that a deeply
nested document is a bad answer, not a ``RecursionError`` that ends the
process. Whatever goes wrong is one exception, ``BadAnswer``, which each
caller turns into that request's failure.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import httpx
import trio

__all__ = ["Answer", "BadAnswer", "read_answer"]


class BadAnswer(Exception):
    """The peer's answer could not be had or used; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    #: The parsed body; ``None`` if it was empty or not JSON (an error page).
    payload: object
    #: The start of the body as text, for an error message.
    head: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


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
    bounds per connect and per read).

    ``BadAnswer`` if the call fails (including a URL httpx will not build),
    takes longer, or answers more, or compressed; a body that is not JSON is
    given as ``payload=None`` so that the caller can tell an error page from
    a bad answer.
    """
    headers = {**kwargs.pop("headers", {}), "accept-encoding": "identity"}
    with trio.move_on_after(within):
        try:
            url = str(client.base_url.join(url))
            async with client.stream(method, url, headers=headers, **kwargs) as response:
                encoding = response.headers.get("content-encoding", "identity").lower()
                if encoding != "identity":
                    raise BadAnswer(f"{url}: an answer with content-encoding {encoding!r:.40}")
                body = bytearray()
                # An async generator (httpx types it as an iterator): closed, not left to GC.
                chunks: AsyncGenerator[bytes, None] = response.aiter_raw()  # type: ignore[assignment]
                async with aclosing(chunks):
                    async for chunk in chunks:
                        body += chunk
                        if len(body) > max_bytes:
                            raise BadAnswer(f"{url}: an answer of more than {max_bytes} bytes")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise BadAnswer(f"{url}: {exc!r}") from exc
        head = body[:200].decode("utf-8", "replace")
        return Answer(response.status_code, _parse(bytes(body)), head)
    raise BadAnswer(f"{url}: no answer in full within {within} s")


def _parse(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None
