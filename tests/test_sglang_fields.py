"""Field parity with SGLang 0.5.23, read from SGLang itself: its fields, defaults and ranges.

The fields the lifecycle and the server accept are typed out in the modules
that check them (``_request/_fields.py``, ``_request/_sampling.py``,
``_protocol/_openai_fields.py``);
these tests read SGLang's own definitions and fail when the two differ
without a reason written down here:

- ``SamplingParams``' fields and defaults, ``GenerateReqInput``'s fields, and
  the fields of the OpenAI request models (``CompletionRequest``,
  ``ChatCompletionRequest``);
- ranges: each probe of sampling parameters goes through what SGLang's
  ``/generate`` runs on it (its API contract check, then ``SamplingParams``
  with ``normalize`` and ``verify``) and through ``check_sampling_params``;
  both must accept it or both refuse it, or the difference is in
  ``RANGE_DIFFERENCES``;
- unknown fields: SGLang ignores them on all three routes, but refuses an
  unknown sampling parameter, as the server does.

Runs in ``nox -s sglang`` (marker ``sglang``); on an older release (``nox -s
sglang-matrix``) it skips, by the name of the 0.5.23 module it needs, and
``test_sglang_release.py`` checks what that release takes instead.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s sglang`")

from pydantic import TypeAdapter

with warnings.catch_warnings():
    # Imported in this process (the harness runs SGLang in processes of its own), SGLang
    # warns that this machine's GPU kernels (AWQ, GGUF) are missing.
    warnings.simplefilter("ignore", UserWarning)
    api_contract = pytest.importorskip(
        "sglang.srt.entrypoints.api_contract",
        reason="field parity is with SGLang 0.5.23, whose api_contract this release lacks",
    )
    generate_contract_error = api_contract.generate_contract_error
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

from trio_sglang import EngineFeatures, InvalidRequest
from trio_sglang._protocol import _openai_fields
from trio_sglang._protocol._openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, Route
from trio_sglang._request._fields import GENERATE_FIELDS, OWN_FIELDS, REFUSED_FIELDS, SGLANG_FIELDS
from trio_sglang._request._parse import parse_request
from trio_sglang._request._sampling import (
    REFUSED_SAMPLING_PARAMS,
    SAMPLING_PARAMS,
    check_sampling_params,
)
from trio_sglang._request._values import is_one_of

pytestmark = pytest.mark.sglang

VOCAB_SIZE = 1000


# -- the fields --------------------------------------------------------------------------------


def test_sampling_params_are_sglangs_with_sglangs_defaults() -> None:
    fields = dict(
        zip(SamplingParams.__struct_fields__, SamplingParams.__struct_defaults__, strict=True)
    )
    # Every field is either taken (with SGLang's default) or refused, with a reason.
    assert set(SAMPLING_PARAMS) | set(REFUSED_SAMPLING_PARAMS) == set(fields)
    assert not set(SAMPLING_PARAMS) & set(REFUSED_SAMPLING_PARAMS)
    assert {key: fields[key] for key in SAMPLING_PARAMS} == dict(SAMPLING_PARAMS)


def test_generate_fields_are_sglangs_and_their_defaults_ask_for_nothing() -> None:
    fields = {field.name: field for field in dataclasses.fields(GenerateReqInput)}
    assert set(fields) == SGLANG_FIELDS
    assert len(OWN_FIELDS) + len(GENERATE_FIELDS) + len(REFUSED_FIELDS) == len(fields)
    for name, field in GENERATE_FIELDS.items():
        default = fields[name].default
        # A request that sends SGLang's default (sglang-router sends many) asks for nothing.
        assert not field.asks(default), name
        assert default is None or field.valid(default), name


#: Fields the OpenAI routes read that SGLang's models do not declare, and why.
OPENAI_EXTRA_FIELDS: dict[Route, dict[str, str]] = {
    "chat": {"reasoning": "ChatCompletionRequest's normalize_reasoning_inputs validator reads it"},
    "completions": {},
}


@pytest.mark.parametrize(
    ("route", "model", "ours"),
    [
        ("completions", CompletionRequest, COMPLETION_FIELDS),
        ("chat", ChatCompletionRequest, CHAT_FIELDS),
    ],
)
def test_openai_fields_are_sglangs(route: Route, model: Any, ours: frozenset[str]) -> None:
    assert set(model.model_fields) == ours - OPENAI_EXTRA_FIELDS[route].keys()
    # An unknown field is ignored (pydantic's default), as the server ignores it.
    assert model.model_config.get("extra", "ignore") == "ignore"
    # What the server refuses, it refuses only past SGLang's default.
    for name, (off, _why) in _openai_fields._UNSUPPORTED[route].items():
        if name in model.model_fields:
            default = model.model_fields[name].default
            assert is_one_of(default, off), (route, name, default)


def test_sglang_ignores_unknown_fields_but_not_unknown_sampling_params() -> None:
    """What the server does with unknown fields is what SGLang's routes do with them."""
    body = {"text": "hi", "tempo": 1}
    assert generate_contract_error(body) is None
    parsed = TypeAdapter(GenerateReqInput).validate_python(body)  # FastAPI's read of the body
    assert not hasattr(parsed, "tempo")
    error = generate_contract_error({"text": "hi", "sampling_params": {"tempo": 1}})
    assert error is not None
    assert "unknown field `tempo`" in error
    assert not hasattr(CompletionRequest.model_validate({"prompt": "hi", "tempo": 1}), "tempo")


# -- the ranges of sampling parameters -----------------------------------------------------------


class _Tokenizer:
    """Enough of a tokenizer for ``SamplingParams.normalize``: a token per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def sglang_refuses(params: dict[str, Any]) -> bool:
    """Whether SGLang's ``/generate`` refuses these sampling parameters.

    Its API contract first (types, unknown names), then, while tokenizing,
    ``SamplingParams(**params)``, ``normalize`` and ``verify``.
    """
    if generate_contract_error({"text": "hi", "sampling_params": params}) is not None:
        return True
    try:
        sampling = SamplingParams(**params)
        sampling.normalize(_Tokenizer())
        sampling.verify(VOCAB_SIZE)
    except (ValueError, TypeError, re.error):  # re.error: a stop_regex that does not compile
        return True
    return False


def we_refuse(params: dict[str, Any]) -> bool:
    try:
        check_sampling_params(params)
    except InvalidRequest:
        return True
    return False


#: Every parameter at and past its bounds, and with a value of the wrong type.
PROBES: list[dict[str, Any]] = [
    *({"max_new_tokens": v} for v in (0, 1, -1, 2**31 - 1, 2**31, 1.5, True, None)),
    *({"min_new_tokens": v} for v in (0, 5, -1, 128, 129, "1")),
    {"max_new_tokens": 2, "min_new_tokens": 3},
    {"max_new_tokens": None, "min_new_tokens": 500},
    *({"n": v} for v in (1, 2, 1024, 1025, 0, -1, 1.0)),
    *({"temperature": v} for v in (0, 0.5, 2, -0.1, "0.5", True)),
    *({"top_p": v} for v in (0, 1e-9, 0.5, 1, 1.5)),
    *({"top_k": v} for v in (-1, 1, 40, 2**31, 0, -2, 1.5)),
    *({"min_p": v} for v in (0, 1, -0.1, 1.1)),
    *({key: v} for key in ("frequency_penalty", "presence_penalty") for v in (-2, 2, -2.1, 2.1)),
    *({"repetition_penalty": v} for v in (0, 0.5, 2, 2.1, -1)),
    *({"stop": v} for v in ("x", ["x"] * 32, ["x"] * 33, 7, [7])),
    *({"stop_regex": v} for v in ("a+", ["a"] * 32, ["a"] * 33, "(", "a" * 256, "a" * 257)),
    *({"stop_token_ids": v} for v in ([1], [], [-1], ["1"])),
    *({key: v} for key in ("json_schema", "regex", "ebnf", "structural_tag") for v in ("x", 7)),
    {"regex": "a", "json_schema": "{}"},
    {"ebnf": "a", "structural_tag": "{}"},
    {"regex": "", "json_schema": "{}"},
    *({key: v} for key in ("ignore_eos", "no_stop_trim", "skip_special_tokens") for v in (True, 1)),
    *({"stream_interval": v} for v in (1, 0, -1, "1")),
    *({"logit_bias": v} for v in ({"1": 0.5}, {"x": 1}, {"-1": 1}, {"999": 1}, {"1000": 1})),
    *({"sampling_seed": v} for v in (0, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 1.5)),
    *({"custom_params": v} for v in ({"a": 1}, [1])),
    *(
        {"watermark": v}
        for v in (
            {"enabled": True},
            {"key": "0xbeef", "context_window": 4},
            {"color": 1},
            {"key": "zz"},
            {"context_window": 0},
            True,
        )
    ),
    *({"beam_width": v} for v in (1, 2, 0)),
    {"beam_width": 2, "n": 2},
    {"choice": ["a"]},
    {"is_normalized": True},
    {"stop_strs": ["x"]},
]

#: Where the lifecycle and SGLang differ on a probe (its ``repr``), and why.
RANGE_DIFFERENCES: dict[str, str] = {
    repr({"max_new_tokens": 2**31}): "token counts are int32 here; past any context length",
    repr({"n": 1025}): "at most 1024 samples here; the server's max-children limit is lower",
    repr({"n": 0}): "no sample is no request; SGLang does not check n, and runs one",
    repr({"n": -1}): "no sample is no request; SGLang does not check n, and runs one",
    repr({"stop_token_ids": [-1]}): "not a token id; SGLang takes it and never meets it",
    repr({"logit_bias": {"1000": 1}}): (
        "the vocabulary size is the model's, which the lifecycle does not know; SGLang's "
        "verify refuses it (as a 400 here too, after the engine's tokenization)"
    ),
    repr({"custom_params": [1]}): "SGLang's custom_params is an object (its CustomParamValue)",
    repr({"beam_width": 2, "n": 2}): (
        "SGLang returns a beam request's n sequences as one request, which the lifecycle's "
        "one stream per sample does not model"
    ),
}


@pytest.mark.parametrize("params", PROBES, ids=repr)
def test_sampling_params_are_refused_as_sglang_refuses_them(params: dict[str, Any]) -> None:
    sglang, ours = sglang_refuses(params), we_refuse(params)
    if repr(params) in RANGE_DIFFERENCES:
        assert sglang != ours, f"no longer a difference: {params!r}"
    else:
        assert sglang == ours, f"SGLang refuses: {sglang}, the lifecycle refuses: {ours}"


# -- the kinds of the other /generate fields -----------------------------------------------------

#: A value of the wrong kind for fields of SGLang's API contract, and a right one.
FIELD_PROBES: list[tuple[str, object]] = [
    ("return_logprob", True),
    ("return_logprob", "yes"),
    ("top_logprobs_num", 2),
    ("top_logprobs_num", "2"),
    ("logprob_start_len", -1),
    ("logprob_start_len", 1.5),
    ("token_ids_logprob", [1, 2]),
    ("token_ids_logprob", "1"),
    ("return_text_in_logprobs", "no"),
    ("lora_path", "adapter"),
    ("lora_path", 7),
    ("custom_logit_processor", 7),
    ("priority", 1),
    ("priority", "high"),
    ("routed_dp_rank", 1.5),
    ("session_id", 7),
    ("extra_key", ["a"]),
    ("cache_salt", 7),
    ("routing_key", 7),
    ("custom_labels", {"a": "b"}),
    ("custom_labels", {"a": 1}),
    ("max_thinking_tokens", "many"),
    ("require_reasoning", "yes"),
    ("return_prompt_token_ids", 1),
]

#: Where the lifecycle and SGLang's contract differ on a field's kind, and why.
FIELD_DIFFERENCES: dict[tuple[str, str], str] = {
    ("extra_key", repr(["a"])): "a list is one value per prompt: a single prompt has one",
}


@pytest.mark.parametrize(("key", "value"), FIELD_PROBES, ids=repr)
def test_generate_fields_are_checked_as_sglangs_contract_checks_them(
    key: str, value: object
) -> None:
    sglang = generate_contract_error({"text": "hi", key: value}) is not None
    try:
        parse_request({"text": "hi", key: value}, "native", EngineFeatures(), {})
    except InvalidRequest:
        ours = True
    else:
        ours = False
    if (key, repr(value)) in FIELD_DIFFERENCES:
        assert sglang != ours, f"no longer a difference: {key}={value!r}"
    else:
        assert sglang == ours, f"{key}={value!r}: SGLang refuses: {sglang}, we refuse: {ours}"


# -- the OpenAI routes' own checks ---------------------------------------------------------------


@pytest.mark.parametrize(("max_tokens", "refused"), [(1, False), (0, True), (-1, True)])
def test_completions_max_tokens_is_positive_as_in_sglang(max_tokens: int, refused: bool) -> None:
    try:
        CompletionRequest.model_validate({"prompt": "hi", "max_tokens": max_tokens})
    except ValueError:
        sglang = True
    else:
        sglang = False
    try:
        _openai_fields.native_fields({"prompt": "hi", "max_tokens": max_tokens}, "completions")
    except Exception:  # InvalidRequest
        ours = True
    else:
        ours = False
    assert sglang == ours == refused
