"""The harness benchmark against NVIDIA Dynamo 1.6.1's own SGLang handler, in its quick form.

``cancel_latency.py --engine sglang-harness --quick`` runs trio-sglang's
worker and Dynamo's ``DecodeWorkerHandler`` (from the ``ai-dynamo`` wheel)
in turn on the real TokenizerManager and the stand-in scheduler, then the
SimEngine's ``poll-then-abort`` model through the same scenarios. Runs in
``nox -s sglang`` (marker ``sglang``), which installs both; real time, so it
asserts counts only, never a latency: the phases' margins are what make the
counts certain (a 0.5 s tokenization against Dynamo's 0.25 s dispatch wait).
"""

from __future__ import annotations

import json
import warnings
from types import ModuleType
from typing import Any

import pytest

from _benchmarks import benchmark_fixture
from trio_sglang._sglang._semantics import detect_semantics

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s sglang`")
pytest.importorskip("dynamo.sglang", reason="needs ai-dynamo 1.6.1: run `nox -s sglang`")

pytestmark = pytest.mark.sglang

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # SGLang's words on GPU kernels this CPU lacks
    SEMANTICS = detect_semantics()
#: Whether the installed SGLang drops a repeated abort (0.5.20 on), as detected.
DEDUPES_ABORTS = SEMANTICS.abort_dedupe
#: Whether it forgets a request aborted in its waiting queue (0.5.14 on), as detected.
QUEUED_ABORT_FORGETS = SEMANTICS.queued_abort_forgets
#: Whether it keeps an abort sent before the dispatch (0.5.17 only), as detected.
EARLY_ABORT_KEPT = SEMANTICS.early_abort_kept

#: Phases in which the request has not reached the scheduler when the cancel comes.
BEFORE_DISPATCH = ("before_registration", "tokenizing", "slow_tokenization")


bench = benchmark_fixture("cancel_latency")


@pytest.fixture(scope="module")
def run(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run (about a minute), shared by the tests below."""
    out = tmp_path_factory.mktemp("harness") / "harness.json"
    assert bench.main(["--engine", "sglang-harness", "--quick", "--json", str(out)]) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def rows(run: dict[str, Any], approach: str) -> dict[str, dict[str, Any]]:
    return {row["phase"]: row for row in run["results"] if row["approach"] == approach}


def test_every_approach_ran_every_phase(bench: ModuleType, run: dict[str, Any]) -> None:
    from _harness_sweep import HARNESS_PHASES

    for approach in ("trio-sglang", "dynamo-1.6", "poll-then-abort"):
        cells = rows(run, approach)
        assert set(cells) == set(HARNESS_PHASES), approach
        assert all(cell["cancels"] == 5 for cell in cells.values()), approach


def test_trio_sglang_loses_nothing_and_sends_nothing_it_cancelled(run: dict[str, Any]) -> None:
    for phase, cell in rows(run, "trio-sglang").items():
        assert (cell["aborts_lost"], cell["not_stopped"], cell["leaked"]) == (0, 0, 0), phase
        assert cell["wasted_tokens"]["max"] == 0, phase
        if phase in BEFORE_DISPATCH:
            assert cell["sent_to_scheduler"] == 0, phase  # released before dispatch


def timer_expired(cell: dict[str, Any]) -> int:
    """How many of Dynamo's aborts in ``cell`` went out when its 0.25 s dispatch wait ran out.

    Such an abort reaches SGLang before the dispatch: 0.5.17 keeps it (the
    request is never sent), later releases drop it (lost). In a slow
    tokenization that is every abort; in a 50 ms one only where a busy machine
    stretched the tokenization past the wait. The counts that follow from it
    are Dynamo's code either way, so each is checked against this number.
    """
    if EARLY_ABORT_KEPT:
        return int(cell["cancels"] - cell["sent_to_scheduler"])
    return int(cell["aborts_lost"])


def test_dynamo_loses_every_abort_in_a_slow_tokenization(run: dict[str, Any]) -> None:
    from _harness_sweep import MAX_NEW_TOKENS

    dynamo = rows(run, "dynamo-1.6")
    slow = dynamo["slow_tokenization"]
    assert timer_expired(slow) == slow["cancels"]
    if DEDUPES_ABORTS:
        # SGLang then drops Dynamo's retries: the request decodes to its end for nobody.
        assert slow["wasted_tokens"]["p50"] == slow["wasted_tokens"]["max"] == MAX_NEW_TOKENS
    for phase, cell in dynamo.items():
        expired = timer_expired(cell) if phase in BEFORE_DISPATCH else 0
        if phase not in BEFORE_DISPATCH:
            assert cell["aborts_lost"] == 0, phase  # no timer: it waited for the dispatch
        if EARLY_ABORT_KEPT:
            # 0.5.17 keeps an abort that comes before the dispatch: never sent, nothing lost.
            assert (cell["aborts_lost"], cell["not_stopped"]) == (0, 0), phase
        else:
            # What was cancelled before it reached the scheduler is sent there all the same.
            if phase in BEFORE_DISPATCH:
                assert cell["sent_to_scheduler"] == cell["cancels"], phase
            # Before 0.5.20 nothing drops a repeated abort, and a retry stops the request;
            # from 0.5.20 the retries are dropped and it decodes to its end.
            assert cell["not_stopped"] == (expired if DEDUPES_ABORTS else 0), phase
        if QUEUED_ABORT_FORGETS:
            assert cell["leaked"] == 0, phase  # every request ended, stopped or not
        else:
            # 0.5.12 and older keep the state of a request aborted in the waiting queue
            # (the stand-in echoes every abort as one): Dynamo leaves each behind.
            assert cell["leaked"] == cell["cancels"], phase


def test_the_sim_model_agrees_with_dynamos_code_in_every_count(run: dict[str, Any]) -> None:
    from _harness_sweep import COUNTS

    if not DEDUPES_ABORTS:
        pytest.skip("the SimEngine models SGLang 0.5.20 on, whose abort dedupe this release lacks")

    model, real = rows(run, "poll-then-abort"), rows(run, "dynamo-1.6")
    for phase, cell in real.items():
        timed = phase in BEFORE_DISPATCH and phase != "slow_tokenization"
        if timed and (timer_expired(model[phase]) or timer_expired(cell)):
            continue  # a busy machine ran one of them down Dynamo's slow path, not both
        assert {key: model[phase][key] for key in COUNTS} == {key: cell[key] for key in COUNTS}
        assert model[phase]["wasted_tokens"]["p50"] == cell["wasted_tokens"]["p50"], phase
    assert {check["phase"] for check in run["model_check"]} == set(real)
