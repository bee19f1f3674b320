"""Read one run's two traces into what the benchmark reports.

Every metric is defined in docs/benchmarks.md ("Disaggregated prefill",
"Method"). All times are sim seconds on the run's ``MockClock``, the clock both
engines stamp their traces with, so the clients' cancels and the engines'
events are on one time line. ``hol_delay_s`` is a lower bound on the delay:
dead work done before a request arrived also pushed back the live work still
ahead of it, which ``ttft_s`` shows.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from _disagg_run import RunData
from _stats import Stats, percentiles
from trio_sglang._phases import Phase

__all__ = ["HELD_AFTER", "PHASES", "ApproachResult", "PhaseResult", "summarize"]

#: The phases of the project's vocabulary (``trio_sglang._phases``) a pair's cancel can
#: land in, as each side of the pair sees it (prefill side / decode side).
PHASES: dict[Phase, str] = {
    "tokenizing": "both legs tokenizing, not yet at either scheduler",
    "bootstrap": "prefill in its bootstrap queue / decode in prealloc (the handshake)",
    "waiting": "prefill waiting behind other prefills / decode waiting for its KV cache",
    "prefilling": "prefill computing its chunks / decode waiting for its KV cache",
    "transferring": "prefill sending the KV cache / decode waiting for it",
    "before_first_token": "decode has the KV cache, its first token not out yet",
    "mid_stream": "decode streaming tokens",
}
#: A decode request that the engine let go of more than this long after the cancel was held.
HELD_AFTER = 0.001

_DECODE_END = frozenset({"abort_applied", "released", "finished", "kv_timeout"})


@dataclass(slots=True, eq=False)
class _PrefillLife:
    prompt_tokens: int
    dispatched: float | None = None
    bootstrapped: float | None = None
    #: (end, forward seconds) of each chunk, in order.
    chunks: list[tuple[float, float]] = field(default_factory=list)
    computed: int = 0
    #: When the forward of the prompt's last token ended.
    computed_at: float | None = None
    kv_sent: float | None = None

    @property
    def forward_started(self) -> float | None:
        if not self.chunks:
            return None
        end, seconds = self.chunks[0]
        return end - seconds

    def wasted_after(self, cancel: float) -> float:
        return sum(max(0.0, min(seconds, end - cancel)) for end, seconds in self.chunks)


@dataclass(slots=True, eq=False)
class _DecodeLife:
    registered: bool = False
    first_token: float | None = None
    tokens_after_cancel: int = 0
    ended: float | None = None
    end_kind: str = ""


@dataclass(slots=True)
class PhaseResult:
    """The cancels that landed in one phase, and what each left behind."""

    cancels: int = 0
    wasted_prefill_s: list[float] = field(default_factory=list)
    decode_hold_s: list[float] = field(default_factory=list)

    @property
    def decode_held(self) -> int:
        return _held(self.decode_hold_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "cancels": self.cancels,
            "wasted_prefill_s": _stats(self.wasted_prefill_s),
            "decode_held": self.decode_held,
            "decode_hold_s": _stats(self.decode_hold_s),
        }


@dataclass(slots=True)
class ApproachResult:
    """One approach's run, read off its traces (sim seconds; lists hold one sample per request)."""

    approach: str
    requests: int
    cancels: int
    #: All prefill forward time of the run, useful or not.
    prefill_forward_s: float
    wasted_prefill_s: list[float]
    #: Clients that stay to the end, and clients whose stream ended before their cancel.
    stayed: int
    ended_first: int
    hol_delay_s: list[float]
    ttft_s: list[float]
    decode_hold_s: list[float]
    #: Cancelled requests whose decode side ended only by SGLang's KV wait timeout.
    kv_timeouts: int
    #: Decode tokens computed after their request's cancel.
    decode_tokens_after_cancel: int
    #: Requests whose client stayed that did not get their whole answer.
    stayed_failed: int
    live_at_end: int
    aborts_lost: int
    bound_hits: int
    phases: dict[Phase, PhaseResult]
    #: Sim seconds until the last client left, and until the engines were empty.
    last_client_s: float
    settled_s: float
    runtime_s: float

    @property
    def decode_held(self) -> int:
        return _held(self.decode_hold_s)

    def to_json(self) -> dict[str, Any]:
        finite = [hold for hold in self.decode_hold_s if not math.isinf(hold)]
        return {
            "approach": self.approach,
            "requests": self.requests,
            "cancels": self.cancels,
            "stayed": self.stayed,
            "ended_before_their_cancel": self.ended_first,
            "prefill_forward_s": round(self.prefill_forward_s, 3),
            "wasted_prefill_s": {
                "total": round(sum(self.wasted_prefill_s), 3),
                "per_cancel": _stats(self.wasted_prefill_s),
            },
            "hol_delay_s": {
                "total": round(sum(self.hol_delay_s), 3),
                "per_request_stayed": _stats(self.hol_delay_s),
            },
            "ttft_s": _stats(self.ttft_s),
            "decode_held": self.decode_held,
            "decode_hold_s": {"total": round(sum(finite), 3), **_stats(self.decode_hold_s)},
            "kv_timeouts": self.kv_timeouts,
            "decode_tokens_after_cancel": self.decode_tokens_after_cancel,
            "stayed_failed": self.stayed_failed,
            "live_at_end": self.live_at_end,
            "aborts_lost": self.aborts_lost,
            "bound_hits": self.bound_hits,
            "phases": {name: phase.to_json() for name, phase in self.phases.items()},
            "sim_s": {
                "last_client_left": round(self.last_client_s, 1),
                "engines_empty": round(self.settled_s, 1),
            },
            "runtime_s": round(self.runtime_s, 2),
        }


def _held(holds: Sequence[float]) -> int:
    """The decode requests let go only after ``HELD_AFTER``, or never."""
    return sum(hold > HELD_AFTER for hold in holds)


def _stats(samples: Sequence[float]) -> Stats:
    return {
        key: None if value is None else round(value, 4)
        for key, value in percentiles(samples).items()
    }


def summarize(run: RunData, prefill_time_per_token: float) -> ApproachResult:
    prefills = _index_prefill(run, prefill_time_per_token)
    decodes = _index_decode(run)
    lives = [
        (client, None if rid is None else prefills.get(rid), decodes.get(client.rec.rid))
        for client, rid in zip(run.clients, run.prefill_rids, strict=True)
    ]
    dead = _DeadForward(
        (prefill, client.rec.cancel_at)
        for client, prefill, _ in lives
        if prefill is not None and client.rec.cancel_at is not None
    )
    phases = {name: PhaseResult() for name in PHASES}
    wasted, holds, hol, ttft = [], [], [], []
    stayed = kv_timeouts = tokens_after = failed = 0
    for client, prefill, decode in lives:
        if client.plan.cancel_after is None:
            stayed += 1
            if prefill is not None and prefill.bootstrapped is not None:
                started = prefill.forward_started
                if started is not None:
                    hol.append(dead.between(prefill.bootstrapped, started))
            if client.first_chunk_at is not None:
                ttft.append(client.first_chunk_at - client.plan.arrival)
            if client.error is not None or decode is None or decode.end_kind != "finished":
                failed += 1
        cancel = client.rec.cancel_at
        if cancel is None:
            continue
        waste = 0.0 if prefill is None else prefill.wasted_after(cancel)
        hold = _hold(decode, cancel)
        phase = phases[_phase(cancel, prefill, decode)]
        phase.cancels += 1
        phase.wasted_prefill_s.append(waste)
        phase.decode_hold_s.append(hold)
        wasted.append(waste)
        holds.append(hold)
        if decode is not None:
            kv_timeouts += decode.end_kind == "kv_timeout"
            tokens_after += decode.tokens_after_cancel
    return ApproachResult(
        approach=run.approach,
        requests=len(run.clients),
        cancels=len(wasted),
        stayed=stayed,
        ended_first=len(run.clients) - stayed - len(wasted),
        prefill_forward_s=sum(s for life in prefills.values() for _, s in life.chunks),
        wasted_prefill_s=wasted,
        hol_delay_s=hol,
        ttft_s=ttft,
        decode_hold_s=holds,
        kv_timeouts=kv_timeouts,
        decode_tokens_after_cancel=tokens_after,
        stayed_failed=failed,
        live_at_end=run.live_at_end,
        aborts_lost=sum(
            event.kind == "abort_lost" for event in (*run.prefill_trace, *run.decode_trace)
        ),
        bound_hits=run.bound_hits,
        phases=phases,
        last_client_s=run.last_client_s,
        settled_s=run.settled_s,
        runtime_s=run.runtime_s,
    )


def _index_prefill(run: RunData, per_token: float) -> dict[str, _PrefillLife]:
    lives = {
        rid: _PrefillLife(client.plan.prompt_tokens)
        for client, rid in zip(run.clients, run.prefill_rids, strict=True)
        if rid is not None
    }
    for event in run.prefill_trace:
        life = lives.get(event.rid)
        if life is None:
            continue
        if event.kind == "dispatched":
            life.dispatched = event.time
        elif event.kind == "bootstrapped":
            life.bootstrapped = event.time
        elif event.kind == "prefill_chunk":
            tokens = int(event.detail)
            life.chunks.append((event.time, tokens * per_token))
            life.computed += tokens
            if life.computed >= life.prompt_tokens:
                life.computed_at = event.time
        elif event.kind == "kv_sent":
            life.kv_sent = event.time
    return lives


def _index_decode(run: RunData) -> dict[str, _DecodeLife]:
    cancel_at = {client.rec.rid: client.rec.cancel_at for client in run.clients}
    lives = {rid: _DecodeLife() for rid in cancel_at}
    for event in run.decode_trace:
        life = lives.get(event.rid)
        if life is None:
            continue
        if event.kind == "registered":
            life.registered = True
        elif event.kind == "token":
            if life.first_token is None:
                life.first_token = event.time
            cancel = cancel_at[event.rid]
            life.tokens_after_cancel += cancel is not None and event.time > cancel
        elif event.kind in _DECODE_END and life.ended is None:
            life.ended, life.end_kind = event.time, event.kind
    return lives


def _hold(decode: _DecodeLife | None, cancel: float) -> float:
    if decode is None or not decode.registered:
        return 0.0  # never reached the decode engine
    if decode.ended is None:
        return math.inf
    return max(0.0, decode.ended - cancel)


def _phase(cancel: float, prefill: _PrefillLife | None, decode: _DecodeLife | None) -> Phase:
    """The last milestone the request had passed at ``cancel`` names its phase."""

    def passed(moment: float | None) -> bool:
        return moment is not None and moment <= cancel

    if prefill is None or not passed(prefill.dispatched):
        return "tokenizing"
    if not passed(prefill.bootstrapped):
        return "bootstrap"
    if not passed(prefill.forward_started):
        return "waiting"
    if not passed(prefill.computed_at):
        return "prefilling"
    if not passed(prefill.kv_sent):
        return "transferring"
    if decode is None or not passed(decode.first_token):
        return "before_first_token"
    return "mid_stream"


class _DeadForward:
    """The prefill GPU's dead forward intervals (after their request's cancel), for lookups.

    The forward runs one chunk at a time, so the intervals never overlap;
    ``before(t)`` is the dead time before ``t``, in O(log n).
    """

    def __init__(self, cancelled: Iterable[tuple[_PrefillLife, float]]) -> None:
        spans = sorted(
            (max(end - seconds, cancel), end)
            for life, cancel in cancelled
            for end, seconds in life.chunks
            if end > cancel
        )
        self._starts = [start for start, _ in spans]
        self._ends = [end for _, end in spans]
        self._sums = list(accumulate((end - start for start, end in spans), initial=0.0))

    def before(self, t: float) -> float:
        i = bisect_right(self._starts, t)
        if not i:
            return 0.0
        return self._sums[i] - max(0.0, self._ends[i - 1] - t)

    def between(self, start: float, end: float) -> float:
        return max(0.0, self.before(end) - self.before(start))
