"""``POST /abort_request``: SGLang's route, by exact public id, through the disconnect's lifecycle.

Servers run in the test's trio run on loopback (``test_server.py``'s
``start_server``), on a SimEngine that sends each request one token at once
and the next one 30 s later: every request is in flight, idle, when it is
aborted. Whether an abort stopped a request is judged at the engine (its live
rids, its trace); what the aborted request's own client saw, by its stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import pytest
import trio

import test_server
from test_server import MODEL, Server, StartServer, eventually
from trio_sglang.server import ServerLimits

#: test_server.py's fixture: servers on free loopback ports, stopped at the test's end.
start_server = test_server.start_server

#: One token at once, the next 30 s later: a request stays in flight until stopped.
IDLE = {"first_token_delay": 0.001, "token_interval": 30.0}
GENERATE = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 100}}
BODIES: dict[str, dict[str, Any]] = {
    "/generate": {**GENERATE, "rid": "mine"},
    "/v1/completions": {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 100,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "stream": True,
    },
}


@dataclass
class Streamed:
    """One streaming response, read by a task of its own: its SSE payloads as they come."""

    payloads: list[Any] = field(default_factory=list)
    first: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)

    async def read(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.payloads.append(data if data == "[DONE]" else json.loads(data))
                    self.first.set()
        self.done.set()

    def finish_reasons(self) -> list[str | None]:
        """Every finish reason its chunks carried (a native chunk's, its ``type``)."""
        reasons = []
        for payload in self.payloads:
            if payload == "[DONE]":
                continue
            if "meta_info" in payload:
                reason = payload["meta_info"]["finish_reason"]
                reasons.append(None if reason is None else reason["type"])
            reasons.extend(choice["finish_reason"] for choice in payload.get("choices", ()))
        return reasons

    async def ended(self) -> None:
        with trio.fail_after(5):
            await self.done.wait()
        assert self.payloads[-1] == "[DONE]"


async def open_stream(
    nursery: trio.Nursery, server: Server, path: str, body: dict[str, Any]
) -> Streamed:
    """A streaming request in flight, its first token received."""
    streamed = Streamed()
    nursery.start_soon(streamed.read, server.client, path, body)
    with trio.fail_after(5):
        await streamed.first.wait()
    return streamed


def public_id(payload: dict[str, Any]) -> str:
    """The id its client knows a request by: an OpenAI chunk's ``id``, or ``meta_info.id``."""
    return str(payload["meta_info"]["id"] if "meta_info" in payload else payload["id"])


async def abort(server: Server, **body: Any) -> dict[str, Any]:
    response = await server.client.post("/abort_request", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def kinds(server: Server) -> list[str]:
    return [event.kind for event in server.engine.trace]


@pytest.mark.parametrize("path", list(BODIES))
async def test_an_abort_from_another_connection_stops_the_request_at_the_engine(
    start_server: StartServer, nursery: trio.Nursery, path: str
) -> None:
    server = await start_server(**IDLE)
    streamed = await open_stream(nursery, server, path, BODIES[path])
    rid = public_id(streamed.payloads[0])
    assert len(server.engine.live_rids()) == 1

    assert await abort(server, rid=rid) == {"found": True, "aborted": 1}
    await streamed.ended()
    await eventually(lambda: server.engine.live_rids() == set())
    assert kinds(server).count("abort_applied") == 1
    assert kinds(server).count("token") == 1
    # Its client's stream ends as SGLang ends an aborted one: a last chunk with
    # the finish reason "abort", then what always ends it.
    assert streamed.finish_reasons()[-1] == "abort"
    last = streamed.payloads[-2]
    if path == "/generate":
        assert last["meta_info"]["id"] == "mine"
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["output_ids"] == []
    elif path == "/v1/completions":  # include_usage: the usage chunk still comes last
        assert last["choices"] == []
        assert last["usage"]["completion_tokens"] == 1
    await eventually(partial(outcome_counted, server, path, "aborted"))
    assert await abort(server, rid=rid) == {"found": False, "aborted": 0}  # it has ended


async def outcome_counted(server: Server, path: str, outcome: str) -> bool:
    return await server.metric("trio_sglang_requests_total", endpoint=path, outcome=outcome) == 1


async def test_a_whole_answer_aborted_is_its_children_so_far(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    """A request is aborted by its own id: every child stops; a child's id stops nothing."""
    server = await start_server(**IDLE)
    body = {"text": "hi", "rid": "whole", "sampling_params": {"max_new_tokens": 100, "n": 2}}
    answers: list[httpx.Response] = []

    async def post() -> None:
        answers.append(await server.client.post("/generate", json=body))

    nursery.start_soon(post)
    await eventually(lambda: kinds(server).count("token") == 2)
    assert await abort(server, rid="whole_0") == {"found": False, "aborted": 0}
    assert await abort(server, rid="whole") == {"found": True, "aborted": 1}
    await eventually(lambda: bool(answers))
    (answer,) = answers
    assert answer.status_code == 200
    results = answer.json()
    assert [r["meta_info"]["id"] for r in results] == ["whole_0", "whole_1"]
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort", "abort"]
    assert [len(r["output_ids"]) for r in results] == [1, 1]
    await eventually(lambda: server.engine.live_rids() == set())


async def test_a_prefix_of_another_requests_id_never_stops_it(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    # SGLang's scheduler matches by prefix: its abort of "abc" stops all three.
    server = await start_server(**IDLE)
    streams = {
        rid: await open_stream(nursery, server, "/generate", {**GENERATE, "rid": rid})
        for rid in ("abc", "abc1", "abcd")
    }
    assert len(server.engine.live_rids()) == 3

    assert await abort(server, rid="abc") == {"found": True, "aborted": 1}
    await streams["abc"].ended()
    assert streams["abc"].finish_reasons()[-1] == "abort"
    await eventually(lambda: len(server.engine.live_rids()) == 2)
    assert kinds(server).count("abort_applied") == 1
    for rid in ("abc1", "abcd"):
        assert not streams[rid].done.is_set()
        assert set(streams[rid].finish_reasons()) == {None}

    for other in ("ab", "abc", "ABCD", "abc1 ", "bcd"):
        assert await abort(server, rid=other) == {"found": False, "aborted": 0}, other
    assert len(server.engine.live_rids()) == 2
    # The end of the test: abort the rest.
    assert await abort(server, rid="abc1") == {"found": True, "aborted": 1}
    assert await abort(server, rid="abcd") == {"found": True, "aborted": 1}
    await eventually(lambda: server.engine.live_rids() == set())


async def test_abort_all_stops_every_request(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    server = await start_server(**IDLE)
    streams = [await open_stream(nursery, server, path, body) for path, body in BODIES.items()]
    assert len(server.engine.live_rids()) == 3

    # SGLang's body for it: AbortReq(rid="", abort_all=True).
    assert await abort(server, rid="", abort_all=True) == {"found": True, "aborted": 3}
    for streamed in streams:
        await streamed.ended()
        assert "abort" in streamed.finish_reasons()
    await eventually(lambda: server.engine.live_rids() == set())
    assert kinds(server).count("abort_applied") == 3
    assert await abort(server, abort_all=True) == {"found": False, "aborted": 0}


async def test_an_unknown_id_is_not_found_and_a_bad_body_is_a_400(
    start_server: StartServer,
) -> None:
    server = await start_server()
    assert await abort(server, rid="nope") == {"found": False, "aborted": 0}
    client = server.client
    for body, param in (
        ({}, "rid"),
        ({"rid": ""}, "rid"),
        ({"rid": 7}, "rid"),
        ({"rid": ["a"]}, "rid"),
        ({"abort_all": "yes"}, "abort_all"),
        ({"abort_all": False}, "rid"),
    ):
        response = await client.post("/abort_request", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            param,
            None,
        )
    # JSON only: a web page cannot post one without asking the browser first.
    as_form = await client.post("/abort_request", content=b"rid=x", headers={})
    assert as_form.status_code == 415
    assert list(server.engine.trace) == []


async def test_only_an_authenticated_caller_may_abort(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    server = await start_server(limits=ServerLimits(api_key="s3cret"), **IDLE)
    server.client.headers["authorization"] = "Bearer s3cret"
    await open_stream(nursery, server, "/generate", {**GENERATE, "rid": "guarded"})
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as stranger:
        for body in ({"rid": "guarded"}, {"abort_all": True}):
            response = await stranger.post("/abort_request", json=body)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert len(server.engine.live_rids()) == 1
    assert await abort(server, rid="guarded") == {"found": True, "aborted": 1}
    await eventually(lambda: server.engine.live_rids() == set())


async def test_it_takes_post_only(start_server: StartServer) -> None:
    server = await start_server()
    for method in ("GET", "HEAD", "PUT"):
        response = await server.client.request(method, "/abort_request")
        assert response.status_code == 405, method
        assert response.headers["allow"] == "POST"


async def test_a_rid_in_flight_is_not_taken_twice(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    """One id, one request (as SGLang's TokenizerManager has it): an abort stops one client's."""
    server = await start_server(**IDLE)
    body = {**GENERATE, "rid": "dup"}
    await open_stream(nursery, server, "/generate", body)
    twice = await server.client.post("/generate", json=body)
    assert twice.status_code == 400
    error = twice.json()["error"]
    assert (error["message"], error["param"]) == ("Duplicate request ID detected: dup", "rid")
    assert len(server.engine.live_rids()) == 1
    assert await abort(server, rid="dup") == {"found": True, "aborted": 1}
    # The id is free again once its request has ended (and been counted).
    await eventually(partial(outcome_counted, server, "/generate", "aborted"))
    one_token = {"text": "hi", "rid": "dup", "sampling_params": {"max_new_tokens": 1}}
    again = await server.client.post("/generate", json=one_token)
    assert again.json()["meta_info"]["id"] == "dup"
