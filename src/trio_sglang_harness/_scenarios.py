"""Conformance scenarios: one definition, run on any engine, observed the same way.

A scenario runs one request through ``open_worker`` (or, for the raw abort
traps, straight on the engine) and returns an ``Observation`` that does not
depend on timing or on random ids: what the scheduler received and did, per
request in order of first appearance; how many requests stayed registered;
and what the caller saw. The SimEngine reports the scheduler's side from its
trace; the real TokenizerManager's stand-in scheduler from its log. In a
prefill or decode role (``DisaggSetup``) the scheduler's side also shows the
stages a request went through and the stage an abort took it out of.

The caller's side is a ``CallerStream``, so one scenario also drives other
callers over the same engine: the benchmark's baselines (NVIDIA Dynamo's own
SGLang handler, and a model of it on the SimEngine).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

import trio

from trio_sglang import (
    Engine,
    EngineFeatures,
    EngineStream,
    OutputMode,
    RequestContext,
    RequestPhase,
    Worker,
)
from trio_sglang.sim import SimEngine, SimKVRooms

from ._peer import DisaggSetup, play_peer

__all__ = [
    "CallerStream",
    "CancelPhase",
    "Observation",
    "RidRecorder",
    "Scenario",
    "SchedulerEvent",
    "Watched",
    "observe_caller",
    "run_scenario",
    "sim_scheduler_events",
    "staged_kind",
]

#: When the caller cancels; ``consumer_leaves``: it leaves the stream after two
#: chunks without a cancel signal (an error, a closed connection).
CancelPhase = Literal[
    "before_registration",
    "tokenizing",
    "dispatched",
    "mid_stream",
    "consumer_leaves",
    "after_finish",
]
RawTrap = Literal["abort_unknown_rid", "abort_twice", "abort_while_tokenizing", "no_bootstrap_room"]
#: What a scheduler logs: it received a request or an abort, applied or lost an abort;
#: and a disaggregated one, each stage a request passed (``kind@stage``: see ``staged_kind``).
SchedulerEvent = tuple[float, str, str]  # (monotonic time, kind, rid)
SCHEDULER_KINDS = (
    "request",
    "abort",
    "abort_applied",
    "abort_lost",
    "bootstrapped",
    "prefill_chunk",
    "kv_sent",
    "kv_received",
    "kv_failed",
    "kv_timeout",
)


@dataclass(frozen=True)
class Scenario:
    name: str
    request: dict[str, Any]
    output: OutputMode = "tokens"
    cancel: CancelPhase | None = None
    #: Seconds the tokenizer takes (the real one is slowed down to match).
    tokenize_delay: float = 0.0
    #: Instead of a worker request: drive the engine's abort by hand.
    trap: RawTrap | None = None
    #: Seconds from reaching the ``cancel`` phase to the cancel. The queues of
    #: a disaggregated scheduler are invisible from the tokenizer side, so a
    #: cancel in one of them is timed from dispatch, by the known stage timing.
    cancel_delay: float = 0.0
    #: At most this many seconds, after the caller is done, to wait for the
    #: engine to hold nothing before the settle: a request that nobody stopped
    #: is then observed to its end (0: do not wait).
    wait_idle: float = 0.0
    #: At least this many seconds, from the caller being done, to watch the
    #: scheduler before observing it: a dispatch that may still come (a slow
    #: tokenizer's, after a cancel) shows up in that window.
    observe_for: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Scenario:
        return cls(**data)


@dataclass
class Observation:
    #: Per request, in order of first appearance at the scheduler: its events.
    scheduler: list[list[str]] = field(default_factory=list)
    #: Requests the tokenizer side still held at the end that it did not hold
    #: before the scenario (what another caller left earlier is not counted).
    registered_after: int = 0
    #: Chunks the caller received, and their finish reasons in order.
    chunks: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)
    #: What a ``native`` caller was given: the text and the token ids, put together.
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    #: Ids the caller saw (public ones only, if the lifecycle is right).
    ids_seen: list[str] = field(default_factory=list)
    #: Timing, for benchmarks (seconds on the scenario's clock; None if not
    #: cancelled): the cancel to the caller's block closing; the later of the
    #: cancel and the dispatch to the scheduler's abort (None when the request
    #: never reached it); tokens decoded after the cancel.
    stream_close: float | None = None
    abort_delay: float | None = None
    tokens_after_cancel: int = 0
    #: Requests the scheduler itself still ran or queued at the end, where it says
    #: (the whole ``sglang.Engine``: its load snapshot); None where it cannot.
    scheduler_held_after: int | None = None
    #: The exception the caller's stream ended with (its class name), if it did:
    #: SGLang 0.5.17 ends a request aborted before its dispatch with its
    #: ``RequestAbortedError``, which Dynamo's handler passes on.
    raised: str | None = None
    #: The cancel was to come at a phase the request went through unseen (a
    #: machine that stalled longer than the phase lasts), so it never came and
    #: the request ran uncancelled; or it came, but its abort reached the
    #: scheduler only after the request had finished there: this run measures no cancel.
    missed: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def staged_kind(kind: str, stage: str | None) -> str:
    """An event's kind and the stage it happened in, if any: ``abort_applied@bootstrap``."""
    return f"{kind}@{stage}" if stage else kind


def normalise(events: Iterable[SchedulerEvent]) -> list[list[str]]:
    """Scheduler events grouped per rid, rids in order of first appearance."""
    per_rid: dict[str, list[str]] = {}
    for _, kind, rid in sorted(events, key=lambda e: e[0]):
        if kind.partition("@")[0] in SCHEDULER_KINDS:
            per_rid.setdefault(rid, []).append(kind)
    return list(per_rid.values())


class RidRecorder:
    """Passes through to an engine and remembers the rid of the last request.

    ``worker.generate`` calls ``engine.generate`` with no checkpoint before
    the block is entered, so right after entering, the last rid is ours.
    Open the worker over the recorder: ``open_worker(RidRecorder(engine))``.
    ``on_generate`` sees each engine request as it is made.
    """

    def __init__(
        self,
        engine: Engine,
        on_generate: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.last_rid: str | list[str] | None = None
        self._on_generate = on_generate

    def running(self) -> AbstractAsyncContextManager[None]:
        return self.engine.running()

    def features(self) -> EngineFeatures:
        return self.engine.features()

    def generate(self, request: Mapping[str, Any]) -> EngineStream:
        self.last_rid = request["rid"]
        if self._on_generate is not None:
            self._on_generate(request)
        return self.engine.generate(request)

    def phase(self, rid: str) -> RequestPhase:
        return self.engine.phase(rid)

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        return await self.engine.wait_phase_change(rid, phase)

    async def abort(self, rid: str) -> None:
        await self.engine.abort(rid)

    def live_requests(self) -> int:
        return self.engine.live_requests()


class Watched(Protocol):
    """Where a scenario reads its request's phase (to time a cancel) and what is still held.

    An ``Engine`` is one (by the request's rid); a harness host may watch
    otherwise, for requests whose rid SGLang never registers (``n > 1``).
    """

    def phase(self, rid: str) -> RequestPhase: ...

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase: ...

    def live_requests(self) -> int: ...


@dataclass(frozen=True, eq=False)
class CallerStream:
    """One request's stream as a scenario's caller holds it, whoever serves it.

    ``chunks`` come in ``output`` mode; ``cancel`` is the caller's cancel
    signal (a kill, a stop, a disconnect callback); ``rid`` gives the engine
    rid, waiting if the server has not picked it yet (Dynamo's handler mints
    its own in its first step). Leaving the block that gave the stream early,
    without ``cancel``, is a caller that leaves without a signal.
    """

    chunks: AsyncIterator[dict[str, Any]]
    output: OutputMode
    cancel: Callable[[], None]
    rid: Callable[[], Awaitable[str]]


#: Opens one caller stream for a request, for the life of the block.
OpenCaller = Callable[[Mapping[str, Any]], AbstractAsyncContextManager[CallerStream]]

#: How often the idle wait (``Scenario.wait_idle``) looks at the engine.
_IDLE_POLL = 0.005


async def run_scenario(
    worker: Worker,
    recorder: RidRecorder,
    scenario: Scenario,
    scheduler_events: Callable[[], list[SchedulerEvent]],
    *,
    settle: float = 0.3,
    clock: Callable[[], float] = trio.current_time,
    watch: Watched | None = None,
) -> Observation:
    """Run ``scenario`` on a worker opened over ``recorder``.

    ``settle`` (seconds) lets aborts and echoes land before the engine is
    observed; ``clock`` must be the clock the scheduler's events are stamped
    with; ``watch`` is where the request's phase is read (the recorder's
    engine by default).
    """
    if scenario.trap is None:
        open_stream = partial(_worker_stream, worker, recorder, scenario.output)
        return await observe_caller(
            open_stream,
            recorder if watch is None else watch,
            scenario,
            scheduler_events,
            settle=settle,
            clock=clock,
        )
    seen = Observation()
    before = recorder.live_requests()
    await _run_trap(recorder.engine, scenario, seen)
    await _settle(recorder, scenario, settle)
    _observe_scheduler(seen, scheduler_events(), recorder.live_requests() - before, None)
    return seen


async def observe_caller(
    open_stream: OpenCaller,
    engine: Watched,
    scenario: Scenario,
    scheduler_events: Callable[[], list[SchedulerEvent]],
    *,
    settle: float = 0.3,
    clock: Callable[[], float] = trio.current_time,
) -> Observation:
    """Run ``scenario``'s request through the caller ``open_stream`` gives, on ``engine``.

    ``engine`` is where the request's phase is read (to time a cancel) and
    what it still holds is counted; ``settle`` and ``clock`` as for
    ``run_scenario``.
    """
    seen = Observation()
    before = engine.live_requests()
    cancelled_at = await _run_request(open_stream, engine, scenario, seen, clock)
    await _settle(engine, scenario, settle)
    events = scheduler_events()
    _observe_scheduler(seen, events, engine.live_requests() - before, cancelled_at)
    if scenario.cancel in _DURING_THE_REQUEST and _aborted_after_finishing(events):
        seen.missed = True
    return seen


async def _settle(engine: Watched, scenario: Scenario, settle: float) -> None:
    """Bounded: the idle wait, then the settle. The engine announces nothing when it
    holds nothing any more, so the idle wait looks at it every ``_IDLE_POLL``."""
    if scenario.wait_idle > 0:
        with trio.move_on_after(scenario.wait_idle):
            while engine.live_requests():  # noqa: ASYNC110 (see the docstring)
                await trio.sleep(_IDLE_POLL)
    await trio.sleep(max(settle, scenario.observe_for))


#: Cancels aimed at a moment before the scheduler has finished the request.
_DURING_THE_REQUEST: tuple[CancelPhase, ...] = (
    "tokenizing",
    "dispatched",
    "mid_stream",
    "consumer_leaves",
)


def _aborted_after_finishing(events: list[SchedulerEvent]) -> bool:
    """Whether the cancel stopped nothing because it came too late: no abort was applied,
    and one reached the scheduler only after a request it was for had finished there (a
    stalled caller). A run where any abort was applied measured a cancel."""
    if any(kind == "abort_applied" for _, kind, _ in events):
        return False
    finished = [(rid, t) for t, kind, rid in events if kind == "finished"]
    return any(
        kind == "abort" and rid.startswith(prefix) and t > done
        for t, kind, prefix in events
        for rid, done in finished
    )


def _observe_scheduler(
    seen: Observation, events: list[SchedulerEvent], live: int, cancelled_at: float | None
) -> None:
    seen.scheduler = normalise(events)
    seen.registered_after = max(0, live)  # another caller's leftover may have gone meanwhile
    if cancelled_at is not None:
        _time_the_cancel(seen, events, cancelled_at)


def _time_the_cancel(seen: Observation, events: list[SchedulerEvent], cancelled_at: float) -> None:
    seen.tokens_after_cancel = sum(
        1 for t, kind, _ in events if kind == "token" and t > cancelled_at
    )
    requests = [(t, rid) for t, kind, rid in events if kind == "request"]
    if len(requests) != 1:
        return  # released before dispatch, or several children: no single delay
    dispatched, rid = requests[0]
    applied = [t for t, kind, r in events if kind.startswith("abort_applied") and r == rid]
    if applied:
        seen.abort_delay = applied[0] - max(cancelled_at, dispatched)


@asynccontextmanager
async def _worker_stream(
    worker: Worker, recorder: RidRecorder, output: OutputMode, request: Mapping[str, Any]
) -> AsyncIterator[CallerStream]:
    """trio-sglang's caller: ``worker.generate``, cancelled with ``ctx.kill()``."""
    ctx = RequestContext("conformance-ctx")
    async with worker.generate(request, ctx, output=output) as chunks:
        rid = recorder.last_rid
        assert rid is not None

        async def engine_rid() -> str:
            await trio.lowlevel.checkpoint()
            return rid if isinstance(rid, str) else rid[0]  # a batch: its first prompt's

        yield CallerStream(chunks, output, ctx.kill, engine_rid)


async def _run_request(
    open_stream: OpenCaller,
    engine: Watched,
    scenario: Scenario,
    seen: Observation,
    clock: Callable[[], float],
) -> float | None:
    """Returns when the cancel happened (``clock``), or the caller left, if either did."""
    cancelled_at: float | None = None
    async with trio.open_nursery() as nursery:
        async with open_stream(scenario.request) as stream:

            def cancel() -> None:
                nonlocal cancelled_at
                cancelled_at = clock()
                stream.cancel()

            if scenario.cancel == "before_registration":
                cancel()
            elif scenario.cancel in ("tokenizing", "dispatched"):
                target = (
                    RequestPhase.REGISTERED
                    if scenario.cancel == "tokenizing"
                    else RequestPhase.DISPATCHED
                )
                nursery.start_soon(
                    _at_phase, engine, stream.rid, target, scenario.cancel_delay, cancel
                )
            try:
                async for chunk in stream.chunks:
                    _note_chunk(seen, chunk, stream.output)
                    if seen.chunks == 2 and scenario.cancel == "mid_stream":
                        cancel()
                    elif seen.chunks == 2 and scenario.cancel == "consumer_leaves":
                        cancelled_at = clock()
                        break  # no signal: the caller just goes
            except Exception as exc:  # observed, and compared by whoever reads the observation
                seen.raised = type(exc).__name__
            if scenario.cancel == "after_finish":
                cancel()
        if cancelled_at is not None:
            seen.stream_close = clock() - cancelled_at
        elif scenario.cancel in ("tokenizing", "dispatched"):
            seen.missed = True
        nursery.cancel_scope.cancel()
    return cancelled_at


async def _at_phase(
    engine: Watched,
    rid: Callable[[], Awaitable[str]],
    target: RequestPhase,
    delay: float,
    action: Callable[[], None],
) -> None:
    """Run ``action`` ``delay`` seconds after the request reaches ``target`` (bounded)."""
    await _reach_phase(engine, await rid(), target)
    await trio.sleep(delay)
    action()


async def _reach_phase(engine: Watched, rid: str, target: RequestPhase) -> None:
    with trio.fail_after(10):
        phase = engine.phase(rid)
        while phase is not target:
            phase = await engine.wait_phase_change(rid, phase)


def _reason(value: object) -> str | None:
    return str(value.get("type")) if isinstance(value, dict) else None


def _note_chunk(seen: Observation, chunk: dict[str, Any], output: OutputMode) -> None:
    seen.chunks += 1
    if output == "native":
        seen.finish_reasons.append(_reason(chunk["meta_info"]["finish_reason"]))
        seen.ids_seen.append(chunk["meta_info"]["id"])
        seen.text += chunk.get("text") or ""
        seen.output_ids.extend(chunk.get("output_ids") or ())
    elif output == "text":
        seen.finish_reasons.append(chunk["choices"][0]["finish_reason"])
        seen.ids_seen.append(chunk["id"])
    else:
        seen.finish_reasons.append(chunk["finish_reason"])


async def _run_trap(engine: Engine, scenario: Scenario, seen: Observation) -> None:
    """SGLang's abort traps (an early abort lost, a repeated one dropped), driven by hand.

    ``no_bootstrap_room`` sends the request as it is (without one) to a
    disaggregated engine, which the worker would refuse: SGLang's scheduler
    answers it with a 400 abort.
    """
    if scenario.trap == "abort_unknown_rid":
        await engine.abort("conformance-unknown-rid")
        return
    rid = "conformance-trap-" + "0" * 15
    stream = engine.generate({**scenario.request, "rid": rid, "stream": True})
    try:
        async with trio.open_nursery() as nursery:
            if scenario.trap == "abort_while_tokenizing":

                async def abort_while_tokenizing() -> None:
                    await _reach_phase(engine, rid, RequestPhase.REGISTERED)
                    await engine.abort(rid)

                nursery.start_soon(abort_while_tokenizing)
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:  # SGLang 0.5.17's end of an abort it kept
                    seen.raised = type(exc).__name__
                    break
                seen.chunks += 1
                seen.finish_reasons.append(_reason(out["meta_info"]["finish_reason"]))
                if scenario.trap == "abort_twice" and seen.chunks == 1:
                    await engine.abort(rid)
                    await engine.abort(rid)
    finally:
        with trio.move_on_after(5, shield=True):
            await stream.aclose()


#: SimEngine trace kinds as the scheduler would log them.
_SIM_TO_SCHEDULER = {
    "dispatched": "request",
    "token": "token",
    "abort_requested": "abort",
    "abort_applied": "abort_applied",
    "abort_lost": "abort_lost",
    "bootstrapped": "bootstrapped",
    "prefill_chunk": "prefill_chunk",
    "kv_sent": "kv_sent",
    "kv_received": "kv_received",
    "kv_failed": "kv_failed",
    "kv_timeout": "kv_timeout",
}
#: SimEngine trace kinds whose detail is the stage the request was in.
_SIM_STAGED = frozenset({"abort_applied", "kv_failed"})


async def observe_on_sim(
    scenario: Scenario,
    *,
    first_token_delay: float,
    token_interval: float,
    disagg: DisaggSetup | None = None,
) -> Observation:
    """The scenario on a fresh ``SimEngine`` with the harness's timing.

    With ``disagg``, a SimEngine in that role with its own ``SimKVRooms``,
    where the peer script plays the other side of each request's room.
    """
    from trio_sglang import open_worker

    rooms = SimKVRooms()
    engine = SimEngine(
        tokenize_delay=scenario.tokenize_delay,
        dispatch_delay=0.0,
        first_token_delay=first_token_delay,
        token_interval=token_interval,
        disaggregation_mode=None if disagg is None else disagg.role,
        kv_rooms=rooms,
        disagg_timing=None if disagg is None else disagg.timing,
    )

    async with trio.open_nursery() as peers:
        on_generate = None if disagg is None else partial(_start_peer, peers, disagg, engine, rooms)
        recorder = RidRecorder(engine, on_generate)
        async with open_worker(recorder) as worker:
            events = partial(sim_scheduler_events, engine)
            seen = await run_scenario(worker, recorder, scenario, events)
        peers.cancel_scope.cancel()  # a peer still waiting for its request
    return seen


def sim_scheduler_events(engine: SimEngine) -> list[SchedulerEvent]:
    """The SimEngine's trace as the stand-in scheduler would have logged it."""
    return [
        (
            e.time,
            staged_kind(_SIM_TO_SCHEDULER[e.kind], e.detail if e.kind in _SIM_STAGED else None),
            e.rid,
        )
        for e in engine.trace
        if e.kind in _SIM_TO_SCHEDULER
    ]


def _start_peer(
    peers: trio.Nursery,
    setup: DisaggSetup,
    engine: Engine,
    rooms: SimKVRooms,
    request: Mapping[str, Any],
) -> None:
    """The peer script for the room of a request the worker is handing to the engine."""
    peers.start_soon(play_peer, setup, engine, rooms, request["rid"], request["bootstrap_room"])
