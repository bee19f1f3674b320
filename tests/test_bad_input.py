"""Bad input gets a clear error and registers nothing at the engine.

Every bad request goes through ``worker.generate`` on a real ``SimEngine``: it
must raise ``ts.InvalidRequest`` (a ``ValueError``) whose message names the
problem, and the engine must have seen nothing at all (empty trace, no live
rid). A few good requests check that the validation does not reject what
SGLang accepts, and a worker that has shut down refuses new streams with
``ts.EngineShutdown`` without touching the engine.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import finish_reason, read, slow_sim
from trio_sglang._request._fields import GENERATE_FIELDS
from trio_sglang._request._ids import RID_LENGTH
from trio_sglang._request._sampling import SAMPLING_PARAMS
from trio_sglang.sim._sim_engine import HONOURED_FIELDS

HELLO: dict[str, Any] = {"text": "Hello world", "sampling_params": {"max_new_tokens": 4}}

#: One valid value for every sampling parameter the worker knows.
EVERY_SAMPLING_PARAM: dict[str, Any] = {
    "max_new_tokens": 4,
    "min_new_tokens": 1,
    "n": 1,
    "stop": ["\n\n", "###"],
    "stop_token_ids": [2],
    "stop_regex": r"\.$",
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "frequency_penalty": 0.1,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.1,
    "ignore_eos": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": False,
    "no_stop_trim": False,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "stream_interval": 1,
    "logit_bias": {"1": 0.5},
    "sampling_seed": 42,
    "beam_width": None,  # beam search is not the SimEngine's: only null is taken
    "watermark": {"enabled": True, "key": "0xbeef", "context_window": 4},
}


def with_sampling(**params: object) -> dict[str, Any]:
    """A one-prompt text request with these sampling params."""
    return {"text": "Hello", "sampling_params": params}


def bad(request: object, match: str, case_id: str) -> Any:
    """One bad request case: the request and a regex its error message must match."""
    return pytest.param(request, match, id=case_id)


# -- helpers -------------------------------------------------------------------


def assert_engine_untouched(engine: ts.SimEngine) -> None:
    assert list(engine.trace) == []
    assert engine.live_rids() == set()
    assert engine.tokenizer_manager.rid_to_state == {}


async def assert_rejected(
    request: object,
    match: str,
    *,
    output: object = "text",
    ctx: object = None,
) -> None:
    """``worker.generate`` raises ``InvalidRequest`` and nothing reaches the engine."""
    engine = ts.SimEngine()
    ctx = ts.RequestContext("chatcmpl-bad") if ctx is None else ctx
    async with ts.open_worker(engine) as worker:
        with pytest.raises(ts.InvalidRequest, match=match) as excinfo:
            async with worker.generate(request, ctx, output=output):  # type: ignore[arg-type]
                pytest.fail("generate opened a stream for a bad request")
        assert isinstance(excinfo.value, ValueError)
        assert worker.open_streams == 0
        assert worker.pending_cleanups == 0
        assert_engine_untouched(engine)
    assert_engine_untouched(engine)


def public_id_of(chunk: Mapping[str, Any], output: str) -> str | None:
    if output == "tokens":
        return None
    if output == "text":
        return chunk["id"]
    return chunk["meta_info"]["id"]


# -- the corpus of bad requests ------------------------------------------------

NEEDS_ONE_PROMPT = r"exactly one of 'text' or 'input_ids'"
BAD_TEXT = r"'text' must be a non-empty string"
BAD_INPUT_IDS = r"'input_ids' must be a non-empty list of token ids"

BAD_REQUESTS = [
    # the request itself
    bad(["Hello"], r"request must be a mapping, got list", "request-is-list"),
    bad("Hello", r"request must be a mapping, got str", "request-is-str"),
    bad(None, r"request must be a mapping, got NoneType", "request-is-none"),
    bad({1: "x", "text": "Hello"}, r"request keys must be strings", "non-str-key"),
    bad({"text": "Hello", "prompt": "Hi"}, r"unknown request field 'prompt'", "unknown-field"),
    bad({"text": "Hello", "stream": "yes"}, r"stream must be a bool", "stream-str"),
    bad({"text": "Hello", "stream": 1}, r"stream must be a bool", "stream-int"),
    # the prompt
    bad({}, NEEDS_ONE_PROMPT, "no-prompt"),
    bad({"sampling_params": {"max_new_tokens": 4}}, NEEDS_ONE_PROMPT, "only-sampling-params"),
    bad({"text": None, "input_ids": None}, NEEDS_ONE_PROMPT, "both-prompts-none"),
    bad({"text": "Hello", "input_ids": [1, 2]}, NEEDS_ONE_PROMPT, "text-and-input-ids"),
    bad({"text": ""}, r"'text' is empty", "text-empty"),
    bad({"text": 42}, BAD_TEXT, "text-int"),
    bad({"text": {"content": "Hello"}}, BAD_TEXT, "text-dict"),
    bad({"text": b"Hello"}, BAD_TEXT, "text-bytes"),
    bad({"text": []}, BAD_TEXT, "text-empty-list"),
    bad({"text": ["Hello", ""]}, BAD_TEXT, "text-batch-with-empty-prompt"),
    bad({"text": ["Hello", 3]}, BAD_TEXT, "text-batch-with-int"),
    bad({"input_ids": []}, BAD_INPUT_IDS, "input-ids-empty"),
    bad({"input_ids": [1, -2, 3]}, BAD_INPUT_IDS, "input-ids-negative"),
    bad({"input_ids": [1, True]}, BAD_INPUT_IDS, "input-ids-bool"),
    bad({"input_ids": [1.0, 2.0]}, BAD_INPUT_IDS, "input-ids-float"),
    bad({"input_ids": ["1", "2"]}, BAD_INPUT_IDS, "input-ids-str"),
    bad({"input_ids": "1 2 3"}, BAD_INPUT_IDS, "input-ids-is-str"),
    bad({"input_ids": [2**31]}, BAD_INPUT_IDS, "input-ids-too-big"),
    bad({"input_ids": [[1, 2], []]}, BAD_INPUT_IDS, "input-ids-batch-with-empty-prompt"),
    bad({"input_ids": [[[1]]]}, BAD_INPUT_IDS, "input-ids-nested-too-deep"),
    # sampling_params
    bad({"text": "Hello", "sampling_params": [4]}, r"sampling_params must be a mapping", "sp-list"),
    bad(
        {"text": "Hello", "sampling_params": "t=1"}, r"sampling_params must be a mapping", "sp-str"
    ),
    # SGLang's API contract knows "choice"; its SamplingParams does not (a TypeError there).
    bad(with_sampling(choice=["a"]), r"unknown sampling parameter 'choice'", "sp-unknown"),
    bad(with_sampling(is_normalized=True), r"is_normalized is SGLang's own", "sp-internal"),
    bad(with_sampling(stop_strs=["x"]), r"stop_strs is SGLang's own", "sp-internal-stop"),
    bad(with_sampling(max_new_tokens=-1), r"sampling_params\.max_new_tokens", "max-new-negative"),
    bad(with_sampling(max_new_tokens=4.0), r"sampling_params\.max_new_tokens", "max-new-float"),
    bad(with_sampling(max_new_tokens=True), r"sampling_params\.max_new_tokens", "max-new-bool"),
    bad(with_sampling(max_new_tokens="16"), r"sampling_params\.max_new_tokens", "max-new-str"),
    bad(with_sampling(max_new_tokens=2**31), r"sampling_params\.max_new_tokens", "max-new-huge"),
    bad(with_sampling(min_new_tokens=-1), r"sampling_params\.min_new_tokens", "min-new-negative"),
    bad(with_sampling(n=0), r"sampling_params\.n must be an int from 1", "n-zero"),
    bad(with_sampling(n=-2), r"sampling_params\.n must be an int from 1", "n-negative"),
    bad(with_sampling(n=True), r"sampling_params\.n must be an int from 1", "n-bool"),
    bad(with_sampling(n=2.0), r"sampling_params\.n must be an int from 1", "n-float"),
    bad(with_sampling(n=1025), r"sampling_params\.n must be an int from 1", "n-too-big"),
    bad(with_sampling(temperature=-0.1), r"sampling_params\.temperature", "temperature-negative"),
    bad(with_sampling(temperature=math.nan), r"sampling_params\.temperature", "temperature-nan"),
    bad(with_sampling(temperature=math.inf), r"sampling_params\.temperature", "temperature-inf"),
    bad(with_sampling(temperature="0.7"), r"sampling_params\.temperature", "temperature-str"),
    bad(with_sampling(temperature=False), r"sampling_params\.temperature", "temperature-bool"),
    bad(with_sampling(top_p=0), r"sampling_params\.top_p must be a number in", "top-p-zero"),
    bad(with_sampling(top_p=1.5), r"sampling_params\.top_p must be a number in", "top-p-1.5"),
    bad(with_sampling(top_k=0), r"sampling_params\.top_k", "top-k-zero"),
    bad(with_sampling(top_k=-2), r"sampling_params\.top_k", "top-k-minus-two"),
    bad(with_sampling(top_k=1.5), r"sampling_params\.top_k", "top-k-float"),
    bad(with_sampling(min_p=1.5), r"sampling_params\.min_p", "min-p-above-one"),
    bad(with_sampling(repetition_penalty=math.nan), r"\.repetition_penalty", "rep-penalty-nan"),
    bad(with_sampling(stop=7), r"sampling_params\.stop must be", "stop-int"),
    bad(with_sampling(stop=["###", 7]), r"sampling_params\.stop must be", "stop-list-with-int"),
    bad(with_sampling(stop={"###"}), r"sampling_params\.stop must be", "stop-set"),
    bad(with_sampling(stop_token_ids=[-1]), r"sampling_params\.stop_token_ids", "stop-ids-neg"),
    bad(with_sampling(ignore_eos="yes"), r"sampling_params\.ignore_eos must be a bool", "eos-str"),
    bad(with_sampling(stop=["x"] * 33), r"sampling_params\.stop must be at most 32", "stop-33"),
    bad(with_sampling(stop="\ud800"), r"sampling_params\.stop must be", "stop-surrogate"),
    bad(with_sampling(stop_regex="(a"), r"sampling_params\.stop_regex must be regular", "re-bad"),
    bad(
        with_sampling(stop_regex="a" * 257), r"\.stop_regex must be patterns of at most", "re-long"
    ),
    bad(with_sampling(stop_regex=["a"] * 33), r"\.stop_regex must be at most 32", "re-33"),
    bad(with_sampling(regex=7), r"sampling_params\.regex must be a string", "regex-int"),
    bad(with_sampling(json_schema={}), r"sampling_params\.json_schema must be a", "schema-dict"),
    bad(with_sampling(beam_width=0), r"sampling_params\.beam_width must be an int >= 1", "beam-0"),
    bad(with_sampling(stream_interval="1"), r"\.stream_interval must be an int", "interval-str"),
    bad(with_sampling(logit_bias={"x": 1}), r"sampling_params\.logit_bias must be", "bias-key"),
    bad(with_sampling(logit_bias={"-1": 1}), r"sampling_params\.logit_bias must be", "bias-neg"),
    bad(with_sampling(logit_bias={"1": "a"}), r"sampling_params\.logit_bias must be", "bias-str"),
    bad(with_sampling(logit_bias=[1]), r"sampling_params\.logit_bias must be", "bias-list"),
    bad(with_sampling(sampling_seed=2**63), r"\.sampling_seed must be an int in", "seed-big"),
    bad(with_sampling(sampling_seed=1.5), r"\.sampling_seed must be an int in", "seed-float"),
    bad(with_sampling(custom_params=[1]), r"\.custom_params must be an object", "custom-list"),
    bad(with_sampling(watermark=True), r"\.watermark must be an object", "watermark-bool"),
    bad(with_sampling(watermark={"on": 1}), r"\.watermark has unknown fields", "watermark-key"),
    bad(with_sampling(watermark={"key": "xyz"}), r"\.watermark\.key must be a hex", "wm-hex"),
    bad(
        with_sampling(watermark={"context_window": 0}),
        r"\.watermark\.context_window must be an int >= 1",
        "watermark-window",
    ),
    # the other fields of SGLang's GenerateReqInput
    bad({**HELLO, "priority": "high"}, r"priority must be an int", "priority-str"),
    bad({**HELLO, "return_logprob": "yes"}, r"return_logprob must be a bool", "logprob-str"),
    bad({**HELLO, "top_logprobs_num": -1}, r"top_logprobs_num must be an int >= 0", "top-neg"),
    bad({**HELLO, "custom_labels": {"a": 1}}, r"custom_labels must be an object of", "labels"),
    bad({**HELLO, "return_hidden_states": "all"}, r"return_hidden_states must be", "hidden"),
    bad({**HELLO, "lora_path": 7}, r"lora_path must be a string, or one per prompt", "lora-int"),
    bad({**HELLO, "return_logprob": [True]}, r"a list 'return_logprob' needs a batch", "list-1"),
    bad(
        {"text": ["a", "b"], "return_logprob": [True]},
        r"'return_logprob' has 1 entries but the batch has 2 prompts",
        "list-len",
    ),
    bad({**HELLO, "input_embeds": [[0.5]]}, r"'input_embeds' may not be set", "input-embeds"),
    bad({**HELLO, "lora_id": "x"}, r"'lora_id' may not be set: SGLang", "lora-id"),
    bad({**HELLO, "received_time": 1.0}, r"'received_time' may not be set", "received-time"),
    bad(
        {**HELLO, "watermark": {}, "sampling_params": {"watermark": {}}},
        r"watermark must be provided either at the request top level or inside",
        "watermark-twice",
    ),
    # rid
    bad({"text": "Hello", "rid": ""}, r"'rid' is empty", "rid-empty"),
    bad({"text": "Hello", "rid": 7}, r"'rid' must be a string", "rid-int"),
    bad({"text": "Hello", "rid": ["a"]}, r"a list 'rid' needs a batch prompt", "rid-list-single"),
    bad({"text": ["a", "b"], "rid": ["x"]}, r"'rid' has 1 entries but the batch has 2", "rid-len"),
    bad({"text": ["a", "b"], "rid": ["x", "x"]}, r"'rid' has duplicate entries", "rid-duplicate"),
    bad({"text": ["a", "b"], "rid": ["x", ""]}, r"every 'rid' in the list", "rid-list-empty"),
    bad({"text": ["a", "b"], "rid": ["x", 2]}, r"every 'rid' in the list", "rid-list-int"),
    bad(
        {"text": ["a", "b"], "sampling_params": [{}]},
        r"sampling_params has 1 entries",
        "sp-list-len",
    ),
    bad(
        {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]},
        r"every prompt of a batch must have the same n",
        "sp-list-mixed-n",
    ),
    bad(
        {"text": "a", "sampling_params": [{}]}, r"sampling_params must be a mapping", "sp-list-one"
    ),
]

#: Ints too big to convert to a float, where a float is expected.
TOO_BIG_FOR_A_FLOAT = [
    bad(with_sampling(temperature=10**400), r"sampling_params\.temperature", "temperature-huge"),
    bad(with_sampling(top_p=10**400), r"sampling_params\.top_p must be a number in", "top-p-huge"),
    bad(with_sampling(presence_penalty=-(10**400)), r"\.presence_penalty", "penalty-huge"),
]

#: Rejected by SGLang's ``SamplingParams.verify``, which runs during tokenization,
#: after the rid was registered: the worker has to reject them first.
SGLANG_VERIFY_REJECTS = [
    bad(with_sampling(frequency_penalty=2.5), r"\.frequency_penalty", "freq-penalty-above-2"),
    bad(with_sampling(presence_penalty=-3), r"\.presence_penalty", "presence-penalty-below-2"),
    bad(with_sampling(repetition_penalty=2.5), r"\.repetition_penalty", "rep-penalty-above-2"),
    bad(with_sampling(repetition_penalty=-1), r"\.repetition_penalty", "rep-penalty-negative"),
    bad(with_sampling(min_new_tokens=8, max_new_tokens=4), r"min_new_tokens", "min-above-max"),
    bad(with_sampling(regex="a+", json_schema="{}"), r"regex|json_schema", "two-grammars"),
    bad(with_sampling(ebnf="a", structural_tag="{}"), r"only one of .*structural_tag", "ebnf-tag"),
]

#: What the SimEngine does not do: refused by name before the engine sees the request.
NOT_ON_THE_SIM = [
    bad({**HELLO, field: value}, rf"'{field}' is not supported by the sim engine", field)
    for field, value in (
        ("image_data", "http://x/cat.png"),
        ("lora_path", "adapter"),
        ("return_logprob", True),
        ("top_logprobs_num", 2),
        ("token_ids_logprob", [1, 2]),
        ("logprob_start_len", 0),
        ("return_hidden_states", "last"),
        ("return_routed_experts", True),
        ("custom_logit_processor", "{}"),
        ("session_params", {"id": "s"}),
        ("return_prompt_token_ids", True),
    )
] + [
    bad(
        with_sampling(beam_width=2),
        r"'sampling_params\.beam_width' is not supported by the sim engine",
        "beam-width",
    ),
    bad(
        {"text": ["a", "b"], "return_logprob": [False, True]},
        r"'return_logprob' is not supported",
        "per-prompt-one-asks",
    ),
    # Beam search returns n sequences as one request, which the lifecycle does not model.
    bad(with_sampling(beam_width=2, n=2), r"beam_width > 1 with .*n > 1", "beam-and-n"),
]


@pytest.mark.parametrize(
    ("request_", "match"),
    BAD_REQUESTS + TOO_BIG_FOR_A_FLOAT + SGLANG_VERIFY_REJECTS + NOT_ON_THE_SIM,
)
async def test_bad_request_is_rejected_before_the_engine(
    request_: object, match: str, autojump_clock: trio.testing.MockClock
) -> None:
    await assert_rejected(request_, match)


@pytest.mark.parametrize("output", ["json", None, "TEXT", "", ["text"]], ids=repr)
async def test_unknown_output_mode_is_rejected(
    output: object, autojump_clock: trio.testing.MockClock
) -> None:
    await assert_rejected(
        HELLO, r"output must be one of \('tokens', 'text', 'native'\)", output=output
    )


@pytest.mark.parametrize(
    "ctx",
    [
        pytest.param(None, id="none"),
        pytest.param("chatcmpl-123", id="str"),
        pytest.param({"id": "chatcmpl-123"}, id="dict"),
        pytest.param(types.SimpleNamespace(id="chatcmpl-123"), id="lookalike"),
    ],
)
async def test_ctx_that_is_not_a_request_context_is_rejected(
    ctx: object, autojump_clock: trio.testing.MockClock
) -> None:
    engine = ts.SimEngine()
    async with ts.open_worker(engine) as worker:
        with pytest.raises(ts.InvalidRequest, match=r"ctx must be a RequestContext") as excinfo:
            async with worker.generate(HELLO, ctx):  # type: ignore[arg-type]
                pytest.fail("generate opened a stream without a RequestContext")
        assert isinstance(excinfo.value, ValueError)
        assert_engine_untouched(engine)


async def test_the_worker_keeps_serving_after_bad_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ts.SimEngine()
    ctx = ts.RequestContext("chatcmpl-1")
    async with ts.open_worker(engine) as worker:
        for request, _match in (case.values for case in BAD_REQUESTS):
            with pytest.raises(ts.InvalidRequest):
                async with worker.generate(request, ctx):  # type: ignore[arg-type]
                    pytest.fail("generate opened a stream for a bad request")
        assert_engine_untouched(engine)
        assert not ctx.cancelled
        async with worker.generate(HELLO, ctx, output="tokens") as chunks:
            tokens = [t for chunk in [c async for c in chunks] for t in chunk["token_ids"]]
        assert len(tokens) == 4
    assert engine.live_rids() == set()


def test_every_sampling_param_covers_the_known_fields() -> None:
    assert set(EVERY_SAMPLING_PARAM) == set(SAMPLING_PARAMS)


def test_the_sim_honours_only_fields_that_exist() -> None:
    sampling = {f"sampling_params.{key}" for key in SAMPLING_PARAMS}
    assert set(HONOURED_FIELDS) <= GENERATE_FIELDS.keys() | sampling


async def test_a_batch_may_give_a_field_per_prompt(autojump_clock: trio.testing.MockClock) -> None:
    engine = ts.SimEngine()
    request = {
        "text": ["a", "b"],
        "return_logprob": [False, None],  # asks for nothing, per prompt
        "cache_salt": ["x", "y"],
        "sampling_params": {"max_new_tokens": 2},
    }
    ctx = ts.RequestContext("x")
    async with (
        ts.open_worker(engine) as worker,
        worker.generate(request, ctx, output="tokens") as chunks,
    ):
        indexes = {chunk["index"] async for chunk in chunks}
    assert indexes == {0, 1}


async def test_an_engine_that_lists_no_honoured_fields_is_passed_every_field(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``honoured_fields`` absent: the engine honours every field (as SGLangEngine does)."""

    class EveryField(ts.SimEngine):
        def features(self) -> ts.EngineFeatures:
            return dataclasses.replace(super().features(), honoured_fields=None)

    engine = EveryField()
    request = {**HELLO, "lora_path": "adapter", "sampling_params": {"max_new_tokens": 2}}
    ctx = ts.RequestContext("x")
    async with (
        ts.open_worker(engine) as worker,
        worker.generate(request, ctx, output="tokens") as chunks,
    ):
        assert [chunk async for chunk in chunks]


# -- good requests ---------------------------------------------------------------

GOOD_REQUESTS = [
    pytest.param({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}, 3, id="ids"),
    pytest.param({"text": "Hello", "sampling_params": EVERY_SAMPLING_PARAM}, 4, id="every-param"),
    pytest.param(with_sampling(max_new_tokens=0), 0, id="max-new-tokens-0"),
    pytest.param({**HELLO, "rid": "caller-rid-1"}, 4, id="caller-rid"),
    pytest.param({**HELLO, "stream": True}, 4, id="stream-true"),
    pytest.param({**HELLO, "return_logprob": False, "priority": 1}, 4, id="passthrough-fields"),
    # What the SimEngine honours; and what asks for nothing (null, SGLang's defaults).
    pytest.param(
        {
            **HELLO,
            "session_id": "s",
            "cache_salt": "tenant-1",
            "custom_labels": {"team": "a"},
            "routing_key": "k",
            "log_metrics": False,
            "watermark": {"enabled": False},
            "image_data": None,
            "return_hidden_states": False,
            "top_logprobs_num": 0,
            "logprob_start_len": -1,
            "routed_experts_start_len": 0,
            "lora_path": None,
        },
        4,
        id="honoured-and-default-fields",
    ),
    pytest.param(
        with_sampling(max_new_tokens=2, temperature=0, top_p=1, top_k=-1, stop="x", n=1),
        2,
        id="boundary-values",
    ),
    pytest.param(
        with_sampling(max_new_tokens=2, temperature=None, stop=[], stop_token_ids=[]),
        2,
        id="none-and-empty-values",
    ),
    pytest.param(types.MappingProxyType(HELLO), 4, id="read-only-mapping"),
    # SGLang's SamplingParams reads null as the default, n = 1 included.
    pytest.param(with_sampling(max_new_tokens=2, n=None), 2, id="n-none"),
    pytest.param(
        {"input_ids": [0, 2**31 - 1], "sampling_params": {"max_new_tokens": 1}}, 1, id="id-bounds"
    ),
]


@pytest.mark.parametrize("output", ["tokens", "text", "native"])
@pytest.mark.parametrize(("request_", "max_new_tokens"), GOOD_REQUESTS)
async def test_good_request_streams_to_the_end(
    request_: Mapping[str, Any],
    max_new_tokens: int,
    output: str,
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ts.SimEngine()
    ctx = ts.RequestContext("chatcmpl-good")
    caller_rid = request_.get("rid")
    async with ts.open_worker(engine) as worker:
        async with worker.generate(request_, ctx, output=output) as chunks:  # type: ignore[arg-type]
            assert chunks.id == (caller_rid or ctx.id)
            received = [chunk async for chunk in chunks]
        assert worker.open_streams == 0
        assert worker.pending_cleanups == 0

    assert received
    assert [finish_reason(c, output) for c in received[:-1]] == [None] * (len(received) - 1)
    assert finish_reason(received[-1], output) == "length"
    for chunk in received:
        assert public_id_of(chunk, output) in (None, caller_rid or ctx.id)

    # Exactly one internal rid reached the engine, and it ran to the end.
    (rid,) = {event.rid for event in engine.trace}
    assert len(rid) == RID_LENGTH
    assert rid != caller_rid
    assert rid not in repr(received)
    kinds = engine.trace.kinds(rid)
    assert kinds == ["registered", "dispatched", *["token"] * max_new_tokens, "finished"]
    assert engine.live_rids() == set()


# -- a worker that has shut down ---------------------------------------------------


@pytest.mark.parametrize("output", ["tokens", "text", "native"])
async def test_generate_after_shutdown_raises_engine_shutdown(
    output: str, autojump_clock: trio.testing.MockClock
) -> None:
    engine = ts.SimEngine()
    async with ts.open_worker(engine) as worker:
        pass
    ctx = ts.RequestContext("chatcmpl-late")
    with pytest.raises(ts.EngineShutdown, match=re.escape("shutting down")):
        async with worker.generate(HELLO, ctx, output=output):  # type: ignore[arg-type]
            pytest.fail("a shut-down worker opened a stream")
    assert not ctx.cancelled
    assert worker.open_streams == 0
    assert_engine_untouched(engine)


# -- what a refused request says -----------------------------------------------------------------

#: A bad request, the field its error names (what the server answers as OpenAI's ``param``),
#: and the words that say what was wrong with the value the caller sent.
REFUSALS = [
    pytest.param(
        {**HELLO, "nonsense": 1}, "nonsense", "unknown request field 'nonsense'", id="unknown"
    ),
    pytest.param({**HELLO, "stream": "yes"}, None, "stream must be a bool, got str", id="stream"),
    pytest.param(
        {**HELLO, "return_logprob": [True]},
        "return_logprob",
        "a list 'return_logprob' needs a batch",
        id="per-prompt-no-batch",
    ),
    pytest.param(
        {"text": ["a", "b"], "return_logprob": [True]},
        "return_logprob",
        "'return_logprob' has 1 entries but the batch has 2 prompts",
        id="per-prompt-short",
    ),
    pytest.param(
        {"text": "a", "watermark": {"key": "0xbeef"}, "sampling_params": {"watermark": {}}},
        "watermark",
        "watermark must be provided either at the request top level or inside",
        id="two-watermarks",
    ),
    pytest.param(
        {**HELLO, "rid": 7}, None, "'rid' must be a string (or a list for a batch), got 7", id="rid"
    ),
    pytest.param({"text": "a\ud800b"}, None, "without a lone surrogate", id="surrogate"),
]


@pytest.mark.mutant_pin
@pytest.mark.parametrize(("request_", "param", "words"), REFUSALS)
async def test_a_refused_request_names_its_field_and_the_value_it_got(
    request_: dict[str, Any], param: str | None, words: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with ts.open_worker(slow_sim()) as worker:
        with pytest.raises(ts.InvalidRequest) as refused:
            await read(worker, request_, ts.RequestContext("pub"))
    assert words in str(refused.value)
    assert refused.value.param == param


@pytest.mark.mutant_pin
async def test_wrong_types_for_the_worker_itself_say_what_they_got(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(TypeError, match="policy must be an AbortPolicy, got dict"):
        async with ts.open_worker(slow_sim(), policy={}):  # type: ignore[arg-type]
            pass
    async with ts.open_worker(slow_sim()) as worker:
        with pytest.raises(ts.InvalidRequest, match="ctx must be a RequestContext, got str"):
            await read(worker, HELLO, "pub")  # type: ignore[arg-type]
