"""The smaller sweep on the real SGLang TokenizerManager (``--engine sglang-harness``).

Each cancel runs as one conformance scenario in the harness's host process:
the real TokenizerManager driven by ``SGLangEngine`` through trio-asyncio,
against the stand-in scheduler. Times come from one clock for both sides
(``time.monotonic``, system-wide): the caller's block closing, and the
scheduler's log of the abort it applied. One stream at a time: the harness
runs scenarios in turn.
"""

from __future__ import annotations

from typing import Any

import trio

from _metrics import percentiles
from trio_sglang.harness import CancelPhase, Scenario, open_sglang_harness

__all__ = ["HARNESS_PHASES", "format_harness", "run_harness_sweep"]

HARNESS_PHASES: tuple[CancelPhase, ...] = ("tokenizing", "dispatched", "mid_stream")
REQUEST = {"text": "hello world", "sampling_params": {"max_new_tokens": 40}}


async def run_harness_sweep(repeats: int) -> list[dict[str, Any]]:
    """One row per phase, in the JSON shape of the SimEngine sweep (concurrency 1)."""
    rows = []
    async with open_sglang_harness(first_token_delay=0.05, token_interval=0.02) as harness:
        for phase in HARNESS_PHASES:
            closes: list[float] = []
            delays: list[float] = []
            wasted: list[float] = []
            lost = leaked = 0
            for i in range(repeats):
                scenario = Scenario(
                    f"{phase}-{i}",
                    REQUEST,
                    "tokens",
                    phase,
                    tokenize_delay=0.05 if phase == "tokenizing" else 0.0,
                )
                with trio.fail_after(60):
                    seen = await harness.run(scenario)
                lost += sum(events.count("abort_lost") for events in seen.scheduler)
                leaked += seen.registered_after
                if seen.stream_close is not None:
                    closes.append(seen.stream_close * 1e3)
                # Released before dispatch: the scheduler never held it.
                delays.append(0.0 if seen.abort_delay is None else seen.abort_delay * 1e3)
                wasted.append(float(seen.tokens_after_cancel))
            rows.append(
                {
                    "approach": "trio-sglang",
                    "engine": "sglang-harness",
                    "phase": phase,
                    "concurrency": 1,
                    "cancels": repeats,
                    "stream_close_ms": percentiles(closes),
                    "abort_delay_ms": percentiles(delays),
                    "aborts_lost": lost,
                    "leaked": leaked,
                    "wasted_tokens": percentiles(wasted),
                }
            )
    return rows


def format_harness(rows: list[dict[str, Any]]) -> str:
    def triple(stats: dict[str, float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.2f}" for v in stats.values())

    lines = [
        "real TokenizerManager + stand-in scheduler, 1 stream (p50 / p99 / max)",
        f"{'phase':<14} {'cancels':>7}  {'stream close ms':>22}  {'abort delay ms':>22}  "
        f"{'lost':>4} {'leaked':>6}  wasted tokens",
    ]
    for row in rows:
        lines.append(
            f"{row['phase']:<14} {row['cancels']:>7}  {triple(row['stream_close_ms']):>22}  "
            f"{triple(row['abort_delay_ms']):>22}  {row['aborts_lost']:>4} {row['leaked']:>6}  "
            f"{triple(row['wasted_tokens'])}"
        )
    return "\n".join(lines)
