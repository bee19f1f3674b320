"""Injected engine faults, through ``trio_sglang.testing.FaultyEngine``.

For every fault the issue names, one run on MockClock checks all of it: the
caller gets a clear error (``EngineError``) or a stream that closed when it
left; the cleanup ends at the time the policy's bounds give; a healthy
request beside the faulty one, and another after it, are served in full; the
fault is logged once, with the public id and the internal rid; and the
worker's observer (the server's metrics) counts it once.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import trio_sglang as ts
from _readme import readme_block
from conftest import Recorder, RecordingEngine, fault_records, read, slow_sim
from trio_sglang.server import ServerMetrics, serve
from trio_sglang.testing import Faults, FaultyEngine

FAULTY: dict[str, Any] = {"text": "faulty", "sampling_params": {"max_new_tokens": 50}}
HEALTHY: dict[str, Any] = {"text": "healthy", "sampling_params": {"max_new_tokens": 5}}

#: Short bounds, so that each one shows in the cleanup's duration.
POLICY = ts.AbortPolicy(
    close_timeout=0.5,
    release_timeout=0.5,
    dispatch_timeout=2.0,
    abort_attempts=3,
    abort_retry_delay=0.25,
    abort_timeout=0.5,
    stall_timeout=3.0,
)


def is_faulty(request: Any) -> bool:
    return bool(request["text"] == FAULTY["text"])


async def read_healthy(worker: ts.Worker, ctx_id: str) -> None:
    assert await read(worker, HEALTHY, ts.RequestContext(ctx_id)) == 5


@dataclass(frozen=True)
class Case:
    faults: Faults
    release_on_close: bool
    kind: ts.EngineFault
    level: int
    #: None: the caller left after its first chunk, at 2.5, and its stream
    #: closed then; else the clock time it got ``EngineError``.
    error_at: float | None
    #: From the caller leaving to the cleanup's end, and whether the engine
    #: had let go of the request by then.
    cleanup_seconds: float
    released: bool


CASES = {
    # No release on close: only an abort stops the request. The pump keeps
    # reading for dispatch_timeout + release_timeout (2.5 s) after the caller
    # left, then closes the stream; the abort runs beside it.
    # Attempts at 2.5, 2.75 and 3.0 raise.
    "abort raises": Case(
        Faults(abort="raise"), False, "abort_error", logging.ERROR, None, 2.5, False
    ),
    # Attempts at 2.5, 3.25 and 4.0 each hang for abort_timeout.
    "abort hangs": Case(
        Faults(abort="hang"), False, "abort_timeout", logging.ERROR, None, 2.5, False
    ),
    # Attempts at 2.5, 3.25 and 4.0 each wait release_timeout for nothing.
    "abort never takes": Case(
        Faults(abort="ignore"), False, "abort_not_taken", logging.ERROR, None, 2.5, False
    ),
    # The dispatch mark never shows: the abort waits dispatch_timeout (to
    # 4.5), then gives up rather than send an abort that could be lost.
    "dispatch never observed": Case(
        Faults(hide_dispatch=True), False, "dispatch_timeout", logging.ERROR, None, 2.5, False
    ),
    # The first token arrives at 2.5, then the stream raises.
    "stream raises": Case(
        Faults(stream_error_after=1), True, "stream_error", logging.ERROR, 2.5, 0.0, True
    ),
    # The first token arrives at 2.5, then nothing: stall_timeout ends it at 5.5.
    "stream goes silent": Case(
        Faults(stream_silent_after=1), True, "stream_stalled", logging.ERROR, 5.5, 0.0, True
    ),
    # The same, read by the worker's own task (no release on close): the
    # abort takes at once, and the reader keeps reading for 2.5 s.
    "stream goes silent, worker-owned reader": Case(
        Faults(stream_silent_after=1), False, "stream_stalled", logging.ERROR, 5.5, 2.5, True
    ),
    # The engine never hears of it: stall_timeout ends it at 3.0.
    "never registered": Case(
        Faults(never_register=True), True, "stream_stalled", logging.ERROR, 3.0, 0.0, True
    ),
    # The close raises without telling the engine: release_timeout, then an abort.
    "close raises": Case(
        Faults(close="raise"), True, "close_error", logging.ERROR, None, 0.5, True
    ),
    # The close hangs for close_timeout, then release_timeout, then an abort.
    "close hangs": Case(
        Faults(close="hang"), True, "close_timeout", logging.WARNING, None, 1.0, True
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_an_injected_fault_is_bounded_logged_once_counted_and_isolated(
    case: Case, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    sim = slow_sim(release_on_close=case.release_on_close)
    engine = FaultyEngine(sim, case.faults, select=is_faulty)
    observer = Recorder()
    async with ts.open_worker(engine, policy=POLICY, observer=observer) as worker:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_healthy, worker, "pub-beside")
            faulty = ts.RequestContext("pub-faulty")
            if case.error_at is None:
                assert await read(worker, FAULTY, faulty, leave_after=1) == 1
                assert trio.current_time() == 2.5  # closed when the caller left
            else:
                with pytest.raises(ts.EngineError, match="pub-faulty") as raised:
                    await read(worker, FAULTY, faulty)
                assert trio.current_time() == case.error_at
                assert str(raised.value).count("pub-faulty") == 1
                assert not any(rid in str(raised.value) for rid in engine.faulty_rids)
        await trio.sleep(60)  # every bound has passed, and the sim has finished
        assert worker.pending_cleanups == 0
        await read_healthy(worker, "pub-after")

    (rid,) = engine.faulty_rids
    assert observer.faults == [case.kind]
    assert observer.cleanups == [(case.cleanup_seconds, case.released)]  # the healthy ones ended
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == case.level
    message = record.getMessage()
    assert f"engine fault {case.kind}: request pub-faulty (rids {rid})" in message
    assert sim.live_rids() == set()


async def test_a_silent_stream_without_a_stall_bound_closes_when_its_caller_leaves(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    sim = slow_sim(release_on_close=True)
    engine = FaultyEngine(sim, Faults(stream_silent_after=1))
    async with ts.open_worker(engine) as worker:  # stall_timeout is off by default
        with trio.move_on_after(20):
            await read(worker, FAULTY, ts.RequestContext("pub-waiting"))
        assert trio.current_time() == 20
        await trio.testing.wait_all_tasks_blocked()
        assert worker.pending_cleanups == 0
        assert sim.live_rids() == set()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_an_engine_that_goes_away_fails_every_stream_and_every_later_request(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    sim = slow_sim(release_on_close=True)
    engine = FaultyEngine(sim)
    observer = Recorder()
    errors: list[float] = []

    async def doomed(ctx_id: str) -> None:
        with pytest.raises(ts.EngineError, match=rf"{ctx_id} \(ConnectionResetError\)"):
            await read(worker, FAULTY, ts.RequestContext(ctx_id))
        errors.append(trio.current_time())

    async with ts.open_worker(engine, policy=POLICY, observer=observer) as worker:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(doomed, "pub-mid-stream")
            await trio.sleep(1.0)
            nursery.start_soon(doomed, "pub-tokenizing")
            await trio.sleep(2.0)
            engine.close_abruptly()
        assert errors == [3.0, 3.0]
        registered = {event.rid for event in sim.trace}
        await doomed("pub-later")
        assert trio.current_time() == 3.0
        assert {event.rid for event in sim.trace} == registered  # never reached it
        await trio.testing.wait_all_tasks_blocked()
        assert worker.pending_cleanups == 0
    assert sim.live_rids() == set()
    assert observer.faults == ["stream_error"] * 3
    logged = sorted(record.getMessage().split(" ")[4] for record in caplog.records)
    assert logged == ["pub-later", "pub-mid-stream", "pub-tokenizing"]


async def test_server_metrics_count_faults_by_kind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    metrics = ServerMetrics()
    engine = FaultyEngine(slow_sim(release_on_close=False), Faults(abort="raise"))
    async with ts.open_worker(engine, policy=POLICY, observer=metrics) as worker:
        await read(worker, FAULTY, ts.RequestContext("pub-1"), leave_after=1)
        await trio.sleep(10)
    text = metrics.render().decode()
    assert 'trio_sglang_engine_faults_total{kind="abort_error"} 1.0' in text
    assert "trio_sglang_cleanups_unconfirmed_total 1.0" in text


async def test_a_stream_that_fails_over_http_ends_with_a_502_event_not_a_500(
    nursery: trio.Nursery,
) -> None:
    engine = FaultyEngine(ts.SimEngine(token_interval=0.001), Faults(stream_error_after=2))
    stop = trio.Event()
    urls = await nursery.start(
        lambda task_status: serve(
            engine, port=0, handle_signals=False, shutdown=stop, task_status=task_status
        )
    )
    async with httpx.AsyncClient(base_url=urls[0]) as client:
        body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 8}}
        response = await client.post("/generate", json=body)
        metrics = (await client.get("/metrics")).text
    stop.set()
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200  # the stream had started
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "the engine failed while generating gen-" in error.pop("message")
    assert error == {"type": "server_error", "param": None, "code": "engine_error"}
    assert events[-1] == "data: [DONE]"
    # The engine's two outputs as two chunks, or as one when the client was behind
    # (serve coalesces a backlog); then the error and the end.
    assert len(events) - 2 in (1, 2)
    assert 'trio_sglang_engine_faults_total{kind="stream_error"} 1.0' in metrics
    assert 'trio_sglang_requests_total{endpoint="/generate",outcome="failed"} 1.0' in metrics


async def test_the_embedding_page_fault_example_injects_what_it_says(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    namespace: dict[str, Any] = {}
    exec(readme_block("python", "FaultyEngine(", "docs/embedding.md"), namespace)
    engine: FaultyEngine = namespace["engine"]
    async with ts.open_worker(engine, policy=POLICY) as worker:
        poison = {"text": "poison", "sampling_params": {"max_new_tokens": 50}}
        await read(worker, poison, ts.RequestContext("pub-poison"), leave_after=1)
        await read_healthy(worker, "pub-healthy")
        await trio.sleep(60)
    (record,) = caplog.records
    assert "engine fault abort_timeout: request pub-poison" in record.getMessage()


# -- which ids a fault names ---------------------------------------------------------------------


@pytest.mark.mutant_pin
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
