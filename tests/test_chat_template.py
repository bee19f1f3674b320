"""Chat prompts: the engine's chat template, or the plain transcript for an engine with none.

``/v1/chat/completions`` hands an engine that renders chat messages
(``ChatTemplating``) the checked messages and sends the engine what it
renders: text, or token ids as SGLang's chat route sends its
TokenizerManager. Servers run on loopback in the test's trio run, as in
``test_server.py``. Whether ``SGLangEngine`` renders as SGLang's own chat
route does is checked against the real SGLang in ``test_conformance.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from typing import Any

import httpx
import pytest
import trio

import trio_sglang as ts
from trio_sglang.server import serve
from trio_sglang.testing import Faults, FaultyEngine
from trio_sglang_harness._scenarios import RidRecorder

MODEL = "templated"
FAST = {"first_token_delay": 0.001, "token_interval": 0.001}
PARTS = [{"type": "text", "text": "what is"}, {"type": "text", "text": " it"}]
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": PARTS},
]


class TemplatedSim(ts.SimEngine):
    """A SimEngine with a model's template of its own: it renders ``prompt``, or refuses.

    It keeps what it rendered and every request it was sent.
    """

    def __init__(self, prompt: str | list[int] | ValueError) -> None:
        super().__init__(**FAST)
        self.prompt = prompt
        self.rendered: list[tuple[Sequence[Mapping[str, Any]], bool]] = []
        self.requests: list[Mapping[str, Any]] = []

    def generate(self, request: Mapping[str, Any]) -> Any:
        self.requests.append(request)
        return super().generate(request)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool = False
    ) -> str | list[int]:
        self.rendered.append((messages, continue_final_message))
        if isinstance(self.prompt, ValueError):
            raise self.prompt
        return self.prompt


@pytest.fixture
async def open_server(nursery: trio.Nursery) -> AsyncIterator[Any]:
    """``open_server(engine)``: an httpx client of a loopback server on ``engine``."""
    stops: list[trio.Event] = []
    clients: list[httpx.AsyncClient] = []

    async def start(engine: ts.Engine) -> httpx.AsyncClient:
        stop = trio.Event()
        stops.append(stop)
        serving = partial(serve, engine, port=0, model=MODEL, handle_signals=False, shutdown=stop)
        urls = await nursery.start(serving)
        clients.append(httpx.AsyncClient(base_url=urls[0], timeout=10))
        return clients[-1]

    yield start
    for client in clients:
        await client.aclose()
    for stop in stops:
        stop.set()


def chat(messages: list[dict[str, Any]] = MESSAGES, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **fields}


# -- the SimEngine's template: the plain transcript -------------------------------------


def test_the_sim_engines_template_is_the_plain_transcript() -> None:
    engine = ts.SimEngine()
    assert isinstance(engine, ts.ChatTemplating)
    assert engine.render_chat(MESSAGES) == "system: be brief\nuser: what is it\nassistant:"
    answered = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]
    assert engine.render_chat(answered) == "user: hi\nassistant: the\nassistant:"
    # Continued, the last assistant message stays open; a user's last one is answered.
    assert engine.render_chat(answered, continue_final_message=True) == "user: hi\nassistant: the"
    assert engine.render_chat(answered[:1], continue_final_message=True) == "user: hi\nassistant:"


# -- the chat route ---------------------------------------------------------------------


async def test_the_chat_route_sends_the_engine_the_prompt_its_template_renders(
    open_server: Any,
) -> None:
    ids = TemplatedSim([5, 6, 7, 8])
    text = TemplatedSim("<|user|>what is it<|assistant|>")
    for engine in (ids, text):
        client = await open_server(engine)
        answer = await client.post("/v1/chat/completions", json=chat(continue_final_message=True))
        assert answer.status_code == 200, answer.text
        assert engine.rendered == [(MESSAGES, True)]
        [request] = engine.requests
        if engine is ids:
            assert request["input_ids"] == [5, 6, 7, 8]
            assert "text" not in request
            assert answer.json()["usage"]["prompt_tokens"] == 4
        else:
            assert request["text"] == "<|user|>what is it<|assistant|>"
            assert "input_ids" not in request


async def test_messages_the_template_refuses_are_the_clients_error(open_server: Any) -> None:
    engine = TemplatedSim(ValueError("a conversation cannot start with a tool message"))
    client = await open_server(engine)
    answer = await client.post("/v1/chat/completions", json=chat())
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "the chat template refused the messages: a conversation cannot start with a tool message"
    )
    assert answer.json()["error"]["param"] == "messages"
    assert engine.requests == []


async def test_token_ids_stand_in_for_the_messages_and_no_template_renders_them(
    open_server: Any,
) -> None:
    """As SGLang's chat route: with ``input_ids``, a template that would refuse is never asked."""
    engine = TemplatedSim(ValueError("never asked"))
    client = await open_server(engine)
    answer = await client.post("/v1/chat/completions", json={**chat(), "input_ids": [9, 8]})
    assert answer.status_code == 200, answer.text
    assert engine.rendered == []
    assert [request["input_ids"] for request in engine.requests] == [[9, 8]]


async def test_the_messages_are_checked_before_any_template_sees_them(open_server: Any) -> None:
    engine = TemplatedSim([1])
    client = await open_server(engine)
    for body, wanted in (
        (chat([{"role": "narrator", "content": "x"}]), "needs a role"),
        (chat([{"role": "user", "content": [{"type": "image_url"}]}]), "must be text"),
        (chat(continue_final_message="yes"), "'continue_final_message' must be a bool"),
    ):
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400
        assert wanted in answer.json()["error"]["message"]
    assert engine.rendered == []


async def test_an_engine_without_a_template_gets_the_plain_transcript(open_server: Any) -> None:
    requests: list[Mapping[str, Any]] = []
    engine = RidRecorder(ts.SimEngine(**FAST), requests.append)
    assert not isinstance(engine, ts.ChatTemplating)
    client = await open_server(engine)
    answer = await client.post("/v1/chat/completions", json=chat())
    assert answer.status_code == 200, answer.text
    assert [request["text"] for request in requests] == [
        "system: be brief\nuser: what is it\nassistant:"
    ]


def test_a_faulty_engine_renders_with_the_template_of_the_engine_it_wraps() -> None:
    assert FaultyEngine(TemplatedSim([1, 2]), Faults()).render_chat(MESSAGES) == [1, 2]
    plain = FaultyEngine(ts.SimEngine(**FAST), Faults())
    assert plain.render_chat(MESSAGES) == ts.SimEngine(**FAST).render_chat(MESSAGES)
