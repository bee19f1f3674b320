"""A hosted application's routes behind ``serve``'s edge, on the SimEngine and the MockClock.

With ``--engine sglang``, SGLang's own server application answers every route
but ``serve``'s own (``_hosted_app.py``): it builds the requests and the
responses, and starts each engine request through the HTTP request's
exchange, which runs it through the worker's lifecycle. What the edge owns
is judged here with a hosted application of the test's own, which does with
the exchange what SGLang's routes do (start a request, stream what it
yields, end), so that no SGLang is needed: the lifecycle underneath, the
client that leaves, ``/abort_request``, the heartbeats, the server's
limits. SGLang's application itself is run in ``tests/test_real_engine_serve.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import slow_sim
from trio_sglang._errors import InvalidRequest
from trio_sglang._hosted_app import EXCHANGE_KEY, SEND_NOW_KEY, HTTPRefusal
from trio_sglang.server import ServerApp, ServerLimits, ServerMetrics
from trio_sglang.server._asgi import SSE_HEARTBEAT

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
LONG = {"text": "hi", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}


class HostedStandIn:
    """What SGLang's ``/generate`` does with the exchange: one request, its outputs as SSE."""

    keeps_metrics = True
    no_transfer_host = None

    def __init__(self) -> None:
        self.feeds: list[Any] = []
        self.paths: list[str] = []
        #: Chunks written at once (``SendNow``), as SGLang's app under ``serve`` writes them.
        self.at_once = 0

    def metrics(self) -> bytes:
        """Its own, which ``serve``'s ``/metrics`` shows beside its (SGLang's ``sglang:*``)."""
        return b"# TYPE hosted_requests counter\nhosted_requests 7.0\n"

    async def __call__(self, scope: Message, receive: Any, send: Send) -> None:
        self.paths.append(scope["path"])
        body = json.loads((await receive())["body"] or b"{}")
        try:
            feed = await scope[EXCHANGE_KEY].start(body)
        except (HTTPRefusal, InvalidRequest) as exc:
            status = exc.status if isinstance(exc, HTTPRefusal) else 400
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": str(exc).encode()})
            return
        self.feeds.append(feed)
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        while True:
            try:
                out = await feed.receive()
            except trio.EndOfChannel:
                break
            event = b"data: " + json.dumps(out).encode() + b"\n\n"
            message = {"type": "http.response.body", "body": event, "more_body": True}
            if scope[SEND_NOW_KEY](message):
                self.at_once += 1
            else:
                await send(message)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


class Exchange:
    """One HTTP request to the app: what it sent, and when."""

    def __init__(self, *, leave_after_answer: bool = False) -> None:
        self.sent: list[tuple[float, Message]] = []
        self.leave = trio.Event()
        self._leave_after_answer = leave_after_answer

    async def send(self, message: Message) -> None:
        self.sent.append((trio.current_time(), message))
        # As hypercorn: "disconnect" as soon as the whole response has gone.
        ended = message["type"] == "http.response.body" and not message.get("more_body")
        if ended and self._leave_after_answer:
            self.leave.set()

    @property
    def status(self) -> int:
        starts = [m for _, m in self.sent if m["type"] == "http.response.start"]
        return int(starts[0]["status"]) if starts else 0

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for _, m in self.sent if "body" in m)

    def events(self) -> list[Any]:
        lines = self.body.decode().split("\n\n")
        return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


async def request(
    app: ServerApp,
    path: str,
    body: object = None,
    *,
    exchange: Exchange | None = None,
    content_type: bytes = b"application/json",
) -> Exchange:
    """One request; the client leaves when ``exchange.leave`` is set, or after the answer."""
    exchange = Exchange() if exchange is None else exchange
    messages = [{"type": "http.request", "body": json.dumps(body).encode() if body else b""}]

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await exchange.leave.wait()
        return {"type": "http.disconnect"}

    method = "GET" if body is None else "POST"
    headers = [(b"content-type", content_type)]
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    await app(scope, receive, exchange.send)
    return exchange


@pytest.fixture
async def worker() -> Any:
    async with ts.open_worker(slow_sim(keep_trace=True)) as worker:
        yield worker


def hosted_app(worker: ts.Worker, **limits: Any) -> tuple[ServerApp, HostedStandIn]:
    hosted = HostedStandIn()
    app = ServerApp(
        worker, ServerMetrics(), model="m", limits=ServerLimits(**limits), hosted=hosted
    )
    return app, hosted


def counted(app: ServerApp, outcome: str) -> float:
    text = app.metrics.render().decode()
    match = re.search(
        rf'^trio_sglang_requests_total\{{endpoint="/generate",outcome="{outcome}"\}} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(match.group(1)) if match else 0.0


async def test_a_hosted_route_streams_its_request_through_the_lifecycle(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    app, hosted = hosted_app(worker, sse_heartbeat=0)
    answer = await request(app, "/generate", LONG)
    events = answer.events()
    assert answer.status == 200
    assert sum(len(event["output_ids"]) for event in events) == 50
    # Under the public id the lifecycle gave it (SGLang's: a uuid's hex), never the engine's.
    [public] = {event["meta_info"]["id"] for event in events}
    assert re.fullmatch("[0-9a-f]{32}", public)
    assert hosted.feeds[0].end == "finished"
    assert worker.engine.live_requests() == 0
    assert counted(app, "completed") == 1
    # Under an ASGI server other than serve's own, every write goes through ``send``,
    # where the route bounds it (serve's connection writes at once: test_hosted_writes).
    assert hosted.at_once == 0


async def test_a_client_that_leaves_stops_the_hosted_route_and_its_request(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    """It leaves at 3.0 s, after its first token (2.5 s): nothing decodes after it."""
    app, hosted = hosted_app(worker, sse_heartbeat=0)
    leaving = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: request(app, "/generate", LONG, exchange=leaving))
        await trio.sleep(3.0)
        leaving.leave.set()
    assert trio.current_time() == pytest.approx(3.0)  # the route ended at once
    assert len(leaving.events()) == 1
    assert b"[DONE]" not in leaving.body
    await worker.wait_idle()
    assert worker.engine.live_requests() == 0
    assert hosted.feeds[0].end == "left"
    assert counted(app, "cancelled") == 1


async def test_a_client_that_leaves_after_its_whole_answer_is_not_counted_as_leaving(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    app, _ = hosted_app(worker, sse_heartbeat=0)
    done = Exchange(leave_after_answer=True)
    short = {**LONG, "sampling_params": {"max_new_tokens": 2}}
    await request(app, "/generate", short, exchange=done)
    assert counted(app, "completed") == 1
    assert counted(app, "cancelled") == 0


async def test_abort_request_ends_a_hosted_stream_by_its_public_id(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    app, hosted = hosted_app(worker, sse_heartbeat=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: request(app, "/generate", {**LONG, "rid": "mine"}))
        await trio.sleep(3.0)
        stopped = await request(app, "/abort_request", {"rid": "mine"})
    assert json.loads(stopped.body) == {"found": True, "aborted": 1}
    assert hosted.feeds[0].end == "aborted"
    assert hosted.paths == ["/generate"]  # /abort_request is serve's own
    await worker.wait_idle()
    assert worker.engine.live_requests() == 0
    assert counted(app, "aborted") == 1


async def test_a_silent_hosted_stream_sends_blank_line_heartbeats(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    """No token before 2.5 s: a heartbeat every 0.1 s, which every SSE reader skips."""
    app, _ = hosted_app(worker, sse_heartbeat=0.1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.heartbeats.run)
        answer = await request(app, "/generate", LONG)
        nursery.cancel_scope.cancel()
    bodies = [(time, m["body"]) for time, m in answer.sent if m.get("body")]
    first_token = next(time for time, body in bodies if body.startswith(b"data: {"))
    beats = [time for time, body in bodies if body == SSE_HEARTBEAT]
    assert len([time for time in beats if time < first_token]) == pytest.approx(25, abs=1)
    # Every non-empty line is an event: a reader that parses each one as JSON never fails.
    lines = [line for line in answer.body.decode().splitlines() if line.strip()]
    assert all(line.startswith("data: ") for line in lines)


async def test_the_servers_limits_refuse_before_the_engine(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    app, hosted = hosted_app(worker, sse_heartbeat=0, max_running_requests=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: request(app, "/generate", LONG))
        await trio.testing.wait_all_tasks_blocked()
        busy = await request(app, "/generate", LONG)
        form = await request(app, "/generate", LONG, content_type=b"text/plain")
        bad = await request(app, "/generate", {"text": "hi", "sampling_params": {"n": 0}})
    assert busy.status == 503
    assert form.status == 415  # a web page's form cannot make the engine generate
    assert bad.status == 400  # the worker's own check, before the engine
    assert len(hosted.feeds) == 1
    assert worker.engine.event_counts()["registered"] == 1


async def test_the_hosted_app_answers_every_route_but_serves_own(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    app, hosted = hosted_app(worker, sse_heartbeat=0)
    metrics = await request(app, "/metrics")
    assert b"trio_sglang_requests_total" in metrics.body
    assert metrics.body.endswith(b"hosted_requests 7.0\n")
    await request(app, "/capabilities")
    models = await request(app, "/v1/models")
    assert hosted.paths == ["/v1/models"]
    assert models.status == 400  # the stand-in starts a request for whatever it is sent


async def test_once_the_server_is_closing_a_hosted_route_is_a_503_at_once(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    app, hosted = hosted_app(worker, sse_heartbeat=0)
    app.close()
    answer = await request(app, "/health")
    assert answer.status == 503
    assert hosted.paths == []


async def test_a_hosted_route_that_fails_leaves_nothing_in_flight(
    autojump_clock: trio.testing.MockClock, worker: ts.Worker
) -> None:
    """A 500, its request stopped at the engine, and its id free for the next request."""

    class Failing(HostedStandIn):
        async def __call__(self, scope: Message, receive: Any, send: Send) -> None:
            body = json.loads((await receive())["body"])
            self.feeds.append(await scope[EXCHANGE_KEY].start(body))
            raise RuntimeError("a bug in the hosted route")

    failing = Failing()
    app = ServerApp(worker, ServerMetrics(), model="m", limits=ServerLimits(), hosted=failing)
    answer = await request(app, "/generate", {**LONG, "rid": "again"})
    assert answer.status == 500
    await worker.wait_idle()
    assert worker.engine.live_requests() == 0
    assert failing.feeds[0].end == "left"
    # Not in flight any more: /abort_request finds nothing under its id.
    stopped = await request(app, "/abort_request", {"rid": "again"})
    assert json.loads(stopped.body) == {"found": False, "aborted": 0}
