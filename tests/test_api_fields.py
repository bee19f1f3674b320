"""SGLang's request fields, as its clients send them: accepted, passed on, or refused by name.

A server on loopback, on a SimEngine that remembers every request the worker
sent it; the clients are the openai SDK (SGLang's fields in ``extra_body``, as
a benchmarking client sends ``min_tokens``) and httpx. What each route does
with SGLang 0.5.23's fields (``_protocol/_openai_fields.py``, ``_request/_fields.py``):

- a field SGLang maps reaches the engine under SGLang's name (``min_tokens``
  as ``min_new_tokens``, ``response_format`` as a ``json_schema``);
- a field the engine does not honour, or the server does not do, is a 400
  that names it as the client did, and reaches nothing;
- a field SGLang does not know is ignored, as SGLang ignores it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio

import trio_sglang as ts
from test_server import sse_payloads
from trio_sglang._cli._parser import build_parser
from trio_sglang.server import serve

MODEL = "trio-sglang-sim"
FAST = {"first_token_delay": 0.001, "token_interval": 0.001}
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
GENERATE = {"text": "Hello there", "sampling_params": {"max_new_tokens": 3}}


class SpyEngine(ts.SimEngine):
    """A SimEngine that remembers every request the worker sends it."""

    def __init__(self, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.requests: list[Mapping[str, Any]] = []

    def generate(self, request: Mapping[str, Any]) -> ts.EngineStream:
        self.requests.append(request)
        return super().generate(request)


@dataclass
class Server:
    url: str
    engine: SpyEngine
    client: httpx.AsyncClient
    sdk: openai.AsyncOpenAI = field(init=False)

    def __post_init__(self) -> None:
        self.sdk = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="k", max_retries=0)

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling parameters of the last request the engine got."""
        return dict(self.engine.requests[-1]["sampling_params"])


StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start_server(nursery: trio.Nursery) -> AsyncIterator[StartServer]:
    stops: list[trio.Event] = []
    servers: list[Server] = []

    async def start(**options: Any) -> Server:
        engine = SpyEngine(**FAST)
        stop = trio.Event()
        stops.append(stop)
        urls = await nursery.start(
            partial(
                serve, engine, port=0, model=MODEL, handle_signals=False, shutdown=stop, **options
            )
        )
        server = Server(urls[0], engine, httpx.AsyncClient(base_url=urls[0], timeout=10))
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.client.aclose()
        await server.sdk.close()
    for stop in stops:
        stop.set()


def stream_in_thread(url: str, **request: Any) -> list[Any]:
    """Every chunk of a chat stream, read by the sync SDK (in a worker thread).

    The async SDK leaves async generators of its own unclosed after a stream,
    which trio reports as it collects them.
    """
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:
        return list(client.chat.completions.create(**request))


async def refused(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error of a 400 that reached nothing at the engine."""
    seen = len(server.engine.requests)
    response = await server.client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert len(server.engine.requests) == seen
    error: dict[str, Any] = response.json()["error"]
    return error


# -- SGLang's sampling fields, mapped as SGLang maps them ------------------------------------

#: OpenAI field -> (a value, the sampling parameter SGLang makes of it).
SGLANG_EXTRAS: dict[str, tuple[Any, str]] = {
    "min_tokens": (2, "min_new_tokens"),
    "top_k": (20, "top_k"),
    "min_p": (0.05, "min_p"),
    "repetition_penalty": (1.1, "repetition_penalty"),
    "stop_token_ids": ([7], "stop_token_ids"),
    "stop_regex": ([r"\d+"], "stop_regex"),
    "no_stop_trim": (True, "no_stop_trim"),
    "ignore_eos": (True, "ignore_eos"),
    "skip_special_tokens": (False, "skip_special_tokens"),
    "custom_params": ({"k": 1}, "custom_params"),
    "watermark": ({"enabled": True}, "watermark"),
    "regex": ("[a-z ]+", "regex"),
}


async def test_the_sdk_sends_sglangs_fields_in_extra_body_and_the_engine_gets_them(
    start_server: StartServer,
) -> None:
    server = await start_server()
    extra = {key: value for key, (value, _) in SGLANG_EXTRAS.items()}
    expected = {param: value for value, param in SGLANG_EXTRAS.values()}
    completion = await server.sdk.completions.create(
        model=MODEL,
        prompt="Hello there",
        max_tokens=3,
        seed=-5,  # SGLang's sampling_seed is any int64
        temperature=0.5,
        logit_bias={"3": 1.5},
        extra_body=extra,
    )
    assert completion.choices[0].finish_reason == "length"
    assert server.sampling == {
        **expected,
        "max_new_tokens": 3,
        "sampling_seed": -5,
        "temperature": 0.5,
        "logit_bias": {"3": 1.5},
    }
    chat = await server.sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        top_p=0.9,
        extra_body=extra,
    )
    assert chat.choices[0].message.content
    assert server.sampling == {**expected, "max_new_tokens": 3, "top_p": 0.9}


async def test_a_streamed_chat_takes_sglangs_fields_too(start_server: StartServer) -> None:
    server = await start_server()
    chunks = await trio.to_thread.run_sync(
        partial(
            stream_in_thread,
            server.url,
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            extra_body={"min_tokens": 4, "top_k": 1, "repetition_penalty": 1.2},
        )
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks).split()
    assert server.sampling == {
        "max_new_tokens": 4,
        "min_new_tokens": 4,
        "top_k": 1,
        "repetition_penalty": 1.2,
    }


async def test_completions_json_schema_and_passed_fields_reach_the_engine(
    start_server: StartServer,
) -> None:
    server = await start_server()
    body = {
        **COMPLETION,
        "json_schema": '{"type": "string"}',
        "session_id": "s-1",
        "priority": 3,
        "cache_salt": "tenant",
        "extra_key": "k",
        "custom_labels": {"team": "a"},
        "routed_dp_rank": 0,
        "user": "someone",  # OpenAI's end-user id: SGLang takes it and ignores it
    }
    assert (await server.client.post("/v1/completions", json=body)).status_code == 200
    request = server.engine.requests[-1]
    assert request["sampling_params"]["json_schema"] == '{"type": "string"}'
    for key in ("session_id", "priority", "cache_salt", "extra_key", "custom_labels"):
        assert request[key] == body[key]
    assert "user" not in request


# -- response_format: SGLang's json_schema ----------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "json_object"}, {"json_schema": '{"type": "object"}'}),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}},
            {"json_schema": json.dumps(SCHEMA)},
        ),
        ({"type": "text"}, {}),
        (
            {"type": "structural_tag", "structures": [], "triggers": ["<f>"]},
            {
                "structural_tag": json.dumps(
                    {"type": "structural_tag", "structures": [], "triggers": ["<f>"]}
                )
            },
        ),
    ],
    ids=["json_object", "json_schema", "text", "structural_tag"],
)
async def test_response_format_becomes_sglangs_grammar(
    start_server: StartServer, response_format: dict[str, Any], expected: dict[str, str]
) -> None:
    """As SGLang's serving code maps it; the SimEngine takes the grammar, not enforcing it."""
    server = await start_server()
    chat = await server.sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format=response_format,  # type: ignore[arg-type]
    )
    assert chat.choices[0].finish_reason == "length"
    grammar = {k: v for k, v in server.sampling.items() if k in ("json_schema", "structural_tag")}
    assert grammar == expected
    completion = await server.sdk.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"response_format": response_format}
    )
    assert completion.choices[0].finish_reason == "length"
    grammar = {k: v for k, v in server.sampling.items() if k in ("json_schema", "structural_tag")}
    assert grammar == expected


async def test_chat_takes_a_bare_schema_as_sglang_does(start_server: StartServer) -> None:
    """ChatCompletionRequest.set_json_schema: ``{"type": "json_schema", "schema": {...}}``."""
    server = await start_server()
    body = {**CHAT, "response_format": {"type": "json_schema", "schema": SCHEMA}}
    assert (await server.client.post("/v1/chat/completions", json=body)).status_code == 200
    assert server.sampling["json_schema"] == json.dumps(SCHEMA)


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ("json", "'response_format' must be an object"),
        ({"type": "yaml"}, "'response_format.type' must be"),
        ({"type": "json_schema"}, "must be an object with a 'name'"),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "must be a JSON schema object"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "y"}},
            "strict' must be a bool",
        ),
        ({"type": "structural_tag"}, "needs 'format', or 'structures' and 'triggers'"),
    ],
)
async def test_a_bad_response_format_is_a_400(
    start_server: StartServer, response_format: object, message: str
) -> None:
    server = await start_server()
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = await refused(server, path, {**body, "response_format": response_format})
        assert message in error["message"]
        assert error["param"] == "response_format"


# -- checked as SGLang checks them, named as the client named them -----------------------------


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"min_tokens": 5}, "min_tokens", "min_tokens (5) exceeds max_tokens (3)"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be an int >= 0"),
        ({"top_k": 0}, "top_k", "top_k must be an int >= 1, or -1"),
        ({"min_p": 2}, "min_p", "min_p must be a number in [0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "in (0, 2]"),
        ({"seed": 2**63}, "seed", "seed must be an int in [-2**63, 2**63 - 1]"),
        ({"stop": ["x"] * 33}, "stop", "stop must be at most 32 strings"),
        ({"stop_regex": "("}, "stop_regex", "stop_regex must be regular expressions"),
        ({"regex": "a", "ebnf": "b"}, "ebnf", "only one of"),
        ({"regex": "a", "response_format": {"type": "json_object"}}, "regex", "only one of"),
        ({"watermark": {"color": 1}}, "watermark", "watermark has unknown fields"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "logit_bias must be an object of token ids"),
        ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be an int >= 1"),
        ({"n": 0}, "n", "n must be an int from 1 to 1024"),
        ({"user": 7}, "user", "'user' must be a str"),
        ({"rid": ["a"]}, "rid", "'rid' must be a non-empty string"),
        ({"priority": "high"}, "priority", "priority must be an int"),
    ],
)
async def test_sglangs_range_checks_in_the_clients_words(
    start_server: StartServer, fields: dict[str, Any], param: str, message: str
) -> None:
    server = await start_server()
    error = await refused(server, "/v1/completions", {**COMPLETION, **fields})
    assert message in error["message"]
    assert error["param"] == param
    assert server.engine.requests == []


async def test_the_sdk_raises_the_400_with_its_param(start_server: StartServer) -> None:
    server = await start_server()
    with pytest.raises(openai.BadRequestError) as raised:
        await server.sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"min_tokens": 3},
        )
    assert raised.value.param == "min_tokens"
    assert "min_tokens (3) exceeds max_tokens (2)" in raised.value.message


# -- refused by name: what the engine does not honour, what the server does not do ------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "lora_path": "adapter"}, "lora_path"),
        ("/v1/chat/completions", {**CHAT, "lora_path": "adapter"}, "lora_path"),
        (
            "/v1/completions",
            {**COMPLETION, "custom_logit_processor": "{}"},
            "custom_logit_processor",
        ),
        ("/v1/chat/completions", {**CHAT, "session_params": {"id": "s"}}, "session_params"),
        ("/generate", {**GENERATE, "lora_path": "adapter"}, "lora_path"),
        ("/generate", {**GENERATE, "image_data": "http://x/cat.png"}, "image_data"),
        ("/generate", {**GENERATE, "return_logprob": True}, "return_logprob"),
        ("/generate", {**GENERATE, "top_logprobs_num": 3}, "top_logprobs_num"),
        ("/generate", {**GENERATE, "token_ids_logprob": [1, 2]}, "token_ids_logprob"),
        ("/generate", {**GENERATE, "return_hidden_states": True}, "return_hidden_states"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"beam_width": 4}},
            "sampling_params.beam_width",
        ),
    ],
)
async def test_a_field_the_engine_does_not_honour_is_refused_by_name(
    start_server: StartServer, path: str, body: dict[str, Any], param: str
) -> None:
    server = await start_server()
    error = await refused(server, path, body)
    assert error["message"] == (
        f"'{param}' is not supported by the sim engine: leave it out, or at its default"
    )
    assert error["param"] == param
    assert list(server.engine.trace) == []


@pytest.mark.parametrize(
    ("path", "fields", "why"),
    [
        ("/v1/completions", {"logprobs": 0}, "log probabilities are not returned"),
        ("/v1/chat/completions", {"logprobs": True}, "log probabilities are not returned"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "log probabilities are not returned"),
        ("/v1/completions", {"echo": True}, "echoing the prompt"),
        ("/v1/completions", {"suffix": "!"}, "completion template"),
        ("/v1/completions", {"best_of": 2}, "each choice here is one sample"),
        ("/v1/completions", {"return_hidden_states": True}, "fields of its own"),
        ("/v1/completions", {"return_token_ids": True}, "fields of its own"),
        ("/v1/chat/completions", {"return_meta_info": True}, "fields of its own"),
        ("/v1/chat/completions", {"return_cached_tokens_details": True}, "fields of its own"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tool-call parser"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool-call parser"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"x": 1}}, "chat template"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "chat template"),
        ("/v1/chat/completions", {"reasoning": {"effort": "low"}}, "chat template"),
        ("/v1/chat/completions", {"max_dynamic_patch": 4}, "text only"),
        ("/v1/completions", {"images_config": {}}, "text only"),
    ],
)
async def test_what_the_server_does_not_do_is_refused_by_name(
    start_server: StartServer, path: str, fields: dict[str, Any], why: str
) -> None:
    server = await start_server()
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), **fields}
    error = await refused(server, path, body)
    (param,) = fields
    assert error["message"].startswith(f"'{param}' is not supported by this server: ")
    assert why in error["message"]
    assert error["param"] == param


async def test_the_sdk_sees_logprobs_refused(start_server: StartServer) -> None:
    server = await start_server()
    with pytest.raises(openai.BadRequestError, match="log probabilities") as raised:
        await server.sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=2)
    assert raised.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError, match="log probabilities") as raised:
        await server.sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2
        )
    assert raised.value.param == "logprobs"


async def test_defaults_ask_for_nothing_and_pass(start_server: StartServer) -> None:
    """SGLang's defaults of what is refused otherwise: what sglang-router sends, say."""
    server = await start_server()
    defaults = {
        "logprobs": False,
        "top_logprobs": 0,
        "tools": [],
        "tool_choice": "auto",
        "return_hidden_states": False,
        "return_meta_info": False,
        "chat_template_kwargs": None,
        "lora_path": None,
        "parallel_tool_calls": True,
        "separate_reasoning": False,
        "return_flat_raw_top_logprobs_b64": True,
    }
    response = await server.client.post("/v1/chat/completions", json={**CHAT, **defaults})
    assert response.status_code == 200, response.text
    native = {**GENERATE, "return_logprob": False, "top_logprobs_num": 0, "image_data": None}
    assert (await server.client.post("/generate", json=native)).status_code == 200


# -- unknown fields: ignored, as by SGLang -----------------------------------------------------


async def test_unknown_fields_are_ignored_as_sglang_ignores_them(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start_server()
    caplog.set_level("DEBUG", logger="trio_sglang.server")
    for path, body in (
        ("/v1/completions", {**COMPLETION, "tempo": 1}),
        # Chat has no json_schema field (only response_format): SGLang ignores it there.
        ("/v1/chat/completions", {**CHAT, "json_schema": "{}", "tempo": 1}),
        ("/generate", {**GENERATE, "tempo": 1, "model": None}),
    ):
        response = await server.client.post(path, json=body)
        assert response.status_code == 200, response.text
        request = server.engine.requests[-1]
        assert "tempo" not in request
        assert "json_schema" not in request["sampling_params"]
    ignored = [r.getMessage() for r in caplog.records if "ignored fields" in r.getMessage()]
    assert len(ignored) == 3
    assert all("tempo" in message for message in ignored)
    # SGLang's /generate refuses an unknown sampling parameter, naming it.
    body = {"text": "hi", "sampling_params": {"tempo": 1}}
    error = await refused(server, "/generate", body)
    assert error["message"] == "unknown sampling parameter 'tempo'"
    assert error["param"] == "sampling_params.tempo"


# -- the rest of SGLang's fields on the OpenAI routes ------------------------------------------


async def test_a_rid_names_the_response_as_in_sglang(start_server: StartServer) -> None:
    server = await start_server()
    completion = await server.sdk.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"rid": "my-request-1"}
    )
    assert completion.id == "my-request-1"
    chat = await server.client.post("/v1/chat/completions", json={**CHAT, "rid": "my-chat-1"})
    assert chat.json()["id"] == "my-chat-1"


async def test_chat_input_ids_stand_in_for_the_rendered_messages(
    start_server: StartServer,
) -> None:
    server = await start_server()
    response = await server.client.post("/v1/chat/completions", json={**CHAT, "input_ids": [5, 6]})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 2
    assert server.engine.requests[-1]["input_ids"] == [5, 6]
    assert "text" not in server.engine.requests[-1]


# -- --enable-cache-report ---------------------------------------------------------------------


async def test_cache_report_counts_the_prompt_tokens_the_prefix_cache_held(
    start_server: StartServer,
) -> None:
    """The SimEngine's prefix cache: a prompt seen before is cached, all but its last token."""
    server = await start_server(enable_cache_report=True)
    prompt = "one two three four five"  # five tokens: the SimEngine's tokens are words
    first = await server.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = await server.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    for completion, cached in ((first, 0), (again, 4)):
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == 5
        assert completion.usage.prompt_tokens_details is not None
        assert completion.usage.prompt_tokens_details.cached_tokens == cached
    # A salt keys the cache too; and n > 1 samples find their prompt cached after the warm-up.
    salted = {**COMPLETION, "prompt": prompt, "cache_salt": "tenant-b", "n": 2}
    usage = (await server.client.post("/v1/completions", json=salted)).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    # Streamed: in the last chunk's usage, and in every chunk's with continuous usage.
    body = {
        **CHAT,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    for cached in (0, CHAT_PROMPT_TOKENS - 1):
        chunks = sse_payloads((await server.client.post("/v1/chat/completions", json=body)).text)
        assert chunks.pop() == "[DONE]"
        assert {chunk["usage"]["prompt_tokens_details"]["cached_tokens"] for chunk in chunks} == {
            cached
        }


#: The plain transcript of CHAT ("user: hi" then "assistant:"), in words.
CHAT_PROMPT_TOKENS = 3


async def test_without_cache_report_usage_has_no_prompt_details(
    start_server: StartServer,
) -> None:
    server = await start_server()
    for _ in range(2):
        usage = (await server.client.post("/v1/completions", json=COMPLETION)).json()["usage"]
        assert "prompt_tokens_details" not in usage
    # /generate's meta_info always has SGLang's cached_tokens.
    response = await server.client.post("/generate", json=GENERATE)
    assert response.json()["meta_info"]["cached_tokens"] == 1  # "Hello there": 2 tokens


def test_serve_has_sglangs_enable_cache_report_flag() -> None:
    assert build_parser().parse_args(["serve", "--enable-cache-report"]).enable_cache_report
    assert not build_parser().parse_args(["serve"]).enable_cache_report
