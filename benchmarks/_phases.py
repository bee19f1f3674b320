"""Where in a request's life the cancel lands, and the engine timing that puts it there.

"Phase" is the project's one vocabulary (``trio_sglang._phases``); the cells,
their engine settings and cancel windows are in docs/benchmarks.md ("Phases").
The windows keep tens of milliseconds of margin on both sides, so that the
event loop's lag at 1,000 or 10,000 streams still lands the cancel in the
intended phase; ``observe_phase`` says where each really landed.
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
#: The ``Phase`` fields that are ``SimEngine`` settings.
_ENGINE_KNOBS = ("tokenize_delay", "dispatch_delay", "first_token_delay", "token_interval")


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

    def engine(self) -> ts.SimEngine:
        return ts.SimEngine(**{name: getattr(self, name) for name in _ENGINE_KNOBS})

    def knobs(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in (*_ENGINE_KNOBS, "pull_delay")}


#: What each shows is in docs/benchmarks.md ("Phases").
PHASES: dict[str, Phase] = {
    phase.name: phase
    for phase in (
        Phase(
            "before_registration",
            expected="before_registration",
            window=(0.02, 0.18),
            pull_delay=0.2,
        ),
        Phase("tokenizing", expected="tokenizing", window=(0.02, 0.17), tokenize_delay=0.2),
        Phase(
            "before_first_token",
            expected="before_first_token",
            window=(0.03, 0.22),
            first_token_delay=0.25,
        ),
        Phase("mid_stream", expected="mid_stream", window=(0.15, 0.5), first_token_delay=0.02),
        Phase("slow_tokenization", expected="tokenizing", window=(0.05, 0.5), tokenize_delay=1.0),
    )
}

#: 10,000 streams parked before their first token, then cancelled in one instant.
AT_ONCE = Phase("at_once", expected="before_first_token", window=(0.0, 0.0), first_token_delay=5.0)


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
