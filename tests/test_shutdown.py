"""The worker's shutdown: open streams get their grace, a close in progress its own bound, and
what a stream outliving the worker is told."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import LONG, RecordingEngine, fault_records, read, slow_sim
from trio_sglang.testing import Faults, FaultyEngine

# -- the shutdown's bounds, and what it tells ----------------------------------------------------


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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


@pytest.mark.mutant_pin
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
