"""``ClientConnection``'s writes: at once when the socket takes them, bounded when it does not.

A streamed event is one write; one the socket's buffer takes goes out with no
wait and no checkpoint (``_write_now``). What it does not take waits in the
bounded path, in order before any later write, and a client that takes none
of it within the stall timeout is dropped. Driven on a loopback connection, without
hypercorn's protocol: ``protocol_send`` is called as hypercorn calls it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.worker_context import WorkerContext

from trio_sglang.server import ServerMetrics
from trio_sglang.server._connection import ClientConnection

STALL = 10.0


class _Protocol:
    """What hypercorn's protocol is told: here, only that the connection closed."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)


@asynccontextmanager
async def connection() -> AsyncIterator[tuple[ClientConnection, trio.SocketStream, _Protocol]]:
    """A loopback TCP connection: the server's end as a ``ClientConnection``, and the peer."""
    [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listener:
        peer = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
        ours = await listener.accept()
    client = ClientConnection(
        None,  # type: ignore[arg-type]  # no app: the writes alone
        Config(),
        WorkerContext(None),
        ours,
        stall_timeout=STALL,
        metrics=ServerMetrics(),
    )
    protocol = _Protocol()
    client.protocol = protocol  # type: ignore[assignment]
    async with peer:
        try:
            yield client, peer, protocol
        finally:
            ours.socket.close()


async def read_exactly(peer: trio.SocketStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += await peer.receive_some()
    return bytes(data)


async def test_a_write_the_socket_takes_goes_out_without_a_checkpoint() -> None:
    async with connection() as (client, peer, protocol):
        with trio.testing.assert_no_checkpoints():
            await client.protocol_send(RawData(b"data: 1\n\n"))
        assert await read_exactly(peer, 9) == b"data: 1\n\n"
        assert protocol.events == []


async def test_what_the_socket_cannot_take_goes_first_when_the_client_reads() -> None:
    big = bytes(range(256)) * (1 << 18)  # 64 MiB: more than loopback buffers hold
    async with connection() as (client, peer, protocol), trio.open_nursery() as nursery:
        nursery.start_soon(client.protocol_send, RawData(big))
        await trio.testing.wait_all_tasks_blocked()  # the rest of it waits for room
        nursery.start_soon(client.protocol_send, RawData(b"after"))
        await trio.testing.wait_all_tasks_blocked()  # behind the lock, not interleaved
        assert await read_exactly(peer, len(big) + 5) == big + b"after"
    assert protocol.events == []
    assert client.dropped is None


async def test_a_client_that_takes_nothing_is_dropped_after_the_stall_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with connection() as (client, _peer, protocol):
        started = trio.current_time()
        await client.protocol_send(RawData(b"x" * (1 << 26)))
        assert trio.current_time() - started == STALL
        assert client.dropped == "stalled"
        assert [type(event) for event in protocol.events] == [Closed]


async def test_a_dropped_connection_is_not_written_to() -> None:
    async with connection() as (client, _peer, protocol):
        client.drop("behind")
        await client.protocol_send(RawData(b"data: late\n\n"))
        assert [type(event) for event in protocol.events] == [Closed]
