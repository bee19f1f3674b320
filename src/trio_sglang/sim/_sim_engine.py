"""``SimEngine``: the embedded default engine, SGLang's abort semantics with no GPU."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, get_args

import trio

from .._engine import EngineFeatures, RequestPhase, SchedulerEcho
from .._kv_rooms import KVRooms
from .._protocol._transcript import plain_transcript
from .._request._sampling import SAMPLING_PARAMS, native_name
from .._request._values import check_at_least
from ._scheduler import SimTiming
from ._sim_disagg import (
    DisaggregationMode,
    SimDecodeScheduler,
    SimDisaggTiming,
    SimPrefillScheduler,
)
from ._tokenizer import SchedulerFactory, SimStream, SimTokenizerManager
from ._trace import Trace, TraceKind

__all__ = ["SimEngine"]

#: The request fields the SimEngine honours (``features().honoured_fields``): what it
#: acts on, and what changes nothing it models, its timing. Every sampling parameter
#: but beam search is taken (its words are not sampled, so none changes them, nor is a
#: grammar enforced); so are ids, routing, caching and bookkeeping fields (``cache_salt``
#: keys its prefix cache). The worker refuses a request that asks for anything else:
#: multimodal input, log probabilities, hidden states, LoRA, a custom logit processor,
#: SGLang's sessions and reasoning budgets.
HONOURED_FIELDS = frozenset(
    {
        "session_id",
        "conversation_id",
        "watermark",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "routing_key",
        "priority",
        "extra_key",
        "cache_salt",
        "kv_hints",
        "log_metrics",
        "background",
        "no_logs",
        "custom_labels",
        "external_trace_header",
        *(native_name(key) for key in SAMPLING_PARAMS if key != "beam_width"),
    }
)


class SimEngine:
    """A trio-native model of SGLang 0.5.23's tokenizer manager and scheduler.

    Not a mock: it reproduces the behaviour a cancellation lifecycle can get
    wrong against SGLang (aborts lost before dispatch, dropped when repeated,
    matched by prefix, child rids that nobody asked for), so a lifecycle that
    is wrong against SGLang is wrong here too. Every delay runs on the trio
    clock, so under ``trio.testing.MockClock`` a run is exact and repeatable.

    Timing knobs (seconds): ``tokenize_delay`` (registration to the end of
    tokenization), ``dispatch_delay`` (from there to the push to the
    scheduler; per child for batches), ``first_token_delay`` (dispatch to the
    first token: queueing and prefill), ``token_interval`` (between tokens).

    ``release_on_close=False`` models an engine whose generator has no
    release path: a closed or cancelled stream leaves its states behind, so
    only an abort after dispatch stops the request; ``features()`` says so.

    Introspection: ``trace`` (every event, see ``TraceEvent``; and
    ``trace.counts``, events per kind) and ``live_rids()`` (rids still
    registered or still at the scheduler). ``keep_trace=False`` keeps the
    counts but not the events, for a long-running server: otherwise the trace
    grows by an event per token for as long as the process lives.

    ``disaggregation_mode`` (``"prefill"`` or ``"decode"``, as SGLang's
    server argument) makes it one side of a prefill/decode pair; the two
    sides share a ``SimKVRooms`` (the bootstrap server and the KV transfer)
    and their timing is ``disagg_timing`` (see ``_sim_disagg.py`` for the
    queues and how each one takes an abort).

    ``context_length`` is the model's context length that ``features()``
    reports, as SGLang's tokenizer manager has one: a server refuses a request
    that cannot fit in it before the engine sees it (the simulator itself
    does not check it).

    A request may ask for the fields it honours (``HONOURED_FIELDS``, which
    ``features()`` lists); the worker refuses any other. ``meta_info.cached_tokens``
    comes from a model of SGLang's prefix cache (``sim/_prefix_cache.py``).

    Its chat template (``render_chat``, the ``ChatTemplating`` capability) is
    the plain transcript: ``role: text`` lines, then ``assistant:``.

    It hears its scheduler on every id it sent an abort for, and aborts one
    again past the once-only flag (``HearsScheduler``), as ``SGLangEngine``
    does. ``missed_aborts`` injects the scheduler fault that needs it (SGLang
    issue #36876): each request's first that many aborts pass it by and it
    decodes on (an aggregated engine's scheduler only).
    """

    #: The SGLang release whose behaviour this models.
    SGLANG_VERSION = "0.5.23"

    def __init__(
        self,
        *,
        tokenize_delay: float = 0.005,
        dispatch_delay: float = 0.001,
        first_token_delay: float = 0.05,
        token_interval: float = 0.02,
        release_on_close: bool = True,
        keep_trace: bool = True,
        disaggregation_mode: DisaggregationMode | None = None,
        kv_rooms: KVRooms | None = None,
        disagg_timing: SimDisaggTiming | None = None,
        context_length: int = 32768,
        missed_aborts: int = 0,
    ) -> None:
        for name, flag in (("release_on_close", release_on_close), ("keep_trace", keep_trace)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        if disaggregation_mode not in (None, "prefill", "decode"):
            raise ValueError(
                f"disaggregation_mode must be None, 'prefill' or 'decode', "
                f"got {disaggregation_mode!r}"
            )
        if disaggregation_mode is not None and kv_rooms is None:
            raise ValueError(
                "a disaggregated SimEngine needs kv_rooms: one SimKVRooms shared "
                "with its prefill or decode peer"
            )
        check_at_least("context_length", context_length, 1, integer=True)
        check_at_least("missed_aborts", missed_aborts, 0, integer=True)
        self.context_length = context_length
        self.timing = SimTiming(tokenize_delay, dispatch_delay, first_token_delay, token_interval)
        self.disaggregation_mode = disaggregation_mode
        self.disagg_timing = SimDisaggTiming() if disagg_timing is None else disagg_timing
        self.trace = Trace(keep_events=keep_trace)
        self._tm = SimTokenizerManager(
            self.timing,
            self.trace,
            release_on_close,
            self._scheduler_factory(kv_rooms),
            missed_aborts,
        )

    def _scheduler_factory(self, rooms: KVRooms | None) -> SchedulerFactory | None:
        mode = self.disaggregation_mode
        if mode is None or rooms is None:
            return None
        side = SimPrefillScheduler if mode == "prefill" else SimDecodeScheduler
        return lambda sink: side(self.timing, self.disagg_timing, rooms, self.trace, sink)

    @property
    def tokenizer_manager(self) -> SimTokenizerManager:
        """The modelled ``TokenizerManager`` (``rid_to_state``, ``abort_request``)."""
        return self._tm

    def live_rids(self) -> set[str]:
        return set(self._tm.rid_to_state) | self._tm.scheduler.rids()

    def live_requests(self) -> int:
        return len(self.live_rids())

    def event_counts(self) -> dict[str, int]:
        """Events so far per kind, every kind: what ``serve`` exports in ``/metrics``."""
        return {kind: self.trace.counts[kind] for kind in get_args(TraceKind)}

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if self._tm.running:
            raise RuntimeError("this SimEngine is already running")
        async with trio.open_nursery() as nursery:
            self._tm.running = True
            nursery.start_soon(self._tm.scheduler.run)
            try:
                yield
            finally:
                self._tm.close()
                nursery.cancel_scope.cancel()

    def features(self) -> EngineFeatures:
        return EngineFeatures(
            kind="sim",
            sglang_version=self.SGLANG_VERSION,
            request_registry=True,
            dispatch_timestamp=True,
            abort_sent_flag=True,
            release_on_close=self._tm.release_on_close,
            batch_parallel_sampling=True,
            disaggregation_mode=self.disaggregation_mode,
            context_length=self.context_length,
            honoured_fields=HONOURED_FIELDS,
        )

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool = False
    ) -> str:
        """The SimEngine's chat template: the plain transcript, as text to tokenize."""
        return plain_transcript(messages, continue_final_message=continue_final_message)

    def generate(self, request: Mapping[str, Any]) -> SimStream:
        return self._tm.generate_request(request)

    def phase(self, rid: str) -> RequestPhase:
        return self._tm.phase(rid)

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        return await self._tm.wait_phase_change(rid, phase)

    async def abort(self, rid: str) -> None:
        self._tm.abort_request(rid)
        await trio.lowlevel.checkpoint()

    def echo(self, rid: str) -> SchedulerEcho | None:
        return self._tm.echoes.get(rid)

    def forget_echo(self, rid: str) -> None:
        self._tm.echoes.forget(rid)

    async def abort_again(self, rid: str) -> None:
        self._tm.abort_again(rid)
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        t = self.timing
        return (
            f"SimEngine(tokenize_delay={t.tokenize_delay}, dispatch_delay={t.dispatch_delay}, "
            f"first_token_delay={t.first_token_delay}, token_interval={t.token_interval})"
        )
