"""The prefill/decode pair under test, and the three ways of cancelling a request on it.

Every approach runs the same topology: a decode worker in front of a decode
``SimEngine`` starts each request's prefill leg at a prefill worker (over a
prefill ``SimEngine``; both engines share one ``SimKVRooms``) beside the
request's decode leg, the way Dynamo's frontend starts both legs of an SGLang
request at once. What differs is what a client's cancel reaches:

- ``trio-sglang``: this project's decode worker (``open_worker(decode,
  prefill=InProcessPrefill(prefill_worker))``), cancelled with ``ctx.kill()``:
  both legs stop at once, in whatever queue they are.
- ``first-response``: the old Dynamo worker (ai-dynamo/dynamo#13691 and
  #14368). The decode handler learns the decode request's id only from its
  first output, so it aborts the decode request then and never earlier (the
  aggregated benchmark's ``FirstResponse``); the prefill leg is never
  cancelled: it runs to its end.
- ``prefill-abort``: the half fix, with the prefill leg cancelled at once (an
  ordered abort at the prefill worker, as ai-dynamo/dynamo#14782 and #14775
  do together) but the decode leg still first-response (#14368 open). SGLang
  does not tell the decode side about a prefill abort, so the decode request
  waits for a KV cache that never comes, until ``kv_wait_timeout``.

The baselines own every task in a nursery and bound every wait, as the
aggregated ones do (``_approaches.py``); their bounds are set longer than
anything SGLang itself lets a request wait, so that they never decide a result.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

import trio_sglang as ts
from _approaches import Approach, Chunks, FirstResponse, RecordingEngine, StreamRecord, TrioSglang

__all__ = ["LONG_CONTEXT", "PD_APPROACHES", "PDPair", "PDTiming", "RoomLog", "open_pd_pair"]


#: One prefill GPU on long prompts (see ``PDTiming``).
LONG_CONTEXT = ts.SimDisaggTiming(
    prefill_time_per_token=5e-5,
    prefill_chunk_tokens=8192,
    bootstrap_delay=0.01,
    kv_transfer_delay=0.1,
    kv_wait_timeout=300.0,
)


@dataclass(frozen=True, slots=True)
class PDTiming:
    """Both engines' knobs: seconds on the trio clock, and the prefill's chunk size in tokens.

    The defaults model a long-context deployment on one prefill GPU: 20,000
    prompt tokens per second in chunks of 8,192 (SGLang's chunked prefill on a
    large GPU), a 10 ms handshake, 100 ms to move a KV cache, SGLang's 300 s
    decode-side wait for it, and 50 decode tokens per second per stream.
    """

    tokenize_delay: float = 0.02
    dispatch_delay: float = 0.001
    #: The decode side's first forward, after its KV cache arrived.
    first_token_delay: float = 0.05
    token_interval: float = 0.02
    disagg: ts.SimDisaggTiming = LONG_CONTEXT

    def engine(self, mode: ts.DisaggregationMode, rooms: ts.SimKVRooms) -> ts.SimEngine:
        return ts.SimEngine(
            tokenize_delay=self.tokenize_delay,
            dispatch_delay=self.dispatch_delay,
            first_token_delay=self.first_token_delay,
            token_interval=self.token_interval,
            disaggregation_mode=mode,
            kv_rooms=rooms,
            disagg_timing=self.disagg,
        )

    @property
    def leg_bound(self) -> float:
        """How long a baseline lets a leg run on after its client left.

        Longer than SGLang's own wait for a KV cache, so that a decode request
        ends by SGLang's timeout (or its first output) and never by this bound;
        a prefill leg that needed longer would show up in ``bound_hits``.
        """
        return self.disagg.kv_wait_timeout + 60.0

    def to_json(self) -> dict[str, Any]:
        knobs = {name: getattr(self, name) for name in self.__slots__ if name != "disagg"}
        disagg = {name: getattr(self.disagg, name) for name in self.disagg.__slots__}
        return {**knobs, **disagg}


class RoomLog(RecordingEngine):
    """A ``RecordingEngine`` that also remembers which rid each bootstrap room got here.

    The two legs of one request carry the same ``bootstrap_room`` and
    different rids (each worker mints its own), so the room is how the
    benchmark pairs a request's prefill rid with its decode rid.
    """

    def __init__(self, inner: ts.Engine) -> None:
        super().__init__(inner)
        self.rid_of_room: dict[int, str] = {}

    def generate(self, request: Mapping[str, Any]) -> ts.EngineStream:
        stream = super().generate(request)
        self.rid_of_room[int(request["bootstrap_room"])] = str(request["rid"])
        return stream


class _DecodeFirstResponse(FirstResponse):
    """``FirstResponse`` on the decode engine, with no bound of its own short of SGLang's.

    The aggregated model gives up on a silent stream after 30 s; the old
    decode handler has no such bound. A decode request waiting for its KV
    cache sends its first output when the cache arrives or when SGLang's
    ``kv_wait_timeout`` fails it, and only then is it aborted.
    """

    def __init__(self, engine: ts.Engine, nursery: trio.Nursery, bound: float) -> None:
        super().__init__(engine, nursery)
        self.pump_bound_after_leave = bound


class PDFirstResponse:
    """A Dynamo-style decode handler: both legs at once, the decode leg first-response.

    ``cancel_prefill`` says whether a client that leaves cancels the prefill
    leg (the half fix) or leaves it to run to its end (the old worker).
    """

    def __init__(
        self,
        decode: ts.Engine,
        peer: ts.PrefillPeer,
        nursery: trio.Nursery,
        *,
        cancel_prefill: bool,
        bound: float,
    ) -> None:
        self._decode = _DecodeFirstResponse(decode, nursery, bound)
        self._peer = peer
        self._nursery = nursery
        self._cancel_prefill = cancel_prefill
        self._bound = bound
        self._legs = 0
        #: Prefill legs cut off by ``bound`` after their client left (it decided their end).
        self.bound_hits = 0

    @property
    def pending(self) -> int:
        return self._decode.pending + self._legs

    @asynccontextmanager
    async def stream(self, request: Mapping[str, Any], rec: StreamRecord) -> AsyncIterator[Chunks]:
        # A random 63-bit room, as SGLang's router and Dynamo's frontend pick them.
        room = secrets.randbits(63)
        bootstrap = {
            "bootstrap_host": self._peer.bootstrap_host,
            "bootstrap_port": self._peer.bootstrap_port,
            "bootstrap_room": room,
        }
        leg = trio.CancelScope()
        self._legs += 1
        self._nursery.start_soon(self._prefill_leg, {**request, **bootstrap}, f"pd-{room}", leg)
        try:
            async with self._decode.stream({**request, **bootstrap}, rec) as chunks:
                yield chunks
        finally:
            if self._cancel_prefill:
                leg.cancel()
            else:
                # It runs on for nobody, bounded like the decode pump.
                leg.deadline = min(leg.deadline, trio.current_time() + self._bound)

    async def _prefill_leg(
        self, request: Mapping[str, Any], public_id: str, scope: trio.CancelScope
    ) -> None:
        try:
            with scope:
                await self._peer.prefill(request, public_id)
        except ts.PrefillFailed:
            pass  # its decode side was aborted first: the prefill had nobody to send to
        finally:
            self._legs -= 1
        if scope.cancelled_caught and not self._cancel_prefill:
            self.bound_hits += 1


#: Builds an approach over a running decode engine and a prefill worker's peer.
PDFactory = Callable[[RoomLog, ts.PrefillPeer, PDTiming], AbstractAsyncContextManager[Approach]]


@asynccontextmanager
async def _open_trio_sglang(
    decode: RoomLog, peer: ts.PrefillPeer, timing: PDTiming
) -> AsyncIterator[Approach]:
    async with ts.open_worker(decode, prefill=peer) as worker:
        yield TrioSglang(worker, decode)


def _pd_baseline(*, cancel_prefill: bool) -> PDFactory:
    @asynccontextmanager
    async def open_baseline(
        decode: RoomLog, peer: ts.PrefillPeer, timing: PDTiming
    ) -> AsyncIterator[Approach]:
        async with decode.running(), trio.open_nursery() as nursery:
            yield PDFirstResponse(
                decode, peer, nursery, cancel_prefill=cancel_prefill, bound=timing.leg_bound
            )
            # Whatever the settle left running is cut off with the run.
            nursery.cancel_scope.cancel()

    return open_baseline


PD_APPROACHES: dict[str, PDFactory] = {
    "trio-sglang": _open_trio_sglang,
    "first-response": _pd_baseline(cancel_prefill=False),
    "prefill-abort": _pd_baseline(cancel_prefill=True),
}


@dataclass(slots=True)
class PDPair:
    """One approach on a running prefill/decode pair, and what the benchmark reads off it."""

    approach: Approach
    prefill: ts.SimEngine
    decode: ts.SimEngine
    #: bootstrap room -> rid, on each side.
    prefill_rooms: dict[int, str]
    decode_rooms: dict[int, str]

    def live_rids(self) -> set[str]:
        return self.prefill.live_rids() | self.decode.live_rids()


@asynccontextmanager
async def open_pd_pair(name: str, timing: PDTiming) -> AsyncIterator[PDPair]:
    """Fresh engines, a trio-sglang prefill worker, and the named approach on the decode side.

    Every approach gets the same prefill worker: it is the decode side that
    decides whether (and when) a prefill leg is cancelled.
    """
    rooms = ts.SimKVRooms()
    prefill, decode = timing.engine("prefill", rooms), timing.engine("decode", rooms)
    prefill_log, decode_log = RoomLog(prefill), RoomLog(decode)
    async with ts.open_worker(prefill_log) as prefill_worker:
        peer = ts.InProcessPrefill(prefill_worker)
        async with PD_APPROACHES[name](decode_log, peer, timing) as approach:
            yield PDPair(approach, prefill, decode, prefill_log.rid_of_room, decode_log.rid_of_room)
