"""One approach over one workload on a prefill/decode pair, on trio's MockClock.

The workload is an open arrival stream of long-context requests, a share of
whose clients leave at a random moment, drawn from a seeded generator so that
every approach faces the same requests, prompts and cancels. Each run gets a
fresh ``trio.run`` on ``MockClock(autojump_threshold=0)``: the clock jumps to
the next timer whenever every task is waiting, so a run's trio-clock seconds
are exactly the modelled engines' seconds (GPU-seconds of the SimEngines),
independent of how fast this machine runs Python, and an hour of them takes
seconds of real time.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

import trio_sglang as ts
from _approaches import Approach, StreamRecord
from _disagg_approaches import PDFirstResponse, PDPair, PDTiming, open_pd_pair
from _output import Progress

__all__ = ["Client", "ClientPlan", "RunData", "Workload", "run_approach"]

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

    Prompt lengths and cancel moments are log-uniform: long-context prompts
    span orders of magnitude, and so do the moments at which clients give up
    (many leave early, some only after a long wait), so that cancels land in
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
