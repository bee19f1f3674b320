"""One approach over one workload on a prefill/decode pair, on trio's MockClock.

The pair, the three approaches (what a client's cancel reaches in each), the
workload and the clock are in docs/benchmarks.md, "Disaggregated prefill".
Every approach faces the same requests, prompts and cancels (one seed), each
in a fresh ``trio.run`` on ``MockClock(autojump_threshold=0)``: a run's
trio-clock seconds are the modelled engines' seconds, however fast this
machine runs Python. The baselines own every task in a nursery and bound every
wait, as the aggregated ones do (``_approaches.py``); their bounds are longer
than anything SGLang itself lets a request wait, so that they never decide a
result.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

import trio_sglang as ts
from _approaches import Approach, Chunks, FirstResponse, StreamRecord, TrioSglang
from _output import Progress
from trio_sglang_harness._scenarios import RidRecorder

__all__ = ["PD_APPROACHES", "Client", "ClientPlan", "RunData", "Workload", "run_approach"]

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
    """Both engines' knobs: seconds on the trio clock (docs/benchmarks.md, "Method")."""

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


class RoomLog(RidRecorder):
    """A ``RidRecorder`` that also remembers which rid each bootstrap room got here.

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


class PDFirstResponse:
    """A Dynamo-style decode handler: both legs at once, the decode leg first-response;
    ``cancel_prefill``: the half fix, or the old worker's prefill that runs to its end."""

    def __init__(
        self,
        decode: ts.Engine,
        peer: ts.PrefillPeer,
        nursery: trio.Nursery,
        *,
        cancel_prefill: bool,
        bound: float,
    ) -> None:
        self._decode = FirstResponse(decode, nursery)
        # No bound short of SGLang's own (the aggregated model's is 30 s): the old decode
        # handler aborts a request waiting for its KV cache only at its first output.
        self._decode.pump_bound_after_leave = bound
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


#: How often the settle looks again (sim seconds).
SETTLE_POLL = 0.5
#: Progress lines per approach.
PROGRESS_STEPS = 5


@dataclass(frozen=True, slots=True)
class ClientPlan:
    index: int
    #: Sim seconds from the run's start.
    arrival: float
    prompt_tokens: int
    max_new_tokens: int
    #: Sim seconds after its arrival at which the client leaves; None: it reads to the end.
    cancel_after: float | None


@dataclass(frozen=True, slots=True)
class Workload:
    """What every approach is run on, and the seed that fixes it.

    Prompt lengths and cancel moments are log-uniform, so that cancels land in
    every phase, the short ones (bootstrap, the KV transfer) included.
    """

    requests: int = 6000
    #: Offered prefill load: every request's whole prefill, over the prefill GPU's time.
    load: float = 0.9
    #: Share of clients that leave before their stream ends.
    cancel_share: float = 0.5
    seed: int = 0
    prompt_tokens: tuple[int, int] = (512, 65_536)
    max_new_tokens: tuple[int, int] = (16, 128)
    #: The window (sim seconds after arrival) the cancel moments are drawn from.
    cancel_after: tuple[float, float] = (0.005, 30.0)
    timing: PDTiming = field(default_factory=PDTiming)

    def plan(self) -> list[ClientPlan]:
        """The same list for every approach: Poisson arrivals at the offered ``load``."""
        rng = random.Random(f"{self.seed}/disagg/{self.requests}")
        prompts = [round(_log_uniform(rng, *self.prompt_tokens)) for _ in range(self.requests)]
        rate = self.load * self.requests / self.prefill_seconds(prompts)
        plans, arrival = [], 0.0
        for index, prompt in enumerate(prompts):
            arrival += rng.expovariate(rate)
            cancel = (
                _log_uniform(rng, *self.cancel_after) if rng.random() < self.cancel_share else None
            )
            plans.append(
                ClientPlan(index, arrival, prompt, rng.randint(*self.max_new_tokens), cancel)
            )
        return plans

    def prefill_seconds(self, prompts: list[int]) -> float:
        """The prefill GPU's forward time for these prompts, computed whole."""
        return sum(prompts) * self.timing.disagg.prefill_time_per_token

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "load": self.load,
            "cancel_share": self.cancel_share,
            "seed": self.seed,
            "prompt_tokens": list(self.prompt_tokens),
            "max_new_tokens": list(self.max_new_tokens),
            "cancel_after_s": list(self.cancel_after),
            "timing": self.timing.to_json(),
        }


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


@dataclass(slots=True, eq=False)
class Client:
    """One client's plan and what it saw, on the trio clock (``rec.rid``: its decode rid)."""

    plan: ClientPlan
    rec: StreamRecord
    first_chunk_at: float | None = None
    #: The worker's error, if the stream ended with one.
    error: str | None = None


@dataclass(slots=True)
class RunData:
    """Everything one run leaves behind for ``_disagg_metrics.summarize``."""

    approach: str
    clients: list[Client]
    prefill_trace: Sequence[ts.TraceEvent]
    decode_trace: Sequence[ts.TraceEvent]
    #: Per client (same order): the rid its prefill leg had at the prefill engine.
    prefill_rids: list[str | None]
    #: Rids either engine still held after the settle.
    live_at_end: int
    #: Baseline prefill legs cut off by their own bound (0 means it never decided anything).
    bound_hits: int
    #: Sim seconds at which the last client left, and at which the settle ended.
    last_client_s: float
    settled_s: float
    runtime_s: float = 0.0


def run_approach(name: str, workload: Workload, progress: Progress) -> RunData:
    """Run one approach in its own ``trio.run`` on an autojumping ``MockClock``."""
    started = time.perf_counter()
    clock = trio.testing.MockClock(autojump_threshold=0)
    data = trio.run(_run, name, workload, progress, clock=clock)
    data.runtime_s = time.perf_counter() - started
    return data


async def _run(name: str, workload: Workload, progress: Progress) -> RunData:
    plans = workload.plan()
    clients = [Client(plan, StreamRecord(offset=plan.cancel_after or math.inf)) for plan in plans]
    timing = workload.timing
    # Nothing can need longer than the arrivals, all the prefill work there is,
    # and a baseline leg's own bound: past that the run is stuck, and says so.
    bound = (
        plans[-1].arrival
        + workload.prefill_seconds([p.prompt_tokens for p in plans])
        + 2 * timing.leg_bound
    )
    steps = {round(len(plans) * k / PROGRESS_STEPS) for k in range(PROGRESS_STEPS)}
    with trio.fail_after(bound):
        async with open_pd_pair(name, timing) as pair:
            async with trio.open_nursery() as nursery:
                for client in clients:
                    await trio.sleep_until(client.plan.arrival)
                    if client.plan.index in steps:
                        if client.plan.index:
                            progress.step_done()
                        progress.start(
                            f"{name}: request {client.plan.index + 1:,} of {len(plans):,} "
                            f"arrives at sim {trio.current_time():,.0f} s"
                        )
                    nursery.start_soon(_client, pair.approach, client, nursery)
            last_client = trio.current_time()
            await _settle(pair, timing.leg_bound)
            progress.step_done()
            data = RunData(
                approach=name,
                clients=clients,
                prefill_trace=pair.prefill.trace,
                decode_trace=pair.decode.trace,
                prefill_rids=_prefill_rids(pair, clients),
                live_at_end=len(pair.live_rids()),
                bound_hits=_bound_hits(pair.approach),
                last_client_s=last_client,
                settled_s=trio.current_time(),
            )
    return data


async def _client(approach: Approach, client: Client, canceller: trio.Nursery) -> None:
    """Open the stream at once, read it to its end or until the cancel closes it."""
    rec, plan = client.rec, client.plan
    # Words stand in for tokens (the SimEngine counts a prompt's words); built
    # here, not in the plan, so that only in-flight prompts are in memory.
    request = {
        "text": "t " * plan.prompt_tokens,
        "sampling_params": {"max_new_tokens": plan.max_new_tokens},
    }
    try:
        async with approach.stream(request, rec) as chunks:
            rec.started_at = trio.current_time()
            if plan.cancel_after is not None:
                canceller.start_soon(_cancel_at, rec, rec.started_at + plan.cancel_after)
            async for _ in chunks:
                if client.first_chunk_at is None:
                    client.first_chunk_at = trio.current_time()
                rec.chunks += 1
    except ts.EngineError as exc:
        client.error = repr(exc)
    rec.closed_at = trio.current_time()


async def _cancel_at(rec: StreamRecord, when: float) -> None:
    """The client's disconnect callback: a separate task, as a server's would be."""
    await trio.sleep_until(when)
    if rec.closed_at is not None:
        return  # ended on its own first: not a cancel
    rec.cancel_at = trio.current_time()
    rec.cancel()


async def _settle(pair: PDPair, bound: float) -> None:
    """Let the approach's detached work and both engines finish (bounded by ``bound``).

    It polls on purpose: it watches from outside, through what the approach
    and the engines expose, none of which offers an event for "all done".
    """
    with trio.move_on_after(bound):
        while pair.approach.pending or pair.live_rids():  # noqa: ASYNC110 (see the docstring)
            await trio.sleep(SETTLE_POLL)


def _prefill_rids(pair: PDPair, clients: list[Client]) -> list[str | None]:
    room_of = {rid: room for room, rid in pair.decode_rooms.items()}
    rids: list[str | None] = []
    for client in clients:
        room = room_of.get(client.rec.rid)
        rids.append(None if room is None else pair.prefill_rooms.get(room))
    return rids


def _bound_hits(approach: Approach) -> int:
    return approach.bound_hits if isinstance(approach, PDFirstResponse) else 0
