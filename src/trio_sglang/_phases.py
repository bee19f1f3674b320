"""Where a request was when its client left: what "phase" means in this project.

One vocabulary for every place that says it: the server's metric
``trio_sglang_cancellations_total{phase=...}``, ``bench-endpoint --phases``
(when its clients leave), the load test's outcomes (``left_<phase>``), the
cancel benchmark's cells (the phase each cancel landed in) and the
prefill/decode benchmark's (a pair has four phases of its own between
tokenizing and the first token). Each of them names only the phases it can
tell apart: a server does not see tokenization, a client does not see
registration. The engine's own view of a request
(registered, dispatched, gone) is ``RequestPhase``, the engine protocol's.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["MEANING", "PHASES", "Phase"]

Phase = Literal[
    "before_headers",
    "before_registration",
    "tokenizing",
    "bootstrap",
    "waiting",
    "prefilling",
    "transferring",
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
    "bootstrap": "a prefill/decode pair's handshake: the two sides meeting in their room",
    "waiting": "a pair's prefill queued behind others, its decode side waiting for the KV cache",
    "prefilling": "a pair's prefill computing, its decode side waiting for the KV cache",
    "transferring": "a pair's prefill sending the KV cache to the decode side",
    "before_first_token": "dispatched (or answered with headers), no token yet: queueing, prefill",
    "first_token": "just after the first token",
    "mid_stream": "after some tokens, before the end",
}
