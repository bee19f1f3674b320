"""One lifecycle fuzz example, run: its consumers, their ways out, and what each saw.

``test_fuzz_lifecycle.py`` draws a ``Scenario`` and judges the ``Outcome``
this module's ``run`` returns: every request sent at once to a
``RecordingEngine`` (a SimEngine that keeps each request's stream, to tell
whose engine ids are whose), each consumer reading at its own pace and
leaving its own way, on a fresh ``MockClock``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import trio
import trio.testing

import trio_sglang as ts
from _strategies import COUNTED, LINGERING, TIMED, RequestPlan, Scenario
from trio_sglang.sim._tokenizer import ReqState, SimStream

#: Mock-clock bound on one example: a hang jumps straight to it and fails.
HORIZON = 1000.0

ConsumerState = Literal["before_open", "before_pull", "in_pull", "between_chunks", "drained"]


class RecordingEngine(ts.SimEngine):
    """A SimEngine that keeps each request's stream, to tell which engine ids are whose."""

    def __init__(self, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.streams: list[SimStream] = []

    def generate(self, request: Mapping[str, Any]) -> SimStream:
        stream = super().generate(request)
        self.streams.append(stream)
        return stream


def engine_states(stream: SimStream | None) -> list[ReqState]:
    """Every engine id one request's stream created: minted rids (or ``rid_i``), warm-up, children.

    Read from the simulator's private record, because SGLang gives parallel
    samples ids that only their first output reveals, and a child cancelled
    before it speaks never reveals its id.
    """
    return [] if stream is None else list(stream._states)


class ConsumerError(Exception):
    """Raised in the block's body by a consumer whose method is ``raise``."""


@dataclass(eq=False)
class Seen:
    """One request as its consumer saw it, and when (and how) it was told to end."""

    plan: RequestPlan
    task_scope: trio.CancelScope
    started_at: float = math.nan
    left_at: float | None = None
    raised: BaseException | None = None
    stream: ts.ResponseStream | None = None
    engine_stream: SimStream | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    chunks_after_aclose: list[dict[str, Any]] = field(default_factory=list)
    in_block: bool = False
    state: ConsumerState = "before_open"
    busy_until: float = math.nan
    #: Read to the end with no cancel before: every token must have arrived.
    complete: bool = False
    left_by_choice: bool = False
    open_at_shutdown: bool = False
    #: The first cancel (or decision to leave): clock time, trace length,
    #: what the consumer was doing, and when its block must exit.
    cancelled_at: float | None = None
    cancel_mark: int | None = None
    cancel_state: ConsumerState | None = None
    expect_left_at: float | None = None

    def note_cancel(self, trace_length: int, expect_left_at: float) -> None:
        """The first cancel is the one judged; one after the consumer left changes nothing."""
        if self.cancelled_at is not None or self.left_at is not None:
            return
        self.cancelled_at = trio.current_time()
        self.cancel_mark = trace_length
        self.cancel_state = self.state
        self.expect_left_at = expect_left_at

    def note_shutdown(self, trace_length: int) -> None:
        """The worker is being left: a stream still open must end now."""
        if not self.in_block:
            return
        now = trio.current_time()
        self.open_at_shutdown = True
        self.note_cancel(trace_length, now)
        assert self.expect_left_at is not None
        self.expect_left_at = min(self.expect_left_at, now)


@dataclass(eq=False)
class Outcome:
    """One example's result: the engine (and its trace), the consumers, the worker's exit."""

    engine: RecordingEngine
    seen: list[Seen]
    #: When the worker's block was left, and when leaving it was done.
    left_worker_at: float = math.nan
    worker_done_at: float = math.nan
    trace_length_at_exit: int = 0
    open_streams_after: int = -1
    pending_cleanups_after: int = -1
    warnings: list[str] = field(default_factory=list)


class Countdown:
    """Set once every consumer is done: the worker is then left, unless a shutdown came first."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._done = trio.Event()
        if count == 0:
            self._done.set()

    def done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._done.set()

    async def wait(self) -> None:
        await self._done.wait()


# -- one example ---------------------------------------------------------------


async def work(seen: Seen, seconds: float) -> None:
    """The consumer's own work (a slow client); zero is still a checkpoint."""
    seen.busy_until = trio.current_time() + seconds
    await trio.sleep(seconds)


async def leave(chunks: ts.ResponseStream, seen: Seen, engine: RecordingEngine) -> None:
    """A counted method's way out of the block, after ``after_chunks`` chunks."""
    seen.left_by_choice = True
    seen.note_cancel(len(engine.trace), trio.current_time())
    if seen.plan.method == "raise":
        raise ConsumerError(seen.plan.index)
    if seen.plan.method == "aclose":
        await chunks.aclose()
        seen.chunks_after_aclose = [chunk async for chunk in chunks]


async def read(chunks: ts.ResponseStream, seen: Seen, engine: RecordingEngine) -> None:
    """The consumer's loop: work, then pull and work per chunk, tracking where it is.

    ``seen.state`` and ``seen.busy_until`` tell a canceller what the consumer
    is doing at the cancel, which decides when its block must exit.
    """
    plan = seen.plan
    seen.state = "before_pull"
    await work(seen, plan.pre_work)
    while True:
        if plan.method in COUNTED and len(seen.chunks) == plan.after_chunks:
            await leave(chunks, seen, engine)
            return
        seen.state = "in_pull"
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            break
        seen.chunks.append(chunk)
        seen.state = "between_chunks"
        await work(seen, plan.work)
    seen.state = "drained"
    seen.complete = seen.cancelled_at is None
    if plan.method in LINGERING:
        await trio.sleep_forever()  # so that a cancel after the end still finds the block open


async def consume(
    worker: ts.Worker, engine: RecordingEngine, ctx: ts.RequestContext, seen: Seen
) -> None:
    plan = seen.plan
    deadline = math.inf
    if plan.method == "deadline":
        deadline = seen.started_at + (plan.cancel_at or 0.0)
    try:
        async with worker.generate(plan.body(), ctx, output=plan.output) as chunks:
            # generate() does not checkpoint before its block: this is our stream.
            seen.stream, seen.engine_stream = chunks, engine.streams[-1]
            seen.in_block = True
            try:
                with trio.move_on_at(deadline) as timer:
                    await read(chunks, seen, engine)
                if timer.cancelled_caught:
                    seen.note_cancel(len(engine.trace), deadline)
            finally:
                seen.in_block = False
    except (ts.EngineShutdown, ConsumerError) as exc:
        seen.raised = exc
    finally:  # also when the consumer's own task is cancelled
        seen.left_at = trio.current_time()


async def cancel(ctx: ts.RequestContext, seen: Seen, engine: RecordingEngine) -> None:
    """A timed method, from outside the consumer's reading; notes what the block must do."""
    method = seen.plan.method
    expect = trio.current_time()
    if method == "aclose_other" and seen.state != "in_pull":
        expect = seen.busy_until  # the consumer's next pull ends the stream
    seen.note_cancel(len(engine.trace), expect)
    if method == "stop":
        ctx.stop()
    elif method == "kill":
        ctx.kill()
    elif method == "consumer_cancelled":
        seen.task_scope.cancel()
    elif method == "aclose_other" and seen.stream is not None:
        await seen.stream.aclose()


async def cancel_later(ctx: ts.RequestContext, seen: Seen, engine: RecordingEngine) -> None:
    assert seen.plan.cancel_at is not None
    await trio.sleep_until(seen.started_at + seen.plan.cancel_at)
    for _ in range(seen.plan.checkpoints):
        await trio.lowlevel.checkpoint()
    await cancel(ctx, seen, engine)


async def run_request(
    worker: ts.Worker, engine: RecordingEngine, seen: Seen, consumers: Countdown
) -> None:
    """One request: its consumer, in a task scope of its own, and its canceller beside it."""
    plan = seen.plan
    await trio.sleep(plan.start_delay)
    seen.started_at = trio.current_time()
    ctx = ts.RequestContext(plan.context_id)
    async with trio.open_nursery() as nursery:
        if plan.method in TIMED and plan.method != "deadline":  # deadline: in consume()
            if plan.cancel_at is None:
                await cancel(ctx, seen, engine)  # before the block opens
            else:
                nursery.start_soon(cancel_later, ctx, seen, engine)
        try:
            with seen.task_scope:
                await consume(worker, engine, ctx, seen)
        finally:
            consumers.done()  # the worker waits for consumers, not for late cancels


async def run_scenario(scenario: Scenario, policy: ts.AbortPolicy) -> Outcome:
    """Every request at once; the worker is left at the shutdown moment or when all are done."""
    engine = RecordingEngine(**scenario.engine.kwargs())
    outcome = Outcome(engine, [Seen(plan, trio.CancelScope()) for plan in scenario.requests])
    consumers = Countdown(len(outcome.seen))
    start = trio.current_time()
    shutdown_at = math.inf if scenario.shutdown_at is None else start + scenario.shutdown_at
    with trio.fail_after(HORIZON):
        async with trio.open_nursery() as outside:  # consumers outlive the worker
            async with ts.open_worker(engine, policy=policy) as worker:
                for seen in outcome.seen:
                    outside.start_soon(run_request, worker, engine, seen, consumers)
                with trio.move_on_at(shutdown_at):
                    await consumers.wait()
                for _ in range(scenario.shutdown_checkpoints):
                    await trio.lowlevel.checkpoint()
                outcome.left_worker_at = trio.current_time()
                for seen in outcome.seen:
                    seen.note_shutdown(len(engine.trace))
            outcome.worker_done_at = trio.current_time()
            outcome.trace_length_at_exit = len(engine.trace)
            outcome.open_streams_after = worker.open_streams
            outcome.pending_cleanups_after = worker.pending_cleanups
    return outcome


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def library_warnings() -> Iterator[list[str]]:
    """The library's warnings and errors: each one means a policy bound was hit."""
    handler = _Collect()
    logger = logging.getLogger("trio_sglang")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def run(scenario: Scenario, policy: ts.AbortPolicy) -> Outcome:
    """One example in its own ``trio.run`` on a fresh ``MockClock``: independent and exact."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    with library_warnings() as messages:
        outcome = trio.run(run_scenario, scenario, policy, clock=clock)
    outcome.warnings = messages
    return outcome
