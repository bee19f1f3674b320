"""The OpenAI routes' fields, as SGLang 0.5.23 takes them, and the native body they become.

SGLang parses an OpenAI body into a pydantic model (``CompletionRequest``,
``ChatCompletionRequest``, in ``protocol.py``) and maps it onto a
``GenerateReqInput`` (``_convert_to_internal_request`` and
``to_sampling_params``, in ``serving_completions.py`` and ``serving_chat.py``).
Every field of those models is in one of these tables, per route:

- ``_SAMPLING``: becomes a sampling parameter, renamed as SGLang renames it
  (``min_tokens`` is ``min_new_tokens``, ``seed`` is ``sampling_seed``), and is
  checked as the lifecycle checks sampling parameters, in the client's words;
  ``response_format`` becomes ``json_schema`` or ``structural_tag``, as there;
- ``_PASSED``: becomes the top-level field of the same name, for the engine,
  which refuses what it does not honour (``Worker.prepare``, in the client's words);
- ``_UNSUPPORTED``: asks for what this server does not do (log probabilities,
  tool calls, SGLang's own response extensions): a 400 that names it, unless it
  is null or SGLang's default, so it is never silently dropped;
- ``_IGNORED``: what SGLang itself ignores there (``user``; the reasoning flags,
  without a reasoning parser): checked, then dropped, as there;
- ``_OWN``: what the plans read themselves (the prompt, ``model``, streaming,
  ``rid``), and ``max_tokens``, read here.

A field neither model has is ignored, as pydantic's default (``extra="ignore"``)
ignores it in SGLang; the server logs its name at DEBUG.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from .._errors import InvalidRequest
from .._request._sampling import check_sampling_params, native_name
from .._request._values import is_int, is_one_of, shown

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "NativeFields",
    "Route",
    "check_sampling",
    "native_fields",
]

logger = logging.getLogger("trio_sglang.server")

Route = Literal["completions", "chat"]

#: OpenAI's default for completions; chat has none (the engine's).
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16

#: Field -> the sampling parameter it becomes (``to_sampling_params``, ``_build_sampling_params``).
_SAMPLING_BOTH = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "n": "n",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "regex": "regex",
    "ebnf": "ebnf",
    "no_stop_trim": "no_stop_trim",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
    "custom_params": "custom_params",
    "watermark": "watermark",
}
_SAMPLING: dict[Route, dict[str, str]] = {
    "completions": {**_SAMPLING_BOTH, "json_schema": "json_schema"},
    "chat": _SAMPLING_BOTH,  # chat has no json_schema field: response_format only
}

_PASSED_BOTH = frozenset(
    {
        "lora_path",
        "session_id",
        "session_params",
        "custom_logit_processor",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "extra_key",
        "cache_salt",
        "priority",
    }
)
#: Fields passed to the engine as the top-level ``GenerateReqInput`` field of the same name.
_PASSED: dict[Route, frozenset[str]] = {
    # SGLang reads completions' custom labels from the headers; the body's go to the engine.
    "completions": _PASSED_BOTH | {"custom_labels"},
    "chat": _PASSED_BOTH,
}

_LOGPROBS = (
    "log probabilities are not returned on the OpenAI routes yet "
    "(/generate passes return_logprob to the engine)"
)
_EXTENSION = "SGLang answers it in fields of its own, which these responses do not carry"
_TOOLS = "tool calls need a tool-call parser, which this server does not have"
_TEMPLATE = "it is an input to SGLang's chat template, which this server does not pass on"
_MEDIA = "messages are text only here: there is no image, video or audio to apply it to"
_UNSUPPORTED_BOTH: dict[str, tuple[tuple[object, ...], str]] = {
    "return_hidden_states": ((None, False), _EXTENSION),
    "return_routed_experts": ((None, False), _EXTENSION),
    "routed_experts_start_len": ((None, 0), _EXTENSION),
    "return_cached_tokens_details": ((None, False), _EXTENSION),
    "return_spec_tokens_details": ((None, False), _EXTENSION),
    "return_token_ids": ((None, False), _EXTENSION),
    "images_config": ((None,), _MEDIA),
    "mm_processor_kwargs": ((None,), _MEDIA),
}
#: Field -> (the values that ask for nothing, why anything else is refused).
_UNSUPPORTED: dict[Route, dict[str, tuple[tuple[object, ...], str]]] = {
    "completions": {
        **_UNSUPPORTED_BOTH,
        "logprobs": ((None,), _LOGPROBS),
        "echo": ((None, False), "echoing the prompt is not supported"),
        "suffix": ((None,), "a suffix needs a completion template, which this server has not"),
        # SGLang takes best_of and ignores it.
        "best_of": ((None, 1), "it would be ignored: each choice here is one sample"),
    },
    "chat": {
        **_UNSUPPORTED_BOTH,
        "logprobs": ((None, False), _LOGPROBS),
        "top_logprobs": ((None, 0), _LOGPROBS),
        "return_prompt_token_ids": ((None, False), _EXTENSION),
        "return_meta_info": ((None, False), _EXTENSION),
        "return_input_ids_in_sglext": ((None, False), _EXTENSION),
        "return_output_ids_in_sglext": ((None, False), _EXTENSION),
        "return_sampling_mask": ((None, False), _EXTENSION),
        "sampling_logprobs_mode": ((None,), _EXTENSION),
        "return_flat_raw_output_top_logprobs": ((None, False), _EXTENSION),
        "tools": ((None, []), _TOOLS),
        "tool_choice": ((None, "none", "auto"), _TOOLS),
        "chat_template_kwargs": ((None, {}), _TEMPLATE),
        "reasoning_effort": ((None,), _TEMPLATE),
        # Not a field of ChatCompletionRequest, but its validator reads it into reasoning_effort.
        "reasoning": ((None,), _TEMPLATE),
        "thinking": ((None,), _TEMPLATE),
        "task": ((None,), _TEMPLATE),
        "video_config": ((None,), _MEDIA),
        "use_audio_in_video": ((None, False), _MEDIA),
        "max_dynamic_patch": ((None,), _MEDIA),
        "min_dynamic_patch": ((None,), _MEDIA),
    },
}

#: What SGLang ignores on that route, and what its value must be: taken, then dropped.
_IGNORED: dict[Route, dict[str, type]] = {
    "completions": {"user": str},
    "chat": {
        "user": str,
        # They split reasoning out of the answer, with a reasoning parser (this server has none).
        "separate_reasoning": bool,
        "stream_reasoning": bool,
        # Tools are refused, so there is nothing to call in parallel.
        "parallel_tool_calls": bool,
        # Only with return_flat_raw_output_top_logprobs, which is refused.
        "return_flat_raw_top_logprobs_b64": bool,
    },
}

#: Read by the plans, and ``max_tokens`` here.
_OWN: dict[Route, frozenset[str]] = {
    "completions": frozenset(
        {"model", "prompt", "stream", "stream_options", "rid", "max_tokens", "response_format"}
    ),
    "chat": frozenset(
        {
            "model",
            "messages",
            # A prompt of token ids, which SGLang takes in place of the rendered messages.
            "input_ids",
            "continue_final_message",
            "stream",
            "stream_options",
            "rid",
            "max_tokens",
            "max_completion_tokens",
            "response_format",
        }
    ),
}


def _fields(route: Route) -> frozenset[str]:
    return frozenset(
        _OWN[route]
        | _SAMPLING[route].keys()
        | _PASSED[route]
        | _UNSUPPORTED[route].keys()
        | _IGNORED[route].keys()
    )


#: Every field each route reads: those of SGLang's ``CompletionRequest`` and
#: ``ChatCompletionRequest`` (and chat's ``reasoning``, which a validator of it reads).
COMPLETION_FIELDS = _fields("completions")
CHAT_FIELDS = _fields("chat")
_ROUTE_FIELDS: dict[Route, frozenset[str]] = {"completions": COMPLETION_FIELDS, "chat": CHAT_FIELDS}


class NativeFields(NamedTuple):
    """What an OpenAI body makes of a native body, its prompt aside."""

    #: ``sampling_params``, to check (``check_sampling``) once admission has had its say.
    sampling: dict[str, Any]
    #: Top-level fields for the engine, as they came.
    passed: dict[str, Any]
    #: Each native field made here (``sampling_params.<name>``, or top-level) -> the client's name.
    names: dict[str, str]


def native_fields(body: Mapping[str, Any], route: Route) -> NativeFields:
    """The fields of an OpenAI ``body`` as SGLang's serving code maps them; 400 when bad.

    The sampling parameters are checked later (``check_sampling``): a token
    budget past the context length is refused as such first, as SGLang does.
    """
    ignored = sorted(key for key in body if key not in _ROUTE_FIELDS[route])
    if ignored:
        # shown(): a client's keys, bounded.
        logger.debug("ignored fields SGLang's %s route does not have: %s", route, shown(ignored))
    for key, (off, why) in _UNSUPPORTED[route].items():
        if not is_one_of(body.get(key), off):
            raise InvalidRequest(f"'{key}' is not supported by this server: {why}", param=key)
    for key, kind in _IGNORED[route].items():
        if not isinstance(body.get(key), kind | None):
            raise InvalidRequest(f"'{key}' must be a {kind.__name__}", param=key)
    names: dict[str, str] = {}
    sampling: dict[str, Any] = {}
    for key, param in _SAMPLING[route].items():
        if body.get(key) is not None:
            sampling[param] = body[key]
            names[native_name(param)] = key
    sampling["max_new_tokens"], names[native_name("max_new_tokens")] = _max_tokens(body, route)
    grammar = _response_format(body.get("response_format"), route)
    if grammar is not None:
        sampling[grammar[0]] = grammar[1]
        names[native_name(grammar[0])] = "response_format"
    # Those the request did not set (named in a message about another) by their route's names.
    for key, param in _SAMPLING[route].items():
        names.setdefault(native_name(param), key)
    passed = {key: body[key] for key in _PASSED[route] if body.get(key) is not None}
    names.update((key, key) for key in passed)
    return NativeFields(sampling, passed, names)


def check_sampling(sampling: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """``native_fields``' sampling parameters, checked as the lifecycle checks them.

    In the client's words: ``min_tokens`` where the native body says
    ``sampling_params.min_new_tokens``.
    """
    check_sampling_params(sampling, lambda key: names.get(native_name(key), key))


def _max_tokens(body: Mapping[str, Any], route: Route) -> tuple[int | None, str]:
    """The completion's token budget, and the field it came from.

    Chat without one asks for no limit (the context length's), as SGLang's
    ``to_sampling_params`` does, sending null (``SamplingParams`` reads null
    as no limit, where a missing ``max_new_tokens`` is 128).
    """
    if route == "completions":
        value = body.get("max_tokens")
        if value is None:
            return _COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens"
        if not is_int(value) or value < 1:
            # SGLang's CompletionRequest: "max_tokens must be positive".
            raise InvalidRequest(
                f"'max_tokens' must be an int >= 1, got {shown(value)}", param="max_tokens"
            )
        return value, "max_tokens"
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not is_int(value) or value < 0:
            raise InvalidRequest(f"'{key}' must be an int >= 0, got {shown(value)}", param=key)
        return value, key
    return None, "max_tokens"


def _response_format(value: object, route: Route) -> tuple[str, str] | None:
    """The grammar ``response_format`` asks for, as SGLang's serving code makes it.

    ``json_object`` is the schema ``{"type": "object"}``; ``json_schema`` its
    schema, as JSON text; ``structural_tag`` the whole format, as JSON text.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad_format("'response_format' must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = value.get("schema")
        if spec is None and route == "chat" and isinstance(schema, Mapping):
            # ChatCompletionRequest.set_json_schema: a bare "schema" beside the type.
            spec = {"name": schema.get("title", "Schema"), "schema": schema}
        if not (isinstance(spec, Mapping) and isinstance(spec.get("name"), str)):
            raise _bad_format("'response_format.json_schema' must be an object with a 'name'")
        if not isinstance(spec.get("strict"), bool | None):
            raise _bad_format("'response_format.json_schema.strict' must be a bool")
        if not isinstance(spec.get("schema"), Mapping):
            raise _bad_format("'response_format.json_schema.schema' must be a JSON schema object")
        return "json_schema", json.dumps(spec["schema"])
    if kind == "structural_tag":
        if not ("format" in value or ("structures" in value and "triggers" in value)):
            raise _bad_format(
                "a structural_tag 'response_format' needs 'format', or 'structures' and 'triggers'"
            )
        return "structural_tag", json.dumps(value)
    raise _bad_format(
        "'response_format.type' must be 'text', 'json_object', 'json_schema' or 'structural_tag'"
    )


def _bad_format(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="response_format")
