"""Unit tests of the small pieces the lifecycle is built from.

``AbortPolicy`` (validated, frozen bounds), ``RequestContext`` (the caller's
handle), ``mint_rid`` (internal rids that can never prefix-match each other),
``format_chunk`` (public ids only, the engine's dict never mutated) and
``build_capabilities`` (versioned metadata derived from the engine's features).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import re
import string
from typing import Any

import pytest
import trio.testing

import trio_sglang as ts
from trio_sglang._core._capabilities import SCHEMA_VERSION, build_capabilities
from trio_sglang._core._drain import Drain
from trio_sglang._core._outputs import PublicIds, format_chunk
from trio_sglang._request._ids import RID_LENGTH, mint_rid

# -- AbortPolicy -------------------------------------------------------------------

POLICY_FIELDS = [field.name for field in dataclasses.fields(ts.AbortPolicy)]
COUNT_FIELDS = {"abort_attempts": 1, "outputs_after_abort": 0}  # each one's least value
DURATION_FIELDS = [name for name in POLICY_FIELDS if name not in COUNT_FIELDS]


def test_abort_policy_defaults_are_valid() -> None:
    policy = ts.AbortPolicy()
    for name in DURATION_FIELDS:
        value = getattr(policy, name)
        assert isinstance(value, float)
        # Every bound is finite, but the stall bound, off by default.
        assert 0 < value < math.inf or (name == "stall_timeout" and value == math.inf)
    for name, least in COUNT_FIELDS.items():
        assert type(getattr(policy, name)) is int
        assert getattr(policy, name) >= least
    assert ts.AbortPolicy(**dataclasses.asdict(policy)) == policy


def test_abort_policy_is_frozen() -> None:
    policy = ts.AbortPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.close_timeout = 2.0  # type: ignore[misc]
    assert policy.close_timeout == ts.AbortPolicy().close_timeout


@pytest.mark.parametrize("value", [0, 0.0, 3, 0.25])
@pytest.mark.parametrize("name", DURATION_FIELDS)
def test_abort_policy_durations_accept_numbers_from_zero(name: str, value: float) -> None:
    assert getattr(ts.AbortPolicy(**{name: value}), name) == value


@pytest.mark.parametrize("value", [-1, -0.001, math.nan, True, False, "1.0", None], ids=repr)
@pytest.mark.parametrize("name", POLICY_FIELDS)
def test_abort_policy_rejects_bad_values(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"AbortPolicy\.{name} must be"):
        ts.AbortPolicy(**{name: value})


@pytest.mark.parametrize("value", [0, 1.0, 2.5], ids=repr)
def test_abort_attempts_rejects_zero_and_floats(value: object) -> None:
    with pytest.raises(ValueError, match=r"AbortPolicy\.abort_attempts must be an int >= 1"):
        ts.AbortPolicy(abort_attempts=value)  # type: ignore[arg-type]


def test_abort_attempts_accepts_one() -> None:
    assert ts.AbortPolicy(abort_attempts=1).abort_attempts == 1


@pytest.mark.parametrize("value", [-1, 1.0, 2.5], ids=repr)
def test_outputs_after_abort_is_a_count_from_zero(value: object) -> None:
    assert ts.AbortPolicy(outputs_after_abort=0).outputs_after_abort == 0
    with pytest.raises(ValueError, match=r"AbortPolicy\.outputs_after_abort must be an int >= 0"):
        ts.AbortPolicy(outputs_after_abort=value)  # type: ignore[arg-type]


# -- RequestContext ------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["", None, 7, b"chatcmpl-1", ["chatcmpl-1"]], ids=repr)
def test_request_context_rejects_bad_ids(bad_id: object) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        ts.RequestContext(bad_id)  # type: ignore[arg-type]


def test_request_context_starts_active() -> None:
    ctx = ts.RequestContext("chatcmpl-123")
    assert ctx.id == "chatcmpl-123"
    assert (ctx.stopped, ctx.killed, ctx.cancelled) == (False, False, False)
    assert repr(ctx) == "RequestContext('chatcmpl-123', active)"


def test_request_context_stop() -> None:
    ctx = ts.RequestContext("c")
    ctx.stop()
    ctx.stop()  # idempotent
    assert (ctx.stopped, ctx.killed, ctx.cancelled) == (True, False, True)
    assert repr(ctx) == "RequestContext('c', stopped)"


def test_request_context_kill() -> None:
    ctx = ts.RequestContext("c")
    ctx.kill()
    assert (ctx.stopped, ctx.killed, ctx.cancelled) == (False, True, True)
    assert repr(ctx) == "RequestContext('c', killed)"


def test_request_context_kill_wins_in_repr() -> None:
    ctx = ts.RequestContext("c")
    ctx.stop()
    ctx.kill()
    assert (ctx.stopped, ctx.killed, ctx.cancelled) == (True, True, True)
    assert repr(ctx) == "RequestContext('c', killed)"


def test_request_context_id_is_read_only() -> None:
    ctx = ts.RequestContext("c")
    with pytest.raises(AttributeError):
        ctx.id = "other"  # type: ignore[misc]


# -- mint_rid --------------------------------------------------------------------------


def test_mint_rid_is_fixed_length_hex() -> None:
    assert RID_LENGTH == 32
    for _ in range(100):
        rid = mint_rid()
        assert len(rid) == RID_LENGTH
        assert set(rid) <= set(string.hexdigits.lower())


def test_mint_rid_never_repeats_nor_prefixes() -> None:
    rids = sorted(mint_rid() for _ in range(10_000))
    assert len(set(rids)) == len(rids)
    # In sorted order, a string that is a prefix of any other is a prefix of
    # its successor, so neighbours are enough.
    for before, after in itertools.pairwise(rids):
        assert not after.startswith(before)


# -- format_chunk ------------------------------------------------------------------------

INTERNAL_RID = "0123456789abcdef0123456789abcdef"
PUBLIC_ID = "chatcmpl-123"
IDS = PublicIds(PUBLIC_ID)


def engine_output(
    *, finish_reason: object = None, index: int | None = None, **fields: Any
) -> dict[str, Any]:
    """An SGLang streamed output dict, as the engine yields it."""
    out: dict[str, Any] = {
        "text": " the cat",
        "output_ids": [5, 9],
        "meta_info": {
            "id": INTERNAL_RID,
            "finish_reason": finish_reason,
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 0,
        },
        **fields,
    }
    if index is not None:
        out["index"] = index
    return out


def assert_no_internal_rid(chunk: dict[str, Any]) -> None:
    assert INTERNAL_RID not in json.dumps(chunk)


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        pytest.param(None, None, id="none"),
        pytest.param({"type": "length", "length": 2}, "length", id="length"),
        pytest.param({"type": "stop", "matched": 2}, "stop", id="stop"),
        pytest.param({"type": "abort", "message": "Abort by request."}, "abort", id="abort"),
        pytest.param({"message": "?"}, "unknown", id="dict-without-type"),
        pytest.param("length", "length", id="plain-str"),
    ],
)
def test_format_chunk_tokens(reason: object, expected: str | None) -> None:
    out = engine_output(finish_reason=reason)
    chunk = format_chunk("tokens", out, IDS)
    assert chunk == {"index": 0, "token_ids": [5, 9], "finish_reason": expected}
    assert chunk["token_ids"] is not out["output_ids"]
    assert_no_internal_rid(chunk)
    assert PUBLIC_ID not in json.dumps(chunk)  # token chunks carry no id at all


def test_format_chunk_tokens_keeps_index_and_handles_missing_fields() -> None:
    chunk = format_chunk("tokens", engine_output(index=2), IDS)
    assert chunk["index"] == 2
    assert format_chunk("tokens", {"meta_info": {"id": INTERNAL_RID}}, IDS) == {
        "index": 0,
        "token_ids": [],
        "finish_reason": None,
    }


@pytest.mark.parametrize(
    ("reason", "expected"),
    [(None, None), ({"type": "length", "length": 2}, "length"), ({"type": "abort"}, "abort")],
    ids=["none", "length", "abort"],
)
def test_format_chunk_text(reason: object, expected: str | None) -> None:
    chunk = format_chunk("text", engine_output(finish_reason=reason, index=1), IDS)
    assert chunk["id"] == PUBLIC_ID
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 1, "text": " the cat", "finish_reason": expected}]
    assert_no_internal_rid(chunk)


def test_format_chunk_native_remaps_the_id_on_a_copy() -> None:
    out = engine_output(finish_reason={"type": "length", "length": 2}, index=3, extra=[1])
    before = copy.deepcopy(out)
    chunk = format_chunk("native", out, IDS)

    assert out == before  # the engine's dict is not mutated
    assert chunk is not out
    assert chunk["meta_info"] is not out["meta_info"]
    assert chunk["meta_info"] == {**before["meta_info"], "id": PUBLIC_ID}
    assert {k: v for k, v in chunk.items() if k != "meta_info"} == {
        k: v for k, v in before.items() if k != "meta_info"
    }
    assert chunk["index"] == 3
    assert_no_internal_rid(chunk)


def test_format_chunk_native_replaces_the_engine_id_in_the_engines_own_messages() -> None:
    """An abort's reason names the request as SGLang knows it: that id is internal too."""
    message = f"KV transfer timed out for request rank=0 req.rid='{INTERNAL_RID}'"
    reason = {"type": "abort", "message": message, "details": [message, {"rid": INTERNAL_RID}]}
    out = engine_output(finish_reason=reason, text=f"model text {INTERNAL_RID}")
    before = copy.deepcopy(out)
    chunk = format_chunk("native", out, IDS)
    assert out == before
    public = f"KV transfer timed out for request rank=0 req.rid='{PUBLIC_ID}'"
    assert chunk["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": public,
        "details": [public, {"rid": PUBLIC_ID}],
    }
    assert chunk["text"] == before["text"]  # what the model generated is the caller's
    assert INTERNAL_RID not in json.dumps(chunk["meta_info"])


def test_format_chunk_native_without_meta_info() -> None:
    out: dict[str, Any] = {"text": "x", "output_ids": [1]}
    assert format_chunk("native", out, IDS) == {**out, "meta_info": {"id": PUBLIC_ID}}
    assert "meta_info" not in out


@pytest.mark.parametrize("output", ["tokens", "text", "native"])
def test_format_chunk_never_mutates_its_input(output: str) -> None:
    out = engine_output(finish_reason={"type": "stop"}, index=0)
    before = copy.deepcopy(out)
    format_chunk(output, out, IDS)  # type: ignore[arg-type]
    assert out == before


# -- build_capabilities -------------------------------------------------------------------

FULL_FEATURES: dict[str, object] = {
    "kind": "sim",
    "sglang_version": "0.5.23",
    "request_registry": True,
    "dispatch_timestamp": True,
    "abort_sent_flag": True,
    "release_on_close": True,
}
LIFECYCLE_FEATURES = (
    "stream_closes_at_cancel_v1",
    "early_exit_aborts_v1",
    "bounded_detached_cleanup_v1",
    "public_ids_only_v1",
)
ENGINE_FEATURES = ("ordered_abort_v1", "cancel_before_first_output_v1")


def without(key: str) -> dict[str, object]:
    return {k: v for k, v in FULL_FEATURES.items() if k != key}


def capabilities(features: dict[str, Any]) -> dict[str, Any]:
    return build_capabilities(ts.EngineFeatures(**features))


def test_capabilities_shape() -> None:
    caps = capabilities(FULL_FEATURES)
    assert caps["schema_version"] == SCHEMA_VERSION == 1
    assert caps["package"] == {"name": "trio-sglang", "version": ts.__version__}
    assert caps["engine"] == {
        "kind": "sim",
        "sglang_version": "0.5.23",
        "disaggregation_mode": None,
        "sglang_semantics": None,
    }
    assert caps["role"] == "aggregated"
    assert json.loads(json.dumps(caps)) == caps


@pytest.mark.parametrize("features", [FULL_FEATURES, {}], ids=["full", "empty"])
def test_capability_feature_keys_are_versioned_bools(features: dict[str, object]) -> None:
    caps_features = capabilities(features)["features"]
    assert set(caps_features) >= {*LIFECYCLE_FEATURES, *ENGINE_FEATURES}
    for key, value in caps_features.items():
        assert re.fullmatch(r"[a-z0-9_]+_v[1-9][0-9]*", key), key
        assert isinstance(value, bool)


def test_capabilities_with_every_engine_feature() -> None:
    caps_features = capabilities(FULL_FEATURES)["features"]
    assert all(caps_features[key] for key in (*LIFECYCLE_FEATURES, *ENGINE_FEATURES))


@pytest.mark.parametrize(
    ("features", "ordered_abort", "cancel_before_first_output"),
    [
        pytest.param({}, False, False, id="nothing-detected"),
        pytest.param(without("request_registry"), False, False, id="no-registry"),
        pytest.param(without("dispatch_timestamp"), False, False, id="no-dispatch-timestamp"),
        pytest.param(without("release_on_close"), True, False, id="no-release-on-close"),
        pytest.param({**FULL_FEATURES, "request_registry": False}, False, False, id="false"),
    ],
)
def test_engine_derived_features(
    features: dict[str, object], ordered_abort: bool, cancel_before_first_output: bool
) -> None:
    caps_features = capabilities(features)["features"]
    assert caps_features["ordered_abort_v1"] is ordered_abort
    assert caps_features["cancel_before_first_output_v1"] is cancel_before_first_output
    # What the lifecycle guarantees by itself does not depend on the engine.
    assert all(caps_features[key] is True for key in LIFECYCLE_FEATURES)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("dispatch_timestamp", 1),
        ("release_on_close", "yes"),
        ("sglang_version", 523),
        ("sglang_version", b"0.5.23"),
        ("sglang_version", ["0.5.23"]),
    ],
    ids=repr,
)
def test_a_feature_claimed_by_a_truthy_stand_in_is_refused_by_name(
    name: str, value: object
) -> None:
    """Only ``True`` claims a feature: a stand-in never turns on an abort path, it is an error."""
    with pytest.raises(TypeError, match=rf"EngineFeatures: {name} must be"):
        ts.EngineFeatures(**{**FULL_FEATURES, name: value})


def test_a_disaggregation_mode_other_than_prefill_or_decode_is_refused() -> None:
    """SGLang's own ``"null"`` (aggregated) is the adapter's to turn into ``None``."""
    with pytest.raises(ValueError, match="must be None, 'prefill' or 'decode', not 'null'"):
        ts.EngineFeatures(**{**FULL_FEATURES, "disaggregation_mode": "null"})


def test_engine_kind_defaults_to_unknown() -> None:
    assert capabilities({})["engine"] == {
        "kind": "unknown",
        "sglang_version": None,
        "disaggregation_mode": None,
        "sglang_semantics": None,
    }


@pytest.mark.parametrize(
    ("features", "role", "cancel_anytime"),
    [
        pytest.param(FULL_FEATURES, "aggregated", False, id="aggregated"),
        pytest.param({**FULL_FEATURES, "disaggregation_mode": "prefill"}, "prefill", True),
        pytest.param({**FULL_FEATURES, "disaggregation_mode": "decode"}, "decode", False),
        pytest.param(
            {**without("dispatch_timestamp"), "disaggregation_mode": "prefill"},
            "prefill",
            False,
            id="prefill-without-dispatch-timestamp",
        ),
        pytest.param(
            {**without("request_registry"), "disaggregation_mode": "prefill"},
            "prefill",
            False,
            id="prefill-without-registry",
        ),
    ],
)
def test_prefill_cancel_anytime_is_advertised_only_by_a_prefill_worker_that_has_it(
    features: dict[str, object], role: str, cancel_anytime: bool
) -> None:
    caps = capabilities(features)
    assert caps["role"] == role
    assert caps["features"]["disagg_prefill_cancel_anytime_v1"] is cancel_anytime


async def test_worker_capabilities_on_sim_engine(autojump_clock: trio.testing.MockClock) -> None:
    engine = ts.SimEngine()
    async with ts.open_worker(engine) as worker:
        caps = worker.capabilities()
        assert worker.engine is engine
    assert caps == build_capabilities(engine.features())
    assert caps["engine"] == {
        "kind": "sim",
        "sglang_version": "0.5.23",
        "disaggregation_mode": None,
        "sglang_semantics": None,
    }
    assert caps["role"] == "aggregated"
    assert caps["engine"]["sglang_version"] == ts.SimEngine.SGLANG_VERSION
    assert caps["package"]["version"] == ts.__version__
    assert all(caps["features"][key] for key in (*LIFECYCLE_FEATURES, *ENGINE_FEATURES))
    assert list(engine.trace) == []


# -- Worker.prepare: one check, then generate as prepared ---------------------------------

HELLO_TWO: dict[str, Any] = {"text": "hello there", "sampling_params": {"max_new_tokens": 2}}


async def test_a_prepared_request_runs_as_it_was_prepared(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with ts.open_worker(ts.SimEngine()) as worker:
        prepared = worker.prepare(HELLO_TWO)
        assert prepared.parsed.output == "text"
        assert (prepared.parsed.n, prepared.parsed.children, prepared.prefill_leg) == (1, 1, False)
        async with worker.generate(prepared, ts.RequestContext("pub")) as chunks:
            ids = [chunk["id"] async for chunk in chunks]
    assert ids == ["pub", "pub"]


async def test_a_prepared_request_is_refused_to_another_worker_and_another_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ts.SimEngine()
    async with ts.open_worker(engine) as worker, ts.open_worker(ts.SimEngine()) as other:
        prepared = worker.prepare(HELLO_TWO, "tokens")
        with pytest.raises(ts.InvalidRequest, match=r"^this request was prepared by another"):
            async with other.generate(prepared, ts.RequestContext("pub"), output="tokens"):
                pytest.fail("generated")
        with pytest.raises(ts.InvalidRequest, match=r"for output 'tokens', not 'text'$"):
            async with worker.generate(prepared, ts.RequestContext("pub")):
                pytest.fail("generated")
    assert list(engine.trace) == []


async def test_prepare_names_a_field_the_engine_does_not_honour_in_the_callers_words(
    autojump_clock: trio.testing.MockClock,
) -> None:
    request = {**HELLO_TWO, "return_logprob": True}
    async with ts.open_worker(ts.SimEngine()) as worker:
        with pytest.raises(ts.InvalidRequest, match=r"^'logprobs' is not supported") as named:
            worker.prepare(request, names={"return_logprob": "logprobs"})
        with pytest.raises(
            ts.InvalidRequest, match=r"^'return_logprob' is not supported"
        ) as native:
            worker.prepare(request)
    assert named.value.param == "logprobs"
    assert native.value.param == "return_logprob"


# -- Drain: the open set a shutdown waits for ---------------------------------------------


async def test_a_drain_waits_until_its_last_item_goes_or_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drain: Drain[str] = Drain()
    assert (drain.closed, drain.hurried, len(drain)) == (False, False, 0)
    for item in "abc":
        drain.add(item)
    drain.close()
    assert drain.closed is True
    assert list(drain) == ["a", "b", "c"]  # oldest first

    async def leave(item: str, at: float) -> None:
        await trio.sleep_until(at)
        drain.discard(item)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for at, item in enumerate("ab", start=1):
            nursery.start_soon(leave, item, start + at)
        assert await drain.wait(start + 5) is False  # "c" never leaves
    assert trio.current_time() == start + 5
    assert list(drain) == ["c"]
    nursery_done = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leave, "c", nursery_done + 1)
        assert await drain.wait(math.inf) is True
    assert trio.current_time() == nursery_done + 1
    assert await drain.wait(math.inf) is True  # empty: at once


async def test_a_hurried_drain_stops_waiting_now_or_as_its_wait_begins(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drain: Drain[int] = Drain()
    drain.add(1)
    drain.hurry()
    assert drain.hurried is True
    start = trio.current_time()
    assert await drain.wait(math.inf) is False
    assert trio.current_time() == start

    later: Drain[int] = Drain()
    later.add(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_hurry_at, later, start + 2)
        assert await later.wait(start + 10) is False
    assert trio.current_time() == start + 2


async def _hurry_at(drain: Drain[int], at: float) -> None:
    await trio.sleep_until(at)
    drain.hurry()


# -- SGLangEngine arguments (the engine itself is covered by tests/test_conformance.py) --


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="nothing"),
        pytest.param({"engine": object(), "tokenizer_manager": object()}, id="two-sources"),
        pytest.param({"engine": object(), "model_path": "m"}, id="engine-and-args"),
        pytest.param({"tokenizer_manager": object(), "poll_interval": 0}, id="zero-poll"),
        pytest.param({"tokenizer_manager": object(), "poll_interval": math.inf}, id="inf-poll"),
    ],
)
def test_sglang_engine_needs_exactly_one_source(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"exactly one|poll_interval"):
        ts.SGLangEngine(**kwargs)


# -- outputs -------------------------------------------------------------------------------------


@pytest.mark.mutant_pin
def test_a_child_index_past_the_known_children_gets_a_public_id_of_its_own() -> None:
    from trio_sglang._core._outputs import PublicIds

    ids = PublicIds("pub", ("a", "b"))
    assert [ids.child(i) for i in (0, 1, 2)] == ["a", "b", "pub_2"]


@pytest.mark.mutant_pin
@pytest.mark.parametrize("engine_id", ["", 7, None], ids=["empty", "int", "none"])
def test_a_native_output_without_a_usable_engine_id_is_only_renamed(engine_id: object) -> None:
    from trio_sglang._core._outputs import PublicIds, format_chunk

    out = {"meta_info": {"id": engine_id, "finish_reason": {"message": "abort req.rid=x"}}}
    chunk = format_chunk("native", out, PublicIds("pub"))
    assert chunk["meta_info"] == {"id": "pub", "finish_reason": {"message": "abort req.rid=x"}}


@pytest.mark.mutant_pin
def test_a_text_chunk_of_an_output_without_text_has_empty_text() -> None:
    from trio_sglang._core._outputs import PublicIds, format_chunk

    chunk = format_chunk("text", {"meta_info": {}}, PublicIds("pub"))
    assert chunk["choices"] == [{"index": 0, "text": "", "finish_reason": None}]
