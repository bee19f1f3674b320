"""Admission at the HTTP edge: what ``ServerLimits`` refuses, and that it never reaches the engine.

Servers run in the test's trio run on loopback (``test_server.py``'s
``start_server``). Every refusal is judged by its status, its OpenAI-shaped
body and ``param``, its count in ``trio_sglang_requests_refused_total``, and
by the SimEngine: no event of any kind for a refused request. The accepted
cases next to them show that each check lets the right requests through.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio

import test_server
import trio_sglang as ts
from test_server import MODEL, Server, StartServer, eventually
from trio_sglang._limits import parse_address
from trio_sglang.server import HTTPPrefill, ServerLimits, ServerMetrics, open_http_kv_rooms, serve
from trio_sglang.server._admission import Admission, Refused

#: test_server.py's fixture: servers on free loopback ports, stopped at the test's end.
start_server = test_server.start_server

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
GENERATE = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}


def events(server: Server) -> int:
    """Everything that ever reached the engine."""
    return sum(server.engine.event_counts().values())


def assert_error(
    response: httpx.Response, status: int, kind: str, param: str | None, code: str
) -> str:
    """An error in OpenAI's shape, ``code`` a string (never the status); its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (kind, param, code)
    assert isinstance(error["message"], str)
    return error["message"]


async def refused(server: Server, reason: str) -> float:
    return await server.metric("trio_sglang_requests_refused_total", reason=reason)


# -- access ------------------------------------------------------------------------


async def test_the_api_key_guards_every_route_but_health(start_server: StartServer) -> None:
    server = await start_server(limits=ServerLimits(api_key="s3cret"))
    client = server.client
    wrong = [
        {},
        {"authorization": "Bearer nope"},
        {"authorization": "Bearer s3cret-and-more"},
        {"authorization": "Basic s3cret"},
        {"authorization": "s3cret"},
    ]
    with trio.fail_after(10):
        for headers in wrong:
            response = await client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert_error(response, 401, "invalid_request_error", None, "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/models", "/metrics", "/capabilities", "/nope"):
            assert (await client.get(path)).status_code == 401, path
        assert (await client.get("/health")).status_code == 200
        assert events(server) == 0

        client.headers["authorization"] = "Bearer s3cret"
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        chat = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "bearer s3cret"}
        )
        assert chat.status_code == 200
        assert await refused(server, "unauthorized") == len(wrong) + 4


async def test_the_host_header_must_name_an_allowed_host(start_server: StartServer) -> None:
    hosts = ("127.0.0.1", "Example.COM:8080", "[::1]")
    server = await start_server(limits=ServerLimits(allowed_hosts=hosts))
    client = server.client
    with trio.fail_after(10):
        for host in ("evil.example", "example.com", "example.com:9090", "127.0.0.2", "[::2]"):
            for path in ("/health", "/generate"):
                response = await client.post(path, json=GENERATE, headers={"host": host})
                assert_error(response, 400, "invalid_request_error", None, "host_not_allowed")
        assert events(server) == 0
        for host in ("EXAMPLE.com:8080", "[::1]:1234", "127.0.0.1:1", "127.0.0.1"):
            response = await client.post("/generate", json=GENERATE, headers={"host": host})
            assert response.status_code == 200, host
        assert (await client.get("/health")).status_code == 200  # httpx's own Host header
        assert await refused(server, "host_not_allowed") == 10


async def test_a_wrong_route_answered_unread_leaves_the_connection_to_the_next_one(
    start_server: StartServer,
) -> None:
    """Answered before its body is read, a request to a wrong route still ends its exchange.

    Each request's headers go first and its body a moment later, as httpx
    sends them. The body is read and dropped before the answer, so the next
    request on the same connection is answered too. Answered with its body
    still unread, the exchange was not over, hypercorn closed the connection,
    and the next request was lost.
    """
    server = await start_server(limits=ServerLimits(allowed_hosts=("127.0.0.1",)))
    body = json.dumps(GENERATE).encode()
    wrong = [
        (b"/nowhere", b"host: 127.0.0.1\r\ncontent-type: application/json"),
        (b"/health", b"host: 127.0.0.1"),  # GET only
    ]
    answers = b""
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        for path, head in wrong:
            await stream.send_all(b"POST %s HTTP/1.1\r\n%s\r\n" % (path, head))
            await stream.send_all(b"content-length: %d\r\n\r\n" % len(body))
            with trio.move_on_after(0.2):  # time to answer before the body, if it would
                answers += await stream.receive_some()
            await stream.send_all(body)
        await stream.send_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        with trio.fail_after(10):
            while answers.count(b"HTTP/1.1 ") < 3 or not answers.endswith(b"\r\n\r\n"):
                received = await stream.receive_some()
                assert received, f"the server closed the connection: {answers!r}"
                answers += received
    lines = answers.split(b"\r\n")
    statuses = [int(line.split()[1]) for line in lines if line.startswith(b"HTTP/1.1 ")]
    assert statuses == [404, 405, 200]
    assert b"connection: close" not in answers.lower()


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"host: evil.example\r\ncontent-type: application/json", 400),
        (b"host: 127.0.0.1\r\ncontent-type: text/plain", 415),
        (b"host: 127.0.0.1\r\ncontent-type: application/json\r\nauthorization: Bearer no", 401),
    ],
)
async def test_a_refusal_goes_at_once_and_closes_the_connection(
    start_server: StartServer, head: bytes, status: int
) -> None:
    """Without this rule a refusal waited for the body (up to the read timeout, 30 s): a
    client that never sent one held its connection slot, key or no key, all that time."""
    limits = ServerLimits(allowed_hosts=("127.0.0.1",), api_key="k", request_read_timeout=30.0)
    server = await start_server(limits=limits)
    if status != 401:
        head += b"\r\nauthorization: Bearer k"
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        # Headers that promise a body, and no body.
        promise = b"content-length: 100\r\n\r\n"
        await stream.send_all(b"POST /generate HTTP/1.1\r\n%s\r\n%s" % (head, promise))
        answer = b""
        with trio.fail_after(5):  # the answer at once, then the close within the linger
            while received := await stream.receive_some():
                answer += received
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer
    assert b"connection: close" in answer.lower()


async def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
    start_server: StartServer,
) -> None:
    """RFC 9112, 6.3. Without this rule the connection stayed open, and the bytes after the
    chunked body ran as a request of their own: here an abort_all."""
    server = await start_server()
    smuggled = (
        b"POST /abort_request HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\ncontent-length: 18\r\n\r\n"
        b'{"abort_all": true}'
    )
    request = (
        b"POST /health HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n%s" % (5 + len(smuggled), smuggled)
    )
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        await stream.send_all(request)
        answer = b""
        with trio.fail_after(5):
            while received := await stream.receive_some():
                answer += received
    assert answer.count(b"HTTP/1.1 ") == 1, answer
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"Content-Length and Transfer-Encoding" in answer
    assert await refused(server, "bad_framing") == 1


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("localhost", ("localhost", None)),
        ("LocalHost:8000", ("localhost", 8000)),
        ("[::1]", ("::1", None)),
        ("[::1]:80", ("::1", 80)),
        ("::1", ("::1", None)),
        ("host:", ("host", None)),
        ("[::1", None),
        ("[::1]x", None),
        (":80", None),
        ("host:8o", None),
        ("host:" + "9" * 5000, None),
    ],
)
def test_host_and_port_are_read_as_http_writes_them(
    text: str, address: tuple[str, int | None] | None
) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize("setting", ["allowed_hosts", "allowed_bootstrap_hosts"])
def test_a_malformed_host_entry_is_a_configuration_error(setting: str) -> None:
    with pytest.raises(ValueError, match=setting):
        ServerLimits(**{setting: ("[::1",)})


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, 415),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("application/jsonx", 415),
        ("application/json", 200),
        ("Application/JSON; charset=utf-8", 200),
    ],
)
async def test_generation_bodies_must_be_json(
    start_server: StartServer, content_type: str | None, status: int
) -> None:
    server = await start_server()
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps(GENERATE).encode()
    with trio.fail_after(10):
        response = await server.client.post("/generate", content=body, headers=headers)
    if status == 415:
        assert_error(response, 415, "invalid_request_error", None, "unsupported_media_type")
        assert events(server) == 0
        assert await refused(server, "unsupported_media_type") == 1
    else:
        assert response.status_code == 200, response.text


# -- load ---------------------------------------------------------------------------


async def test_past_max_running_requests_the_server_answers_503(
    start_server: StartServer,
) -> None:
    server = await start_server(first_token_delay=30.0, limits=ServerLimits(max_running_requests=1))
    client = server.client
    stream = {"text": "Hello", "stream": True}
    with trio.fail_after(10):
        async with client.stream("POST", "/generate", json=stream) as first:
            assert first.status_code == 200
            # Then nothing happens at the engine until its first token, 30 s away.
            await eventually(lambda: server.engine.event_counts()["dispatched"] == 1)
            before = events(server)
            response = await client.post("/v1/completions", json=COMPLETION)
            assert_error(response, 503, "server_error", None, "overloaded")
            assert response.headers["retry-after"] == "1"
            assert events(server) == before
        # The first request's handler has ended once its outcome is counted.
        await eventually(
            partial(
                server.metric,
                "trio_sglang_requests_total",
                endpoint="/generate",
                outcome="cancelled",
            )
        )
        async with client.stream("POST", "/generate", json=stream) as again:
            assert again.status_code == 200
        assert await refused(server, "overloaded") == 1


# -- the request's own bounds -----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"], "n": 2}),
        ("/v1/chat/completions", {**CHAT, "n": 5}),
        ("/generate", {"text": ["a"] * 5}),
        ("/generate", {"input_ids": [[1], [2], [3]], "sampling_params": {"n": 2}}),
        ("/generate", {"text": ["a", "b", "c"], "sampling_params": [{"n": 2}] * 3}),
        ("/generate", {"text": "a", "sampling_params": {"n": 10**30}}),
    ],
)
async def test_prompts_times_n_is_bounded(
    start_server: StartServer, path: str, body: dict[str, Any]
) -> None:
    server = await start_server(limits=ServerLimits(max_children_per_request=4))
    with trio.fail_after(10):
        response = await server.client.post(path, json=body)
        message = assert_error(response, 400, "invalid_request_error", "n", "too_many_children")
        assert message.endswith("the most one request may ask for is 4")
        assert events(server) == 0
        assert await refused(server, "too_many_children") == 1
        four = {**COMPLETION, "prompt": ["a", "b"], "n": 2}
        accepted = await server.client.post("/v1/completions", json=four)
        assert len(accepted.json()["choices"]) == 4


@pytest.mark.parametrize(
    "body",
    [
        {**GENERATE, "rid": "r" * 9},
        {"text": ["a", "b"], "rid": ["a", "r" * 9]},
        # Not long, but not printable: a line break would forge log lines.
        {**GENERATE, "rid": "r\nERROR x"},
        {**GENERATE, "rid": "\x1b[2J"},
    ],
)
async def test_a_long_rid_is_refused(start_server: StartServer, body: dict[str, Any]) -> None:
    server = await start_server(limits=ServerLimits(max_rid_length=8))
    with trio.fail_after(10):
        response = await server.client.post("/generate", json=body)
        assert_error(response, 400, "invalid_request_error", "rid", "rid_too_long")
        assert events(server) == 0
        assert await refused(server, "rid_too_long") == 1
        accepted = await server.client.post("/generate", json={**GENERATE, "rid": "r" * 8})
        assert accepted.json()["meta_info"]["id"] == "r" * 8


IDS_60 = list(range(1, 61))
TOTAL = "a total of 100 tokens"


def budget(tokens: int) -> dict[str, int]:
    return {"max_new_tokens": tokens}


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": 2**31}, "max_tokens", "of 100 tokens"),
        (
            "/v1/completions",
            {**COMPLETION, "prompt": IDS_60, "max_tokens": 40},
            "max_tokens",
            TOTAL,
        ),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 100}, "max_tokens", "100 tokens for"),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 100},
            "max_completion_tokens",
            "of 100 tokens",
        ),
        ("/generate", {"text": "a", "sampling_params": budget(100)}, "max_new_tokens", "alone"),
        (
            "/generate",
            {"input_ids": IDS_60, "sampling_params": budget(40)},
            "max_new_tokens",
            TOTAL,
        ),
        (
            "/generate",
            {"input_ids": [[1], IDS_60], "sampling_params": [budget(1), budget(40)]},
            "max_new_tokens",
            "60 tokens from the input messages and 40 tokens for the completion",
        ),
        (
            "/generate",
            {"input_ids": list(range(100))},
            "input_ids",
            "The input (100 tokens) is longer than the model's context length (100 tokens).",
        ),
    ],
)
async def test_what_cannot_fit_the_context_is_refused(
    start_server: StartServer, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    server = await start_server(context_length=100, token_interval=0.001)
    with trio.fail_after(10):
        response = await server.client.post(path, json=body)
        assert words in assert_error(
            response, 400, "invalid_request_error", param, "context_length_exceeded"
        )
        assert events(server) == 0
        assert await refused(server, "context_length") == 1
        fits = {"input_ids": IDS_60, "sampling_params": budget(39)}
        assert (await server.client.post("/generate", json=fits)).status_code == 200


async def test_the_servers_context_length_overrides_the_engines(
    start_server: StartServer,
) -> None:
    server = await start_server(limits=ServerLimits(context_length=50))
    assert server.engine.features().context_length == 32768
    with trio.fail_after(10):
        response = await server.client.post(
            "/v1/completions", json={**COMPLETION, "max_tokens": 50}
        )
        assert "of 50 tokens" in assert_error(
            response, 400, "invalid_request_error", "max_tokens", "context_length_exceeded"
        )
        assert events(server) == 0


# -- bootstrap addresses on a decode server --------------------------------------------------


@asynccontextmanager
async def decode_server(limits: ServerLimits) -> AsyncIterator[httpx.AsyncClient]:
    """A decode server with no prefill peer; its engine reaches KV rooms over HTTP."""
    rooms_opened = open_http_kv_rooms(http_timeout=0.5, delivery_timeout=0.5, shutdown_grace=0.1)
    async with rooms_opened as rooms, trio.open_nursery() as nursery:
        engine = ts.SimEngine(disaggregation_mode="decode", kv_rooms=rooms)
        stop = trio.Event()
        run = partial(
            serve, engine, port=0, model=MODEL, handle_signals=False, shutdown=stop, limits=limits
        )
        (url,) = await nursery.start(run)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                yield client
        finally:
            stop.set()


def listening() -> socket.socket:
    """A loopback socket that listens but never accepts: a connection waits in its queue."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def connected(sock: socket.socket) -> bool:
    """Whether anything connected to ``sock`` (accepted here, at once, and closed)."""
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


async def test_a_decode_server_reaches_only_allowed_bootstrap_addresses() -> None:
    with listening() as forbidden, listening() as allowed:
        port = allowed.getsockname()[1]
        limits = ServerLimits(allowed_bootstrap_hosts=(f"127.0.0.1:{port}", "prefill.internal"))
        with trio.fail_after(10):
            async with decode_server(limits) as client:
                other = forbidden.getsockname()[1]
                bodies: list[tuple[str, dict[str, Any]]] = [
                    ("/generate", {**GENERATE, "bootstrap_port": other}),
                    (
                        "/generate",
                        {**GENERATE, "bootstrap_host": "LOCALHOST", "bootstrap_port": port},
                    ),
                    ("/generate", {**GENERATE, "bootstrap_host": "127.0.0.1"}),
                    ("/generate", {"text": ["a", "b"], "bootstrap_port": [port, other]}),
                    ("/v1/completions", {**COMPLETION, "bootstrap_port": other}),
                    ("/v1/chat/completions", {**CHAT, "bootstrap_host": "10.0.0.1"}),
                    # Hosts that no URL can carry as written (the brackets once passed
                    # the allow-list, then made an URL httpx refused, which ended the
                    # process, or hung the request).
                    *(
                        ("/generate", {**GENERATE, "bootstrap_host": host, "bootstrap_port": port})
                        for host in ("[127.0.0.1]", "[127.0.0.1", "127.0.0.1]", "127.0.0.1/x")
                    ),
                ]
                for path, body in bodies:
                    body = {"bootstrap_host": "127.0.0.1", "bootstrap_room": 7, **body}
                    response = await client.post(path, json=body)
                    assert_error(
                        response,
                        400,
                        "invalid_request_error",
                        "bootstrap_host",
                        "bootstrap_not_allowed",
                    )
                metrics = (await client.get("/metrics")).text
                assert (
                    'trio_sglang_requests_refused_total{reason="bootstrap_not_allowed"} 10.0'
                    in metrics
                )
                assert 'trio_sglang_sim_events_total{kind="registered"} 0.0' in metrics
                # An allowed address is reached: the decode engine's handshake arrives there.
                body = {
                    **GENERATE,
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": port,
                    "bootstrap_room": 7,
                    "stream": True,
                }
                async with client.stream("POST", "/generate", json=body) as response:
                    assert response.status_code == 200
                    await eventually(lambda: connected(allowed))
                assert not connected(forbidden)


async def test_the_prefill_peers_bootstrap_address_is_allowed() -> None:
    async with HTTPPrefill("http://127.0.0.1:8100") as peer:
        admission = Admission(
            ServerLimits(), ServerMetrics(), context_length=None, decode=True, prefill=peer
        )
        body = {**GENERATE, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8100}
        admission.check_request("/generate", body, body)
        for wrong in ({"bootstrap_port": 8101}, {"bootstrap_host": "127.0.0.2"}):
            with pytest.raises(Refused) as refusal:
                admission.check_request("/generate", {**body, **wrong}, {**body, **wrong})
            assert refusal.value.param == "bootstrap_host"
    # Not a decode server: its engine connects nowhere, so any address passes.
    aggregated = Admission(ServerLimits(), ServerMetrics(), context_length=None, decode=False)
    anywhere = {**body, "bootstrap_host": "10.0.0.1"}
    aggregated.check_request("/generate", anywhere, anywhere)


def test_the_engines_no_transfer_host_passes_and_only_it() -> None:
    """SGLang's health check and warm-up send its fake bootstrap host to a decode server:
    the engine fakes the KV cache and connects nowhere, so the allow-list does not apply."""
    admission = Admission(
        ServerLimits(),
        ServerMetrics(),
        context_length=None,
        decode=True,
        no_transfer_host="2.2.2.2",
    )
    fake = {**GENERATE, "bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
    admission.check_request("/generate", fake, fake)
    for wrong in ({"bootstrap_host": "2.2.2.3"}, {"bootstrap_host": ["2.2.2.2", "10.0.0.1"]}):
        with pytest.raises(Refused) as refusal:
            admission.check_request("/generate", {**fake, **wrong}, {**fake, **wrong})
        assert refusal.value.param == "bootstrap_host"
