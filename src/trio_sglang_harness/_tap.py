"""What the real scheduler was sent and what it answered, at the TokenizerManager's sockets.

With the whole ``sglang.Engine`` there is no stand-in scheduler to keep a log,
so the harness host taps the TokenizerManager where it meets the real one:
every message it dispatches (a request, an abort) and every message that
comes back (outputs with their token counts and finish reasons, the echo of
an abort in the waiting queue). What comes back is the scheduler's own word:
tokens are counted from its outputs (their ``completion_tokens``), and an
abort took effect when the scheduler finished the request with an ``abort``
reason. Events carry the stand-in's kinds and ``time.monotonic`` stamps, so
the same ``Observation`` comes of both. The tap sees outputs before the
TokenizerManager handles them, so those for a state already released count
too: that is decoding for nobody.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._scenarios import SchedulerEvent

__all__ = ["SchedulerTap"]


@dataclass(frozen=True)
class _Dispatch:
    """A generation request as the scheduler got it."""

    at: float
    rid: str
    input_ids: list[int]
    #: SGLang's warm-up request of ``n > 1`` asks for no token.
    warm_up: bool


class SchedulerTap:
    """Installed on one TokenizerManager for its life; read through marks."""

    def __init__(self, tm: Any) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        self._abort_type = AbortReq
        self._events: list[SchedulerEvent] = []
        self._dispatches: list[_Dispatch] = []
        #: rid -> tokens the scheduler has reported for it so far.
        self._completed: dict[str, int] = {}
        #: rids the scheduler has aborted (it may say so twice: an output and an echo).
        self._aborted: set[str] = set()
        send, handle, dispatch = (
            tm._dispatch_to_scheduler,
            tm._handle_batch_output,
            tm._result_dispatcher,
        )

        def dispatched(obj: Any) -> None:
            send(obj)
            self._sent(obj)

        async def outputs(batch: Any) -> None:
            self._received(batch)
            await handle(batch)

        def answer(obj: Any) -> Any:
            if isinstance(obj, self._abort_type):
                self._applied(obj.rid, time.monotonic())
            return dispatch(obj)

        tm._dispatch_to_scheduler = dispatched
        tm._handle_batch_output = outputs
        tm._result_dispatcher = answer

    def events_since_now(self) -> Callable[[], list[SchedulerEvent]]:
        """From now on: the scheduler's events, as the stand-in scheduler logs them."""
        start = len(self._events)
        return lambda: self._events[start:]

    def prompts_since_now(self) -> Callable[[], list[list[int]]]:
        """From now on: the prompt ids of each request the scheduler gets (warm-ups left out)."""
        start = len(self._dispatches)
        return lambda: [d.input_ids for d in self._dispatches[start:] if not d.warm_up]

    def dispatched_since(self, mark: float) -> bool:
        """Whether a request (not a warm-up) reached the scheduler after ``mark``."""
        return any(d.at >= mark and not d.warm_up for d in self._dispatches)

    def _sent(self, obj: Any) -> None:
        now = time.monotonic()
        if isinstance(obj, self._abort_type):
            self._events.append((now, "abort", obj.rid))
            return
        for request in getattr(obj, "batch", None) or [obj]:
            params = getattr(request, "sampling_params", None)
            if params is None or not hasattr(request, "input_ids"):
                continue  # not a generation request (a control message)
            self._events.append((now, "request", request.rid))
            warm_up = getattr(params, "max_new_tokens", None) == 0
            self._dispatches.append(_Dispatch(now, request.rid, list(request.input_ids), warm_up))

    def _received(self, batch: Any) -> None:
        now = time.monotonic()
        counts = getattr(batch, "completion_tokens", None) or []
        reasons = getattr(batch, "finished_reasons", None) or []
        for i, rid in enumerate(batch.rids or ()):
            if i < len(counts):
                new = counts[i] - self._completed.get(rid, 0)
                self._completed[rid] = counts[i]
                self._events.extend((now, "token", rid) for _ in range(max(new, 0)))
            reason = reasons[i] if i < len(reasons) else None
            if isinstance(reason, dict) and reason.get("type") == "abort":
                self._applied(rid, now)

    def _applied(self, rid: str, now: float) -> None:
        if rid not in self._aborted:
            self._aborted.add(rid)
            self._events.append((now, "abort_applied", rid))
