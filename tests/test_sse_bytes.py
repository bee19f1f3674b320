"""What a streaming response puts on the wire: ``json.dumps``'s bytes, with less work per token.

``serve`` encodes with a JSON encoder built once (``server/_json.py``), and
an OpenAI stream chunk from a template whose constant fields are encoded once
per response (``Template``). Both must give, byte for byte, what ``json.dumps``
makes of the chunk's dict: the OpenAI and SGLang shapes clients parse, with
the separators and escapes the server has always sent. A streamed response
also no longer adds up the text it has sent (only a body needs it).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from trio_sglang._protocol._json import Template, dumps
from trio_sglang._protocol._native import NativePlan
from trio_sglang._protocol._openai import ChatPlan, CompletionPlan, OpenAIPlan

VALUES: list[object] = [
    "plain",
    'é ü 中文 😀 \u2028\u2029 \x00\x1f \\ " / \t\n',
    "",
    0,
    -(2**70),
    1.5,
    -0.0,
    1e300,
    math.inf,
    -math.inf,
    True,
    None,
    [],
    {},
    [1, [2, [3, {"a": None}]]],
    {"b": 1, "a": [1.25, "x"], 3: "int key", None: "null key", True: "bool key"},
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_dumps_is_json_dumps(value: object) -> None:
    assert dumps(value) == json.dumps(value)


def test_dumps_writes_nan_and_refuses_what_json_cannot_hold_as_json_dumps_does() -> None:
    assert dumps(math.nan) == json.dumps(math.nan) == "NaN"
    with pytest.raises(TypeError) as ours:
        dumps({"x": object()})
    with pytest.raises(TypeError) as theirs:
        json.dumps({"x": object()})
    assert str(ours.value) == str(theirs.value)


def test_a_template_renders_the_dumps_of_its_filled_dict() -> None:
    template = Template({"id": "a\u00e9", "choices": Template.HOLE, "n": 1, "u": Template.HOLE})
    for choices, usage in [([{"x": "é"}], None), ([], {"t": 3}), ("text", [1, 2])]:
        expected = {"id": "a\u00e9", "choices": choices, "n": 1, "u": usage}
        assert template.render(choices, usage) == json.dumps(expected)
    with pytest.raises(TypeError, match="2 values expected"):
        template.render([])


def test_a_hole_must_be_a_top_level_value() -> None:
    with pytest.raises(ValueError, match="top-level"):
        Template({"choices": [Template.HOLE]})


def test_a_client_string_cannot_pass_for_a_hole() -> None:
    # The hole is random per process: a model name that spells what a hole
    # might look like is constant text.
    shape = {"model": "\x00hole", "choices": Template.HOLE}
    assert Template(shape).render([1]) == json.dumps({**shape, "choices": [1]})


def output(text: str, *, index: int | None = None, reason: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "text": text,
        "output_ids": [7],
        "meta_info": {
            "id": "public",
            "finish_reason": None if reason is None else {"type": reason},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 1,
        },
    }
    if index is not None:
        out["index"] = index
    return out


def event(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def streamed(plan: Any, out: dict[str, Any]) -> bytes:
    index, _ = plan.add(out)
    data: bytes = plan.sse(index, out)
    return data


@pytest.mark.parametrize("continuous", [False, True])
def test_chat_chunks_are_openai_chunks(continuous: bool) -> None:
    body = {
        "model": "m\u00e9",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "n": 2,
        "stream_options": {"continuous_usage_stats": continuous},
    }
    plan = ChatPlan.parse(body, "m\u00e9")
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

    def chunk(index: int, delta: dict[str, str], reason: str | None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        data: dict[str, Any] = {
            "id": plan.public_id,
            "object": "chat.completion.chunk",
            "created": plan.created,
            "model": "m\u00e9",
            "choices": [choice],
        }
        if continuous:
            data["usage"] = usage
        return event(data)

    assert streamed(plan, output(" é", index=0)) == chunk(
        0, {"role": "assistant", "content": " é"}, None
    )
    assert streamed(plan, output(" b", index=1)) == chunk(
        1, {"role": "assistant", "content": " b"}, None
    )
    assert streamed(plan, output(" c", index=0)) == chunk(0, {"content": " c"}, None)
    assert streamed(plan, output("", index=0, reason="length")) == chunk(
        0, {"content": ""}, "length"
    )


def test_completion_chunks_are_openai_chunks() -> None:
    body = {"model": "m", "prompt": "hi", "stream": True}
    plan = CompletionPlan.parse(body, "m")
    for out, reason in [(output(" a"), None), (output(" \u2028", reason="stop"), "stop")]:
        expected = {
            "id": plan.public_id,
            "object": "text_completion",
            "created": plan.created,
            "model": "m",
            "choices": [
                {"index": 0, "text": out["text"], "logprobs": None, "finish_reason": reason}
            ],
        }
        assert streamed(plan, out) == event(expected)


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_chunk_object_is_what_its_sse_event_carries(route: str, continuous: bool) -> None:
    """``chunk`` is for a transport that encodes chunks itself (Dynamo's text mode)."""
    options = {"stream_options": {"continuous_usage_stats": continuous}, "stream": True, "n": 2}
    events: OpenAIPlan
    objects: OpenAIPlan
    if route == "chat":
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **options}
        events, objects = ChatPlan.parse(chat, "m"), ChatPlan.parse(chat, "m")
    else:
        body = {"model": "m", "prompt": "hi", **options}
        events, objects = CompletionPlan.parse(body, "m"), CompletionPlan.parse(body, "m")
    objects.public_id, objects.created = events.public_id, events.created
    for out in (output(" a", index=0), output(" b", index=1), output(" c", index=0, reason="stop")):
        sent = streamed(events, out)
        assert json.loads(sent.removeprefix(b"data: ")) == objects.chunk(objects.add(out)[0], out)


def test_native_events_are_the_outputs_as_sglang_streams_them() -> None:
    plan = NativePlan.parse({"text": "hi", "stream": True})
    out = output(" 中", reason="length")
    assert streamed(plan, out) == event(out)


def test_a_stream_keeps_the_newest_state_and_a_body_the_totals() -> None:
    stream = NativePlan.parse({"text": "hi", "stream": True})
    body = NativePlan.parse({"text": "hi"})
    for plan in (stream, body):
        plan.add(output(" a"))
        plan.add(output(" b", reason="length"))
    assert stream.children[0].text == ""
    assert stream.children[0].output_ids == []
    assert body.children[0].text == " a b"
    assert body.children[0].output_ids == [7, 7]
    for plan in (stream, body):
        assert plan.children[0].finish_reason == "length"
        assert plan.children[0].meta["completion_tokens"] == 2
