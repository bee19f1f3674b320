"""The installed SGLang release, as trio-sglang detects it: its semantics and the fields it takes.

Runs in ``nox -s sglang`` on 0.5.23 and in ``nox -s sglang-matrix`` on each
release there (marker ``sglang``). ``READ_FROM_THE_CODE`` is what a reading
of each release's ``tokenizer_manager.py`` found; the run-time detection
(``_sglang/_semantics.py``) must agree with it on every release it lists.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s sglang`")

with warnings.catch_warnings():
    # Imported in this process (the harness runs SGLang in processes of its own), SGLang
    # warns that this machine's GPU kernels (AWQ, GGUF) are missing.
    warnings.simplefilter("ignore", UserWarning)
    from sglang.srt.managers import io_struct, tokenizer_manager  # noqa: F401
    from sglang.srt.sampling import sampling_params  # noqa: F401
    from sglang.version import __version__

from trio_sglang import EngineFeatures, InvalidRequest, SGLangEngine, UnsupportedSGLang
from trio_sglang._request._fields import check_honoured
from trio_sglang._sglang._fields_taken import fields_taken
from trio_sglang._sglang._semantics import (
    MINIMUM_RELEASE,
    detect_semantics,
    engine_keeps_a_tokenizer,
    require_supported,
)
from trio_sglang_harness import Scenario, open_sglang_harness

pytestmark = pytest.mark.sglang

_KEEPS = ("time_stats", "keeps", False, False, True, False)
_FORGETS = ("time_stats", "forgets", False, False, True, False)
_RELEASES = ("dispatched", "releases", True, False, True, False)
#: Per release: dispatch mark, what its close does, abort dedupe, children named by
#: parent, a request aborted in the waiting queue forgotten, an abort before the
#: dispatch kept.
READ_FROM_THE_CODE: dict[str, tuple[str, str, bool, bool, bool, bool]] = {
    **dict.fromkeys(("0.5.10", "0.5.12"), ("time_stats", "keeps", False, False, False, False)),
    **dict.fromkeys(("0.5.14", "0.5.15", "0.5.16"), _KEEPS),
    "0.5.17": ("dispatched", "aborts", False, True, True, True),
    **dict.fromkeys(("0.5.18", "0.5.19"), _FORGETS),
    **dict.fromkeys(("0.5.20", "0.5.21", "0.5.22", "0.5.23"), _RELEASES),
}


def release() -> str:
    found = re.match(r"\d+\.\d+\.\d+", __version__)
    assert found is not None, __version__
    return found.group()


def test_the_detected_semantics_are_what_the_releases_code_reads() -> None:
    if release() not in READ_FROM_THE_CODE:
        pytest.skip(f"no reading of SGLang {__version__}'s code to compare the detection with")
    semantics = detect_semantics()
    assert semantics.version == __version__
    assert semantics.registered_before_dispatch
    found = (
        semantics.dispatch_mark.value,
        semantics.close.value,
        semantics.abort_dedupe,
        semantics.children_named_by_parent,
        semantics.queued_abort_forgets,
        semantics.early_abort_kept,
    )
    assert found == READ_FROM_THE_CODE[release()]


def older_than_the_minimum() -> bool:
    return tuple(map(int, release().split("."))) < tuple(map(int, MINIMUM_RELEASE.split(".")))


def test_the_installed_release_is_supported() -> None:
    assert not older_than_the_minimum()
    require_supported(detect_semantics())


async def test_an_older_release_is_refused_at_start_in_one_line() -> None:
    if not older_than_the_minimum():
        pytest.skip(f"SGLang {__version__} is supported (nox -s sglang-matrix refuses 0.5.9)")
    engine = SGLangEngine(tokenizer_manager=object())
    with pytest.raises(UnsupportedSGLang) as refused:
        async with engine.running():
            pytest.fail("an SGLang older than the minimum ran")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"SGLang {__version__} ")
    assert message.endswith(f"trio-sglang needs SGLang >= {MINIMUM_RELEASE}")


#: SGLang's sampling fields and top-level fields that need no GPU feature, each set.
EVERY_FIELD_REQUEST = {
    "text": "hello world",
    "sampling_params": {
        "max_new_tokens": 4,
        "min_new_tokens": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "repetition_penalty": 1.1,
        "stop": ["zzz"],
        "stop_token_ids": [3],
        "stop_regex": [r"\d{9}"],
        "ignore_eos": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "no_stop_trim": True,
        "stream_interval": 1,
        "logit_bias": {"5": 0.5},
        "sampling_seed": 7,
        "custom_params": {"a": 1},
    },
    "session_id": "session-1",
    "conversation_id": "conversation-1",
    "routing_key": "key",
    "extra_key": "extra",
    "cache_salt": "salt",
    "custom_labels": {"team": "a"},
    "log_metrics": False,
    "no_logs": True,
    "return_logprob": False,
    "return_hidden_states": False,
}


def taken(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` without the fields the installed release lacks."""
    fields = fields_taken()
    if fields is None:
        return request
    params = {
        key: value
        for key, value in request["sampling_params"].items()
        if f"sampling_params.{key}" in fields
    }
    top = {key: value for key, value in request.items() if key in fields or key == "text"}
    return {**top, "sampling_params": params}


def test_a_field_the_release_lacks_is_refused_by_name_before_the_engine() -> None:
    fields = fields_taken()
    if fields is None:
        pytest.skip(f"SGLang {__version__} takes every field trio-sglang passes")
    features = EngineFeatures(kind="sglang", sglang_version=__version__, honoured_fields=fields)
    missing = sorted(set(EVERY_FIELD_REQUEST) - fields - {"text", "sampling_params"})
    for field in missing:
        with pytest.raises(InvalidRequest, match=rf"'{field}' is not supported .*{__version__}"):
            check_honoured({"text": "hi", field: EVERY_FIELD_REQUEST[field]}, features, {})


async def test_the_real_tokenizer_manager_takes_every_field_the_lifecycle_passes(
    tmp_path: Path,
) -> None:
    """SGLangEngine honours every field its release has: none is dropped on its way to SGLang."""
    async with open_sglang_harness(
        workdir=tmp_path, first_token_delay=0.05, token_interval=0.01
    ) as harness:
        with trio.fail_after(60):
            seen = await harness.run(Scenario("every-field", taken(EVERY_FIELD_REQUEST), "native"))
    assert seen.scheduler == [["request"]]
    assert seen.registered_after == 0
    assert seen.finish_reasons[-1] == "length"


async def test_every_token_reaches_the_caller_once_whichever_way_the_release_streams(
    tmp_path: Path,
) -> None:
    """The harness's TokenizerManager streams increments; releases before 0.5.17 keep that
    flag in their server arguments only, and a stream read as cumulative lost every token
    after the first (its deltas taken as whole texts)."""
    request = {"text": "hi", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    async with open_sglang_harness(
        workdir=tmp_path, first_token_delay=0.05, token_interval=0.02
    ) as harness:
        with trio.fail_after(60):
            seen = await harness.run(Scenario("every-token", request, "native"))
    assert seen.finish_reasons[-1] == "length"
    assert len(seen.output_ids) == 5, seen
    assert len(seen.text.split()) == 5, seen.text


async def test_an_engine_whose_tokenizer_manager_is_a_router_is_refused_in_one_line() -> None:
    """An Engine with ``tokenizer_worker_num`` above 1 holds only a router on older releases."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from sglang.srt.managers.multi_tokenizer_mixin import MultiTokenizerRouter

    router = MultiTokenizerRouter.__new__(MultiTokenizerRouter)  # SGLang's class, never started
    engine = SGLangEngine(engine=SimpleNamespace(tokenizer_manager=router))
    with pytest.raises(ValueError, match="is a MultiTokenizerRouter, which generates nothing"):
        async with engine.running():
            pytest.fail("an engine whose requests go to a router ran")


async def test_several_tokenizer_workers_are_refused_where_the_engine_keeps_no_tokenizer() -> None:
    if engine_keeps_a_tokenizer():
        pytest.skip(f"SGLang {__version__}'s Engine keeps one: test_real_engine.py drives it")
    engine = SGLangEngine(model_path="no-model-loads", tokenizer_worker_num=2)
    with pytest.raises(ValueError, match="keeps no tokenizer") as refused:
        async with engine.running():
            pytest.fail("a model loaded for an engine that cannot serve it")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"tokenizer_worker_num=2: the Engine of SGLang {__version__} ")


@pytest.mark.parametrize("mode", ["prefill", "decode", "null"])
def test_the_role_is_known_before_the_engine_runs(mode: str) -> None:
    """``open_worker`` asks a decode worker's engine its role before starting it: a decode
    ``serve --engine sglang --prefill-url ...`` once failed to start on this."""
    engine = SGLangEngine(model_path="no-model-loads", disaggregation_mode=mode)
    assert engine.features().disaggregation_mode == (None if mode == "null" else mode)
