"""The sweep on the real SGLang (``--engine sglang-harness``, ``sglang-engine``), with Dynamo's.

What it runs and how is in docs/benchmarks.md ("On the real TokenizerManager",
"Against NVIDIA Dynamo 1.6.1's own handler", "On the whole sglang.Engine"):
trio-sglang's worker and Dynamo 1.6.1's own SGLang handler take turns, cancel
by cancel, one stream at a time, on one clock (``time.monotonic``). Then the
SimEngine's ``poll-then-abort`` runs the same scenarios on a MockClock (the
model's own prediction, with no event-loop noise), and ``check_model`` sets
each of its rows against Dynamo's real one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

import trio_sglang as ts
from _approaches import PollThenAbort, StreamRecord
from _stats import percentiles
from _units import ms
from _verdict import MachineState
from trio_sglang_harness import (
    Caller,
    CallerStream,
    CancelPhase,
    Observation,
    Scenario,
    observe_caller,
    open_sglang_harness,
    sim_scheduler_events,
)

__all__ = [
    "HARNESS_PHASES",
    "check_model",
    "format_harness",
    "run_harness_sweep",
    "run_model_sweep",
]

FIRST_TOKEN_DELAY = 0.05
TOKEN_INTERVAL = 0.02
MAX_NEW_TOKENS = 40
REQUEST = {"text": "hello world", "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS}}
#: On the whole engine: the tiny model decodes hundreds of tokens a second, so a
#: request nobody stopped is seen decoding for a second (its EOS ignored).
REAL_MAX_NEW_TOKENS = 400
REAL_REQUEST = {
    "text": "hello world",
    "sampling_params": {"max_new_tokens": REAL_MAX_NEW_TOKENS, "ignore_eos": True},
}
#: The longest the host waits after a request for the TokenizerManager to hold nothing.
WAIT_IDLE = 5.0
#: How many more times a cancel is tried whose moment a stalled machine let pass unseen
#: (``Observation.missed``): such a run cancelled nothing and is not counted.
MISSED_RETRIES = 3
#: A model's abort delay agrees with the real one within this (ms), or this share of it.
DELAY_NOISE_MS, DELAY_NOISE_SHARE = 3.0, 0.25


@dataclass(frozen=True, slots=True)
class HarnessPhase:
    name: str
    cancel: CancelPhase
    tokenize_delay: float

    def scenario(self, index: int, request: dict[str, Any] = REQUEST) -> Scenario:
        return Scenario(
            f"{self.name}-{index}",
            request,
            "tokens",
            self.cancel,
            tokenize_delay=self.tokenize_delay,
            wait_idle=WAIT_IDLE,
        )


#: The cancel in each is docs/benchmarks.md's ("Against NVIDIA Dynamo 1.6.1's own handler").
HARNESS_PHASES: dict[str, HarnessPhase] = {
    phase.name: phase
    for phase in (
        HarnessPhase("before_registration", "before_registration", 0.05),
        HarnessPhase("tokenizing", "tokenizing", 0.05),
        HarnessPhase("slow_tokenization", "tokenizing", 0.5),
        HarnessPhase("dispatched", "dispatched", 0.0),
        HarnessPhase("mid_stream", "mid_stream", 0.0),
        HarnessPhase("consumer_leaves", "consumer_leaves", 0.0),
    )
}


async def run_harness_sweep(
    repeats: int, callers: Sequence[Caller], *, real_engine: bool = False
) -> list[dict[str, Any]]:
    """One row per (caller, phase), the callers taking turns cancel by cancel.

    ``real_engine``: on the whole ``sglang.Engine`` instead of the stand-in scheduler.
    """
    seen: dict[tuple[Caller, str], list[Observation]] = {}
    request = REAL_REQUEST if real_engine else REQUEST
    async with open_sglang_harness(
        first_token_delay=FIRST_TOKEN_DELAY,
        token_interval=TOKEN_INTERVAL,
        dynamo="dynamo-1.6" in callers,
        real_engine=real_engine,
    ) as harness:
        for phase in HARNESS_PHASES.values():
            for i in range(repeats):
                for caller in callers:
                    for _ in range(1 + MISSED_RETRIES):
                        with trio.fail_after(60):
                            observed = await harness.run(phase.scenario(i, request), caller)
                        if not observed.missed:
                            seen.setdefault((caller, phase.name), []).append(observed)
                            break
    engine = "sglang-engine" if real_engine else "sglang-harness"
    return [_row(caller, engine, phase, runs) for (caller, phase), runs in seen.items()]


async def run_model_sweep(repeats: int) -> list[dict[str, Any]]:
    """The same scenarios through the SimEngine's ``poll-then-abort`` (run it on a MockClock)."""
    rows = []
    for phase in HARNESS_PHASES.values():
        runs = [await _observe_poll_then_abort(phase.scenario(i)) for i in range(repeats)]
        rows.append(_row("poll-then-abort", "sim", phase.name, runs))
    return rows


async def _observe_poll_then_abort(scenario: Scenario) -> Observation:
    """``scenario`` through ``poll-then-abort`` on a fresh SimEngine with the harness's timing.

    The caller is the baseline's consumer; its stream ends when the pump is done with the
    engine stream (what the real handler's stream ending is)."""
    engine = ts.SimEngine(
        tokenize_delay=scenario.tokenize_delay,
        dispatch_delay=0.0,
        first_token_delay=FIRST_TOKEN_DELAY,
        token_interval=TOKEN_INTERVAL,
    )
    async with engine.running(), trio.open_nursery() as nursery:
        baseline = PollThenAbort(engine, nursery)
        events = partial(sim_scheduler_events, engine)
        seen = await observe_caller(partial(_stream, baseline), engine, scenario, events)
        nursery.cancel_scope.cancel()  # a retry still waiting, past the settle
    return seen


@asynccontextmanager
async def _stream(
    baseline: PollThenAbort, request: Mapping[str, Any]
) -> AsyncIterator[CallerStream]:
    rec = StreamRecord(offset=0.0)
    async with baseline.stream(request, rec) as chunks:

        async def rid() -> str:
            await trio.lowlevel.checkpoint()
            return rec.rid

        yield CallerStream(chunks, "native", rec.cancel, rid)
    await chunks.server_ended()


def _reached(seen: Observation) -> bool:
    """The request reached the scheduler."""
    return any("request" in events for events in seen.scheduler)


def _stopped(seen: Observation) -> bool:
    return any(kind.startswith("abort_applied") for events in seen.scheduler for kind in events)


def _abort_delay_ms(seen: Observation) -> float:
    if not _reached(seen):
        return 0.0  # nothing ever reached the scheduler: nothing to stop
    if seen.abort_delay is None:
        return math.inf  # it reached the scheduler and nothing stopped it
    return seen.abort_delay * 1e3


def _lost(events: list[str]) -> bool:
    """An abort that went out before its request, which then came (the stand-in also says
    ``abort_lost``; the real scheduler cannot). One whose request never came stopped all it
    had to (SGLang 0.5.17 keeps an abort that comes before the dispatch, and never sends
    the request); one that comes after another stopped it is a repeat, not a loss."""
    if "request" not in events:
        return False
    first = min(
        (events.index(kind) for kind in ("abort", "abort_lost") if kind in events), default=None
    )
    return first is not None and first < events.index("request")


def _row(approach: str, engine: str, phase: str, runs: list[Observation]) -> dict[str, Any]:
    held = [s.scheduler_held_after for s in runs if s.scheduler_held_after is not None]
    return {
        "approach": approach,
        "engine": engine,
        "phase": phase,
        "concurrency": 1,
        "cancels": len(runs),
        "stream_end_ms": percentiles(
            [s.stream_close * 1e3 for s in runs if s.stream_close is not None]
        ),
        "abort_delay_ms": percentiles([_abort_delay_ms(s) for s in runs]),
        "sent_to_scheduler": sum(_reached(s) for s in runs),
        "aborts_lost": sum(_lost(events) for s in runs for events in s.scheduler),
        "not_stopped": sum(_reached(s) and not _stopped(s) for s in runs),
        "leaked": sum(s.registered_after for s in runs),
        # What the scheduler still held after the settle, by its own load (whole engine only).
        **({"scheduler_held": sum(held)} if held else {}),
        "wasted_tokens": percentiles([float(s.tokens_after_cancel) for s in runs]),
    }


#: What must be equal between the model and the real handler, per phase.
COUNTS = ("sent_to_scheduler", "aborts_lost", "not_stopped", "leaked")


def check_model(rows: list[dict[str, Any]], machine: MachineState) -> list[dict[str, Any]]:
    """Per phase: does ``poll-then-abort`` (sim) agree with ``dynamo-1.6`` (real), and if not, how.

    The counts must be equal, and the wasted tokens at p50: judged on any
    machine. The abort delay at p50 must be within ``DELAY_NOISE_MS`` or
    ``DELAY_NOISE_SHARE`` of the real one; the real one is the event loop's
    sleeps, which a busy machine stretches, so that is judged only on a quiet
    one (``machine``). The stream end is reported, not judged (the model has
    no transport between tokenizer and scheduler: docs/benchmarks.md).
    """
    by_key = {(row["approach"], row["phase"]): row for row in rows}
    checks = []
    for phase in HARNESS_PHASES:
        real, model = by_key.get(("dynamo-1.6", phase)), by_key.get(("poll-then-abort", phase))
        if real is None or model is None:
            continue
        differ = [f"{key} {model[key]} vs {real[key]}" for key in COUNTS if model[key] != real[key]]
        if model["wasted_tokens"]["p50"] != real["wasted_tokens"]["p50"]:
            differ.append(
                f"wasted tokens p50 {model['wasted_tokens']['p50']:.0f} vs "
                f"{real['wasted_tokens']['p50']:.0f}"
            )
        sim_ms, real_ms = model["abort_delay_ms"]["p50"], real["abort_delay_ms"]["p50"]
        unjudged = []
        if not _delays_agree(sim_ms, real_ms):
            delay = f"abort delay p50 {ms(sim_ms)} vs {ms(real_ms)} ms"
            if machine.quiet or None in (sim_ms, real_ms):
                differ.append(delay)
            else:
                unjudged.append(f"{delay}: {machine.verdict}")
        checks.append(
            {"phase": phase, "agree": not differ, "differences": differ, "not_judged": unjudged}
        )
    return checks


def _delays_agree(model: float | None, real: float | None) -> bool:
    if model is None or real is None:  # never stopped
        return model is real
    return abs(model - real) <= max(DELAY_NOISE_MS, DELAY_NOISE_SHARE * real)


def format_harness(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    """The table (p50 / p99, ms), then the model check; within 100 columns."""

    def pair(stats: dict[str, float | None]) -> str:
        return f"{_short(stats['p50'])} / {_short(stats['p99'])}"

    real = any(row["engine"] == "sglang-engine" for row in rows)
    about = (
        [
            "the whole sglang.Engine on this CPU (its scheduler, the tiny model), one stream at a",
            "time, p50 / p99 in ms; abort delay: to the scheduler's output finishing it with abort",
        ]
        if real
        else [
            "real TokenizerManager + stand-in scheduler, one stream at a time, p50 / p99 in ms;",
            "poll-then-abort: the SimEngine's model of dynamo-1.6 in the same scenarios "
            "(MockClock)",
        ]
    )
    lines = [
        *about,
        "",
        f"{'phase':<19} {'approach':<15} {'n':>3} {'stream end':>13} {'abort delay':>13} "
        f"{'sent':>4} {'lost':>4} {'unstop':>6} {'leak':>4} wasted",
    ]
    order = {phase: i for i, phase in enumerate(HARNESS_PHASES)}
    for row in sorted(rows, key=lambda r: order[r["phase"]]):
        wasted = row["wasted_tokens"]
        lines.append(
            f"{row['phase']:<19} {row['approach']:<15} {row['cancels']:>3} "
            f"{pair(row['stream_end_ms']):>13} {pair(row['abort_delay_ms']):>13} "
            f"{row['sent_to_scheduler']:>4} {row['aborts_lost']:>4} {row['not_stopped']:>6} "
            f"{row['leaked']:>4} {wasted['p50']:>3.0f} / {wasted['max']:.0f}"
        )
    if checks:
        lines += ["", "poll-then-abort (the SimEngine's model) against dynamo-1.6 (its real code):"]
        for check in checks:
            agrees = "agrees in every count" if check["not_judged"] else "agrees"
            verdict = agrees if check["agree"] else "differs: " + "; ".join(check["differences"])
            lines.append(f"  {check['phase']:<19} {verdict}")
            lines += [f"    {note}" for note in check["not_judged"]]
    return "\n".join(lines)


def _short(value: float | None) -> str:
    """A latency in at most five characters: 0.13, 72.5, 1,002."""
    if value is None:
        return "never"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"
