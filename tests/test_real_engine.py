"""Every lifecycle check on the whole ``sglang.Engine``, judged by its real scheduler.

One engine for the module, in a harness host process of its own (SGLang's
shutdown and crash handler kill their caller's process tree):
``SGLangEngine(device="cpu")`` launched from inside trio, as a user's program
launches it, over the tiny local model. Each scenario cancels one request at
one moment; the host taps what the TokenizerManager sent the real scheduler
and what the scheduler answered, and waits (bounded) for the scheduler's own
load snapshot to show it holds nothing. A request left decoding fails here
three ways: its abort missing or never applied, its tokens after the cancel,
and the scheduler still holding it. Runs in ``nox -s real-engine`` (marker
``real_engine``); real time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

from trio_sglang._sglang._semantics import engine_keeps_a_tokenizer
from trio_sglang_harness import Observation, Scenario, open_sglang_harness

pytestmark = pytest.mark.real_engine

#: Long enough that a request nobody stops decodes for seconds on this CPU.
MAX_NEW_TOKENS = 2000
#: What a stopped request may still decode after its cancel: the abort's trip to the
#: scheduler and the batch in flight (2 to 4 tokens on a quiet machine; a busy one
#: stretches it), against every token of the 2,000 for one never stopped.
TOKENS_AFTER_CANCEL_BOUND = 200


def request(**sampling: Any) -> dict[str, Any]:
    params = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, **sampling}
    return {"text": "hello world", "sampling_params": params}


SINGLE = request()
SHORT = request(max_new_tokens=8)
PARALLEL = {**request(n=3), "text": "hi"}
BATCH = {**request(), "text": ["hi", "there"]}
STOPPED = ["request", "abort", "abort_applied"]

#: (scenario, what the real scheduler must have seen: per request, its events in order)
CASES: list[tuple[Scenario, list[list[str]]]] = [
    (Scenario("before_registration", SINGLE, "tokens", "before_registration"), []),
    # Released before dispatch: nothing ever reaches the scheduler.
    (Scenario("tokenizing", SINGLE, "tokens", "tokenizing", tokenize_delay=0.3), []),
    (Scenario("dispatched", SINGLE, "tokens", "dispatched"), [STOPPED]),
    (Scenario("mid_stream-tokens", SINGLE, "tokens", "mid_stream"), [STOPPED]),
    (Scenario("mid_stream-text", SINGLE, "text", "mid_stream"), [STOPPED]),
    (Scenario("mid_stream-native", SINGLE, "native", "mid_stream"), [STOPPED]),
    (Scenario("consumer_leaves", SINGLE, "native", "consumer_leaves"), [STOPPED]),
    (Scenario("after_finish", SHORT, "native", "after_finish"), [["request"]]),
    (Scenario("uncancelled", SHORT, "text"), [["request"]]),
    # n > 1: SGLang's warm-up request first, then the children under fresh ids.
    (Scenario("n3-tokenizing", PARALLEL, "native", "tokenizing", tokenize_delay=0.3), []),
    (Scenario("n3-mid_stream", PARALLEL, "native", "mid_stream"), [["request"], *[STOPPED] * 3]),
    (Scenario("batch2-tokenizing", BATCH, "native", "tokenizing", tokenize_delay=0.3), []),
    (Scenario("batch2-mid_stream", BATCH, "native", "mid_stream"), [STOPPED] * 2),
]
#: Cancelled after the first child's dispatch: the others may not have been sent yet.
PARTLY_SENT = [
    Scenario("n3-dispatched", PARALLEL, "native", "dispatched"),
    Scenario("batch2-dispatched", BATCH, "native", "dispatched"),
]
#: SGLang's trap, shown on its real scheduler: an abort while tokenizing is lost, and
#: the request decodes to its end (what the lifecycle above never lets happen).
LOST = Scenario(
    "trap-abort-while-tokenizing", SHORT, tokenize_delay=0.3, trap="abort_while_tokenizing"
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-engine")


def public(seen: Observation) -> bool:
    """Ids the caller saw are the context's (``conformance-ctx``, ``_i`` for a batch)."""
    return all(i == "conformance-ctx" or i.startswith("conformance-ctx_") for i in seen.ids_seen)


def left_nothing(name: str, seen: Observation) -> list[str]:
    problems = []
    if seen.registered_after:
        problems.append(f"{name}: {seen.registered_after} state(s) left in rid_to_state")
    if seen.scheduler_held_after != 0:
        problems.append(f"{name}: the scheduler still holds {seen.scheduler_held_after}")
    return problems


@pytest.mark.parametrize("tokenizer_workers", [1, 2])
async def test_every_cancel_phase_stops_the_real_scheduler(
    workdir: Path, tokenizer_workers: int
) -> None:
    """With ``tokenizer_worker_num`` 2 the worker drives the Engine's own tokenizer worker,
    and SGLang's router stands between it and the scheduler."""
    if tokenizer_workers > 1 and not engine_keeps_a_tokenizer():
        pytest.skip("this SGLang's Engine keeps no tokenizer of its own: refused at start")
    problems: list[str] = []
    from sglang.version import __version__

    async with open_sglang_harness(
        workdir=workdir, real_engine=True, tokenizer_workers=tokenizer_workers
    ) as harness:
        assert harness.tokenizer_manager == (
            "TokenizerManager" if tokenizer_workers == 1 else "TokenizerWorker"
        )
        assert harness.capabilities["engine"]["kind"] == "sglang"
        # The release installed here (``nox -s sglang-matrix``'s folders run older ones).
        assert harness.capabilities["engine"]["sglang_version"] == __version__
        assert harness.capabilities["features"]["cancel_before_first_output_v1"] is True
        for scenario, expected in CASES:
            seen = await harness.run(scenario)
            problems += left_nothing(scenario.name, seen)
            if seen.scheduler != expected:
                problems.append(f"{scenario.name}: the scheduler saw {seen.scheduler}")
            bound = TOKENS_AFTER_CANCEL_BOUND * len(expected or [1])
            if scenario.cancel not in (None, "after_finish") and seen.tokens_after_cancel > bound:
                problems.append(f"{scenario.name}: {seen.tokens_after_cancel} tokens after")
            if not public(seen):
                problems.append(f"{scenario.name}: the caller saw {sorted(set(seen.ids_seen))}")
        for scenario in PARTLY_SENT:
            seen = await harness.run(scenario)
            problems += left_nothing(scenario.name, seen)
            children = [events for events in seen.scheduler if events != ["request"]]
            if not children or any(events != STOPPED for events in children):
                problems.append(f"{scenario.name}: the scheduler saw {seen.scheduler}")
        lost = await harness.run(LOST)
    assert not problems, "\n".join(problems)
    # The trap is real on the real scheduler: the abort went first, matched nothing,
    # and the request then decoded every token it asked for.
    assert lost.scheduler == [["abort", "request"]]
    assert lost.finish_reasons[-1] == "length"
