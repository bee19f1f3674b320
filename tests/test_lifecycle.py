"""Lifecycle behaviour beyond the matrix: fallbacks, faults, shutdown order, sharing."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import HELLO, LONG, Recorder, read, slow_sim
from trio_sglang.testing import AbortFault, Faults, FaultyEngine

#: On ``slow_sim()``: registered at 0, dispatched at 1.5, tokens at 2.5, 3.5, ..., 6.5.
REQUEST: dict[str, Any] = {"text": "hello there", "sampling_params": {"max_new_tokens": 5}}


async def stream_until(
    worker: ts.Worker, ctx: ts.RequestContext, *, chunks: int, then: Callable[[], Awaitable[None]]
) -> float:
    """Read ``chunks`` chunks, run ``then``, leave, and return when the block was left."""
    async with worker.generate(REQUEST, ctx) as stream:
        async for _ in stream:
            chunks -= 1
            if chunks == 0:
                await then()
                break
    return trio.current_time()


async def read_one_chunk(worker: ts.Worker, ctx: ts.RequestContext) -> float:
    return await stream_until(worker, ctx, chunks=1, then=trio.lowlevel.checkpoint)


def only_rid(engine: ts.SimEngine) -> str:
    (rid,) = {event.rid for event in engine.trace}
    return rid


async def test_stopped_context_never_reaches_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim()
    ctx = ts.RequestContext("gone-before-start")
    ctx.kill()
    async with ts.open_worker(engine) as worker:
        async with worker.generate(REQUEST, ctx) as stream:
            async for _ in stream:
                pytest.fail("a killed context must not stream")
        assert stream.closed
    assert engine.trace == []


async def test_one_context_stops_every_stream_it_opened(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim()
    ctx = ts.RequestContext("shared")
    left: list[float] = []

    async def one() -> None:
        async with worker.generate(REQUEST, ctx) as stream:
            async for _ in stream:
                pass
        left.append(trio.current_time())

    async with ts.open_worker(engine) as worker, trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
        await trio.sleep(3.0)
        ctx.stop()
    assert left == [3.0, 3.0]
    assert ctx.stopped
    assert not ctx.killed
    assert engine.live_rids() == set()
    assert [e.kind for e in engine.trace].count("abort_applied") == 2


async def test_other_requests_keep_streaming_while_one_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim()
    contexts = [ts.RequestContext(f"r{i}") for i in range(10)]
    got: dict[str, int] = {}

    async def one(ctx: ts.RequestContext) -> None:
        got[ctx.id] = 0
        async with worker.generate(REQUEST, ctx, output="tokens") as stream:
            async for _ in stream:
                got[ctx.id] += 1

    async with ts.open_worker(engine) as worker, trio.open_nursery() as nursery:
        for ctx in contexts:
            nursery.start_soon(one, ctx)
        await trio.sleep(3.0)
        for ctx in contexts[::2]:
            ctx.kill()
    assert got == {ctx.id: 1 if i % 2 == 0 else 5 for i, ctx in enumerate(contexts)}
    kinds = [e.kind for e in engine.trace]
    assert kinds.count("finished") == 5
    assert kinds.count("abort_applied") == 5
    assert engine.live_rids() == set()


async def test_an_error_in_the_body_aborts_and_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim()

    async def fail() -> None:
        raise KeyError("client bug")

    async with ts.open_worker(engine) as worker:
        with pytest.raises(KeyError, match="client bug"):
            await stream_until(worker, ts.RequestContext("c"), chunks=2, then=fail)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.live_rids() == set()
        assert engine.trace.kinds(only_rid(engine))[-2:] == ["abort_requested", "abort_applied"]


async def test_an_engine_error_mid_stream_reaches_the_caller_and_still_stops_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = slow_sim()
    engine = FaultyEngine(sim, Faults(stream_error_after=2))
    async with ts.open_worker(engine) as worker:
        with pytest.raises(ts.EngineError, match=r"generating c \(RuntimeError\)") as raised:
            await stream_until(worker, ts.RequestContext("c"), chunks=5, then=pytest.fail)
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert trio.current_time() == 3.5
        await trio.testing.wait_all_tasks_blocked()
        assert sim.live_rids() == set()
        assert sim.trace.kinds(only_rid(sim))[-2:] == [
            "abort_requested",
            "abort_applied",
        ]


@pytest.mark.mutant_pin
async def test_a_caller_busy_while_the_reader_stops_a_failed_stream_still_gets_the_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The reader (no release on close) meets the engine's error, stops the request, and its
    cleanup is over before the caller pulls again: that pull still raises the error, and the
    caller's leaving, with the cleanup gone, owes nothing more."""
    sim = slow_sim(release_on_close=False)
    engine = FaultyEngine(sim, Faults(stream_error_after=1))
    async with ts.open_worker(engine) as worker:
        async with worker.generate(HELLO, ts.RequestContext("busy"), output="tokens") as chunks:
            await chunks.__anext__()
            await trio.sleep(30)  # the stream fails; the reader stops it and its cleanup ends
            assert (worker.pending_cleanups, sim.live_rids()) == (0, set())
            with pytest.raises(ts.EngineError, match=r"generating busy \(RuntimeError\)"):
                await chunks.__anext__()
        assert worker.pending_cleanups == 0
    assert sim.trace.kinds(only_rid(sim))[-2:] == ["abort_requested", "abort_applied"]


async def test_an_abort_that_raises_is_retried_and_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # No release path: only the worker's abort (at once: it is dispatched) can
    # stop the request.
    sim = slow_sim(release_on_close=False)
    engine = FaultyEngine(sim, Faults(abort="raise", abort_failures=1))
    policy = ts.AbortPolicy(release_timeout=0.5, abort_retry_delay=0.25)
    async with ts.open_worker(engine, policy=policy) as worker:
        left = await read_one_chunk(worker, ts.RequestContext("pub-1"))
        await trio.sleep(5)
    assert left == 2.5  # the stream closed at once
    # the first abort raised, the retry took
    assert [time for time, _ in engine.aborts] == [2.5, 2.75]
    assert sim.live_rids() == set()
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.WARNING
    assert "abort_error" in record.getMessage()
    assert "after 1 failed abort attempt(s)" in record.getMessage()
    assert "pub-1" in record.getMessage()
    assert only_rid(sim) in record.getMessage()


@pytest.mark.parametrize("mode", ["raise", "ignore"])
async def test_retries_are_bounded_when_the_abort_never_takes(
    mode: AbortFault, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    sim = slow_sim(release_on_close=False)
    engine = FaultyEngine(sim, Faults(abort=mode))
    policy = ts.AbortPolicy(release_timeout=0.5, abort_retry_delay=0.25, abort_attempts=3)
    async with ts.open_worker(engine, policy=policy) as worker:
        left = await read_one_chunk(worker, ts.RequestContext("pub-2"))
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(10)
        assert worker.pending_cleanups == 0
    assert left == 2.5
    if mode == "raise":
        assert [time for time, _ in engine.aborts] == [2.5, 2.75, 3.0]
    else:  # each attempt waits release_timeout for the abort to take
        assert [time for time, _ in engine.aborts] == [2.5, 3.25, 4.0]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "after 3 abort attempts" in errors[0].getMessage()
    assert "pub-2" in errors[0].getMessage()
    # The engine was never able to stop it: it ran to its natural end.
    assert sim.trace.kinds(only_rid(sim))[-1] == "finished"


async def test_without_release_on_close_the_abort_follows_the_dispatch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The engine's close frees nothing, and an abort during tokenization would
    # be lost: the worker keeps the generator running (in its own task) until
    # the request is dispatched, and aborts at that very moment (woken, not
    # polled). The caller's stream still closes at the cancel.
    engine = slow_sim(release_on_close=False)
    async with ts.open_worker(engine) as worker:
        with trio.move_on_after(0.5):
            await read_one_chunk(worker, ts.RequestContext("cancelled-while-tokenizing"))
        assert trio.current_time() == 0.5
        await trio.sleep(5)
        assert worker.pending_cleanups == 0
    events = engine.trace.of(only_rid(engine))
    assert [(e.time, e.kind) for e in events] == [
        (0.0, "registered"),
        (1.5, "dispatched"),
        (1.5, "abort_requested"),
        (1.5, "abort_applied"),
    ]


async def test_shutdown_cancels_pending_cleanup_before_the_engine_closes(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    pending_at_close: list[int] = []

    class WatchedClose(FaultyEngine):
        @asynccontextmanager
        async def running(self) -> AsyncIterator[None]:
            async with super().running():
                try:
                    yield
                finally:
                    pending_at_close.append(worker.pending_cleanups)

    engine = WatchedClose(slow_sim(release_on_close=False), Faults(abort="ignore"))
    policy = ts.AbortPolicy(release_timeout=2.0, shutdown_grace=1.0)
    async with ts.open_worker(engine, policy=policy) as worker:
        async with trio.open_nursery() as nursery:
            for i in range(100):
                ctx = ts.RequestContext(f"r{i}")
                nursery.start_soon(read_one_chunk, worker, ctx)
        await trio.sleep(1.0)
        assert worker.pending_cleanups == 100
        exit_started = trio.current_time()
    assert engine.closed_at == exit_started + policy.shutdown_grace
    assert pending_at_close == [0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "100 engine-side cleanups were still running after the 1.0s shutdown grace "
        "and were cancelled; the engine closes with them"
    ]


async def test_end_grace_cancels_pending_cleanup_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A second signal's "now": the grace ends when asked, not when it runs out."""
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(abort="ignore"))
    policy = ts.AbortPolicy(release_timeout=30.0, shutdown_grace=60.0)
    async with trio.open_nursery() as nursery, ts.open_worker(engine, policy=policy) as worker:
        await read_one_chunk(worker, ts.RequestContext("r"))
        assert worker.pending_cleanups == 1  # its abort is ignored: it waits 30 s
        exit_started = trio.current_time()

        async def second_signal() -> None:
            await trio.sleep(2.0)
            worker.end_grace()

        nursery.start_soon(second_signal)
    assert engine.closed_at == exit_started + 2.0
    assert worker.pending_cleanups == 0


async def test_end_grace_before_the_shutdown_leaves_no_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(abort="ignore"))
    policy = ts.AbortPolicy(release_timeout=30.0, shutdown_grace=60.0)
    async with ts.open_worker(engine, policy=policy) as worker:
        await read_one_chunk(worker, ts.RequestContext("r"))
        worker.end_grace()
        exit_started = trio.current_time()
    assert engine.closed_at == exit_started


async def test_an_engine_that_does_not_close_is_left_behind(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Leaving the worker always finishes: the engine's close is bounded, and logged past it."""

    class StuckClose(FaultyEngine):
        @asynccontextmanager
        async def running(self) -> AsyncIterator[None]:
            async with super().running():
                yield
                await trio.sleep_forever()  # its close never returns by itself

    engine = StuckClose(slow_sim(), Faults())
    policy = ts.AbortPolicy(engine_close_timeout=3.0)
    async with ts.open_worker(engine, policy=policy):
        exit_started = trio.current_time()
    assert trio.current_time() == exit_started + 3.0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["the engine did not close within 3.0s (engine_close_timeout); left it behind"]

    # What the block raised still comes out (in the engine's nursery's group), though
    # the close was cut short after it.
    class StuckEvenOnError(FaultyEngine):
        @asynccontextmanager
        async def running(self) -> AsyncIterator[None]:
            async with super().running():
                try:
                    yield
                finally:
                    await trio.sleep_forever()  # the stuck close under test

    came_out = False
    try:
        async with ts.open_worker(StuckEvenOnError(slow_sim(), Faults()), policy=policy):
            raise KeyError("raised in the block")
    except* KeyError:
        came_out = True
    assert came_out


async def test_shutdown_is_immediate_when_nothing_is_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim()
    async with ts.open_worker(engine) as worker:
        await stream_until(worker, ts.RequestContext("a"), chunks=5, then=trio.lowlevel.checkpoint)
        before = trio.current_time()
    assert trio.current_time() == before


async def test_generate_after_shutdown_raises_engine_shutdown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim()
    async with ts.open_worker(engine) as worker:
        pass
    with pytest.raises(ts.EngineShutdown):
        async with worker.generate(REQUEST, ts.RequestContext("late")):
            pytest.fail("unreachable")
    assert engine.trace == []


async def test_open_worker_rejects_a_policy_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="AbortPolicy"):
        async with ts.open_worker(ts.SimEngine(), policy={"close_timeout": 1}):  # type: ignore[arg-type]
            pass


async def test_aclose_from_another_task_ends_a_pull_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim()

    async def watchdog(stream: ts.ResponseStream) -> None:
        await trio.sleep(2.0)
        await stream.aclose()

    async with ts.open_worker(engine) as worker:
        async with (
            worker.generate(REQUEST, ts.RequestContext("w")) as stream,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(watchdog, stream)
            async for _ in stream:
                pytest.fail("closed before the first token")
        assert trio.current_time() == 2.0
        await trio.testing.wait_all_tasks_blocked()
        assert engine.trace.kinds(only_rid(engine)) == [
            "registered",
            "dispatched",
            "abort_requested",
            "abort_applied",
        ]


# -- the caller's block and stream ---------------------------------------------------------------


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
async def test_a_generate_block_is_entered_once(autojump_clock: trio.testing.MockClock) -> None:
    async with ts.open_worker(slow_sim()) as worker:
        block = worker.generate(HELLO, ts.RequestContext("pub"))
        async with block:
            with pytest.raises(RuntimeError, match=r"^a generate\(\) block is entered once$"):
                await block.__aenter__()


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
async def test_a_context_keeps_no_hold_on_the_requests_it_outlives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One context per client connection, many requests: a finished one is let go."""
    ctx = ts.RequestContext("connection")
    async with ts.open_worker(slow_sim()) as worker:
        for _ in range(3):
            assert await read(worker, HELLO, ctx) == 5
    assert ctx._scopes == set()


# -- the worker's reader -------------------------------------------------------------------------


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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
