"""A client slower than its engine: outputs are coalesced, held within a bound, and never pile up.

``IncrementQueue`` merges a child's backlog as SGLang's TokenizerManager does;
the server's streaming responses hold what their client has not taken in
one (``Outbox``). The app is driven here through ASGI directly, on the
MockClock, with a ``send`` as slow (or as stuck) as the case needs: what
the socket does is ``tests/test_edge.py``'s part.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import slow_sim
from trio_sglang._increments import IncrementQueue
from trio_sglang.server import ServerApp, ServerLimits, ServerMetrics
from trio_sglang.server._asgi import SSE_HEARTBEAT
from trio_sglang.server._outbox import ROUND, Heartbeats, Outbox


def output(text: str, ids: list[int], *, index: int = 0, **meta: Any) -> dict[str, Any]:
    return {"text": text, "output_ids": ids, "index": index, "meta_info": {"id": "r", **meta}}


# -- IncrementQueue ------------------------------------------------------------------


def test_a_childs_backlog_is_merged_as_sglang_merges_it() -> None:
    queue = IncrementQueue()
    first = output("a", [1], completion_tokens=1, output_token_logprobs=[(-0.1, 1)])
    queue.put(first)
    queue.put(output("b", [2, 3], completion_tokens=3, output_token_logprobs=[(-0.2, 2)]))
    queue.put(output("x", [9], index=1, completion_tokens=1))
    queue.put(output("c", [4], completion_tokens=4, finish_reason={"type": "length"}))
    assert queue.tokens == 5
    assert len(queue) == 2  # one waiting output per child
    merged, other = queue.take_all()
    assert merged["text"] == "abc"
    assert merged["output_ids"] == [1, 2, 3, 4]
    assert merged["meta_info"]["completion_tokens"] == 4  # the newest state
    assert merged["meta_info"]["finish_reason"] == {"type": "length"}
    assert merged["meta_info"]["output_token_logprobs"] == [(-0.1, 1), (-0.2, 2)]
    assert other["text"] == "x"
    # The engine's own output was copied before it was merged into, never changed.
    assert first == output("a", [1], completion_tokens=1, output_token_logprobs=[(-0.1, 1)])
    assert queue.tokens == 0
    assert len(queue) == 0


def test_an_output_taken_is_not_merged_into_again() -> None:
    queue = IncrementQueue()
    queue.put(output("a", [1]))
    assert queue.popleft()["text"] == "a"
    queue.put(output("b", [2]))
    queue.put(output("c", [3]))
    assert [out["text"] for out in queue.take_all()] == ["bc"]


# -- the app, through ASGI ------------------------------------------------------------

Send = Callable[[dict[str, Any]], Awaitable[None]]
BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}, "stream": True}


async def generate(app: ServerApp, send: Send) -> None:
    """One streaming ``POST /generate`` whose client stays connected and sends nothing more."""
    body = json.dumps(BODY).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()
        raise AssertionError  # unreachable

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/generate",
        "headers": [(b"content-type", b"application/json")],
    }
    await app(scope, receive, send)


def sse_events(sent: list[dict[str, Any]]) -> list[Any]:
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    lines = text.decode().split("\n\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.fixture
async def worker() -> Any:
    async with ts.open_worker(slow_sim(keep_trace=True)) as worker:
        yield worker


async def test_a_client_slower_than_its_tokens_gets_them_coalesced(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    """A token a second, a client that takes an event every 3.5 s: fewer events, every token."""
    app = ServerApp(worker, ServerMetrics(), model="m", limits=ServerLimits())
    sent: list[dict[str, Any]] = []

    async def slow_send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            await trio.sleep(3.5)

    await generate(app, slow_send)
    events = sse_events(sent)
    assert sum(len(event["output_ids"]) for event in events) == 50
    assert len(events) < 20
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_a_client_that_takes_no_bytes_is_stopped_after_the_stall_timeout(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    limits = ServerLimits(client_stall_timeout=5.0)
    metrics = ServerMetrics()
    app = ServerApp(worker, metrics, model="m", limits=limits)
    engine = worker.engine
    assert isinstance(engine, ts.SimEngine)
    stuck_since: list[float] = []

    async def stuck_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            stuck_since.append(trio.current_time())
            await trio.sleep_forever()  # as HTTP/2's flow control waits for a window

    await generate(app, stuck_send)
    # Stopped at the stall timeout after the first token's send got stuck, not 50 s later.
    assert trio.current_time() == pytest.approx(stuck_since[0] + 5.0, abs=0.01)
    await worker.wait_idle()
    assert engine.live_rids() == set()
    assert max(e.time for e in engine.trace if e.kind == "token") <= stuck_since[0] + 5.0
    assert b'outcome="cancelled"' in metrics.render()


async def test_a_client_further_behind_than_the_bound_is_gone(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    """The held tokens never pass the bound: past it the request stops, however slow the send."""
    app = ServerApp(worker, ServerMetrics(), model="m", limits=ServerLimits(max_unsent_tokens=4))
    engine = worker.engine
    assert isinstance(engine, ts.SimEngine)

    async def slow_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await trio.sleep(9.0)  # under the stall timeout: only the bound can stop it

    started = trio.current_time()
    await generate(app, slow_send)
    await worker.wait_idle()
    assert engine.live_rids() == set()
    tokens = [e.time for e in engine.trace if e.kind == "token"]
    assert len(tokens) < 10  # 50 were asked for
    assert trio.current_time() - started < 20.0


# -- heartbeats ------------------------------------------------------------------------


def body_times(sent: list[tuple[float, bytes]], payload: bytes) -> list[float]:
    return [time for time, body in sent if body == payload]


async def test_a_silent_stream_sends_a_heartbeat_in_every_gap_longer_than_the_interval(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    """Before the first token (2.5 s in), and between tokens a second apart: the stream is
    never silent longer than 0.1 s (and the heartbeat's round), and an idle one beats once
    per 0.1 s, not more."""
    app = ServerApp(worker, ServerMetrics(), model="m", limits=ServerLimits(sse_heartbeat=0.1))
    sent: list[tuple[float, bytes]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append((trio.current_time(), message["body"]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.heartbeats.run)
        await generate(app, send)
        nursery.cancel_scope.cancel()
    first_token = next(time for time, body in sent if body.startswith(b"data: {"))
    assert first_token == pytest.approx(2.5)
    beats = [time for time, body in sent if body == SSE_HEARTBEAT]
    assert len([time for time in beats if time < first_token]) == pytest.approx(25, abs=1)
    for (before, _), (time, _) in itertools.pairwise(sent):
        assert time - before <= 0.1 + ROUND + 1e-9
    for earlier, later in itertools.pairwise(beats):
        assert later - earlier >= 0.1 - 1e-9
    messages = [{"type": "http.response.body", "body": body} for _, body in sent]
    assert sum(len(event["output_ids"]) for event in sse_events(messages)) == 50


async def beats_of_silent_streams(
    streams: int, *, interval: float, max_per_second: int, duration: float
) -> list[list[float]]:
    """When each of ``streams`` silent responses beat, over ``duration`` s of the heartbeat."""
    heartbeats = Heartbeats(interval, max_per_second)
    beats: list[list[float]] = [[] for _ in range(streams)]

    async def silent(times: list[float]) -> None:
        outbox = Outbox(max_tokens=100)
        with heartbeats.watching(outbox):
            while (held := await outbox.take()) != []:
                assert held is None  # nothing is ever put: every take is a beat
                times.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeats.run)
        for times in beats:
            nursery.start_soon(silent, times)
        await trio.sleep(duration)
        nursery.cancel_scope.cancel()
    return beats


async def test_silent_streams_beat_every_interval_within_the_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Below ``max_per_second`` beats a second in all, each silent stream beats every interval."""
    beats = await beats_of_silent_streams(5, interval=0.1, max_per_second=1000, duration=10)
    for times in beats:
        assert len(times) == pytest.approx(100, abs=2)
        assert all(0.1 - 1e-9 <= b - a <= 0.1 + ROUND + 1e-9 for a, b in itertools.pairwise(times))


async def test_thousands_of_silent_streams_beat_no_faster_than_the_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """3,000 silent streams at 0.1 s would be 30,000 beats a second (measured:
    85% of a core); with a budget of 1,000 each beats every 3 s. Opened together, their
    first beats come due together, and go out spread over one spacing, not as a herd."""
    streams, rate, duration = 3000, 1000, 30.0
    beats = await beats_of_silent_streams(
        streams, interval=0.1, max_per_second=rate, duration=duration
    )
    spacing, burst = streams / rate, rate * ROUND + 1
    every = sorted(time for times in beats for time in times)
    assert len(every) <= rate * duration + burst
    assert len(every) >= 0.95 * rate * (duration - spacing)  # the budget is spent, not wasted
    per_second = [0] * int(duration + 1)
    for time in every:
        per_second[int(time)] += 1
    assert max(per_second) <= rate + burst
    for times in beats:  # each one still beats: the first within two spacings, then every one
        assert times
        assert times[0] <= 2 * spacing + ROUND
        assert all(spacing - 1e-9 <= b - a <= spacing + 0.2 for a, b in itertools.pairwise(times))


async def test_no_heartbeats_when_turned_off(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    app = ServerApp(worker, ServerMetrics(), model="m", limits=ServerLimits(sse_heartbeat=0))
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.heartbeats.run)
        await generate(app, send)
    assert SSE_HEARTBEAT not in sent
    assert len(sse_events([{"type": "http.response.body", "body": b} for b in sent])) == 50


async def test_outputs_sent_count_as_the_beat_the_heartbeat_asked_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A beat asked of a silent sender is answered by outputs going out instead."""
    outbox = Outbox(max_tokens=100)
    outbox.beat()  # the heartbeat found it silent
    outbox.put(output("a", [1]))
    assert [out["text"] for out in await outbox.take() or []] == ["a"]
    with trio.move_on_after(1.0) as waited:
        await outbox.take()  # nothing held, no beat due: it waits
    assert waited.cancelled_caught
