"""A request as Dynamo 1.6.1's frontend sends it (captured), for the tests of the Dynamo backend."""

from __future__ import annotations

from typing import Any

#: A request as Dynamo 1.6.1's frontend sends it for ``/v1/completions`` (captured).
CAPTURED: dict[str, Any] = {
    "model": "sim",
    "token_ids": [0, 1, 2],
    "stop_conditions": {
        "max_tokens": 5,
        "stop": None,
        "stop_token_ids": None,
        "stop_token_ids_visible": None,
        "stop_token_ids_hidden": [65],
        "min_tokens": None,
        "ignore_eos": None,
        "max_thinking_tokens": None,
    },
    "sampling_options": {
        "n": None,
        "best_of": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "use_beam_search": None,
        "length_penalty": None,
        "seed": None,
        "include_stop_str_in_output": None,
        "guided_decoding": None,
    },
    "output_options": {
        "logprobs": None,
        "prompt_logprobs": None,
        "skip_special_tokens": None,
        "formatted_prompt": None,
        "return_tokens_as_token_ids": None,
    },
    "eos_token_ids": [65],
    "annotations": [],
    "routing": {},
}


def with_fields(section: str, **fields: Any) -> dict[str, Any]:
    return {**CAPTURED, section: {**CAPTURED[section], **fields}}
