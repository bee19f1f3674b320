"""Conformance: the same scenarios on the SimEngine and on the real TokenizerManager.

The real side is SGLang 0.5.23's TokenizerManager in its own process, driven
by ``SGLangEngine`` through trio-asyncio, against the stand-in scheduler
(``trio_sglang.harness``). Both sides must agree on what the scheduler
received and did, per request and in order; on what stayed registered; and
on what the caller saw. Runs in ``nox -s sglang`` (marker ``sglang``), which
installs SGLang's CPU-importable parts; real time, not MockClock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s sglang`")

from trio_sglang import OutputMode
from trio_sglang.harness import (
    CancelPhase,
    Observation,
    Scenario,
    SGLangHarness,
    observe_on_sim,
    open_sglang_harness,
)

pytestmark = pytest.mark.sglang

FIRST_TOKEN_DELAY = 0.2
TOKEN_INTERVAL = 0.05
REQUEST = {"text": "hello world", "sampling_params": {"max_new_tokens": 6}}
PHASES: list[CancelPhase] = [
    "before_registration",
    "tokenizing",
    "dispatched",
    "mid_stream",
    "after_finish",
]
OUTPUTS: list[OutputMode] = ["tokens", "text", "native"]

SCENARIOS = [
    *(
        Scenario(f"{phase}-{output}", REQUEST, output, phase, tokenize_delay=0.3)
        for phase in PHASES
        for output in OUTPUTS
    ),
    Scenario("uncancelled", REQUEST, "native"),
    Scenario(
        "trap-abort-while-tokenizing", REQUEST, tokenize_delay=0.3, trap="abort_while_tokenizing"
    ),
    Scenario("trap-abort-unknown-rid", REQUEST, trap="abort_unknown_rid"),
    Scenario("trap-abort-twice", REQUEST, trap="abort_twice"),
    Scenario(
        "n3-uncancelled", {"text": "hi", "sampling_params": {"n": 3, "max_new_tokens": 3}}, "native"
    ),
    Scenario(
        "n3-mid-stream",
        {"text": "hi", "sampling_params": {"n": 3, "max_new_tokens": 20}},
        "native",
        "mid_stream",
    ),
    Scenario(
        "batch2-mid-stream",
        {"text": ["hi", "there"], "sampling_params": {"max_new_tokens": 20}},
        "native",
        "mid_stream",
    ),
]


#: What the scheduler must see, whichever engine: SGLang's traps, and the lifecycle avoiding them.
EXPECTED_AT_SCHEDULER = {
    "tokenizing-tokens": [],  # released before dispatch: nothing ever reached it
    "dispatched-tokens": [["request", "abort", "abort_applied"]],
    "mid_stream-tokens": [["request", "abort", "abort_applied"]],
    "after_finish-tokens": [["request"]],
    "trap-abort-while-tokenizing": [["abort", "abort_lost", "request"]],  # lost, runs to the end
    "trap-abort-unknown-rid": [],  # dropped by the tokenizer side
    "trap-abort-twice": [["request", "abort", "abort_applied"]],  # the second one dropped
    "n3-mid-stream": [["request"], *[["request", "abort", "abort_applied"]] * 3],  # warm-up first
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-harness")


@pytest.fixture
async def harness(workdir: Path) -> AsyncIterator[SGLangHarness]:
    async with open_sglang_harness(
        workdir=workdir, first_token_delay=FIRST_TOKEN_DELAY, token_interval=TOKEN_INTERVAL
    ) as started:
        yield started


def comparable(seen: Observation) -> Observation:
    """Chunk counts depend on how the real TokenizerManager coalesces outputs; reasons do not."""
    return Observation(
        scheduler=seen.scheduler,
        registered_after=seen.registered_after,
        chunks=0,
        finish_reasons=[r for r in seen.finish_reasons if r is not None],
        # Which children speak first is timing; that every id is public is not.
        ids_seen=sorted({i.split("_")[0] for i in seen.ids_seen}),
    )


async def test_the_sim_and_the_real_tokenizer_manager_agree(harness: SGLangHarness) -> None:
    assert harness.capabilities["engine"]["kind"] == "sglang"
    assert harness.capabilities["engine"]["sglang_version"] == "0.5.23"
    assert harness.capabilities["features"]["cancel_before_first_output_v1"] is True
    disagreements = []
    for scenario in SCENARIOS:
        with trio.fail_after(60):
            real = await harness.run(scenario)
        sim = await observe_on_sim(
            scenario, first_token_delay=FIRST_TOKEN_DELAY, token_interval=TOKEN_INTERVAL
        )
        print(f"{scenario.name}: {comparable(real)}")
        assert real.registered_after == 0, (scenario.name, real)
        if scenario.name in EXPECTED_AT_SCHEDULER:
            assert real.scheduler == EXPECTED_AT_SCHEDULER[scenario.name], scenario.name
        if comparable(real) != comparable(sim):
            disagreements.append((scenario.name, comparable(sim), comparable(real)))
    assert disagreements == []
