"""HTTP/2 whose every write of a response has a deadline: a client that grants no window is gone.

hypercorn's HTTP/2 queues a stream's body in a buffer that its send task
empties as fast as the client's flow-control window allows. If the client
keeps the window at zero (``SETTINGS_INITIAL_WINDOW_SIZE=0`` and no
``WINDOW_UPDATE``), two things go wrong there. The app's send waits at the
end of a body for the buffer to drain, for good: the handler never ends,
and holds its request, its connection and its slot (nor does closing the
connection end it: hypercorn closes the streams then, not their buffers).
And until then the buffer never pushes back: the send task's empty reads
of a closed window count as progress, so a streamed response queues every
token for a client that takes none.

``BoundedH2`` is hypercorn's protocol with a send that waits, bounded: past
32 KiB queued, a send waits for the client to take it all, and that wait,
like the one at the end, has the stall timeout, as every socket write of
``ClientConnection`` does. Past it the stream is reset (``RST_STREAM``,
``CANCEL``), its app sees the client disconnect, which stops its request at
the engine, and a connection left with no open stream is dropped as
stalled. At the connection's close every buffer is closed, so no handler
waits on one.

Two more holes, each found by a client that held the server:

* **A flood of frames that ask for nothing** (PRIORITY for streams never
  opened, PING, SETTINGS, empty DATA) cost CPU with no request to bound it:
  hypercorn kept a priority tree of up to 1,000 idle streams, at about
  1.5 ms a frame past that, and h2 parses a 64 KiB read of such frames in
  40 to 100 ms with no checkpoint. Here priority signals are ignored (RFC
  9113 deprecates them; h2 still parses them), a read is parsed in slices of
  ``_SLICE_BYTES`` with a checkpoint between, and each connection has a
  budget of such frames (``ControlBudget``): past it the client gets a
  GOAWAY (``ENHANCE_YOUR_CALM``) and is dropped as ``flooding``.
* **Streams opened while the connection closes** (a burst of requests, then
  a reset, read while a failed write closes the connection) got no
  disconnect, and generated to their end: a closed connection opens no
  stream, and a send on a stream it missed closes that stream.

``Protocols`` is hypercorn's switch from HTTP/1.1 to HTTP/2 (an h2c
upgrade, or the preface), to this protocol instead of hypercorn's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body, Data, EndBody, EndData, StreamClosed, Trailers
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import BUFFER_HIGH_WATER, H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError

__all__ = ["BoundedH2", "ClientBounds", "ControlBudget", "Protocols"]

#: The stream events whose send waits for the client's window.
_WINDOWED = (Body, Data, EndBody, EndData, Trailers)
#: A read is handed to h2 this much at a time, with a checkpoint between: at
#: most a few milliseconds of parsing, whatever frames it holds.
_SLICE_BYTES = 1 << 13


@dataclass(frozen=True, slots=True)
class ClientBounds:
    """What a connection gives its HTTP/2: the stall timeout, and whom to tell of a client."""

    stall_timeout: float
    #: Told of each stalled stream: ``True`` when it left the connection no other.
    stalled: Callable[[bool], None]
    #: Told once the client's frames that ask for nothing went past its budget.
    flooding: Callable[[], None]


class ControlBudget:
    """Frames that ask for nothing, per connection: ``burst`` at once, ``per_second`` after.

    A token bucket: a client's start (a SETTINGS, a few PRIORITY frames) and
    keep-alive PINGs are far inside it; a flood empties it within one read.
    """

    def __init__(self, burst: int = 1000, per_second: float = 100.0) -> None:
        self._burst = burst
        self._rate = per_second
        self._tokens = float(burst)
        self._at = trio.current_time()

    def take(self) -> bool:
        """Whether one more such frame is within the budget."""
        now = trio.current_time()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class BoundedH2(H2Protocol):
    """hypercorn's HTTP/2, with a deadline on each wait for the client's window."""

    def __init__(self, *args: Any, bounds: ClientBounds, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stall_timeout = bounds.stall_timeout
        self._stalled = bounds.stalled
        self._flooding = bounds.flooding
        self._budget = ControlBudget()
        self._flooded = False

    async def stream_send(self, event: StreamEvent) -> None:
        if self.closed and not isinstance(event, StreamClosed):
            # A stream the close missed: nothing it sends will reach anyone.
            await self._close_stream(event.stream_id)
            return
        if not isinstance(event, _WINDOWED):
            await super().stream_send(event)
            return
        with trio.move_on_after(self._stall_timeout) as bound:
            await super().stream_send(event)
            buffer = self.stream_buffers.get(event.stream_id)
            if buffer is not None and len(buffer.buffer) >= BUFFER_HIGH_WATER:
                await buffer.drain()
        if bound.cancelled_caught:
            await self._reset_stalled(event.stream_id)

    async def handle(self, event: Event) -> None:
        if isinstance(event, RawData) and len(event.data) > _SLICE_BYTES:
            data = memoryview(event.data)
            for start in range(0, len(data), _SLICE_BYTES):
                if self.closed or self._flooded:
                    return
                if start:
                    await trio.lowlevel.checkpoint()
                await super().handle(RawData(data=bytes(data[start : start + _SLICE_BYTES])))
            return
        if self.closed and isinstance(event, RawData):
            return
        await super().handle(event)
        if isinstance(event, Closed):  # nothing will drain them now: let their waiters go
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        """hypercorn's, an event at a time: none past the close, none past the budget."""
        for event in events:
            if self.closed or self._flooded:
                return
            if self._asks_nothing(event) and not self._budget.take():
                self._flooded = True
                self.connection.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                await self._flush()
                self._flooding()
                return
            await super()._handle_events([event])

    def _asks_nothing(self, event: h2.events.Event) -> bool:
        if isinstance(event, h2.events.PriorityUpdated):
            return event.stream_id not in self.streams  # not the one of a request's HEADERS
        if isinstance(event, h2.events.DataReceived):
            return not event.data and event.stream_ended is None
        return isinstance(
            event,
            h2.events.PingReceived
            | h2.events.PingAckReceived
            | h2.events.RemoteSettingsChanged
            | h2.events.SettingsAcknowledged
            | h2.events.UnknownFrameReceived,
        )

    async def _priority_updated(self, event: h2.events.PriorityUpdated) -> None:
        """Ignored: RFC 9113 deprecates priority signals, and every stream here is one request."""

    async def _reset_stalled(self, stream_id: int) -> None:
        """Reset a stream whose client took none of it in time, as a client's reset is handled."""
        with contextlib.suppress(h2.exceptions.ProtocolError):  # already closed, by either side
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        await self._flush()
        await self._close_stream(stream_id)  # its app sees the client gone
        # The send task finds the stream closed, and drops its buffer.
        await self._window_updated(stream_id)
        self._stalled(not self.streams)


class Protocols(ProtocolWrapper):
    """hypercorn's ``ProtocolWrapper``, switching to ``BoundedH2`` where it switches to HTTP/2."""

    def __init__(self, *args: Any, bounds: ClientBounds) -> None:
        super().__init__(*args)
        self._bounds = bounds

    @classmethod
    def instead_of(cls, wrapper: ProtocolWrapper, bounds: ClientBounds) -> Protocols:
        """This wrapper in place of ``wrapper``, with its HTTP/1.1 protocol and state."""
        protocols = cls(
            wrapper.app,
            wrapper.config,
            wrapper.context,
            wrapper.task_group,
            wrapper.state,
            wrapper.ssl,
            wrapper.client,
            wrapper.server,
            wrapper.send,
            bounds=bounds,
        )
        protocols.protocol = wrapper.protocol
        return protocols

    async def handle(self, event: Event) -> None:
        try:
            await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:  # the HTTP/2 preface
            self.protocol = self._h2()
            await self.protocol.initiate()
            if error.data != b"":
                await self.protocol.handle(RawData(data=error.data))
        except H2CProtocolRequiredError as error:  # an h2c upgrade
            self.protocol = self._h2()
            await self.protocol.initiate(error.headers, error.settings)
            if error.data != b"":
                await self.protocol.handle(RawData(data=error.data))

    def _h2(self) -> BoundedH2:
        return BoundedH2(
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.state,
            self.ssl,
            self.client,
            self.server,
            self.send,
            bounds=self._bounds,
        )
