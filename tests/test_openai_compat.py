"""OpenAI's API as its clients expect it: error bodies, model names, usage on every chunk.

Servers run in the test's trio run on loopback (``test_server.py``'s
``start_server``); the clients are httpx and the openai SDK's ``AsyncOpenAI``,
which parses what it is sent into its own types, errors included.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio

import test_server
import trio_sglang as ts
from test_server import MODEL, StartServer, sse_payloads
from trio_sglang.server import ServerLimits, serve
from trio_sglang.testing import Faults, FaultyEngine

#: test_server.py's fixture: servers on free loopback ports, stopped at the test's end.
start_server = test_server.start_server

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
FAST = {"first_token_delay": 0.001, "token_interval": 0.001}


def sdk(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def stream_in_thread(url: str, path: str, request: dict[str, Any]) -> list[Any]:
    """Every chunk of a stream, read by the sync SDK (run it in a worker thread).

    The async SDK leaves async generators of its own unclosed after a stream,
    which trio reports as it collects them.
    """
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        if path == "/v1/completions":
            return list(client.completions.create(**request))
        return list(client.chat.completions.create(**request))


# -- error bodies ---------------------------------------------------------------------


async def test_every_error_is_in_openais_shape(start_server: StartServer) -> None:
    """``{"error": {message, type, param, code}}``; ``code`` a string or null, never the status."""
    server = await start_server(limits=ServerLimits(api_key="k", max_body_bytes=1024))
    client = server.client
    key = {"authorization": "Bearer k"}
    big = {**COMPLETION, "prompt": "x" * 2048}
    cases: list[tuple[httpx.Response, int, str, str | None, str | None]] = [
        (await client.get("/v1/models"), 401, "invalid_request_error", None, "invalid_api_key"),
        (await client.get("/nope", headers=key), 404, "invalid_request_error", None, None),
        (await client.get("/generate", headers=key), 405, "invalid_request_error", None, None),
        (
            await client.post("/v1/completions", content=b"{}", headers=key),
            415,
            "invalid_request_error",
            None,
            "unsupported_media_type",
        ),
        (
            await client.post("/v1/completions", json=big, headers=key),
            413,
            "invalid_request_error",
            None,
            None,
        ),
        (
            await client.post("/v1/completions", json={**COMPLETION, "n": 0}, headers=key),
            400,
            "invalid_request_error",
            "n",
            None,
        ),
        (
            await client.post(
                "/v1/completions", json={**COMPLETION, "max_tokens": 10**6}, headers=key
            ),
            400,
            "invalid_request_error",
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            await client.post(
                "/v1/completions", json={**COMPLETION, "model": f"{MODEL}:lora"}, headers=key
            ),
            400,
            "invalid_request_error",
            "model",
            "model_not_found",
        ),
    ]
    for response, status, kind, param, code in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str)
        assert (error["type"], error["param"], error["code"]) == (kind, param, code), status
    assert list(server.engine.trace) == []


async def test_the_openai_sdk_reads_every_field_of_an_error(start_server: StartServer) -> None:
    server = await start_server(limits=ServerLimits(api_key="k"))
    async with sdk(server.url, key="wrong") as stranger:
        with pytest.raises(openai.AuthenticationError) as unauthorized:
            await stranger.completions.create(model=MODEL, prompt="hi")
    async with sdk(server.url, key="k") as client:
        with pytest.raises(openai.BadRequestError, match="LoRA adapter 'v2'") as adapter:
            await client.completions.create(model=f"{MODEL}:v2", prompt="hi")
        with pytest.raises(openai.NotFoundError, match="no route /v1/embeddings") as no_route:
            await client.embeddings.create(model=MODEL, input="hi")
    for raised, status, param, code in (
        (unauthorized, 401, None, "invalid_api_key"),
        (adapter, 400, "model", "model_not_found"),
        (no_route, 404, None, None),
    ):
        error = raised.value
        assert (error.status_code, error.type, error.param, error.code) == (
            status,
            "invalid_request_error",
            param,
            code,
        )


async def test_an_error_after_the_stream_started_is_an_event_the_sdk_raises(
    nursery: trio.Nursery,
) -> None:
    engine = FaultyEngine(ts.SimEngine(**FAST), Faults(stream_error_after=2))
    stop = trio.Event()
    urls = await nursery.start(
        partial(serve, engine, port=0, model=MODEL, handle_signals=False, shutdown=stop)
    )
    request = {**COMPLETION, "stream": True}
    try:
        with pytest.raises(openai.APIError, match="the engine failed") as raised:
            await trio.to_thread.run_sync(stream_in_thread, urls[0], "/v1/completions", request)
    finally:
        stop.set()
    assert (raised.value.type, raised.value.code) == ("server_error", "engine_error")


# -- model names -------------------------------------------------------------------------


async def test_every_name_is_listed_and_any_name_is_served(start_server: StartServer) -> None:
    """As SGLang 0.5.23 does: any model is served, and named back as the client sent it."""
    server = await start_server(model=("primary", "alias"), **FAST)
    client = server.client
    models = (await client.get("/v1/models")).json()["data"]
    assert [model["id"] for model in models] == ["primary", "alias"]
    assert (await client.get("/server_info")).json()["served_model_name"] == "primary"
    async with sdk(server.url) as openai_client:
        for name in ("primary", "alias", "gpt-4o", "primary:"):
            completion = await openai_client.completions.create(
                model=name, prompt="hi", max_tokens=2
            )
            assert completion.model == name
            chat = await openai_client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.model == name
    # No model: SGLang's default name, "default".
    unnamed = {key: value for key, value in COMPLETION.items() if key != "model"}
    assert (await client.post("/v1/completions", json=unnamed)).json()["model"] == "default"
    streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert {chunk["model"] for chunk in sse_payloads(streamed.text)[:-1]} == {MODEL}


# -- usage on every chunk ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_puts_each_choices_usage_on_its_chunks(
    start_server: StartServer, path: str
) -> None:
    server = await start_server(first_token_delay=0.001, token_interval=0.0005)
    body = COMPLETION if path == "/v1/completions" else CHAT
    options = {"continuous_usage_stats": True}
    request = {**body, "n": 2, "max_tokens": 12, "stream": True, "stream_options": options}
    chunks = sse_payloads((await server.client.post(path, json=request)).text)
    assert chunks.pop() == "[DONE]"
    words: dict[int, int] = defaultdict(int)
    for chunk in chunks:
        (choice,) = chunk["choices"]  # no usage-only chunk without include_usage
        text = choice["text"] if path == "/v1/completions" else choice["delta"]["content"]
        words[choice["index"]] += len(text.split())
        # That choice's own usage, up to this chunk: the SimEngine's tokens are words,
        # and a chunk that carries several tokens (a coalesced backlog) counts them all.
        prompt = chunks[0]["usage"]["prompt_tokens"]
        assert chunk["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": words[choice["index"]],
            "total_tokens": prompt + words[choice["index"]],
        }
    assert dict(words) == {0: 12, 1: 12}


async def test_include_usage_still_ends_the_stream_with_the_total(
    start_server: StartServer,
) -> None:
    server = await start_server(**FAST)
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = {**CHAT, "n": 2, "stream": True, "stream_options": options}
    chunks = await trio.to_thread.run_sync(
        stream_in_thread, server.url, "/v1/chat/completions", request
    )
    *choices, total = chunks
    assert all(chunk.usage is not None for chunk in choices)
    assert total.choices == []
    assert total.usage is not None
    assert (total.usage.completion_tokens, total.usage.total_tokens) == (8, 8 + 3)
    # Without stream_options: no usage anywhere.
    plain = await server.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert all("usage" not in chunk for chunk in sse_payloads(plain.text)[:-1])


@pytest.mark.parametrize(
    ("options", "status"),
    [
        ({"continuous_usage_stats": None, "include_usage": None}, 200),
        ({"continuous_usage_stats": "yes"}, 400),
        ({"continuous_usage_stats": 1}, 400),
    ],
)
async def test_stream_options_are_bools_or_null(
    start_server: StartServer, options: dict[str, Any], status: int
) -> None:
    server = await start_server(**FAST)
    request = {**COMPLETION, "stream": True, "stream_options": options}
    response = await server.client.post("/v1/completions", json=request)
    assert response.status_code == status, response.text
    if status == 400:
        assert json.loads(response.text)["error"]["param"] == "stream_options"
