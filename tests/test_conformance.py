"""Conformance: the same scenarios on the SimEngine and on the real TokenizerManager.

The real side is the installed SGLang's TokenizerManager (0.5.23 in ``nox -s
sglang``, each release of ``nox -s sglang-matrix`` there) in its own process, driven
by ``SGLangEngine`` through trio-asyncio, against the stand-in scheduler
(``trio_sglang_harness``). Both sides must agree on what the scheduler
received and did, per request and in order; on what stayed registered; and
on what the caller saw. Runs in ``nox -s sglang`` (marker ``sglang``), which
installs SGLang's CPU-importable parts. The real side runs in real time; the
SimEngine's side runs on a MockClock, where its timing is exact and instant.

The same holds in the prefill and the decode role (prefill/decode
disaggregation).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from trio.testing import MockClock

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s sglang`")

from trio_sglang import OutputMode, SimDisaggTiming
from trio_sglang._asyncio_bridge._asyncio_side import LOOP_KINDS
from trio_sglang_harness import (
    CancelPhase,
    DisaggSetup,
    Observation,
    Scenario,
    SGLangHarness,
    observe_on_sim,
    open_sglang_harness,
)

pytestmark = pytest.mark.sglang

T = TypeVar("T")

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
    # The zombie window of releases whose close forgets a dispatched request: the
    # dispatch would come 5.5 s after the cancel, past the ordered abort's 5 s.
    Scenario(
        "tokenizing-slow-native",
        REQUEST,
        "native",
        "tokenizing",
        tokenize_delay=5.5,
        observe_for=6.5,
    ),
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
    # A cancel while a slow tokenizer runs releases it: its dispatch, 5.5 s on, never comes.
    "tokenizing-slow-native": [],
    "n3-mid-stream": [["request"], *[["request", "abort", "abort_applied"]] * 3],  # warm-up first
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-harness")


def on_mock_clock(observe: Callable[[], Awaitable[T]]) -> T:
    """``observe()`` in a trio run of its own on a MockClock: the SimEngine's timing, exact and
    instant (20 s of sleeps for ``SCENARIOS`` on the real clock), never starved by a harness."""
    return trio.run(observe, clock=MockClock(autojump_threshold=0))


async def _observe_scenarios_on_sim() -> dict[str, Observation]:
    return {
        scenario.name: await observe_on_sim(
            scenario, first_token_delay=FIRST_TOKEN_DELAY, token_interval=TOKEN_INTERVAL
        )
        for scenario in SCENARIOS
    }


@pytest.fixture(scope="module")
def on_sim() -> dict[str, Observation]:
    """Every scenario of ``SCENARIOS`` on the SimEngine, once for both loops."""
    return on_mock_clock(_observe_scenarios_on_sim)


@pytest.fixture(params=LOOP_KINDS)
async def harness(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[SGLangHarness]:
    """The host on each asyncio loop ``serve --loop`` offers: the lifecycle holds on both."""
    async with open_sglang_harness(
        workdir=workdir,
        first_token_delay=FIRST_TOKEN_DELAY,
        token_interval=TOKEN_INTERVAL,
        loop=request.param,
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
        raised=seen.raised,
    )


def expected_at_scheduler(name: str, semantics: dict[str, Any]) -> list[list[str]] | None:
    """What the scheduler must see; a release without SGLang's abort dedupe passes a repeat,
    and one that keeps an abort sent before the dispatch (0.5.17) never sends the request."""
    if name == "trap-abort-twice" and not semantics["abort_dedupe"]:
        return [["request", "abort", "abort_applied", "abort", "abort_lost"]]
    if name == "trap-abort-while-tokenizing" and semantics["early_abort_kept"]:
        return [["abort", "abort_lost"]]  # the request itself never goes
    return EXPECTED_AT_SCHEDULER.get(name)


def modelled(name: str, semantics: dict[str, Any]) -> bool:
    """Whether the SimEngine (SGLang 0.5.20 on) models what this release does in ``name``."""
    if name == "trap-abort-twice":
        return bool(semantics["abort_dedupe"])
    if name == "trap-abort-while-tokenizing":
        return not semantics["early_abort_kept"]
    return True


def without_repeats(scenario: Scenario, real: Observation, semantics: dict[str, Any]) -> None:
    """On 0.5.17, whose close aborts what was dispatched and which drops no repeat, an
    ``n > 1`` child may get the lifecycle's abort and then its close's: the scheduler
    drops the second (``abort_lost`` after ``abort_applied``), which stops nothing twice
    and loses nothing. Those are left out here; a trap shows what it sent as it was."""
    if scenario.trap is not None or semantics["close"] != "aborts" or semantics["abort_dedupe"]:
        return
    for events in real.scheduler:
        while events[-2:] == ["abort", "abort_lost"] and "abort_applied" in events[:-2]:
            del events[-2:]


async def test_the_sim_and_the_real_tokenizer_manager_agree(
    harness: SGLangHarness, on_sim: dict[str, Observation]
) -> None:
    from sglang.version import __version__

    engine = harness.capabilities["engine"]
    assert engine["kind"] == "sglang"
    assert engine["sglang_version"] == __version__
    assert engine["sglang_semantics"]["version"] == __version__
    assert harness.capabilities["features"]["cancel_before_first_output_v1"] is True
    semantics = engine["sglang_semantics"]
    disagreements = []
    for scenario in SCENARIOS:
        with trio.fail_after(60):
            real = await harness.run_measured(scenario)
        sim = on_sim[scenario.name]
        print(f"{scenario.name}: {comparable(real)}")
        without_repeats(scenario, real, semantics)
        assert real.registered_after == 0, (scenario.name, real)
        expected = expected_at_scheduler(scenario.name, semantics)
        if expected is not None:
            assert real.scheduler == expected, scenario.name
        kept = scenario.name == "trap-abort-while-tokenizing" and semantics["early_abort_kept"]
        assert real.raised == ("RequestAbortedError" if kept else None), scenario.name
        if modelled(scenario.name, semantics) and comparable(real) != comparable(sim):
            disagreements.append((scenario.name, comparable(sim), comparable(real)))
    assert disagreements == []


# Prefill/decode disaggregation: the real TokenizerManager as a prefill or a decode
# server's, against the stand-in scheduler's queues for that role, and a SimEngine in the
# same role; on both, the peer script plays the other side of each bootstrap room.

#: 30 prompt tokens, given as ids so that both sides count the same chunks.
PD_REQUEST = {
    "input_ids": list(range(3, 33)),
    "sampling_params": {"max_new_tokens": 6},
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": 4242,
}
#: From dispatch: bootstrap until the decode side's handshake at 0.3 s; prefilling
#: in 3 chunks of 10 tokens, 0.2 s each, until 0.9 s; transferring until 1.2 s.
PREFILL = DisaggSetup(
    "prefill",
    peer_delay=0.3,
    timing=SimDisaggTiming(
        prefill_time_per_token=0.02, prefill_chunk_tokens=10, kv_transfer_delay=0.3
    ),
)
#: From dispatch: prealloc until its handshake at 0.2 s; transfer until the KV cache
#: arrives at 0.5 s; then tokens from 0.7 s on (FIRST_TOKEN_DELAY, TOKEN_INTERVAL).
DECODE = DisaggSetup("decode", peer_delay=0.3, timing=SimDisaggTiming(bootstrap_delay=0.2))

#: What a request that went through every prefill stage left at the scheduler.
PREFILLED = ["request", "bootstrapped", *["prefill_chunk"] * 3]

#: Each cancel lands mid-stage (at least 0.1 s from its edges); what the scheduler must see.
PD_SCENARIOS: dict[str, list[tuple[Scenario, list[list[str]]]]] = {
    "prefill": [
        (
            Scenario("prefill-tokenizing", PD_REQUEST, "native", "tokenizing", tokenize_delay=0.3),
            [],
        ),
        (
            Scenario("prefill-bootstrap", PD_REQUEST, "native", "dispatched", cancel_delay=0.15),
            [["request", "abort", "abort_applied@bootstrap"]],
        ),
        (
            Scenario("prefill-prefilling", PD_REQUEST, "native", "dispatched", cancel_delay=0.6),
            # The chunk in the forward pass when the abort came is finished first.
            [[*PREFILLED[:3], "abort", "prefill_chunk", "abort_applied@prefilling"]],
        ),
        (
            Scenario("prefill-transferring", PD_REQUEST, "native", "dispatched", cancel_delay=1.05),
            [[*PREFILLED, "abort", "abort_applied@transferring"]],
        ),
        (Scenario("prefill-uncancelled", PD_REQUEST, "native"), [[*PREFILLED, "kv_sent"]]),
        (
            # The worker refuses it; SGLang's TokenizerManager does not, its scheduler does.
            Scenario("prefill-trap-no-room", REQUEST, trap="no_bootstrap_room"),
            [["request", "abort_applied@no bootstrap room"]],
        ),
    ],
    "decode": [
        (Scenario("decode-tokenizing", PD_REQUEST, "native", "tokenizing", tokenize_delay=0.3), []),
        (
            Scenario("decode-prealloc", PD_REQUEST, "native", "dispatched", cancel_delay=0.1),
            [["request", "abort", "abort_applied@prealloc"]],
        ),
        (
            Scenario("decode-transfer", PD_REQUEST, "native", "dispatched", cancel_delay=0.35),
            [["request", "bootstrapped", "abort", "abort_applied@transfer"]],
        ),
        (
            Scenario("decode-mid-stream", PD_REQUEST, "native", "mid_stream"),
            [["request", "bootstrapped", "kv_received", "abort", "abort_applied"]],
        ),
        (
            Scenario("decode-uncancelled", PD_REQUEST, "native"),
            [["request", "bootstrapped", "kv_received"]],
        ),
    ],
}
PD_SETUPS = (PREFILL, DECODE)


async def _observe_on_harness(
    workdir: Path, setup: DisaggSetup, seen: dict[str, Observation]
) -> None:
    async with open_sglang_harness(
        workdir=workdir,
        first_token_delay=FIRST_TOKEN_DELAY,
        token_interval=TOKEN_INTERVAL,
        disagg=setup,
    ) as harness:
        assert harness.capabilities["role"] == setup.role
        cancel_anytime = harness.capabilities["features"]["disagg_prefill_cancel_anytime_v1"]
        assert cancel_anytime is (setup.role == "prefill")
        for scenario, _ in PD_SCENARIOS[setup.role]:
            with trio.fail_after(60):
                seen[scenario.name] = await harness.run_measured(scenario)


async def _observe_on_sim() -> dict[str, Observation]:
    seen = {}
    for setup in PD_SETUPS:
        for scenario, _ in PD_SCENARIOS[setup.role]:
            seen[scenario.name] = await observe_on_sim(
                scenario,
                first_token_delay=FIRST_TOKEN_DELAY,
                token_interval=TOKEN_INTERVAL,
                disagg=setup,
            )
    return seen


async def test_the_sim_and_the_real_tokenizer_manager_agree_in_prefill_and_decode_roles(
    workdir: Path,
) -> None:
    """Both roles at once, each on its own harness; the SimEngine on a MockClock.

    The harnesses mostly sleep (the stages are timed), so they run side by
    side. The SimEngine runs in a trio run of its own (in a thread) on a
    MockClock: exact and instant, never starved by the harnesses' start.
    """
    real: dict[str, Observation] = {}
    async with trio.open_nursery() as nursery:
        for setup in PD_SETUPS:
            nursery.start_soon(_observe_on_harness, workdir, setup, real)
        sim = await trio.to_thread.run_sync(on_mock_clock, _observe_on_sim)
    disagreements = []
    for setup in PD_SETUPS:
        for scenario, expected in PD_SCENARIOS[setup.role]:
            name = scenario.name
            print(f"{name}: {comparable(real[name])}")
            assert real[name].registered_after == 0, (name, real[name])
            assert real[name].scheduler == expected, name
            if comparable(real[name]) != comparable(sim[name]):
                disagreements.append((name, comparable(sim[name]), comparable(real[name])))
    assert disagreements == []


# Chat: the prompt reaching the real TokenizerManager through trio-sglang's chat
# route (ChatPlan over SGLangEngine.render_chat) against the one SGLang's own chat
# route (OpenAIServingChat) builds for the same body: the ids the scheduler received.

CHATS: dict[str, list[dict[str, Any]]] = {
    "one user message": [{"role": "user", "content": "hello world"}],
    "a system message and text parts": [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is"},
                {"type": "text", "text": " the answer?"},
            ],
        },
    ],
    # SGLang makes a last assistant message the user's, unless it is continued.
    "a last assistant message": [
        {"role": "user", "content": "what is the answer?"},
        {"role": "assistant", "content": "the answer is"},
    ],
    "developer and tool roles": [
        {"role": "developer", "content": "answer in words"},
        {"role": "user", "content": "hi"},
        {"role": "tool", "content": "forty two", "tool_call_id": "call-1"},
    ],
}


def chat_body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 1, **fields}


def decoded(workdir: Path, ids: list[int] | str) -> str:
    """The prompt as text, by the tiny model's tokenizer (the harness built it in ``workdir``)."""
    from transformers import AutoTokenizer

    assert isinstance(ids, list), ids
    text: str = AutoTokenizer.from_pretrained(str(workdir / "tiny-llama")).decode(ids)
    return text


async def test_chat_prompts_are_the_ones_sglangs_chat_route_builds(
    harness: SGLangHarness, workdir: Path
) -> None:
    bodies = {
        **{name: chat_body(messages) for name, messages in CHATS.items()},
        "continue_final_message": chat_body(
            CHATS["a last assistant message"], continue_final_message=True
        ),
    }
    seen = {}
    for name, body in bodies.items():
        with trio.fail_after(30):
            seen[name] = await harness.chat(body)
        print(f"{name}: {seen[name]}")
        assert isinstance(seen[name].ours, list), (name, seen[name])
        assert seen[name].ours == seen[name].sglang, name
    # The model's template, not a plain transcript; continued, the answer's start is kept.
    assert decoded(workdir, seen["one user message"].ours) == (
        "<s><|user|>\nhello world</s>\n<|assistant|>\n"
    )
    assert decoded(workdir, seen["continue_final_message"].ours) == (
        "<s><|user|>\nwhat is the answer?</s>\n<|assistant|>\nthe answer is"
    )
    # What the template refuses, both routes refuse (trio-sglang's with a 400), unsent.
    refused = chat_body([{"role": "tool", "content": "42", "tool_call_id": "call-1"}])
    with trio.fail_after(30):
        refusals = await harness.chat(refused)
    message = "a conversation cannot start with a tool message"
    assert refusals.sglang == message
    assert refusals.ours == f"the chat template refused the messages: {message}"


#: SGLang's --chat-template, a Jinja file (written into the test's folder) or a name.
TEMPLATE_FILE = (
    "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.mark.parametrize(
    ("template", "rendered"),
    [
        ("file", "[system] be brief\n[user] hello world\n[assistant] "),
        ("chatml", "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"),
    ],
)
async def test_a_chat_template_given_to_the_server_replaces_the_models(
    template: str, rendered: str, workdir: Path, tmp_path: Path
) -> None:
    if template == "file":
        (tmp_path / "chat.jinja").write_text(TEMPLATE_FILE)
        template = str(tmp_path / "chat.jinja")
    messages = [{"role": "system", "content": "be brief"}, *CHATS["one user message"]]
    async with open_sglang_harness(workdir=workdir, chat_template=template) as harness:
        with trio.fail_after(30):
            seen = await harness.chat(chat_body(messages))
    print(seen)
    assert seen.ours == seen.sglang
    assert decoded(workdir, seen.ours).endswith(rendered)
