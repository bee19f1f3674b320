"""Lines of the lifecycle's contract that only these tests pin: each one was a surviving mutant.

``nox -s mutants`` (docs/mutants.md) changes the lifecycle core one statement
at a time and runs the fast MockClock tests against each change. Each test
here states the property whose loss no other test noticed: the engine-side
cleanup's bounds, its one-abort rule and what it reports, the worker's
shutdown, and what the request parser and the output formatter promise.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import Recorder, read, slow_sim
from trio_sglang._core._cleanup_group import CleanupGroup, open_cleanup_group
from trio_sglang._core._disagg import CANCEL_ANYTIME
from trio_sglang._core._lifecycle import Event, Lifecycle, State
from trio_sglang._core._outputs import PublicIds
from trio_sglang._core._reports import Reports
from trio_sglang._engine import RequestPhase
from trio_sglang.testing import Faults, FaultyEngine

HELLO: dict[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 5}}
#: Still decoding when every bound of a cleanup has run out.
LONG: dict[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 50}}


def fault_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("engine fault ")]


# -- the hand-over after a cancelled pull ---------------------------------------------------


async def test_a_cancelled_pull_that_released_everything_leaves_no_cleanup_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The release path ran in the pull: nothing is left to await, and no task is spent on it.

    In a burst of cancels this spares a task per request; the observer still
    hears of the cleanup, over in 0 s with everything released.
    """
    observer = Recorder()
    async with (
        ts.open_worker(slow_sim(), observer=observer) as worker,
        worker.generate(HELLO, ts.RequestContext("pub")) as chunks,
    ):
        with trio.move_on_after(1.0):  # tokenizing until 1.0
            await chunks.__anext__()
        assert worker.pending_cleanups == 0  # before any checkpoint: no task was started
        assert observer.cleanups == [(0.0, True)]


# -- the request's lifecycle ----------------------------------------------------------------


async def test_aclose_outside_a_pull_ends_the_stream_and_not_the_block(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only a pull in progress is cut by cancelling the block: before the first, or between
    two, ``aclose`` leaves the stream and the block's body runs on."""
    async with ts.open_worker(slow_sim()) as worker:
        for pulls in (0, 1):
            ran_on = False
            async with worker.generate(HELLO, ts.RequestContext("pub")) as chunks:
                for _ in range(pulls):
                    await chunks.__anext__()
                await chunks.aclose()
                assert chunks.closed
                ran_on = True
            assert ran_on, f"aclose after {pulls} pull(s) cancelled the block"


async def test_a_stream_read_outside_its_block_says_where_to_read_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with ts.open_worker(slow_sim()) as worker:
        stream = worker.generate(HELLO, ts.RequestContext("pub"))
        with pytest.raises(RuntimeError, match="inside its block"):
            await stream.__anext__()
        with pytest.raises(RuntimeError, match="inside its block"):
            await stream.aclose()
        assert worker.open_streams == 0  # nothing was opened, nothing reached the engine


def test_a_move_the_state_table_does_not_list_is_refused_by_name() -> None:
    """A bug in the lifecycle shows at once, naming the event and the state."""
    request = lifecycle(SlowAbortEngine(), CleanupGroup())
    with pytest.raises(AssertionError, match=r"^the engine side stopped in state new$"):
        request._fire(Event.STOPPED)
    assert request.state is State.NEW


async def test_a_reader_that_stopped_a_failed_stream_counts_its_cleanup_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine fails under the reader, which begins stopping the request before its caller
    takes the error; the caller's leaving then adds nothing, and the cleanup ends once."""
    observer = Recorder()
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(stream_error_after=1))
    async with ts.open_worker(engine, observer=observer) as worker:
        with pytest.raises(ts.EngineError):
            await read(worker, LONG, ts.RequestContext("pub"))
        await worker.wait_idle()
        assert worker.pending_cleanups == 0
    assert len(observer.cleanups) == 1


async def test_a_reader_whose_caller_left_reads_to_the_end_and_stops_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No release on close: after the caller leaves, the reader reads on until the engine ends
    the stream (its abort took); that end is not the caller's, and the cleanup ends."""
    observer = Recorder()
    engine = slow_sim(release_on_close=False)
    async with ts.open_worker(engine, observer=observer) as worker:
        assert await read(worker, LONG, ts.RequestContext("pub"), leave_after=1) == 1
        await worker.wait_idle()
        assert worker.pending_cleanups == 0
    assert [released for _, released in observer.cleanups] == [True]


# -- the one-abort rule, on an engine whose abort waits behind a forward ------------------


class SlowAbortEngine:
    """One dispatched request; an abort takes 3 s to apply (behind a long forward).

    Closing its stream runs the release path, which sends the abort, as
    SGLang's does; ``abort_sent_flag`` says whether the engine tells so.
    """

    def __init__(self, *, abort_sent_flag: bool = True, close_raises: bool = False) -> None:
        self.abort_sent_flag = abort_sent_flag
        self.close_raises = close_raises
        self.aborts: list[float] = []
        self.applies_at: float | None = None
        self.phase_changed = trio.Event()

    def features(self) -> ts.EngineFeatures:
        return ts.EngineFeatures(release_on_close=True, abort_sent_flag=self.abort_sent_flag)

    def phase(self, rid: str) -> RequestPhase:
        if rid != "rid-1" or (
            self.applies_at is not None and trio.current_time() >= self.applies_at
        ):
            return RequestPhase.ABSENT
        return RequestPhase.DISPATCHED

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        while self.phase(rid) is phase:
            if self.applies_at is None:
                await self.phase_changed.wait()
            else:
                await trio.sleep_until(self.applies_at)
        return self.phase(rid)

    def send_abort(self) -> None:
        if self.applies_at is None:
            self.applies_at = trio.current_time() + 3.0
            self.phase_changed.set()

    async def abort(self, rid: str) -> None:
        self.aborts.append(trio.current_time())
        self.send_abort()
        await trio.lowlevel.checkpoint()


class SlowAbortStream:
    def __init__(self, engine: SlowAbortEngine) -> None:
        self._engine = engine

    def __aiter__(self) -> SlowAbortStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._engine.close_raises:
            raise ConnectionError("the close failed after the release path ran")
        self._engine.send_abort()


def lifecycle(
    engine: SlowAbortEngine,
    group: CleanupGroup,
    rids: tuple[str, ...] = ("rid-1",),
    observer: Recorder | None = None,
) -> Lifecycle:
    """One request of ``engine``, as a worker runs it."""
    features = engine.features()
    return Lifecycle(
        SlowAbortStream(engine),
        PublicIds("pub"),
        rids,
        "tokens",
        engine=engine,  # type: ignore[arg-type]
        policy=ts.AbortPolicy(),
        group=group,
        reports=Reports(observer),
        release_on_close=features.release_on_close,
        abort_sent_flag=features.abort_sent_flag,
        scope=trio.CancelScope(),
    )


@asynccontextmanager
async def slow_abort_request(
    engine: SlowAbortEngine, observer: Recorder | None = None
) -> AsyncIterator[Lifecycle]:
    """One request of ``engine``; leaving waits for its cleanup."""
    async with open_cleanup_group() as group:
        yield lifecycle(engine, group, observer=observer)
        await group.wait_idle()


async def cancelled_pull(life: Lifecycle) -> None:
    """The caller's first pull, parked in the engine stream, cancelled there at once."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(life.pull)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()


async def test_a_closed_dispatched_request_gets_no_second_abort_while_its_first_is_on_its_way(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The close sent the abort; it takes 3 s, past ``release_timeout``; the cleanup waits it out.

    SGLang honours one abort per request: a second one would only be dropped.
    """
    engine = SlowAbortEngine()
    async with slow_abort_request(engine) as request:
        await request.stop()
        assert trio.current_time() == 3.0  # it waited for the engine to let go
    assert engine.aborts == []


async def test_a_cancelled_pull_that_sent_the_abort_sends_no_second_one_if_the_close_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What the engine still held after the pull's release path was dispatched: its abort went."""
    engine = SlowAbortEngine(close_raises=True)
    engine.send_abort()  # the cancelled pull's release path
    observer = Recorder()
    async with slow_abort_request(engine, observer) as request:
        await cancelled_pull(request)
    assert observer.cleanups == [(3.0, True)]  # it waited for the engine to let go
    assert engine.aborts == []


async def test_an_engine_that_does_not_tell_what_it_sent_gets_the_abort_after_release_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Without ``abort_sent_flag`` the worker cannot know the close sent one: it aborts."""
    engine = SlowAbortEngine(abort_sent_flag=False)
    async with slow_abort_request(engine) as request:
        await request.stop()
    assert engine.aborts[0] == ts.AbortPolicy().release_timeout


class StubbornEngine(SlowAbortEngine):
    """Two dispatched ids: ``rid-2`` goes at its abort, ``rid-1`` never lets go."""

    def __init__(self) -> None:
        super().__init__()
        self.held = {"rid-1", "rid-2"}
        self.aborted: list[str] = []

    def features(self) -> ts.EngineFeatures:
        return ts.EngineFeatures()

    def phase(self, rid: str) -> RequestPhase:
        return RequestPhase.DISPATCHED if rid in self.held else RequestPhase.ABSENT

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        await trio.sleep_forever()  # nothing changes by itself: only an abort lets an id go
        raise AssertionError("unreachable")

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        if rid != "rid-1":
            self.held.discard(rid)
        await trio.lowlevel.checkpoint()


async def test_each_id_of_a_request_gets_one_ordered_abort_however_often_it_is_asked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first id's abort never takes; asked again after the second id's, it sends no more."""
    engine = StubbornEngine()
    policy = ts.AbortPolicy()
    async with open_cleanup_group() as group:
        request = lifecycle(engine, group, ("rid-1", "rid-2"))
        await request.ordered_abort("rid-1")
        await request.ordered_abort("rid-2")
        await request.ordered_abort("rid-1")
    assert engine.aborted == ["rid-1"] * policy.abort_attempts + ["rid-2"]


# -- what a cleanup reports -----------------------------------------------------------------


async def test_a_cleanup_past_its_timeout_is_reported_once_though_another_task_ended_in_time(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Two tasks work on one cleanup: the reader ends in time (7.5), the abort does not (12.5).

    No release on close: the worker's reader watches for 6 s after the caller
    leaves at 2.5, then closes; the abort hangs until the cleanup's 10 s bound.
    """
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(abort="hang"))
    observer = Recorder()
    policy = ts.AbortPolicy(abort_timeout=20.0, cleanup_timeout=10.0)
    async with ts.open_worker(engine, policy=policy, observer=observer) as worker:
        assert await read(worker, LONG, ts.RequestContext("pub"), leave_after=1) == 1
        await trio.sleep(5.5)
        assert worker.pending_cleanups == 1  # the reader is done, the abort is not
        await trio.sleep(10)
        assert worker.pending_cleanups == 0
    (rid,) = engine.faulty_rids
    (record,) = fault_records(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"engine fault cleanup_timeout: request pub (rids {rid}): "
        "the cleanup ran past 10.0s; the engine may still hold it"
    )
    assert observer.faults == ["cleanup_timeout"]
    assert observer.cleanups == [(10.0, False)]


class NumberedAborts(FaultyEngine):
    """A ``FaultyEngine`` whose failed aborts say which attempt they were."""

    async def abort(self, rid: str) -> None:
        try:
            await super().abort(rid)
        except ConnectionError as exc:
            raise ConnectionError(f"attempt {len(self.aborts)}") from exc


#: Short bounds, each one visible in the clock times below.
POLICY = ts.AbortPolicy(
    close_timeout=0.5, dispatch_timeout=2.0, abort_retry_delay=0.25, stall_timeout=3.0
)
#: Per fault: whether the engine releases on close, the faults, and the fault log
#: lines (kind, detail, the error attached) of a caller that leaves after one chunk (2.5).
REPORTS: dict[str, tuple[bool, Faults, list[tuple[str, str, str | None]]]] = {
    "close raises, then every abort": (
        True,
        Faults(close="raise", abort="raise"),
        [
            (
                "close_error",
                "closing the engine stream raised",
                "injected: closing the engine stream failed",
            ),
            ("abort_error", "the engine still holds it after 3 abort attempts", "attempt 3"),
        ],
    ),
    "close hangs": (
        True,
        Faults(close="hang"),
        [("close_timeout", "closing the engine stream took over 0.5s", None)],
    ),
    "the first abort raises": (
        False,
        Faults(abort="raise", abort_failures=1),
        [
            (
                "abort_error",
                "the engine let go of it after 1 failed abort attempt(s) "
                "(the first: ConnectionError('attempt 1'))",
                None,
            )
        ],
    ),
    "dispatch never observed": (
        False,
        Faults(hide_dispatch=True),
        [
            (
                "dispatch_timeout",
                "still undispatched after 2.0s; not aborted, since an abort before dispatch "
                "is lost",
                None,
            )
        ],
    ),
}


@pytest.mark.parametrize("case", REPORTS, ids=str)
async def test_each_fault_of_a_cleanup_is_logged_with_what_went_wrong(
    case: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """What a person reads to find out why the engine kept a request: the detail and the error."""
    release, faults, expected = REPORTS[case]
    engine = NumberedAborts(slow_sim(release_on_close=release), faults)
    async with ts.open_worker(engine, policy=POLICY) as worker:
        assert await read(worker, LONG, ts.RequestContext("pub"), leave_after=1) == 1
        await trio.sleep(30)
    (rid,) = engine.faulty_rids
    logged = []
    for record in fault_records(caplog):
        kind, detail = record.getMessage().removeprefix("engine fault ").split(": ", 2)[::2]
        assert f"request pub (rids {rid})" in record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        logged.append((kind, detail, None if error is None else str(error) or type(error).__name__))
    assert logged == expected


async def test_the_last_failed_abort_is_reported_when_its_retries_run_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Attempts at 3.5, 3.75 and 4.0 (after the close failed, and ``release_timeout``); no wait
    after the last one: the cleanup ends at 4.0."""
    engine = NumberedAborts(slow_sim(), Faults(close="raise", abort="raise"))
    observer = Recorder()
    async with ts.open_worker(engine, policy=POLICY, observer=observer) as worker:
        assert await read(worker, LONG, ts.RequestContext("pub"), leave_after=1) == 1
        await trio.sleep(30)
    assert [time for time, _ in engine.aborts] == [3.5, 3.75, 4.0]
    assert observer.cleanups == [(1.5, False)]
    assert observer.faults == ["close_error", "abort_error"]


async def test_aborts_stop_once_the_engine_lets_go_and_the_failures_are_reported_as_passed(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The abort hangs twice (4.5 and 5.75), the request finishes at 6.5 meanwhile: no third."""
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(abort="hang"))
    async with ts.open_worker(engine, policy=POLICY) as worker:
        assert await read(worker, HELLO, ts.RequestContext("pub"), leave_after=3) == 3
        await trio.sleep(30)
    assert [time for time, _ in engine.aborts] == [4.5, 5.75]
    (record,) = fault_records(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage().endswith("the engine let go of it after 2 failed abort attempt(s)")


@pytest.mark.parametrize(
    ("faults", "detail", "error"),
    [
        (
            Faults(stream_error_after=1),
            "RuntimeError: injected: the engine stream failed",
            "injected: the engine stream failed",
        ),
        (Faults(stream_silent_after=1), "no output for 3.0s (engine phase: dispatched)", None),
    ],
    ids=["stream raises", "stream goes silent"],
)
async def test_a_stream_fault_is_logged_with_the_engines_error_or_phase(
    faults: Faults,
    detail: str,
    error: str | None,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FaultyEngine(slow_sim(), faults)
    async with ts.open_worker(engine, policy=POLICY) as worker:
        with pytest.raises(ts.EngineError, match=r"pub \(RuntimeError\)|pub in 3.0s"):
            await read(worker, LONG, ts.RequestContext("pub"))
    (rid,) = engine.faulty_rids
    (record,) = fault_records(caplog)
    assert record.getMessage().endswith(f"request pub (rids {rid}): {detail}")
    logged_error = record.exc_info[1] if record.exc_info else None
    assert (None if logged_error is None else str(logged_error)) == error


async def test_a_stall_before_any_sample_spoke_says_no_id_is_known_yet(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``n > 1``: SGLang names each sample only in its first output."""
    engine = FaultyEngine(slow_sim(), Faults(never_register=True))
    n2 = {"text": "hello", "sampling_params": {"max_new_tokens": 5, "n": 2}}
    async with ts.open_worker(engine, policy=POLICY) as worker:
        with pytest.raises(ts.EngineError, match=r"pub in 3\.0s"):
            await read(worker, n2, ts.RequestContext("pub"))
    (record,) = fault_records(caplog)
    assert record.getMessage().endswith(
        "request pub (rids none known): no output for 3.0s (engine phase: unknown)"
    )


async def test_a_watch_cut_by_the_cleanup_timeout_is_reported_as_one(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """No release on close: the abort takes at 2.5, but the stream goes silent instead of ending,
    so the worker's reader watches it until the 3 s cleanup bound (its own watch is 6 s)."""
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(stream_silent_after=1))
    observer = Recorder()
    policy = ts.AbortPolicy(cleanup_timeout=3.0)
    async with ts.open_worker(engine, policy=policy, observer=observer) as worker:
        assert await read(worker, LONG, ts.RequestContext("pub"), leave_after=1) == 1
        await trio.sleep(10)
    assert observer.cleanups == [(3.0, True)]
    assert observer.faults == ["cleanup_timeout"]
    (record,) = fault_records(caplog)
    assert "the cleanup ran past 3.0s" in record.getMessage()


# -- the shutdown ---------------------------------------------------------------------------


async def test_a_close_in_progress_runs_to_its_own_bound_past_the_shutdown_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A half-closed stream is worse than a short wait: the close's 2 s bound, not the 0.5 s grace.

    The caller leaves at 2.5 and the worker with it; the close hangs until 4.5.
    """
    engine = FaultyEngine(slow_sim(), Faults(close="hang"))
    policy = ts.AbortPolicy(close_timeout=2.0, shutdown_grace=0.5)
    async with ts.open_worker(engine, policy=policy) as worker:
        assert await read(worker, LONG, ts.RequestContext("pub"), leave_after=1) == 1
    assert engine.closed_at == 4.5


async def leave_slowly(
    worker: ts.Worker, seconds: float, told: list[str], *, after_one: bool = False
) -> None:
    """Read until stopped (or one chunk), then take ``seconds`` to leave (a slow handler)."""
    try:
        async with worker.generate(LONG, ts.RequestContext("pub")) as chunks:
            try:
                async for _ in chunks:
                    if after_one:
                        break
            finally:
                with trio.CancelScope(shield=True):
                    await trio.sleep(seconds)
    except ts.EngineShutdown as exc:
        told.append(str(exc))


async def test_a_worker_cancelled_from_outside_still_gives_open_streams_their_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The body's own deadline ends the worker at 3.0; the stream's block leaves at 4.0, in the
    grace, and its cleanup runs before the engine closes."""
    engine = FaultyEngine(slow_sim())
    told: list[str] = []
    async with trio.open_nursery() as outside:
        with trio.move_on_at(3.0):
            async with ts.open_worker(engine, policy=ts.AbortPolicy(shutdown_grace=5.0)) as worker:
                outside.start_soon(leave_slowly, worker, 1.0, told)
                await trio.sleep_forever()
    assert engine.closed_at == 4.0
    assert told == ["the worker shut down while the stream was open"]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_stream_that_outlives_the_worker_is_said_to_have_closed_with_the_engine(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Its block leaves at 5.5, past the 1 s grace that began at 3.0: the engine has closed."""
    told: list[str] = []
    async with trio.open_nursery() as outside, ts.open_worker(slow_sim()) as worker:
        outside.start_soon(partial(leave_slowly, worker, 3.0, told, after_one=True))
        await trio.sleep(3.0)
    assert trio.current_time() == 5.5
    assert worker.pending_cleanups == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["request pub ended after the worker closed; the engine closed with it"]


async def test_the_shutdown_waits_for_the_last_open_stream_not_the_first(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker leaves at 3.0; two blocks leave in the grace, at 4.0 and 5.0: then the engine."""
    engine = FaultyEngine(slow_sim())
    told: list[str] = []
    policy = ts.AbortPolicy(shutdown_grace=5.0)
    async with trio.open_nursery() as outside, ts.open_worker(engine, policy=policy) as worker:
        outside.start_soon(leave_slowly, worker, 1.0, told)
        outside.start_soon(leave_slowly, worker, 2.0, told)
        await trio.sleep(3.0)
    assert engine.closed_at == 5.0
    assert len(told) == 2
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_cut_at_shutdown_is_said_at_debug_level_not_as_a_fault(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_sglang")
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(abort="ignore"))
    policy = ts.AbortPolicy(release_timeout=30.0, shutdown_grace=1.0)
    async with ts.open_worker(engine, policy=policy) as worker:
        assert await read(worker, LONG, ts.RequestContext("pub"), leave_after=1) == 1
    assert "cleanup of request pub cancelled at shutdown" in caplog.messages
    assert fault_records(caplog) == []


async def test_a_worker_read_stream_cut_at_shutdown_ends_with_engine_shutdown_not_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A pull that the grace could not end (shielded here) must not look like a finished stream."""
    n2 = {"text": "hello", "sampling_params": {"max_new_tokens": 50, "n": 2}}
    told: list[str] = []

    async def pull_shielded(worker: ts.Worker) -> None:
        async with worker.generate(n2, ts.RequestContext("pub")) as chunks:
            with trio.CancelScope(shield=True):
                try:
                    async for _ in chunks:
                        pass
                except ts.EngineShutdown as exc:
                    told.append(str(exc))

    policy = ts.AbortPolicy(shutdown_grace=1.0)
    async with trio.open_nursery() as outside, ts.open_worker(slow_sim(), policy=policy) as w:
        outside.start_soon(pull_shielded, w)
        await trio.sleep(3.0)
    assert told == ["the worker's tasks were cancelled"]
    assert w.pending_cleanups == 0  # the cut reader left nothing for its caller to stop


async def test_a_first_pull_after_the_worker_closed_is_told_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A handler shields its block past the shutdown, then pulls: nothing reaches the engine."""
    n2 = {"text": "hello", "sampling_params": {"max_new_tokens": 5, "n": 2}}
    engine = RecordingEngine(slow_sim())
    told: list[str] = []

    async def pull_late(worker: ts.Worker) -> None:
        async with worker.generate(n2, ts.RequestContext("pub")) as chunks:
            with trio.CancelScope(shield=True):
                await trio.sleep(5.0)
                try:
                    await chunks.__anext__()
                except ts.EngineShutdown as exc:
                    told.append(str(exc))

    async with trio.open_nursery() as outside, ts.open_worker(engine) as worker:
        outside.start_soon(pull_late, worker)
        await trio.sleep(1.0)
    assert told == ["the worker has shut down"]
    assert list(engine.inner.trace) == []


# -- which ids a fault names ----------------------------------------------------------------


class RecordingEngine(FaultyEngine):
    """A ``FaultyEngine`` that keeps every ``/generate`` body the worker sends."""

    def __init__(self, inner: ts.Engine, faults: Faults | None = None) -> None:
        super().__init__(inner, faults or Faults())
        self.bodies: list[Mapping[str, Any]] = []

    def generate(self, request: Mapping[str, Any]) -> Any:
        self.bodies.append(request)
        return super().generate(request)


async def test_a_fault_names_the_children_still_running_not_the_finished_nor_the_parent_rid(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Two prompts, two samples each; the first prompt's two finish, then the engine goes silent.

    SGLang gives each sample a fresh id, so the rid the worker minted names nothing it runs.
    """
    request = {
        "text": ["p0", "p1"],
        "sampling_params": [{"n": 2, "max_new_tokens": 2}, {"n": 2, "max_new_tokens": 3}],
    }
    engine = RecordingEngine(slow_sim(), Faults(stream_silent_after=6))
    policy = ts.AbortPolicy(stall_timeout=10.0)
    async with ts.open_worker(engine, policy=policy) as worker:
        with pytest.raises(ts.EngineError):
            await read(worker, request, ts.RequestContext("pub"))
    (record,) = fault_records(caplog)
    named = record.getMessage().split("(rids ")[1].split(")")[0].split(", ")
    minted = engine.bodies[0]["rid"]
    assert len(named) == 2
    assert set(named) <= engine.faulty_rids - {minted}


# -- what the engine is asked -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False, None], ids=["stream", "no-stream", "unset"])
async def test_the_engine_is_always_asked_to_stream_under_a_minted_rid(
    stream: bool | None, autojump_clock: trio.testing.MockClock
) -> None:
    """The worker reads outputs as they come, whatever the caller's ``stream`` said."""
    engine = RecordingEngine(slow_sim())
    request = {**HELLO, "rid": "caller-rid"}
    if stream is not None:
        request["stream"] = stream
    async with ts.open_worker(engine) as worker:
        assert await read(worker, request, ts.RequestContext("pub")) == 5
    (body,) = engine.bodies
    assert body["stream"] is True
    assert body["rid"] != "caller-rid"
    assert len(body["rid"]) == 32


async def test_a_batch_of_token_id_prompts_streams(autojump_clock: trio.testing.MockClock) -> None:
    batch = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2}}
    async with ts.open_worker(slow_sim()) as worker:
        assert await read(worker, batch, ts.RequestContext("pub")) >= 2


@pytest.mark.parametrize(
    ("features", "n", "refused"),
    [({"batch_parallel_sampling": False}, 1, False), ({"batch_parallel_sampling": False}, 2, True)],
    ids=["one sample", "two samples"],
)
async def test_a_batch_needs_batch_parallel_sampling_only_for_n_above_one(
    features: dict[str, object], n: int, refused: bool, autojump_clock: trio.testing.MockClock
) -> None:
    engine = FaultyEngine(slow_sim(), Faults(), features=features)
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "n": n}}
    async with ts.open_worker(engine) as worker:
        if refused:
            with pytest.raises(ts.InvalidRequest, match="parallel sampling"):
                await read(worker, batch, ts.RequestContext("pub"))
        else:
            assert await read(worker, batch, ts.RequestContext("pub")) >= 2


async def test_every_prompt_of_a_batch_is_aborted_when_the_close_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One task per prompt waits ``release_timeout`` (1.0), then aborts it after its dispatch."""
    sim = slow_sim()
    engine = RecordingEngine(sim, Faults(close="raise"))
    batch = {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 50}}
    async with ts.open_worker(engine) as worker:
        assert await read(worker, batch, ts.RequestContext("pub"), leave_after=1) == 1
        left = trio.current_time()
        await trio.sleep(30)
    rids = engine.bodies[0]["rid"]
    assert sorted(rid for _, rid in engine.aborts) == sorted(rids)
    assert {time for time, _ in engine.aborts} == {left + 1.0}
    assert sim.live_rids() == set()


# -- what a refused request says ------------------------------------------------------------

#: A bad request, the field its error names (what the server answers as OpenAI's ``param``),
#: and the words that say what was wrong with the value the caller sent.
REFUSALS = [
    pytest.param(
        {**HELLO, "nonsense": 1}, "nonsense", "unknown request field 'nonsense'", id="unknown"
    ),
    pytest.param({**HELLO, "stream": "yes"}, None, "stream must be a bool, got str", id="stream"),
    pytest.param(
        {**HELLO, "return_logprob": [True]},
        "return_logprob",
        "a list 'return_logprob' needs a batch",
        id="per-prompt-no-batch",
    ),
    pytest.param(
        {"text": ["a", "b"], "return_logprob": [True]},
        "return_logprob",
        "'return_logprob' has 1 entries but the batch has 2 prompts",
        id="per-prompt-short",
    ),
    pytest.param(
        {"text": "a", "watermark": {"key": "0xbeef"}, "sampling_params": {"watermark": {}}},
        "watermark",
        "watermark must be provided either at the request top level or inside",
        id="two-watermarks",
    ),
    pytest.param(
        {**HELLO, "rid": 7}, None, "'rid' must be a string (or a list for a batch), got 7", id="rid"
    ),
    pytest.param({"text": "a\ud800b"}, None, "without a lone surrogate", id="surrogate"),
]


@pytest.mark.parametrize(("request_", "param", "words"), REFUSALS)
async def test_a_refused_request_names_its_field_and_the_value_it_got(
    request_: dict[str, Any], param: str | None, words: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with ts.open_worker(slow_sim()) as worker:
        with pytest.raises(ts.InvalidRequest) as refused:
            await read(worker, request_, ts.RequestContext("pub"))
    assert words in str(refused.value)
    assert refused.value.param == param


async def test_wrong_types_for_the_worker_itself_say_what_they_got(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(TypeError, match="policy must be an AbortPolicy, got dict"):
        async with ts.open_worker(slow_sim(), policy={}):  # type: ignore[arg-type]
            pass
    async with ts.open_worker(slow_sim()) as worker:
        with pytest.raises(ts.InvalidRequest, match="ctx must be a RequestContext, got str"):
            await read(worker, HELLO, "pub")  # type: ignore[arg-type]


# -- bootstrap fields -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "accepted"),
    [
        pytest.param({"bootstrap_room": 0}, True, id="room-0"),
        pytest.param({"bootstrap_room": 2**63 - 1}, True, id="room-max"),
        pytest.param({"bootstrap_room": 2**63}, False, id="room-past-max"),
        pytest.param({"bootstrap_room": -1}, False, id="room-negative"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 1}, True, id="port-1"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 65535}, True, id="port-max"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 65536}, False, id="port-past-max"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 0}, False, id="port-0"),
        # An aggregated engine needs no room.
        pytest.param({"bootstrap_host": "10.0.0.7"}, True, id="host-alone"),
    ],
)
async def test_bootstrap_values_are_checked_at_their_bounds(
    fields: dict[str, Any], accepted: bool, autojump_clock: trio.testing.MockClock
) -> None:
    async with ts.open_worker(slow_sim()) as worker:
        if accepted:
            assert await read(worker, {**HELLO, **fields}, ts.RequestContext("pub")) == 5
        else:
            with pytest.raises(ts.InvalidRequest, match="bootstrap_"):
                await read(worker, {**HELLO, **fields}, ts.RequestContext("pub"))


async def test_a_batch_may_give_one_bootstrap_room_per_prompt_each_checked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}
    async with ts.open_worker(slow_sim()) as worker:
        assert await read(worker, {**batch, "bootstrap_room": [1, 2]}, ts.RequestContext("a")) >= 2
        with pytest.raises(ts.InvalidRequest, match="bootstrap_room must be an int"):
            await read(worker, {**batch, "bootstrap_room": [1, -2]}, ts.RequestContext("b"))


# -- outputs ------------------------------------------------------------------------------------


def test_a_child_index_past_the_known_children_gets_a_public_id_of_its_own() -> None:
    from trio_sglang._core._outputs import PublicIds

    ids = PublicIds("pub", ("a", "b"))
    assert [ids.child(i) for i in (0, 1, 2)] == ["a", "b", "pub_2"]


@pytest.mark.parametrize("engine_id", ["", 7, None], ids=["empty", "int", "none"])
def test_a_native_output_without_a_usable_engine_id_is_only_renamed(engine_id: object) -> None:
    from trio_sglang._core._outputs import PublicIds, format_chunk

    out = {"meta_info": {"id": engine_id, "finish_reason": {"message": "abort req.rid=x"}}}
    chunk = format_chunk("native", out, PublicIds("pub"))
    assert chunk["meta_info"] == {"id": "pub", "finish_reason": {"message": "abort req.rid=x"}}


def test_a_text_chunk_of_an_output_without_text_has_empty_text() -> None:
    from trio_sglang._core._outputs import PublicIds, format_chunk

    chunk = format_chunk("text", {"meta_info": {}}, PublicIds("pub"))
    assert chunk["choices"] == [{"index": 0, "text": "", "finish_reason": None}]


# -- the stream, the context and the group ----------------------------------------------------


async def test_a_stream_is_not_closed_before_its_first_pull_nor_between_pulls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        ts.open_worker(slow_sim()) as worker,
        worker.generate(HELLO, ts.RequestContext("pub")) as chunks,
    ):
        assert not chunks.closed
        await chunks.__anext__()
        assert not chunks.closed
        async for _ in chunks:
            pass
        assert chunks.closed


async def test_a_context_keeps_no_hold_on_the_requests_it_outlives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One context per client connection, many requests: a finished one is let go."""
    ctx = ts.RequestContext("connection")
    async with ts.open_worker(slow_sim()) as worker:
        for _ in range(3):
            assert await read(worker, HELLO, ctx) == 5
    assert ctx._scopes == set()


async def test_wait_idle_waits_again_after_the_group_was_idle_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_cleanup_group() as group:
        for _ in range(2):
            group.start_soon(trio.sleep, 1.0)
            started = trio.current_time()
            await group.wait_idle()
            assert trio.current_time() == started + 1.0


# -- a decode request's prefill leg -------------------------------------------------------------


class FailingPeer:
    """A prefill worker whose prefill fails at ``fail_at``; it counts the legs it was given."""

    name = "failing-prefill"
    bootstrap_host = "127.0.0.1"
    bootstrap_port = 8998

    def __init__(self, *, fail_at: float, cancel_anytime: bool = True) -> None:
        self.fail_at = fail_at
        self.cancel_anytime = cancel_anytime
        self.legs = 0

    async def capabilities(self) -> Mapping[str, Any]:
        await trio.lowlevel.checkpoint()
        return {"features": {CANCEL_ANYTIME: self.cancel_anytime}}

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        self.legs += 1
        await trio.sleep_until(self.fail_at)
        raise ts.PrefillFailed("no KV cache for you")


def decode_engine() -> RecordingEngine:
    return RecordingEngine(slow_sim(disaggregation_mode="decode", kv_rooms=ts.SimKVRooms()))


async def test_a_prefill_leg_failing_while_its_request_is_open_is_a_fault_that_says_where(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    engine = decode_engine()
    async with ts.open_worker(engine, prefill=FailingPeer(fail_at=1.0)) as worker:
        with pytest.raises(ts.EngineError, match="the prefill of pub failed"):
            await read(worker, HELLO, ts.RequestContext("pub"))
    (body,) = engine.bodies
    (record,) = fault_records(caplog)
    assert record.getMessage() == (
        f"engine fault prefill_failed: request pub (rids {body['rid']}): the prefill leg at "
        f"failing-prefill (room {body['bootstrap_room']}) failed: "
        "PrefillFailed('no KV cache for you')"
    )


async def test_the_prefill_legs_failure_is_the_cause_of_the_blocks_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with ts.open_worker(decode_engine(), prefill=FailingPeer(fail_at=1.0)) as worker:
        with pytest.raises(ts.EngineError) as raised:
            await read(worker, HELLO, ts.RequestContext("pub"))
    assert isinstance(raised.value.__cause__, ts.PrefillFailed)
    assert raised.value.__suppress_context__


class OwnError(Exception):
    pass


async def test_a_block_that_raises_its_own_error_gets_it_back_not_the_prefills(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The prefill leg failed (at 1.0) and cancelled the block; the body raised first, its own."""

    async def raise_own_error(worker: ts.Worker) -> None:
        async with worker.generate(HELLO, ts.RequestContext("pub")) as chunks:
            with trio.CancelScope(shield=True):  # the pull (it starts the legs) outlives 1.0
                async with trio.open_nursery() as pulling:
                    pulling.start_soon(chunks.__anext__)
                    await trio.sleep(1.5)
                    pulling.cancel_scope.cancel()
            raise OwnError  # no checkpoint since the leg failed: the block's Cancelled never came

    async with ts.open_worker(decode_engine(), prefill=FailingPeer(fail_at=1.0)) as worker:
        with pytest.raises(OwnError):
            await raise_own_error(worker)
    assert trio.current_time() == 1.5


async def test_a_generate_block_is_entered_once(autojump_clock: trio.testing.MockClock) -> None:
    async with ts.open_worker(slow_sim()) as worker:
        block = worker.generate(HELLO, ts.RequestContext("pub"))
        async with block:
            with pytest.raises(RuntimeError, match=r"^a generate\(\) block is entered once$"):
                await block.__aenter__()


async def test_a_prefill_leg_failing_after_its_request_ended_is_no_fault_only_a_debug_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that cannot be cancelled: its leg runs on, bounded, and fails at 1.0 (expected)."""
    caplog.set_level(logging.DEBUG, logger="trio_sglang")
    peer = FailingPeer(fail_at=1.0, cancel_anytime=False)
    async with ts.open_worker(decode_engine(), prefill=peer) as worker:
        with trio.move_on_after(0.5):
            await read(worker, HELLO, ts.RequestContext("pub"))
        await trio.sleep(1.0)
    assert fault_records(caplog) == []
    assert "prefill leg of pub ended with PrefillFailed('no KV cache for you')" in caplog.messages


async def test_a_decode_worker_with_a_peer_decodes_a_routed_request_without_a_leg_of_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """sglang-router ran the prefill: the request carries its bootstrap fields."""
    peer = FailingPeer(fail_at=0.0)
    routed = {**HELLO, "bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 7}
    engine = decode_engine()
    async with ts.open_worker(engine, prefill=peer) as worker:
        with trio.move_on_after(1.0):  # no prefill side runs here: the decode leg waits
            await read(worker, routed, ts.RequestContext("routed"))
    assert peer.legs == 0
    assert engine.bodies[0]["bootstrap_room"] == 7


async def test_the_worker_read_stream_reads_nothing_ahead_of_a_paused_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Back-pressure as if the caller read the engine itself: it pauses from 3.5 to 6.7, and gets
    the one output in the reader's hand, then each sample's backlog as one chunk."""
    n2 = {"text": "hello", "sampling_params": {"n": 2, "max_new_tokens": 6}}
    got: list[tuple[float, int, int]] = []
    async with (
        ts.open_worker(slow_sim()) as worker,
        worker.generate(n2, ts.RequestContext("pub"), output="tokens") as chunks,
    ):
        async for chunk in chunks:
            got.append((trio.current_time(), chunk["index"], len(chunk["token_ids"])))
            if len(got) == 1:
                await trio.sleep(3.2)
    assert [(index, tokens) for time, index, tokens in got if time == 6.7] == [
        (1, 1),
        (0, 3),
        (1, 2),
    ]
