"""``trio_sglang.dynamo`` without Dynamo: the request mapping, the hand-over, the configuration.

What the frontend sends becomes SGLang's ``/generate`` body, the worker's
chunks become Dynamo's (token chunks, or OpenAI chunks in text mode), and a
chunk crosses from the request's trio task to the runtime's asyncio
generator. The bridge that runs them: ``test_dynamo_bridge.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from _dynamo_captured import CAPTURED, with_fields
from trio_sglang._errors import InvalidRequest
from trio_sglang._protocol._transcript import plain_transcript
from trio_sglang.dynamo import SIM_MODEL_PATH, DynamoEndpoint, RuntimePlanes
from trio_sglang.dynamo._exchange import Exchange
from trio_sglang.dynamo._mapping import ChunkMapper, engine_request, merge_token_chunks
from trio_sglang.dynamo._text import merge_text_chunks
from trio_sglang.sim._scheduler import VOCAB_SIZE
from trio_sglang.sim._tokenizer import _WORDS

# -- the request mapping -------------------------------------------------------


def test_a_captured_request_maps_to_sglang_input_ids_and_sampling_params() -> None:
    assert engine_request(CAPTURED) == {
        "input_ids": [0, 1, 2],
        "sampling_params": {"max_new_tokens": 5, "stop_token_ids": [65]},
    }


def test_every_sampling_field_maps_as_dynamos_own_sglang_worker_maps_it() -> None:
    request = with_fields(
        "sampling_options",
        n=2,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
    )
    request["stop_conditions"] = {
        **CAPTURED["stop_conditions"],
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [9, 65],
    }
    assert engine_request(request)["sampling_params"] == {
        "n": 2,
        "max_new_tokens": 5,
        "min_new_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [9, 65],  # the hidden (EOS) and the client's, once each
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "sampling_seed": 7,
    }


def test_no_max_tokens_is_sent_as_none_not_left_out() -> None:
    request = with_fields("stop_conditions", max_tokens=None)
    assert engine_request(request)["sampling_params"]["max_new_tokens"] is None


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        ({"json": {"type": "object"}}, {"json_schema": json.dumps({"type": "object"})}),
        ({"regex": "a+"}, {"regex": "a+"}),
        ({"choice": ["a.b", "c"]}, {"regex": r"(a\.b|c)"}),
        ({"grammar": "root ::= 'x'"}, {"ebnf": "root ::= 'x'"}),
    ],
)
def test_guided_decoding_maps_to_sglangs_constraint(
    guided: dict[str, Any], expected: dict[str, Any]
) -> None:
    params = engine_request(with_fields("sampling_options", guided_decoding=guided))
    assert {key: params["sampling_params"][key] for key in expected} == expected


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("output_options", "logprobs", 2),
        ("output_options", "prompt_logprobs", 1),
        ("sampling_options", "use_beam_search", True),
        ("sampling_options", "length_penalty", 0.5),
        ("sampling_options", "best_of", 3),
        ("stop_conditions", "max_thinking_tokens", 64),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(section: str, field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest, match=field) as refused:
        engine_request(with_fields(section, **{field: value}))
    assert refused.value.param == field


def test_a_malformed_request_is_refused_not_guessed() -> None:
    with pytest.raises(InvalidRequest, match="one prompt"):
        engine_request({**CAPTURED, "token_ids": [[1], [2]]})
    with pytest.raises(InvalidRequest, match="'sampling_options' must be an object"):
        engine_request({**CAPTURED, "sampling_options": [1]})
    with pytest.raises(InvalidRequest, match="JSON object"):
        engine_request([])


def test_chunks_carry_usage_on_each_choices_first_and_last_and_abort_reads_cancelled() -> None:
    to_dynamo = ChunkMapper(prompt_tokens=3)
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    first = {"index": 0, "token_ids": [4], "finish_reason": None}
    assert to_dynamo(first) == {"index": 0, "token_ids": [4], "completion_usage": usage}
    assert to_dynamo({"index": 1, "token_ids": [], "finish_reason": None}) is None
    assert to_dynamo({"index": 0, "token_ids": [5, 6], "finish_reason": None}) == {
        "index": 0,
        "token_ids": [5, 6],
    }
    last = to_dynamo({"index": 0, "token_ids": [], "finish_reason": "abort"})
    assert last is not None
    assert last["finish_reason"] == "cancelled"
    assert last["completion_usage"]["completion_tokens"] == 3
    other = to_dynamo({"index": 1, "token_ids": [7], "finish_reason": "length"})
    assert other is not None
    assert other["completion_usage"]["completion_tokens"] == 1


# -- the hand-over -------------------------------------------------------------


def test_a_backlog_is_merged_per_choice_and_the_error_comes_after_the_last_chunk() -> None:
    async def main() -> list[dict[str, Any]]:
        exchange = Exchange(asyncio.get_running_loop(), merge_token_chunks)
        exchange.put({"index": 0, "token_ids": [1], "completion_usage": {"n": 1}})
        exchange.put({"index": 0, "token_ids": [2]})
        exchange.put({"index": 1, "token_ids": [3]})
        exchange.put({"index": 0, "token_ids": [4], "finish_reason": "length"})
        exchange.put({"index": 0, "token_ids": [5]})
        exchange.end(ValueError("late"))
        exchange.end()  # the first end is the one
        seen = []
        try:
            while (chunk := await exchange.get()) is not None:
                seen.append(chunk)
        except ValueError as exc:
            seen.append({"raised": str(exc)})
        return seen

    assert asyncio.run(main()) == [
        {"index": 0, "token_ids": [1, 2], "completion_usage": {"n": 1}},
        {"index": 1, "token_ids": [3]},
        {"index": 0, "token_ids": [4], "finish_reason": "length"},
        {"index": 0, "token_ids": [5]},
        {"raised": "late"},
    ]


def test_a_text_backlog_is_merged_per_unfinished_choice_and_usage_alone_stays_apart() -> None:
    def chat(index: int, content: str, reason: str | None = None, **extra: Any) -> dict[str, Any]:
        delta = {"content": content, **extra}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}

    first = chat(0, " a", role="assistant")
    assert merge_text_chunks(first, chat(0, " b"))
    assert not merge_text_chunks(first, chat(1, " x"))  # another choice
    assert merge_text_chunks(first, {**chat(0, " c", "length"), "usage": {"completion_tokens": 3}})
    assert first["choices"][0] == {
        "index": 0,
        "delta": {"content": " a b c", "role": "assistant"},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert first["usage"] == {"completion_tokens": 3}
    assert not merge_text_chunks(first, chat(0, " d"))  # finished: nothing after it merges
    assert not merge_text_chunks(first, {"id": "c", "choices": [], "usage": {}})
    text = {"choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]}
    assert merge_text_chunks(text, {"choices": [{**text["choices"][0], "text": " b"}]})
    assert text["choices"][0]["text"] == "a b"


# -- configuration -------------------------------------------------------------


def test_planes_come_from_dynamos_variables_with_dynamos_defaults() -> None:
    assert RuntimePlanes.from_env({}) == RuntimePlanes("etcd", "tcp", "tcp", None)
    local = {"DYN_DISCOVERY_BACKEND": "file", "DYN_EVENT_PLANE": "zmq"}
    assert RuntimePlanes.from_env(local) == RuntimePlanes("file", "tcp", "tcp", "zmq")
    with pytest.raises(ValueError, match="DYN_REQUEST_PLANE='udp'"):
        RuntimePlanes.from_env({"DYN_REQUEST_PLANE": "udp"})


def test_an_endpoint_needs_names_dynamo_accepts_and_a_tokenizer(tmp_path: Path) -> None:
    assert DynamoEndpoint("m").path == "dynamo.backend.generate"
    with pytest.raises(ValueError, match="component"):
        DynamoEndpoint("m", component="a.b")
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        DynamoEndpoint("m", model_path=tmp_path)
    with pytest.raises(ValueError, match="name"):
        DynamoEndpoint("")


def test_a_text_endpoint_needs_no_tokenizer_and_the_input_is_one_dynamo_has(
    tmp_path: Path,
) -> None:
    assert DynamoEndpoint("m", model_path=tmp_path, model_input="text").model_input == "text"
    with pytest.raises(ValueError, match="model_input 'bytes'"):
        DynamoEndpoint("m", model_input="bytes")


def test_the_sim_tokenizer_is_the_sim_engines_vocabulary() -> None:
    tokenizer = json.loads((SIM_MODEL_PATH / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    words = _WORDS[:VOCAB_SIZE]
    assert {vocab[word]: word for word in words} == dict(enumerate(words))
    config = json.loads((SIM_MODEL_PATH / "config.json").read_text())
    eos = json.loads((SIM_MODEL_PATH / "generation_config.json").read_text())["eos_token_id"]
    assert config["eos_token_id"] == eos == vocab["<eos>"] >= VOCAB_SIZE  # never generated
    template = json.loads((SIM_MODEL_PATH / "tokenizer_config.json").read_text())["chat_template"]
    # Rendered by the frontend: the SimEngine's own chat transcript, line for line.
    assert "{{ message['role'] }}: {{ message['content'] }}\n" in template
    assert plain_transcript([{"role": "user", "content": "x"}]) == "user: x\nassistant:"
