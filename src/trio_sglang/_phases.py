"""Where a request was when its client left: what "phase" means in this project.

One vocabulary for every place that says it: the server's metric
``trio_sglang_cancellations_total{phase=...}``, ``bench-endpoint --phases``
(when its clients leave), the load test's outcomes (``left_<phase>``) and the
cancel benchmark's cells (the phase each cancel landed in). Each of them
names only the phases it can tell apart: a server does not see tokenization,
a client does not see registration. The engine's own view of a request
(registered, dispatched, gone) is ``RequestPhase``, the engine protocol's.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["MEANING", "PHASES", "Phase"]

Phase = Literal[
    "before_headers",
    "before_registration",
    "tokenizing",
    "before_first_token",
    "first_token",
    "mid_stream",
]
#: In the order a request goes through them.
PHASES: tuple[Phase, ...] = get_args(Phase)

MEANING: dict[Phase, str] = {
    "before_headers": "the request was sent, and nothing answered yet: no response headers",
    "before_registration": "the stream was opened and not yet pulled: nothing at the engine",
    "tokenizing": "registered at the engine, not yet dispatched to its scheduler",
    "before_first_token": "dispatched (or answered with headers), no token yet: queueing, prefill",
    "first_token": "just after the first token",
    "mid_stream": "after some tokens, before the end",
}
