"""``trio-sglang serve`` over loopback, with real clients: httpx, raw sockets, the openai SDK.

The server runs in the test's trio run on a real socket (port 0), so the
SimEngine's trace and the clients share one clock: a disconnect is judged by
what the engine did after it (no token decoded after the client left, the
request released or aborted), not by wall-clock thresholds. Waits for the
server to react are bounded polls.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio

import trio_sglang as ts
from trio_sglang.server import ServerLimits, serve

MODEL = "trio-sglang-sim"
#: What httpx sends with ``json=``; a body given as bytes must say it too.
JSON = {"content-type": "application/json"}


@dataclass
class Server:
    url: str
    engine: ts.SimEngine
    client: httpx.AsyncClient

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def metric(self, name: str, **labels: str) -> float:
        text = (await self.client.get("/metrics")).text
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        pattern = rf"^{name}(\{{{re.escape(wanted)}\}})? (\S+)$" if labels else rf"^{name} (\S+)$"
        match = re.search(pattern, text, flags=re.MULTILINE)
        return float(match.groups()[-1]) if match else 0.0


StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start_server(nursery: trio.Nursery) -> AsyncIterator[StartServer]:
    """Start servers on free loopback ports; shut each down gracefully at the end."""
    stops: list[trio.Event] = []
    clients: list[httpx.AsyncClient] = []

    async def start(**knobs: Any) -> Server:
        """A server on ``SimEngine(**knobs)``; ``limits`` (or ``max_body_bytes``) and
        ``model`` to ``serve``."""
        body_limit = ServerLimits(max_body_bytes=knobs.pop("max_body_bytes", 1 << 20))
        options = {"limits": knobs.pop("limits", body_limit), "model": knobs.pop("model", MODEL)}
        engine = ts.SimEngine(**knobs)
        stop = trio.Event()
        stops.append(stop)
        urls = await nursery.start(
            partial(serve, engine, port=0, handle_signals=False, shutdown=stop, **options)
        )
        client = httpx.AsyncClient(base_url=urls[0], timeout=10)
        clients.append(client)
        return Server(urls[0], engine, client)

    yield start
    for client in clients:
        await client.aclose()
    for stop in stops:
        stop.set()


async def eventually(check: Callable[[], bool | Awaitable[bool]]) -> None:
    """Wait, bounded, until ``check()`` holds: state that no event announces to the test."""
    with trio.fail_after(5):
        while True:
            result = check()
            if await result if isinstance(result, Awaitable) else result:
                return
            await trio.sleep(0.005)


def sse_payloads(text: str) -> list[Any]:
    return [
        line[len("data: ") :] if line == "data: [DONE]" else json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


# -- plain endpoints ---------------------------------------------------------


async def test_health_models_capabilities_and_metrics(start_server: StartServer) -> None:
    server = await start_server()
    client = server.client
    assert (await client.get("/health")).json() == {"status": "ok"}
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    caps = (await client.get("/capabilities")).json()
    assert caps["schema_version"] == 1
    assert caps["engine"] == {
        "kind": "sim",
        "sglang_version": "0.5.23",
        "disaggregation_mode": None,
        "sglang_semantics": None,
    }
    assert caps["role"] == "aggregated"
    assert caps["features"]["cancel_before_first_output_v1"] is True
    metrics = (await client.get("/metrics")).text
    for name in (
        "trio_sglang_engine_live_requests",
        "trio_sglang_cleanup_tasks_in_flight",
        "trio_sglang_abort_delay_seconds_bucket",
        "trio_sglang_open_streams",
    ):
        assert name in metrics
    info = (await client.get("/server_info")).json()
    assert info["served_model_name"] == MODEL
    assert (await client.get("/get_model_info")).json()["model_path"] == MODEL
    assert (await client.get("/nope")).status_code == 404
    not_allowed = await client.get("/generate")
    assert (not_allowed.status_code, not_allowed.headers["allow"]) == (405, "POST")
    not_allowed = await client.post("/health")
    assert (not_allowed.status_code, not_allowed.headers["allow"]) == (405, "GET, HEAD")


# -- generation ----------------------------------------------------------------


async def test_completions_stream_and_not(start_server: StartServer) -> None:
    server = await start_server(first_token_delay=0.001, token_interval=0.001)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "n": 2}
    whole = (await server.client.post("/v1/completions", json=body)).json()
    assert whole["id"].startswith("cmpl-")
    assert whole["object"] == "text_completion"
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in whole["choices"])
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = await server.client.post("/v1/completions", json=stream_body)
    assert response.headers["content-type"] == "text/event-stream"
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 8
    chunks = events[:-2]
    # One chunk per token, unless a child's tokens came faster than they were sent (then
    # they are coalesced, as SGLang's TokenizerManager coalesces a backlog).
    assert len(chunks) <= 8
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert server.engine.live_rids() == set()


async def test_chat_completions(start_server: StartServer) -> None:
    server = await start_server(first_token_delay=0.001, token_interval=0.001)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    whole = (await server.client.post("/v1/chat/completions", json=body)).json()
    assert whole["id"].startswith("chatcmpl-")
    assert whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["usage"]["completion_tokens"] == 3
    response = await server.client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = sse_payloads(response.text)[:-1]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "role" not in chunks[1]["choices"][0]["delta"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_generate_native_with_the_callers_rid(start_server: StartServer) -> None:
    server = await start_server(first_token_delay=0.001, token_interval=0.001)
    body = {"text": "hi", "rid": "my-rid", "sampling_params": {"max_new_tokens": 3}}
    whole = (await server.client.post("/generate", json=body)).json()
    assert whole["meta_info"]["id"] == "my-rid"
    assert len(whole["output_ids"]) == 3
    streamed = sse_payloads(
        (await server.client.post("/generate", json={**body, "stream": True})).text
    )
    assert streamed[-1] == "[DONE]"
    assert {c["meta_info"]["id"] for c in streamed[:-1]} == {"my-rid"}
    batch = {"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": {"max_new_tokens": 2}}
    results = (await server.client.post("/generate", json=batch)).json()
    assert [r["meta_info"]["id"] for r in results] == ["x", "y"]
    internal = {e.rid for e in server.engine.trace}
    assert "my-rid" not in internal
    assert not internal & {"x", "y"}


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", b"{not json", 400, "malformed JSON"),
        ("/v1/completions", b"[1, 2]", 400, "must be an object"),
        ("/v1/completions", {"model": 7, "prompt": "hi"}, 400, "'model' must be a string"),
        ("/v1/completions", {"model": MODEL, "prompt": 7}, 400, "'prompt'"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n must be"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": -1},
            400,
            "'max_tokens'",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "'stream'"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "logprobs": 1},
            400,
            "'logprobs' is not supported",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "'messages'"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x"}]}, 400, "role"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": -3}},
            400,
            "max_new_tokens",
        ),
        ("/generate", {"sampling_params": {}}, 400, "'text' or 'input_ids'"),
        ("/generate", {"text": "x" * 5000}, 413, "over 4096 bytes"),
    ],
)
async def test_bad_requests_get_a_clear_4xx_and_reach_nothing(
    start_server: StartServer, path: str, body: Any, status: int, message: str
) -> None:
    server = await start_server(max_body_bytes=4096)
    if isinstance(body, bytes):
        response = await server.client.post(path, content=body, headers=JSON)
    else:
        response = await server.client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"]
    # OpenAI's shape: the status is the response's, ``code`` a string or null (null here).
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", None)
    assert list(server.engine.trace) == []


# -- a disconnect cancels --------------------------------------------------------


async def raw_request(port: int, path: str, body: dict[str, Any]) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + data)
    return stream


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    seen = b""
    with trio.fail_after(5):
        while marker not in seen:
            seen += await stream.receive_some(65536)
    return seen


def engine_end(engine: ts.SimEngine) -> tuple[float, str]:
    (event,) = [e for e in engine.trace if e.kind in ("abort_applied", "released")]
    return event.time, event.kind


async def test_disconnect_before_headers_reaches_nothing(start_server: StartServer) -> None:
    server = await start_server()
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    await stream.send_all(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n" + b'{"text": "'
    )
    await stream.aclose()
    await eventually_metric(server, "trio_sglang_cancellations_total", phase="before_headers")
    assert list(server.engine.trace) == []


async def eventually_metric(server: Server, name: str, **labels: str) -> None:
    async def counted() -> bool:
        return await server.metric(name, **labels) >= 1

    await eventually(counted)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_disconnect_before_the_first_token_aborts_after_dispatch(
    start_server: StartServer, path: str
) -> None:
    server = await start_server(tokenize_delay=0.01, first_token_delay=30.0)
    body: dict[str, Any] = {"text": "hi", "stream": True}
    if path != "/generate":
        body = {"model": MODEL, "prompt": "hi", "stream": True}
    stream = await raw_request(server.port, path, body)
    await eventually(lambda: "dispatched" in [e.kind for e in server.engine.trace])
    left = trio.current_time()
    await stream.aclose()
    await eventually(lambda: server.engine.live_rids() == set())
    ended, kind = engine_end(server.engine)
    assert kind == "abort_applied"
    assert "token" not in [e.kind for e in server.engine.trace]
    print(f"{path}: disconnect before the first token -> abort {1e3 * (ended - left):.2f} ms")
    await eventually_metric(server, "trio_sglang_cancellations_total", phase="before_first_token")


async def test_disconnect_while_the_stream_is_idle_between_tokens(
    start_server: StartServer,
) -> None:
    # Tokens 30 s apart: the client leaves right after the first one, while
    # the response is idle; the server must notice without sending anything.
    server = await start_server(first_token_delay=0.01, token_interval=30.0)
    stream = await raw_request(server.port, "/generate", {"text": "hi", "stream": True})
    await read_until(stream, b"data: ")
    left = trio.current_time()
    await stream.aclose()
    await eventually(lambda: server.engine.live_rids() == set())
    ended, kind = engine_end(server.engine)
    assert kind == "abort_applied"
    assert [e.kind for e in server.engine.trace].count("token") == 1
    print(f"disconnect mid-stream (idle) -> abort {1e3 * (ended - left):.2f} ms")
    assert await server.metric("trio_sglang_cancellations_total", phase="mid_stream") == 1


async def test_disconnect_during_tokenization_releases_before_dispatch(
    start_server: StartServer,
) -> None:
    server = await start_server(tokenize_delay=30.0)
    stream = await raw_request(server.port, "/generate", {"text": "hi", "stream": True})
    await eventually(lambda: "registered" in [e.kind for e in server.engine.trace])
    await stream.aclose()
    await eventually(lambda: server.engine.live_rids() == set())
    assert [e.kind for e in server.engine.trace] == ["registered", "released"]


# -- the openai SDK ------------------------------------------------------------------


def sdk_session(base_url: str) -> tuple[str, str, str]:
    """Stream and leave early, then a whole chat completion; in a worker thread."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    try:
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=500, stream=True)
        first = next(iter(stream))
        stream.close()  # the client goes away mid-stream
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        return first.id, chat.id, chat.choices[0].message.content or ""
    finally:
        client.close()


async def test_openai_sdk_streams_and_closing_early_cancels(start_server: StartServer) -> None:
    server = await start_server(first_token_delay=0.001, token_interval=0.05)
    stream_id, chat_id, content = await trio.to_thread.run_sync(sdk_session, server.url)
    assert stream_id.startswith("cmpl-")
    assert chat_id.startswith("chatcmpl-")
    assert content
    await eventually(lambda: server.engine.live_rids() == set())
    kinds = [e.kind for e in server.engine.trace]
    assert kinds.count("abort_applied") == 1  # the early-closed stream
    assert kinds.count("token") < 500


async def test_openai_sdk_sees_a_clear_error_for_a_bad_request(start_server: StartServer) -> None:
    server = await start_server()

    def call() -> None:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with client:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)

    with pytest.raises(openai.BadRequestError, match="maximum context length") as raised:
        await trio.to_thread.run_sync(call)
    error = raised.value
    assert (error.code, error.type, error.param) == (
        "context_length_exceeded",
        "invalid_request_error",
        "max_tokens",
    )


async def test_a_broken_http2_connection_does_not_take_the_server_down(
    start_server: StartServer,
) -> None:
    # sglang-router probes workers with gRPC over cleartext HTTP/2; hypercorn's
    # HTTP/2 code can raise on such connections. Each must end alone.
    server = await start_server()
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for junk in (b"", b"\x00\x00\x00\x04\x00\x00\x00\x00\x00", b"\xff" * 64):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(preface + junk)
        await stream.aclose()
    assert (await server.client.get("/health")).json() == {"status": "ok"}
