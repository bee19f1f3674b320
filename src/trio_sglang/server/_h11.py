"""HTTP/1.1 whose reader never parks: a client that sent more than its request can still leave.

h11 stops parsing at the end of a request until its response is done (its
``PAUSED``), and hypercorn's HTTP/1.1 then stops reading the socket: its
reader waits for the response to end. A client that sends one byte of a next
request behind its first one (HTTP/1.1 pipelining) and then closes or resets
is never seen to go: a non-streaming request runs to its last token for
nobody, and a stream that ends on a failed write leaves the reader waiting
for good, holding the connection, its descriptor and its slot.

``HTTP11`` reads on while paused. What arrives waits in h11's buffer for the
next request, and the wait ends when the response does, or when the client
closes or resets (``ClientLeft``: the caller ends the connection, and the
request with it), or when it has sent more than ``PIPELINE_BYTES`` ahead
(``PipelinedTooFar``: it is dropped). A request is never cut short for the
bytes of the next one within that bound; past it, RFC 9112 (9.3.2) already
says that no client should pipeline behind a POST, which every generation
request is.
"""

from __future__ import annotations

from typing import Any

import h11
import trio
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.utils import suppress_body

__all__ = ["HTTP11", "PIPELINE_BYTES", "ClientLeft", "PipelinedTooFar"]

#: Bytes of its next request a client may send before its current response ends.
PIPELINE_BYTES = 1 << 16
#: The most read from the socket at once (hypercorn's own ``MAX_RECV``).
_RECV_BYTES = 1 << 16


class ClientLeft(Exception):
    """The client closed or reset its connection while its response was in progress."""


class PipelinedTooFar(Exception):
    """The client sent more than ``PIPELINE_BYTES`` ahead of its response."""


class HTTP11(H11Protocol):
    """hypercorn's HTTP/1.1, reading on while a response is in progress.

    ``upgrades``: whether it hands the connection over to HTTP/2 (an h2c
    upgrade, or the HTTP/2 preface) as hypercorn does. Without, the request
    goes on as HTTP/1.1, as RFC 9110 lets a server ignore an upgrade, and the
    preface is taken as the HTTP/1.1 request it reads as.
    """

    def __init__(self, *args: Any, sock: trio.socket.SocketType, upgrades: bool) -> None:
        super().__init__(*args)
        self._upgrades = upgrades
        self.can_read = _ReadWhilePaused(self, sock)

    @classmethod
    def instead_of(
        cls, protocol: H11Protocol, *, sock: trio.socket.SocketType, upgrades: bool
    ) -> HTTP11:
        """This protocol in place of ``protocol``, before it has read a byte."""
        return cls(
            protocol.app,
            protocol.config,
            protocol.context,
            protocol.task_group,
            protocol.connection_state,
            protocol.ssl,
            protocol.client,
            protocol.server,
            protocol.send,
            sock=sock,
            upgrades=upgrades,
        )

    async def _check_protocol(self, event: h11.Request) -> None:
        if self._upgrades:
            await super()._check_protocol(event)

    def frame_body(self, body: bytes) -> bytes | None:
        """``body`` framed as the next piece of the response in progress, as hypercorn would
        send it; ``None`` where hypercorn would not send it as one (no response body in
        progress, or one it suppresses, as a HEAD's), or where the framing counts what it
        frames (a declared ``content-length``).

        For a write that does not wait (``ClientConnection.send_body_now``): h11 frames a
        body of no declared length (chunked, or up to the close) keeping no count, so bytes
        framed and then not written can be framed again.
        """
        stream = self.stream
        if not isinstance(stream, HTTPStream) or stream.state is not ASGIHTTPState.RESPONSE:
            return None
        response = stream.response
        if suppress_body(stream.scope["method"], int(response["status"])):
            return None
        if any(bytes(name).lower() == b"content-length" for name, _ in response["headers"]):
            return None
        if self.connection.our_state is not h11.SEND_BODY:
            return None
        data: bytes = self.connection.send(h11.Data(data=body))
        return data

    def buffered(self) -> int:
        """Bytes received that h11 has not parsed yet: the next request's, while paused."""
        connection = self.connection
        return len(connection.trailing_data[0]) if isinstance(connection, h11.Connection) else 0


class _ReadWhilePaused:
    """hypercorn's ``can_read`` event, whose wait also takes what the client sends meanwhile.

    hypercorn clears it and waits on it when h11 pauses, and sets it when the
    response is done; the wait runs in the connection's reader task, so the
    socket still has one reader.
    """

    def __init__(self, protocol: HTTP11, sock: trio.socket.SocketType) -> None:
        self._protocol = protocol
        self._socket = sock
        self._set = False
        self._waiting: trio.CancelScope | None = None

    async def set(self) -> None:
        self._set = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        while not self._set:
            with trio.CancelScope() as self._waiting:
                try:
                    await trio.lowlevel.wait_readable(self._socket)
                except (OSError, ValueError, trio.ClosedResourceError):  # dropped: closed
                    raise ClientLeft from None
            self._waiting = None
            if self._set:
                return
            try:
                data = await self._socket.recv(_RECV_BYTES)
            except (OSError, trio.ClosedResourceError):  # reset
                raise ClientLeft from None
            if not data:
                raise ClientLeft
            self._protocol.connection.receive_data(data)
            if self._protocol.buffered() > PIPELINE_BYTES:
                raise PipelinedTooFar
