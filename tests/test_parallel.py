"""Parallel sampling and native batches: every child stops, only public ids are seen.

Each shape first runs uncancelled on a fresh ``SimEngine`` (MockClock), which
must complete every child; its trace then gives the phase boundaries, and the
same request is cancelled once per phase, on an engine whose close releases
every child (SGLang 0.5.23) and on one whose close releases nothing (the
fail-closed path: abort what was seen, keep watching, abort what appears).
Each run is judged from the engine's trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import finish_reason, read, slow_sim
from trio_sglang.testing import Faults, FaultyEngine

CTX_ID = "chatcmpl-par"
PRE_WORK = 1.0
#: On a no-release engine the cleanup reads on for 10 s after the cancel, to abort late children.
POLICY = ts.AbortPolicy(child_watch_timeout=10.0)


@dataclass(frozen=True)
class Shape:
    name: str
    request: dict[str, Any]
    public_children: tuple[str, ...]


def shape(name: str, prompts: int | None, n: int, rids: list[str] | None = None) -> Shape:
    text: str | list[str] = (
        "one prompt" if prompts is None else [f"prompt {i}" for i in range(prompts)]
    )
    request: dict[str, Any] = {"text": text, "sampling_params": {"n": n, "max_new_tokens": 3}}
    if prompts is not None:  # prompts finish at different times
        request["sampling_params"] = [{"n": n, "max_new_tokens": 2 + i} for i in range(prompts)]
    if rids is not None:
        request["rid"] = rids
        children = tuple(r if n == 1 else f"{r}_{j}" for r in rids for j in range(n))
    else:
        children = tuple(f"{CTX_ID}_{k}" for k in range((prompts or 1) * n))
    return Shape(name, request, children)


SHAPES = [
    shape("n2", None, 2),
    shape("n3", None, 3),
    shape("n4", None, 4),
    shape("batch2", 2, 1),
    shape("batch3-rids", 3, 1, ["a", "b", "c"]),
    shape("batch2xn2", 2, 2),
    shape("batch2xn2-rids", 2, 2, ["x", "y"]),
]
PHASES = [
    "before_registration",
    "tokenizing",
    "dispatching",  # some children dispatched, others not (or the n > 1 warm-up)
    "before_first_token",
    "some_finished",
    "after_finish",
]


def times(engine: ts.SimEngine, kind: str) -> list[float]:
    return sorted(e.time for e in engine.trace if e.kind == kind)


def cancel_offsets(engine: ts.SimEngine, t0: float) -> dict[str, float]:
    """Phase -> a cancel time strictly inside it (seconds after ``t0``), from an uncancelled run."""
    registered = min(times(engine, "registered"))
    dispatched = times(engine, "dispatched")
    first_token = min(times(engine, "token"))
    finished = times(engine, "finished")
    children_finished = [t for t in finished if t > first_token]  # not the n > 1 warm-up
    at = {
        "before_registration": t0 + PRE_WORK / 2,
        "tokenizing": registered + 0.25,
        "dispatching": dispatched[-1] - 0.25,
        "before_first_token": (dispatched[-1] + first_token) / 2,
        "some_finished": children_finished[0] + 0.25,
        "after_finish": finished[-1] + 1.0,
    }
    return {phase: t - t0 for phase, t in at.items()}


@dataclass
class Run:
    engine: ts.SimEngine
    t0: float
    chunks: list[dict[str, Any]]
    left_at: float | None = None


async def run(s: Shape, output: ts.OutputMode, release: bool, cancel_after: float | None) -> Run:
    """One request; its consumer's task is cancelled ``cancel_after`` seconds in."""
    result = Run(slow_sim(release_on_close=release), trio.current_time(), [])
    async with ts.open_worker(result.engine, policy=POLICY) as worker:
        async with trio.open_nursery() as nursery:

            async def consumer() -> None:
                ctx = ts.RequestContext(CTX_ID)
                try:
                    async with worker.generate(s.request, ctx, output=output) as stream:
                        await trio.sleep(PRE_WORK)
                        async for chunk in stream:
                            result.chunks.append(chunk)
                        await trio.sleep(100)  # stays in the block until cancelled
                finally:
                    result.left_at = trio.current_time()

            nursery.start_soon(consumer)
            await trio.sleep(50 if cancel_after is None else cancel_after)
            nursery.cancel_scope.cancel()
        await trio.sleep(30)  # past every child's natural end
        assert worker.pending_cleanups == 0
    return result


def check_public(s: Shape, output: str, result: Run) -> None:
    engine_ids = {e.rid for e in result.engine.trace}
    for chunk in result.chunks:
        assert not any(rid in repr(chunk) for rid in engine_ids), chunk
        if output == "native":
            assert chunk["meta_info"]["id"] in s.public_children
        elif output == "text":
            assert chunk["id"] == CTX_ID
            assert 0 <= chunk["choices"][0]["index"] < len(s.public_children)
        else:
            assert 0 <= chunk["index"] < len(s.public_children)


@pytest.mark.parametrize("output", ["tokens", "text", "native"])
@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.name)
async def test_uncancelled_run_completes_every_child(
    s: Shape, output: ts.OutputMode, autojump_clock: trio.testing.MockClock
) -> None:
    result = await run(s, output, True, None)
    trace = result.engine.trace
    children = [e.rid for e in trace if e.kind == "token"]
    finished = {e.rid for e in trace if e.kind == "finished"} & set(children)
    assert len(finished) == len(s.public_children)
    assert not [e for e in trace if e.kind.startswith("abort")]
    finals = [
        c
        for c in result.chunks
        if finish_reason(c, output) == "length"
        or (output == "native" and c["meta_info"]["finish_reason"] is not None)
    ]
    assert len(finals) == len(s.public_children)
    if output == "native":
        assert {c["meta_info"]["id"] for c in result.chunks} == set(s.public_children)
    check_public(s, output, result)


@pytest.mark.parametrize("release", [True, False], ids=["release-on-close", "no-release"])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.name)
async def test_cancel_stops_every_child(
    s: Shape, phase: str, release: bool, autojump_clock: trio.testing.MockClock
) -> None:
    dry = await run(s, "native", True, None)
    offset = cancel_offsets(dry.engine, dry.t0)[phase]
    result = await run(s, "native", release, offset)
    at = result.t0 + offset
    trace = result.engine.trace

    assert result.left_at == at  # the caller's stream closed at the cancel
    assert result.engine.live_rids() == set()
    assert "abort_lost" not in [e.kind for e in trace]
    for rid in {e.rid for e in trace}:
        events = trace.of(rid)
        kinds = [e.kind for e in events]
        if "abort_requested" in kinds:
            assert kinds.index("dispatched") < kinds.index("abort_requested")
            assert "finished" not in kinds  # a finished child is never aborted
        late_tokens = [e for e in events if e.kind == "token" and e.time > at]
        # Released at once, or (no release) aborted on dispatch or on first sight.
        assert len(late_tokens) <= (0 if release else 1)
    check_public(s, "native", result)
    if phase == "before_registration":
        assert list(trace) == []


async def test_batch_with_n_is_refused_where_the_engine_cannot_run_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = slow_sim(release_on_close=True)
    engine = FaultyEngine(sim, features={"batch_parallel_sampling": False})
    request = {"text": ["a", "b"], "sampling_params": {"n": 2}}
    async with ts.open_worker(engine) as worker:
        with pytest.raises(ts.InvalidRequest, match="native batch"):
            async with worker.generate(request, ts.RequestContext(CTX_ID)):
                pytest.fail("unreachable")
        assert worker.capabilities()["features"]["batch_parallel_sampling_v1"] is False
    assert list(sim.trace) == []


@pytest.mark.parametrize("release", [True, False], ids=["release-on-close", "no-release"])
async def test_breaking_out_after_the_first_child_speaks_stops_the_others(
    release: bool, autojump_clock: trio.testing.MockClock
) -> None:
    engine = slow_sim(release_on_close=release)
    async with ts.open_worker(engine, policy=POLICY) as worker:
        async with worker.generate(SHAPES[2].request, ts.RequestContext(CTX_ID)) as stream:
            async for chunk in stream:
                assert chunk["choices"][0]["index"] == 0
                break
        left = trio.current_time()
        await trio.sleep(30)
    assert engine.live_rids() == set()
    for rid in {e.rid for e in engine.trace}:
        late = [e for e in engine.trace.of(rid) if e.kind == "token" and e.time > left]
        assert len(late) <= (0 if release else 1)


async def drain_until_shutdown(worker: ts.Worker, raised: list[BaseException]) -> None:
    """Read a parallel stream; record the EngineShutdown that must end it."""
    try:
        await read(worker, SHAPES[1].request, ts.RequestContext(CTX_ID))
    except ts.EngineShutdown as exc:
        raised.append(exc)


async def test_shutdown_ends_a_parallel_stream_and_stops_its_children(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim(release_on_close=True)
    raised: list[BaseException] = []
    async with trio.open_nursery() as outer, ts.open_worker(engine) as worker:
        outer.start_soon(drain_until_shutdown, worker, raised)
        await trio.sleep(5.0)  # mid-stream
    assert len(raised) == 1
    assert engine.live_rids() == set()


async def test_an_engine_error_reaches_a_parallel_stream_and_its_children_stop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = slow_sim(release_on_close=True)
    engine = FaultyEngine(sim, Faults(stream_error_after=2))
    async with ts.open_worker(engine) as worker:
        with pytest.raises(ts.EngineError, match="RuntimeError"):
            await read(worker, SHAPES[1].request, ts.RequestContext(CTX_ID))
        await trio.testing.wait_all_tasks_blocked()
        assert worker.pending_cleanups == 0
    assert sim.live_rids() == set()
    assert "abort_applied" in [e.kind for e in sim.trace]


async def test_a_worker_cancelled_from_outside_ends_outside_streams_with_engine_shutdown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = slow_sim(release_on_close=True)
    raised: list[BaseException] = []
    async with trio.open_nursery() as outer:
        with trio.CancelScope() as scope:
            async with ts.open_worker(engine) as worker:
                outer.start_soon(drain_until_shutdown, worker, raised)
                await trio.sleep(5.0)  # mid-stream
                scope.cancel()
                await trio.sleep_forever()
    assert len(raised) == 1
    assert engine.live_rids() == set()
