"""The harness's scenarios on the SimEngine: a cancel timed to a phase either comes, or says so.

A cancel aimed at a phase (``tokenizing``: the request registered, not yet
dispatched) is fired when the harness sees that phase. A machine that stalls
longer than the phase lasts lets the request pass it unseen; the cancel then
never comes and the request runs to its end. Such a run measures no cancel,
and must not be counted as one (once it was: "sent to the scheduler and not
stopped", under load, on SGLang 0.5.14): it says ``missed``, and the harness
sweep runs it again. Here the phase lasts no time at all, which no look can
catch.
"""

from __future__ import annotations

import pytest
import trio

import trio_sglang as ts
from trio_sglang_harness._scenarios import RidRecorder, Scenario, run_scenario

REQUEST = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}


@pytest.mark.parametrize(("tokenize_delay", "missed"), [(0.0, True), (1.0, False)])
async def test_a_cancel_whose_phase_went_by_unseen_says_so(
    autojump_clock: trio.testing.MockClock, tokenize_delay: float, missed: bool
) -> None:
    recorder = RidRecorder(ts.SimEngine(tokenize_delay=tokenize_delay, dispatch_delay=0.0))
    async with ts.open_worker(recorder) as worker:
        seen = await run_scenario(
            worker, recorder, Scenario("t", REQUEST, "tokens", "tokenizing"), list
        )
    assert seen.missed is missed
    assert (seen.stream_close is None) is missed
    assert seen.chunks == (3 if missed else 0)  # uncancelled, it ran to its end
