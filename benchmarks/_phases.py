"""Where in a request's life the cancel lands, and the engine timing that puts it there.

"Phase" is the project's one vocabulary (``trio_sglang._phases``): where the
request was when its caller left. A cell of this benchmark is named after the
phase it aims its cancels at (``slow_tokenization`` aims at ``tokenizing``
with a longer tokenization, ``at_once`` at ``before_first_token``, all at one
instant), and ``observe_phase`` says which phase each cancel really landed in.

Each cell pairs SimEngine delays with a window of cancel offsets (seconds
after the stream started its life: its first pull, or for
``before_registration`` the wait before it). The windows keep tens of
milliseconds of margin on both sides, so that the event loop's lag at 1,000
or 10,000 streams still lands the cancel in the intended phase; every cancel
also records the phase it actually observed, and the report counts the ones
that missed (the ``off`` column).

The same offsets, drawn from a seeded generator per (phase, concurrency),
are used for every approach, so all of them face the same cancel schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import trio_sglang as ts
from _approaches import StreamRecord
from trio_sglang._phases import Phase as Observed

__all__ = ["AT_ONCE", "PHASES", "Phase", "cancel_offsets", "observe_phase"]

#: Long enough that no request finishes on its own during a cell: a request
#: still decoding at the end was not stopped, and counts as leaked.
MAX_NEW_TOKENS = 100_000


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    #: The phase ``observe_phase`` should see at the cancel.
    expected: Observed
    #: The cancel offset is drawn uniformly from this window.
    window: tuple[float, float]
    tokenize_delay: float = 0.005
    dispatch_delay: float = 0.001
    first_token_delay: float = 0.05
    token_interval: float = 0.1
    #: The consumer opens its stream and waits this long before the first pull.
    pull_delay: float = 0.0
    why: str = ""

    def engine(self) -> ts.SimEngine:
        return ts.SimEngine(
            tokenize_delay=self.tokenize_delay,
            dispatch_delay=self.dispatch_delay,
            first_token_delay=self.first_token_delay,
            token_interval=self.token_interval,
        )

    def knobs(self) -> dict[str, float]:
        return {
            "tokenize_delay": self.tokenize_delay,
            "dispatch_delay": self.dispatch_delay,
            "first_token_delay": self.first_token_delay,
            "token_interval": self.token_interval,
            "pull_delay": self.pull_delay,
        }


PHASES: dict[str, Phase] = {
    phase.name: phase
    for phase in (
        Phase(
            "before_registration",
            expected="before_registration",
            window=(0.02, 0.18),
            pull_delay=0.2,
            why="the stream is open but not yet pulled: nothing is registered",
        ),
        Phase(
            "tokenizing",
            expected="tokenizing",
            window=(0.02, 0.17),
            tokenize_delay=0.2,
            why="registered, tokenizing for 0.2 s (under poll-then-abort's 0.25 s dispatch wait)",
        ),
        Phase(
            "before_first_token",
            expected="before_first_token",
            window=(0.03, 0.22),
            first_token_delay=0.25,
            why="dispatched; queueing and prefill take 0.25 s",
        ),
        Phase(
            "mid_stream",
            expected="mid_stream",
            window=(0.15, 0.5),
            first_token_delay=0.02,
            why="a token every 0.1 s from 0.026 s on: 1 to 5 tokens in",
        ),
        Phase(
            "slow_tokenization",
            expected="tokenizing",
            window=(0.05, 0.5),
            tokenize_delay=1.0,
            why="a 1 s tokenization (a very long prompt): longer than the 0.25 s dispatch wait",
        ),
    )
}

#: 10,000 streams parked before their first token, then cancelled in one instant.
AT_ONCE = Phase(
    "at_once",
    expected="before_first_token",
    window=(0.0, 0.0),
    first_token_delay=5.0,
    why="every stream dispatched and waiting for its first token",
)


def cancel_offsets(phase: Phase, count: int, seed: int) -> list[float]:
    """The cell's cancel schedule: the same for every approach."""
    rng = random.Random(f"{seed}/{phase.name}/{count}")
    low, high = phase.window
    return [rng.uniform(low, high) for _ in range(count)]


def observe_phase(engine: ts.Engine, rec: StreamRecord) -> Observed | Literal["ended"]:
    """The request's phase at the cancel, from what the engine shows and the consumer saw."""
    phase = engine.phase(rec.rid)
    if phase is ts.RequestPhase.REGISTERED:
        return "tokenizing"
    if phase is ts.RequestPhase.DISPATCHED:
        return "mid_stream" if rec.chunks else "before_first_token"
    return "before_registration" if not rec.chunks else "ended"
