"""The engine-side cleanup of a request its caller left: the one-abort rule, its bounds, and
what it reports (to the log, once per fault, and to the worker's observer)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import HELLO, LONG, Recorder, fault_records, read, slow_sim, unchecked
from trio_sglang._core._cleanup import Cleanup
from trio_sglang._core._cleanup_group import CleanupGroup, open_cleanup_group
from trio_sglang._core._lifecycle import Event, ResponseStream, State
from trio_sglang._core._outputs import PublicIds
from trio_sglang._core._reports import Reports
from trio_sglang._core._shared import shared_by_worker
from trio_sglang._engine import RequestPhase
from trio_sglang.testing import Faults, FaultyEngine

# -- the hand-over after a cancelled pull --------------------------------------------------------


@pytest.mark.mutant_pin
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


# -- the one-abort rule, on an engine whose abort waits behind a forward -------------------------


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
) -> ResponseStream:
    """One request of ``engine``, as a worker runs it once its block is entered."""
    features = engine.features()
    reports = Reports(observer)
    shared = shared_by_worker(
        engine,  # type: ignore[arg-type]
        features,
        ts.AbortPolicy(),
        group,
        reports,
        unchecked,
        None,
        False,
    )
    request = ResponseStream(shared, {}, ts.RequestContext("pub"), "tokens")
    request._start(SlowAbortStream(engine), PublicIds("pub"), rids)
    return request


def cleanup_of(life: ResponseStream) -> Cleanup:
    """The cleanup ``life`` would make if its caller left now, the engine still holding it."""
    return life._cleanup(frozenset())


@asynccontextmanager
async def slow_abort_request(
    engine: SlowAbortEngine, observer: Recorder | None = None
) -> AsyncIterator[ResponseStream]:
    """One request of ``engine``; leaving waits for its cleanup."""
    async with open_cleanup_group() as group:
        yield lifecycle(engine, group, observer=observer)
        await group.wait_idle()


async def cancelled_pull(life: ResponseStream) -> None:
    """The caller's first pull, parked in the engine stream, cancelled there at once."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(life.__anext__)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()


@pytest.mark.mutant_pin
async def test_a_closed_dispatched_request_gets_no_second_abort_while_its_first_is_on_its_way(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The close sent the abort; it takes 3 s, past ``release_timeout``; the cleanup waits it out.

    SGLang honours one abort per request: a second one would only be dropped.
    """
    engine = SlowAbortEngine()
    async with slow_abort_request(engine) as request:
        await cleanup_of(request).stop()
        assert trio.current_time() == 3.0  # it waited for the engine to let go
    assert engine.aborts == []


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
async def test_an_engine_that_does_not_tell_what_it_sent_gets_the_abort_after_release_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Without ``abort_sent_flag`` the worker cannot know the close sent one: it aborts."""
    engine = SlowAbortEngine(abort_sent_flag=False)
    async with slow_abort_request(engine) as request:
        await cleanup_of(request).stop()
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


@pytest.mark.mutant_pin
async def test_each_id_of_a_request_gets_one_ordered_abort_however_often_it_is_asked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first id's abort never takes; asked again after the second id's, it sends no more."""
    engine = StubbornEngine()
    policy = ts.AbortPolicy()
    async with open_cleanup_group() as group:
        cleanup = cleanup_of(lifecycle(engine, group, ("rid-1", "rid-2")))
        await cleanup.ordered_abort("rid-1")
        await cleanup.ordered_abort("rid-2")
        await cleanup.ordered_abort("rid-1")
    assert engine.aborted == ["rid-1"] * policy.abort_attempts + ["rid-2"]


# -- the state table, on a request built by hand -------------------------------------------------


@pytest.mark.mutant_pin
def test_a_move_the_state_table_does_not_list_is_refused_by_name() -> None:
    """A bug in the lifecycle shows at once, naming the event and the state."""
    request = lifecycle(SlowAbortEngine(), CleanupGroup())
    with pytest.raises(AssertionError, match=r"^the engine side stopped in state new$"):
        request._fire(Event.STOPPED)
    assert request.state is State.NEW


# -- what a cleanup reports ----------------------------------------------------------------------


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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
