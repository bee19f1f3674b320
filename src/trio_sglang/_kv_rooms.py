"""KV rooms: how the two sides of a prefill/decode pair meet, as a contract of its own.

The SimEngine's disaggregated schedulers call these rooms (``trio_sglang.sim``)
and the HTTP server carries them between processes (``trio_sglang.server``).
The contract lives here, apart from both, so that the server knows rooms by
this protocol and never imports the simulator; SGLang itself does not use it
(its bootstrap server and KV transfer are its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["BootstrapAddr", "HostedKVRooms", "KVRooms", "RoomEvent"]

#: ``decode_ready``: the decode side's handshake; ``kv_sent``: the prefill side
#: sent the KV cache; ``decode_aborted``: the decode side's abort notification.
RoomEvent = Literal["decode_ready", "kv_sent", "decode_aborted"]


@dataclass(frozen=True, slots=True)
class BootstrapAddr:
    """Where a disaggregated request's prefill side hosts its bootstrap server.

    SGLang's ``bootstrap_host`` and ``bootstrap_port`` request fields: the
    decode side reaches the room there. ``None`` where the request did not say.
    """

    host: str | None = None
    port: int | None = None


class KVRooms(Protocol):
    """What the two sides of a pair know of each other, keyed by bootstrap room.

    In SGLang the prefill side hosts the bootstrap server and the KV cache
    goes from GPU to GPU; here a room collects the events that matter to
    aborts: the decode side's handshake, the KV cache sent, and the decode
    side's abort notification. ``at`` is where the request says the prefill
    side's bootstrap server is: rooms shared in one process ignore it, rooms
    reached over a network go there (``trio_sglang.server.open_http_kv_rooms``).
    The scheduler calls them from its own tasks, ``post`` and ``side_done``
    synchronously (so a networked implementation sends in the background),
    and none may raise (``wait`` only ``Cancelled``): an error would stop the
    scheduler, not one request.
    """

    def post(self, room: int, event: RoomEvent, at: BootstrapAddr) -> None:
        """Record ``event`` for ``room`` and wake whoever waits for it."""
        ...

    def happened(self, room: int, event: RoomEvent, at: BootstrapAddr) -> bool: ...

    async def wait(
        self, room: int, wanted: frozenset[RoomEvent], at: BootstrapAddr
    ) -> frozenset[RoomEvent]:
        """Those of ``wanted`` that have happened to ``room``, once one has; unbounded."""
        ...

    def side_done(self, room: int, at: BootstrapAddr) -> None:
        """One side is done with ``room``; it is forgotten once both are."""
        ...


class HostedKVRooms(KVRooms, Protocol):
    """Rooms held in this process, which a prefill server serves to decode engines elsewhere.

    Hosted rooms are the bootstrap server itself, so ``at`` means nothing to
    them. ``len`` (rooms held) is exported as a metric: one side done and
    the other never come is a room that stays until it is forgotten.
    """

    def __contains__(self, room: int) -> bool: ...

    def __len__(self) -> int: ...
