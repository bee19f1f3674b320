"""Prometheus metrics of one server, in its own registry (no process globals)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Literal, Protocol, get_args, runtime_checkable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from .._core._reports import EngineFault
from .._core._worker import Worker

__all__ = ["CancelPhase", "CountsEvents", "RefusalReason", "SchedulerLoad", "ServerMetrics"]

CancelPhase = Literal["before_headers", "before_first_token", "mid_stream"]
Outcome = Literal["completed", "aborted", "cancelled", "rejected", "failed", "shutdown"]
#: Why the server's admission refused a request before the engine saw it (``_admission.py``).
RefusalReason = Literal[
    "unauthorized",
    "unsupported_media_type",
    "host_not_allowed",
    "overloaded",
    "too_many_children",
    "rid_too_long",
    "context_length",
    "bootstrap_not_allowed",
    "bad_framing",
]


@runtime_checkable
class CountsEvents(Protocol):
    """An engine that counts what reached it, as the SimEngine does (its trace's kinds).

    Exported as ``trio_sglang_sim_events_total{kind}``; the server knows the
    simulator by this and nothing else.
    """

    def event_counts(self) -> Mapping[str, int]:
        """Events so far per kind, every kind (zeros too, so each series exists at once)."""
        ...


@runtime_checkable
class SchedulerLoad(Protocol):
    """An engine whose scheduler publishes what it holds, as SGLang's does (its load snapshot).

    Exported as ``trio_sglang_scheduler_requests``: the requests the scheduler
    itself is running or queueing, beside the tokenizer side's count
    (``trio_sglang_engine_live_requests``). Decoding for a client that left
    shows here, and nowhere else.
    """

    def scheduler_requests(self) -> int:
        """Running plus waiting requests, as the scheduler last published them."""
        ...


class ServerMetrics:
    """Names prefixed ``trio_sglang_``; also the worker's cleanup observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # process_resident_memory_bytes, process_cpu_seconds_total, ...: what a
        # load test compares before and after, from outside the process.
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "trio_sglang_requests",
            "Generation requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.requests_refused = Counter(
            "trio_sglang_requests_refused",
            "Requests refused before the engine saw them, by reason (see RefusalReason).",
            ["reason"],
            registry=self.registry,
        )
        for reason in get_args(RefusalReason):  # every series exists at once, at zero
            self.requests_refused.labels(reason)
        self.cancellations = Counter(
            "trio_sglang_cancellations",
            "Requests whose client went away, by the phase it left in: before_headers, "
            "before_first_token or mid_stream.",
            ["phase"],
            registry=self.registry,
        )
        self.abort_delay = Histogram(
            "trio_sglang_abort_delay_seconds",
            "From the client leaving to the engine letting go of the request.",
            # 1-2.5-5 per decade from 0.1 ms (an engine that lets go at once) to 5 s.
            buckets=(
                *(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
                *(0.1, 0.25, 0.5, 1, 2.5, 5),
            ),
            registry=self.registry,
        )
        self.cleanups_unconfirmed = Counter(
            "trio_sglang_cleanups_unconfirmed",
            "Cleanups that ended with the engine still holding the request.",
            registry=self.registry,
        )
        self.engine_faults = Counter(
            "trio_sglang_engine_faults",
            "Engine faults the worker worked around or could not, by kind (see EngineFault).",
            ["kind"],
            registry=self.registry,
        )
        self.clients_dropped = Counter(
            "trio_sglang_clients_dropped",
            "Connections the server reset, by reason: stalled (took no bytes within the "
            "stall timeout), behind (further behind its stream than the server holds), "
            "idle (no request in flight when the server needed room for a new connection), "
            "shutdown (still open when the shutdown grace ended), pipelined (sent more than "
            "64 KiB of a next request before its response ended), flooding (sent HTTP/2 "
            "control frames past its budget).",
            ["reason"],
            registry=self.registry,
        )
        self.cleanup_tasks = Gauge(
            "trio_sglang_cleanup_tasks_in_flight",
            "Engine-side cleanups still running.",
            registry=self.registry,
        )
        self.open_streams = Gauge(
            "trio_sglang_open_streams", "Responses being generated.", registry=self.registry
        )
        self.engine_live = Gauge(
            "trio_sglang_engine_live_requests",
            "Requests the engine still holds (registered or scheduled).",
            registry=self.registry,
        )

    def watch(self, worker: Worker) -> None:
        """Sample the worker's and the engine's gauges at every scrape."""
        self.cleanup_tasks.set_function(lambda: worker.pending_cleanups)
        self.open_streams.set_function(lambda: worker.open_streams)
        self.engine_live.set_function(worker.engine.live_requests)
        if isinstance(worker.engine, CountsEvents):
            self.registry.register(_EngineEvents(worker.engine))
        if isinstance(worker.engine, SchedulerLoad):
            Gauge(
                "trio_sglang_scheduler_requests",
                "Requests the engine's scheduler runs or queues, as it last published them "
                "(SGLang's load snapshot).",
                registry=self.registry,
            ).set_function(worker.engine.scheduler_requests)

    def watch_kv_rooms(self, rooms: Sized) -> None:
        """A prefill server's KV rooms (its bootstrap server): ``trio_sglang_kv_rooms``.

        A room is forgotten once both sides are done with it, so a count that
        only grows means requests whose other side never came or never ended.
        """
        Gauge(
            "trio_sglang_kv_rooms",
            "KV rooms this prefill server holds for its decode peers.",
            registry=self.registry,
        ).set_function(lambda: len(rooms))

    def cleanup_finished(self, seconds: float, *, released: bool) -> None:
        if released:
            self.abort_delay.observe(seconds)
        else:
            self.cleanups_unconfirmed.inc()

    def engine_fault(self, kind: EngineFault) -> None:
        self.engine_faults.labels(kind).inc()

    def refused(self, reason: RefusalReason) -> None:
        self.requests_refused.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineEvents(Collector):
    """The SimEngine's event counts, every kind: ``trio_sglang_sim_events_total{kind}``.

    So that what reached the simulated engine (``abort_lost`` above all) can
    be checked from outside the process; the counts are kept even when the
    engine keeps no events (``SimEngine(keep_trace=False)``, as ``serve`` runs it).
    """

    def __init__(self, engine: CountsEvents) -> None:
        self._engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "trio_sglang_sim_events",
            "SimEngine events by kind (see trio_sglang.TraceKind).",
            labels=["kind"],
        )
        for kind, count in self._engine.event_counts().items():
            family.add_metric([kind], count)
        yield family
