"""The one streaming client that leaves: how it is made, how it reads the events, how it goes.

bench-endpoint's visits (``_visits``) and the load test's users
(``benchmarks/_load_clients.py``) both send a streaming request, read its
server-sent events and leave at some moment; what they count, time and
judge differs. So this module does the sending and the reading, and hands
each data event (``[DONE]`` aside) to the caller's ``on_event``, which
counts and times it as its figures mean and says whether to leave now.

Leaving closes the connection, which is all a server ever sees of a client
that goes. There are three ways, and any caller may use each:

- ``on_event`` returns True: the read returns between two events;
- the caller cancels the read (a ``trio`` deadline: a moment after sending,
  or a bound): httpx closes a connection whose read is cancelled;
- ``leave_when_sent(scope)``: httpcore's trace hook cancels ``scope`` once
  the request's last byte is written, before any answer.

A clean close sends FIN; ``http_client(reset=True)`` sets SO_LINGER to 0 on
the socket first, so the kernel sends RST instead, as it does for a killed
process. Every line is bounded by ``MAX_LINE_BYTES``, and httpx's failures
come out as ``BadAnswer``: a server's bad answer fails that request, never
the run. The reading costs no more than httpx's own ``aiter_lines`` (about
2.4 µs an event against 2.6), which the load test's 1,000 users need.
"""

from __future__ import annotations

import math
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from .._bounded_http import BadAnswer, stream_lines

__all__ = ["MAX_LINE_BYTES", "BadAnswer", "Stream", "http_client", "leave_when_sent", "read_events"]

#: One context for every client: httpx otherwise builds one per client, loading
#: the CA bundle each time (about 17 ms of CPU per client, for nothing on http://).
_SHARED_SSL = ssl.create_default_context()
_RESET = [(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))]
#: httpcore's trace event once the request's last byte is written.
_SENT = "http11.send_request_body.complete"
#: The longest SSE line read: an event is a few hundred bytes (its logprobs a few kB).
MAX_LINE_BYTES = 1 << 20
#: How much of an error page is kept, for a message.
_HEAD = 200


def http_client(
    url: str, timeout: float, *, headers: dict[str, str] | None = None, reset: bool = False
) -> httpx.AsyncClient:
    """A client with one connection of its own (kept alive between its requests), as a
    separate user has; no proxy from the environment gets between it and ``url``.
    ``reset``: leaving sends RST, not FIN."""
    transport = httpx.AsyncHTTPTransport(
        verify=_SHARED_SSL,
        trust_env=False,
        limits=httpx.Limits(max_connections=1),
        socket_options=_RESET if reset else None,
    )
    return httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, transport=transport, trust_env=False
    )


def leave_when_sent(scope: trio.CancelScope) -> dict[str, Any]:
    """httpx request extensions that cancel ``scope`` once the request is all written."""

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == _SENT:
            scope.cancel()

    return {"trace": trace}


@dataclass(slots=True)
class Stream:
    """What the reader saw of one answer, filled in as it comes: a leave may cut it short."""

    #: None until the answer's headers came.
    status: int | None = None
    #: Whether ``[DONE]`` was read.
    done: bool = False
    #: When the answer ended (its ``[DONE]`` read, or its body's end), on the trio clock.
    ended_at: float = math.nan
    #: The start of a non-200 answer's body (an error page), for a message.
    head: str = ""


async def read_events(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    stream: Stream,
    on_event: Callable[[str], bool],
    *,
    extensions: dict[str, Any] | None = None,
    reuse: bool = False,
) -> None:
    """POST ``body`` to ``path`` and read the answer's events into ``on_event`` (each data
    event's text, ``[DONE]`` aside) until it returns True, the answer ends, or the caller
    cancels; ``BadAnswer`` for a failed call or a line too long.

    ``reuse``: read on past ``[DONE]`` (and an error page to its end) so that the
    connection, read to the end of the answer, can serve the client's next request;
    otherwise the read stops there, and leaving the answer unread closes it.
    """
    request = {"json": body, "extensions": extensions or {}}
    async with stream_lines(client, "POST", path, max_line=MAX_LINE_BYTES, **request) as (
        response,
        lines,
    ):
        stream.status = response.status_code
        if stream.status != 200:
            async for line in lines:
                stream.head = (stream.head + line)[:_HEAD]
                if len(stream.head) >= _HEAD and not reuse:
                    return
            return
        async for line in lines:
            if stream.done or not line.startswith("data:"):
                continue  # past [DONE]; a comment (SSE heartbeat), a blank line, an event name
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                stream.done, stream.ended_at = True, trio.current_time()
                if not reuse:
                    return
            elif on_event(data):
                return  # leaving the block closes the unfinished answer's connection
        if not stream.done:
            stream.ended_at = trio.current_time()
