"""Every settings class refuses a bad number at once, in the same words.

``AbortPolicy``, ``ServerLimits``, the SimEngine's timings and knobs,
``SimKVRooms``, ``Faults`` and ``SGLangEngine``'s poll interval share one
range check: a value says what it must be (an int, a number of seconds, a
finite one), the bound, and what was given. A bool is no number here, as in
SGLang's own checks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest

import trio_sglang as ts
from trio_sglang.server import ServerLimits
from trio_sglang.testing import Faults

#: What builds a settings object from one bad value, and the whole message it raises.
REFUSALS: dict[str, tuple[Callable[[], object], str]] = {
    "policy seconds": (
        lambda: ts.AbortPolicy(cleanup_timeout=-1),
        "AbortPolicy.cleanup_timeout must be a number of seconds >= 0, got -1",
    ),
    "policy NaN": (
        lambda: ts.AbortPolicy(shutdown_grace=math.nan),
        "AbortPolicy.shutdown_grace must be a number of seconds >= 0, got nan",
    ),
    "policy count": (
        lambda: ts.AbortPolicy(abort_attempts=0),
        "AbortPolicy.abort_attempts must be an int >= 1, got 0",
    ),
    "limits timeout": (
        lambda: ServerLimits(request_read_timeout=0),
        "request_read_timeout must be a number of seconds > 0, got 0",
    ),
    "limits heartbeat": (
        lambda: ServerLimits(sse_heartbeat=-0.5),
        "sse_heartbeat must be a number of seconds >= 0, got -0.5",
    ),
    "limits count": (
        lambda: ServerLimits(max_connections=True),
        "max_connections must be an int >= 1, got True",
    ),
    "sim timing": (
        lambda: ts.SimEngine(token_interval=math.inf),
        "token_interval must be a finite number of seconds >= 0, got inf",
    ),
    "sim context": (
        lambda: ts.SimEngine(context_length=0),
        "context_length must be an int >= 1, got 0",
    ),
    "sim missed aborts": (
        lambda: ts.SimEngine(missed_aborts=1.0),  # type: ignore[arg-type]
        "missed_aborts must be an int >= 0, got 1.0",
    ),
    "disagg chunk": (
        lambda: ts.SimDisaggTiming(prefill_chunk_tokens=0),
        "prefill_chunk_tokens must be an int >= 1, got 0",
    ),
    "disagg seconds": (
        lambda: ts.SimDisaggTiming(kv_transfer_delay="1"),  # type: ignore[arg-type]
        "kv_transfer_delay must be a finite number of seconds >= 0, got '1'",
    ),
    "rooms": (
        lambda: ts.SimKVRooms(forget_after=math.inf),
        "forget_after must be a finite number of seconds >= 0, got inf",
    ),
    "faults": (
        lambda: Faults(abort_failures=-1),
        "Faults.abort_failures must be an int >= 0, got -1",
    ),
    "sglang poll": (
        lambda: ts.SGLangEngine(model_path="m", poll_interval=0),
        "poll_interval must be a finite number of seconds > 0, got 0",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_number_is_refused_in_the_same_words_everywhere(case: str) -> None:
    build, message = REFUSALS[case]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build()


@pytest.mark.parametrize(
    "build",
    [
        lambda: ts.AbortPolicy(cleanup_timeout=0, abort_attempts=1, outputs_after_abort=0),
        lambda: ServerLimits(sse_heartbeat=0, max_connections=1, request_read_timeout=0.001),
        lambda: ts.SimEngine(token_interval=0, context_length=1, missed_aborts=0),
        lambda: ts.SimDisaggTiming(prefill_chunk_tokens=1, kv_transfer_delay=0),
        lambda: ts.SimKVRooms(forget_after=0),
        lambda: Faults(abort_failures=0),
    ],
    ids=["policy", "limits", "sim", "disagg", "rooms", "faults"],
)
def test_each_bound_itself_is_accepted(build: Callable[[], object]) -> None:
    build()
