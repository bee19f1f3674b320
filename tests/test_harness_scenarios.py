"""The harness's scenarios on the SimEngine: a cancel timed to a phase either comes, or says so.

A cancel aimed at a phase (``tokenizing``: the request registered, not yet
dispatched) is fired when the harness sees that phase. A machine that stalls
longer than the phase lasts lets the request pass it unseen; the cancel then
never comes and the request runs to its end. Such a run measures no cancel,
and must not be counted as one (once it was: "sent to the scheduler and not
stopped", under load, on SGLang 0.5.14): it says ``missed``, and the harness
sweep runs it again. Here the stall is a watcher that never sees the phase.
The same holds for a cancel that comes, but so late that its abort reaches the
scheduler after the request finished there (0.5.17's ``mid_stream``, under
load: all six tokens sent, the abort 0.19 s after the last): the conformance
check runs such a scenario again (``SGLangHarness.run_measured``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import trio_sglang as ts
from trio_sglang import RequestPhase
from trio_sglang_harness import logged_since
from trio_sglang_harness._scenarios import (
    RidRecorder,
    Scenario,
    SchedulerEvent,
    _aborted_after_finishing,
    run_scenario,
)

REQUEST = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}


class StalledThroughTokenizing:
    """The engine, as a watcher that stalled through every tokenization sees it."""

    def __init__(self, engine: ts.SimEngine) -> None:
        self._engine = engine

    @staticmethod
    def _seen(phase: RequestPhase) -> RequestPhase:
        return RequestPhase.DISPATCHED if phase is RequestPhase.REGISTERED else phase

    def phase(self, rid: str) -> RequestPhase:
        return self._seen(self._engine.phase(rid))

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        while (now := self._engine.phase(rid)) is phase or self._seen(now) is phase:
            await self._engine.wait_phase_change(rid, now)
        return self._seen(now)

    def live_requests(self) -> int:
        return self._engine.live_requests()


@pytest.mark.parametrize("stalled", [True, False])
async def test_a_cancel_whose_phase_went_by_unseen_says_so(
    autojump_clock: trio.testing.MockClock, stalled: bool
) -> None:
    engine = ts.SimEngine(tokenize_delay=1.0)
    recorder = RidRecorder(engine)
    watch = StalledThroughTokenizing(engine) if stalled else None
    scenario = Scenario("t", REQUEST, "tokens", "tokenizing")
    async with ts.open_worker(recorder) as worker:
        seen = await run_scenario(worker, recorder, scenario, list, watch=watch)
    assert seen.missed is stalled
    assert (seen.stream_close is None) is stalled
    assert seen.chunks == (3 if stalled else 0)  # uncancelled, it ran to its end


def test_the_stand_in_schedulers_log_is_read_to_its_last_complete_line(tmp_path: Path) -> None:
    """The scheduler writes while a benchmark reads: a line without its newline yet is left
    for the next read, not parsed half-written."""
    log = tmp_path / "scheduler.jsonl"
    log.write_bytes(b'{"kind": "old"}\n{"kind": "request", "rid": "a"}\n{"kind": "fini')
    offset = len(b'{"kind": "old"}\n')
    assert logged_since(log, offset) == [{"kind": "request", "rid": "a"}]
    with log.open("ab") as f:
        f.write(b'shed", "rid": "a"}\n')
    assert logged_since(log, offset)[-1] == {"kind": "finished", "rid": "a"}


LATE: list[SchedulerEvent] = [
    (0.0, "request", "r1"),
    (0.45, "finished", "r1"),
    (0.64, "abort", "r1"),
    (0.64, "abort_lost", "r1"),
]


@pytest.mark.parametrize(
    ("events", "late"),
    [
        (LATE, True),
        # The abort came first and stopped it: a cancel that was measured.
        ([(0.0, "request", "r1"), (0.3, "abort", "r1"), (0.3, "abort_applied", "r1")], False),
        # Never aborted (uncancelled, or released before it was sent): nothing to say.
        ([(0.0, "request", "r1"), (0.45, "finished", "r1")], False),
        # An abort by the parent's prefix, for children that had all finished.
        ([(0.0, "request", "p_1"), (0.4, "finished", "p_1"), (0.5, "abort", "p")], True),
        # One child had finished, the other was stopped: that run measured a cancel.
        (
            [
                (0.0, "request", "p_1"),
                (0.0, "request", "p_2"),
                (0.4, "finished", "p_1"),
                (0.5, "abort", "p"),
                (0.5, "abort_applied", "p_2"),
            ],
            False,
        ),
    ],
)
def test_an_abort_that_reached_the_scheduler_after_the_request_finished_is_told(
    events: list[SchedulerEvent], late: bool
) -> None:
    assert _aborted_after_finishing(events) is late
