"""The lifecycle matrix: every way of leaving x every phase x every output mode.

Each case runs one request on a ``SimEngine`` under trio's ``MockClock`` (one
whose close releases the request, as SGLang 0.5.23's does, and one whose close
frees nothing, so the worker must wait for dispatch and abort) and is judged
from the engine's trace: the caller's block ends at the clock time of
the cancel, the engine holds nothing afterwards, no abort is lost or sent
before dispatch, at most one token is decoded after the cancel, and the
caller never sees the internal rid.

Timeline (seconds after the block is entered; the consumer first works for
1 s, then iterates): registered at 1, tokenizing until 2, dispatched at 2.5,
tokens at 3.5, 4.5, 5.5, 6.5 and 7.5 (the last one finishes the request).
The consumer spends 0.8 s on each chunk, so a mid-stream cancel at 5.0 finds
it in its own code, not inside a pull: only the worker's detached cleanup can
stop the engine then (a cancel between pulls never reaches SGLang's generator).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

import trio_sglang as ts
from conftest import finish_reason, slow_sim

PRE_WORK = 1.0
SEND_TIME = 0.8
METHODS = ["stop", "kill", "break", "aclose", "consumer_cancelled", "worker_shutdown"]
PHASES = ["before_registration", "tokenizing", "dispatched", "mid_stream", "after_finish"]
OUTPUTS: list[ts.OutputMode] = ["tokens", "text", "native"]

#: When the cancel lands, for methods driven from outside the consumer.
CANCEL_AT = {
    "before_registration": 0.5,
    "tokenizing": 1.5,
    "dispatched": 3.0,
    "mid_stream": 5.0,
    "after_finish": 9.0,
}
#: The engine events each phase must leave, in order.
EXPECTED_KINDS: dict[str, list[str]] = {
    "before_registration": [],
    "tokenizing": ["registered", "released"],
    "dispatched": ["registered", "dispatched", "abort_requested", "abort_applied"],
    "mid_stream": [
        "registered",
        "dispatched",
        "token",
        "token",
        "abort_requested",
        "abort_applied",
    ],
    "after_finish": ["registered", "dispatched", *["token"] * 5, "finished"],
}


@dataclass
class Consumer:
    """What the consumer saw."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    left_at: float | None = None
    raised: BaseException | None = None


def cancel_time(method: str, phase: str) -> float:
    """When the stream must close; consumer-driven exits act on what they receive."""
    if method in ("break", "aclose") and phase == "mid_stream":
        return 4.5  # right after the second chunk
    if method == "break" and phase == "after_finish":
        return 7.5  # right after the final chunk, before StopAsyncIteration
    return CANCEL_AT[phase]


async def consume(
    worker: ts.Worker,
    ctx: ts.RequestContext,
    output: ts.OutputMode,
    method: str,
    phase: str,
    t0: float,
    seen: Consumer,
    streams: list[ts.ResponseStream],
) -> None:
    request: dict[str, Any] = {"text": "tell me a story", "sampling_params": {"max_new_tokens": 5}}
    if output == "native":
        request["rid"] = "caller-rid-7"  # the caller's rid wins over the context id
    at = t0 + cancel_time(method, phase)
    try:
        async with worker.generate(request, ctx, output=output) as chunks:
            streams.append(chunks)
            if phase == "before_registration" and method in ("break", "aclose"):
                await trio.sleep_until(at)
                if method == "aclose":
                    await chunks.aclose()
                    seen.chunks.extend([c async for c in chunks])
                seen.left_at = trio.current_time()
                return
            await trio.sleep(PRE_WORK)
            if method == "break" and phase in ("tokenizing", "dispatched"):
                with trio.move_on_at(at):  # the consumer gives up waiting, then leaves
                    seen.chunks.append(await chunks.__anext__())
                seen.left_at = trio.current_time()
                return
            async for chunk in chunks:
                seen.chunks.append(chunk)
                if phase == "mid_stream" and len(seen.chunks) == 2:
                    if method == "break":
                        break
                    if method == "aclose":
                        await chunks.aclose()
                        continue
                if method == "break" and finish_reason(chunk, output) is not None:
                    break
                # Work between chunks (a slow client): a mid-stream cancel at 5.0
                # lands here, with the engine stream parked between items.
                await trio.sleep(SEND_TIME)
            if method == "aclose" and phase == "after_finish":
                await trio.sleep_until(at)
                await chunks.aclose()
            elif method != "break" and method != "aclose":
                await trio.sleep(100)  # stays in the block until cancelled
    except ts.EngineShutdown as exc:
        seen.raised = exc
    finally:  # also when the consumer's task is cancelled
        if seen.left_at is None:
            seen.left_at = trio.current_time()


async def run_case(
    method: str, phase: str, output: ts.OutputMode, release: bool
) -> tuple[ts.SimEngine, Consumer, float]:
    engine = slow_sim(release_on_close=release)
    ctx = ts.RequestContext("ctx-public-1")
    seen = Consumer()
    streams: list[ts.ResponseStream] = []
    t0 = trio.current_time()
    at = t0 + cancel_time(method, phase)
    async with trio.open_nursery() as outer:
        # The grace lets a no-release engine reach dispatch, so the abort can follow.
        async with ts.open_worker(engine, policy=ts.AbortPolicy(shutdown_grace=5.0)) as worker:
            with trio.CancelScope() as consumer_scope:
                async with trio.open_nursery() as nursery:
                    task_nursery = outer if method == "worker_shutdown" else nursery
                    task_nursery.start_soon(
                        consume, worker, ctx, output, method, phase, t0, seen, streams
                    )
                    await trio.sleep_until(at)
                    if method == "stop":
                        ctx.stop()
                    elif method == "kill":
                        ctx.kill()
                    elif method == "aclose" and phase in ("tokenizing", "dispatched"):
                        await streams[0].aclose()  # from another task, mid-pull
                    elif method == "consumer_cancelled":
                        consumer_scope.cancel()
            # worker_shutdown: leaving the worker here, at `at`
        if method == "worker_shutdown":
            assert seen.left_at == at
            assert isinstance(seen.raised, ts.EngineShutdown)
        await trio.testing.wait_all_tasks_blocked()
        assert worker.open_streams == 0
        assert worker.pending_cleanups == 0
    return engine, seen, at


def check_public_ids(seen: Consumer, output: str, internal: set[str]) -> None:
    public = "caller-rid-7" if output == "native" else "ctx-public-1"
    for chunk in seen.chunks:
        assert not any(rid in repr(chunk) for rid in internal), chunk
        if output == "tokens":
            assert set(chunk) == {"index", "token_ids", "finish_reason"}
        elif output == "text":
            assert chunk["id"] == public
        else:
            assert chunk["meta_info"]["id"] == public


@pytest.mark.parametrize("release", [True, False], ids=["release-on-close", "no-release"])
@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("method", METHODS)
async def test_cancel_matrix(
    method: str, phase: str, output: str, release: bool, autojump_clock: trio.testing.MockClock
) -> None:
    engine, seen, at = await run_case(method, phase, output, release)
    trace = engine.trace
    rids = {event.rid for event in trace}

    # The caller's stream closed at the clock time of the cancel.
    assert seen.left_at == at
    if method != "worker_shutdown":
        assert seen.raised is None

    # The engine holds nothing, and saw exactly what this phase allows.
    assert engine.live_rids() == set()
    assert len(rids) <= 1
    expected = EXPECTED_KINDS[phase]
    if phase == "tokenizing" and not release:  # kept running until dispatch, then aborted
        expected = EXPECTED_KINDS["dispatched"]
    assert [event.kind for event in trace] == expected

    for rid in rids:
        events = trace.of(rid)
        kinds = [event.kind for event in events]
        assert "abort_lost" not in kinds
        if "abort_requested" in kinds:
            assert kinds.index("dispatched") < kinds.index("abort_requested")
            # the abort went out at the cancel, or right at a later dispatch
            dispatched = next(e.time for e in events if e.kind == "dispatched")
            aborted = next(e.time for e in events if e.kind == "abort_requested")
            assert aborted == max(at, dispatched)
        if phase != "after_finish":
            assert [e for e in events if e.kind == "token" and e.time > at] == []
        if phase == "tokenizing" and release:
            assert next(e.time for e in events if e.kind == "released") == at
    check_public_ids(seen, output, rids)
    expected_chunks = {"mid_stream": 2, "after_finish": 5}.get(phase, 0)
    assert len(seen.chunks) == expected_chunks


# -- a scope inside the block cancels a pull, and the block stays open ----------------

#: Request shapes, and whether the engine's close releases them; each takes another path
#: (the caller's own pull, the worker's reader, or a decode leg beside its prefill leg)
#: through the lifecycle.
PULL_PATHS: dict[str, tuple[dict[str, Any], bool]] = {
    "one prompt": ({}, True),
    "native batch": ({"text": ["once upon", "a time"]}, True),
    "parallel sampling": ({"sampling_params": {"max_new_tokens": 5, "n": 2}}, True),
    "no release on close": ({}, False),
    "disaggregated": ({}, True),
}
#: With ``slow_sim``: registered at 0, dispatched at 1.5, tokens at 2.5, 3.5, ...
PULL_CANCELS = {"tokenizing": 1.0, "before the first token": 2.0, "mid-stream": 3.0}


@asynccontextmanager
async def engines_and_worker(path: str) -> AsyncIterator[tuple[list[ts.SimEngine], ts.Worker]]:
    """The worker of ``path``, and every engine its requests reach."""
    _, release = PULL_PATHS[path]
    if path != "disaggregated":
        engine = slow_sim(release_on_close=release)
        async with ts.open_worker(engine) as worker:
            yield [engine], worker
        return
    rooms = ts.SimKVRooms()
    prefill = slow_sim(disaggregation_mode="prefill", kv_rooms=rooms)
    decode = slow_sim(disaggregation_mode="decode", kv_rooms=rooms)
    async with ts.open_worker(prefill) as prefill_worker:
        peer = ts.InProcessPrefill(prefill_worker)
        async with ts.open_worker(decode, prefill=peer) as worker:
            yield [prefill, decode], worker


@pytest.mark.parametrize("moment", PULL_CANCELS, ids=str)
@pytest.mark.parametrize("path", PULL_PATHS, ids=str)
async def test_a_pull_cancelled_inside_the_block_stops_the_engine_then_not_at_block_exit(
    path: str, moment: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A timeout around the ``async for``, and the block goes on: the engine stops at the timeout.

    The stream cannot resume after a cancelled pull, so its cleanup starts at
    that moment, whoever reads the engine stream (and a decode request's
    prefill leg stops with it); it does not wait for the block to end, which
    may be much later.
    """
    fields, release = PULL_PATHS[path]
    cancel_at = PULL_CANCELS[moment]
    request = {"text": "tell me a story", "sampling_params": {"max_new_tokens": 5}, **fields}
    async with (
        engines_and_worker(path) as (engines, worker),
        worker.generate(request, ts.RequestContext("timed-out"), output="tokens") as chunks,
    ):
        with trio.move_on_at(cancel_at):
            async for _ in chunks:
                pass
        assert chunks.closed
        # An engine that cannot release waits for the dispatch (1.5), then aborts.
        stop_at = cancel_at if release else max(cancel_at, 1.5)
        await trio.sleep_until(stop_at)
        await trio.testing.wait_all_tasks_blocked()
        for engine in engines:
            assert engine.live_rids() == set()  # stopped while the block is still open
        assert trio.current_time() == stop_at
        await trio.sleep(10)
    for engine in engines:
        # What the cancel ended (n > 1 releases SGLang's rid_i placeholders earlier, by itself),
        # at the engine the tokens come from; a prefill leg may have finished before it.
        ended = {e.time for e in engine.trace if e.kind in ("released", "abort_applied")}
        ended_by_cancel = {time for time in ended if time >= cancel_at}
        assert (
            ended_by_cancel == {stop_at} if engine is engines[-1] else ended_by_cancel <= {stop_at}
        )
        assert [e for e in engine.trace if e.kind == "token" and e.time > cancel_at] == []
