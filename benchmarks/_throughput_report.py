"""What the serving benchmark measured, and what it says: cells, targets, tables, JSON.

A row adds a server's cells at a stream count up, every round (CPU seconds over
chunks, never an average of per-round ratios). What is judged, and when:
docs/benchmarks.md, "Serving throughput".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from _output import target_lines, wrap
from _report_base import Column, SummaryReport, columns_table
from _sse_client import Reading
from _units import ratio, times, us
from _verdict import MachineState, Target, judge_machine

__all__ = ["SERVERS", "Cell", "Row", "ThroughputReport"]

Server = Literal["serve", "floor", "sglang", "hosted"]
#: Always measured; ``sglang`` (SGLang's own server) and ``hosted`` (``serve`` hosting
#: SGLang's application) only where SGLang is installed.
SERVERS: tuple[Server, ...] = ("serve", "floor")

#: The targets (docs/benchmarks.md, "Serving throughput"): serve's CPU per chunk at this
#: many streams, in µs and over the floor's.
TARGET_STREAMS = 100
TARGET_US = 35.0
TARGET_RATIO = 1.5
#: The clients may use at most this much of a core, or they, not the server, set the pace.
CLIENT_CORES_AT_MOST = 0.5
#: A server at this much of a core or more over its window had no headroom: streams of its
#: still starting say the machine could not carry the offered load, not that it is wrong.
SATURATED_CORES = 0.9
#: The SGLang release whose own server ``--sglang`` runs (the ``sglang`` extra's).
SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True, slots=True)
class Cell:
    server: Server
    streams: int
    round: int
    reading: Reading


@dataclass(frozen=True, slots=True)
class Side:
    """One server's cells at one stream count, added up."""

    chunks: int
    heartbeats: int
    window_s: float
    server_cpu_s: float
    client_cpu_s: float
    tokens_completed: int
    chunks_completed: int
    failures: int
    late_streams: int

    @classmethod
    def of(cls, cells: Sequence[Cell]) -> Side:
        """The cells' readings added up; ``failures``, kept per reason there, in all."""
        readings = [cell.reading for cell in cells]
        totals = {
            name: sum(getattr(r, name) for r in readings)
            for name in cls.__dataclass_fields__
            if name != "failures"
        }
        return cls(**totals, failures=sum(sum(r.failures.values()) for r in readings))

    @property
    def us_per_chunk(self) -> float | None:
        return 1e6 * self.server_cpu_s / self.chunks if self.chunks else None

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.window_s if self.window_s else 0.0

    @property
    def server_cores(self) -> float:
        return self.server_cpu_s / self.window_s if self.window_s else 0.0

    @property
    def client_cores(self) -> float:
        return self.client_cpu_s / self.window_s if self.window_s else 0.0

    @property
    def client_us_per_chunk(self) -> float | None:
        return 1e6 * self.client_cpu_s / self.chunks if self.chunks else None

    @property
    def tokens_per_chunk(self) -> float | None:
        """Over the responses read to their end: above 1, the server coalesced a backlog."""
        return self.tokens_completed / self.chunks_completed if self.chunks_completed else None

    def to_json(self) -> dict[str, Any]:
        """The sums, then every figure derived from them (the properties, in their order)."""
        derived = [name for name, value in vars(Side).items() if isinstance(value, property)]
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass(frozen=True, slots=True)
class Row:
    streams: int
    token_interval: float
    serve: Side
    floor: Side
    #: SGLang's own server, when the run measured it.
    sglang: Side | None = None
    #: ``serve`` hosting SGLang's application over the same work, when measured.
    hosted: Side | None = None

    @property
    def ratio(self) -> float | None:
        return _ratio_of(self.serve, self.floor)

    @property
    def sides(self) -> list[Side]:
        return [self.serve, self.floor, *(s for s in (self.sglang, self.hosted) if s is not None)]

    def to_json(self) -> dict[str, Any]:
        sglang = {}
        if self.sglang is not None:
            sglang = {
                "sglang": self.sglang.to_json(),
                "ratio_sglang_over_floor": _ratio_of(self.sglang, self.floor),
                "ratio_serve_over_sglang": _ratio_of(self.serve, self.sglang),
            }
        if self.hosted is not None:
            sglang["hosted"] = self.hosted.to_json()
            if self.sglang is not None:
                sglang["ratio_hosted_over_sglang"] = _ratio_of(self.hosted, self.sglang)
        return {
            "streams": self.streams,
            "token_interval_s": self.token_interval,
            "serve": self.serve.to_json(),
            "floor": self.floor.to_json(),
            "ratio_serve_over_floor": self.ratio,
            **sglang,
        }


def _ratio_of(side: Side, other: Side) -> float | None:
    """``side``'s CPU per chunk over ``other``'s (None if either read nothing)."""
    return ratio(side.us_per_chunk, other.us_per_chunk)


@dataclass(slots=True)
class ThroughputReport(SummaryReport):
    config: dict[str, Any]
    cells: list[Cell] = field(default_factory=list)
    #: The 1-minute load average before and after the run.
    load_average: tuple[float, float] = (0.0, 0.0)
    cores: int = 1
    runtime_s: float = 0.0
    #: The processes the run started (servers, clients) and this one: CPU s over the run.
    own_cpu_s: float = 0.0
    #: Per stream count, the token interval both servers ran at.
    intervals: dict[int, float] = field(default_factory=dict)

    def rows(self) -> list[Row]:
        def side(streams: int, server: Server) -> Side:
            return Side.of([c for c in self.cells if c.streams == streams and c.server == server])

        with_sglang = any(cell.server == "sglang" for cell in self.cells)
        with_hosted = any(cell.server == "hosted" for cell in self.cells)
        return [
            Row(
                streams,
                interval,
                side(streams, "serve"),
                side(streams, "floor"),
                side(streams, "sglang") if with_sglang else None,
                side(streams, "hosted") if with_hosted else None,
            )
            for streams, interval in sorted(self.intervals.items())
        ]

    def machine(self) -> MachineState:
        own = self.own_cpu_s / self.runtime_s if self.runtime_s else 0.0
        return judge_machine(*self.load_average, self.cores, own, 0.0)

    def targets(self) -> list[Target]:
        row = next((r for r in self.rows() if r.streams == TARGET_STREAMS), None)
        at = f"at {TARGET_STREAMS} streams"
        absolute = (f"serve CPU per chunk {at}", f"<= {TARGET_US:g} us")
        relative = (f"serve / floor, CPU per chunk {at}", f"<= {TARGET_RATIO:g}x")
        if row is None or row.serve.us_per_chunk is None or row.ratio is None:
            not_run = [Target(*absolute, "not run", None), Target(*relative, "not run", None)]
            return [*not_run, *self.checks()]
        cpu, over = row.serve.us_per_chunk, row.ratio
        return [
            Target(*absolute, f"{cpu:.1f} us", cpu <= TARGET_US, "time").judged_on(self.machine()),
            # A ratio of two figures from the same run: judged on every run, as counts are.
            Target(
                *relative,
                f"{over:.2f}x ({cpu:.1f} / {row.floor.us_per_chunk:.1f} us)",
                over <= TARGET_RATIO,
            ),
            *self.checks(),
        ]

    def checks(self) -> list[Target]:
        """What makes the run's figures valid, judged on every run."""
        sides = [side for row in self.rows() for side in row.sides]
        failures = sum(side.failures for side in sides)
        empty = sum(1 for side in sides if side.chunks == 0)
        late = sum(side.late_streams for side in sides)
        busiest = max((side.client_cores for side in sides), default=0.0)
        late_check = Target(
            "streams without a token when their window began (still starting)",
            "0",
            f"{late}",
            late == 0,
        )
        late_cores = [side.server_cores for side in sides if side.late_streams]
        if late_cores and min(late_cores) >= SATURATED_CORES:
            late_check = replace(
                late_check,
                met=None,
                not_judged=f"not judged: a late server was saturated ({min(late_cores):.2f} cores)",
            )
        return [
            Target(
                "requests failed (a status, a connection cut, no [DONE])",
                "0",
                f"{failures}",
                failures == 0,
            ),
            Target("cells that read no chunk", "0", f"{empty}", empty == 0 and bool(sides)),
            late_check,
            Target(
                "the clients' busiest cell, cores",
                f"<= {CLIENT_CORES_AT_MOST:g} (not the bottleneck)",
                f"{busiest:.2f}",
                busiest <= CLIENT_CORES_AT_MOST,
            ),
        ]

    @property
    def passed(self) -> bool:
        """Every check on the run's validity held (the targets are reported, not required)."""
        return all(check.met is not False for check in self.checks())

    # -- text ---------------------------------------------------------------------

    def lines(self) -> list[str]:
        machine = self.machine()
        return [
            *wrap(
                f"trio-sglang serve against the floor (hypercorn's trio worker and a minimal "
                f"ASGI app streaming the same bytes), measured in this run: "
                f"{self.config['endpoint']}, {self.config['rate']:,.0f} tokens/s offered in "
                f"all (a token every streams/rate s per stream), "
                f"{self.config['max_tokens']} tokens a request, {self.config['rounds']} "
                f"round(s) of {self.config['window']:g} s per cell. us/chunk: the server "
                "process's CPU over the data events the clients read; tok/chunk: tokens per "
                "event (above 1: serve was behind, and coalesced); beats/s: serve's SSE "
                "heartbeats; client: the client process's CPU per chunk, us."
            ),
            "",
            *columns_table(
                _TEXT, self.rows(), groups=[("", 2), ("serve", 4), ("floor", 2), ("", 2)]
            ),
            *self._beside(
                "sglang",
                f"SGLang {SGLANG_VERSION}'s own HTTP server in the same run: its FastAPI app "
                "on uvicorn and its TokenizerManager, over the stand-in scheduler (whose "
                "process, in a GPU scheduler's place, is not counted).",
                _SGLANG_TEXT,
            ),
            *self._beside(
                "hosted",
                "serve hosting SGLang's application (serve --engine sglang's way: SGLang's "
                "routes, trio-sglang's connection and lifecycle), over the same TokenizerManager "
                "and stand-in scheduler:",
                _HOSTED_TEXT,
            ),
            "",
            "targets and checks:",
            *target_lines(self.targets()),
            "",
            *wrap(
                f"{machine.head}; load average {self.load_average[0]:.2f} before, "
                f"{self.load_average[1]:.2f} after; runtime {self.runtime_s:.1f} s"
            ),
        ]

    def _beside(self, server: str, about: str, columns: Sequence[Column[Row]]) -> list[str]:
        """The table of a server measured beside the two, if this run measured it."""
        rows = [row for row in self.rows() if getattr(row, server) is not None]
        return ["", *wrap(about), "", *columns_table(columns, rows)] if rows else []

    def markdown(self) -> str:
        """This benchmark's section of ``summary.md``."""
        rows = self.rows()
        columns = [
            *_MARKDOWN,
            *(_SGLANG_MARKDOWN if any(row.sglang is not None for row in rows) else []),
            *(_HOSTED_MARKDOWN if any(row.hosted is not None for row in rows) else []),
        ]
        return "\n".join(
            [
                "## Serving throughput",
                "",
                f"`serve` against the floor, {self.config['endpoint']}, "
                f"{self.config['rate']:,.0f} tokens/s offered; {self.machine().head}.",
                "",
                *columns_table(
                    # Markdown writes the µ a terminal might not have.
                    [(head.replace("us/", "µs/"), cell) for head, cell in columns],
                    rows,
                    markdown=True,
                ),
                "",
                *(
                    f"- [{target.label}] {target.what}: {target.measured} (target {target.target})"
                    for target in self.targets()
                ),
                "",
            ]
        )

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        return {
            "benchmark": "serve_throughput",
            "machine": machine,
            "config": self.config,
            "machine_state": self.machine().to_json(),
            "load_average": list(self.load_average),
            "runtime_s": self.runtime_s,
            "own_cpu_s": self.own_cpu_s,
            "rows": [row.to_json() for row in self.rows()],
            "cells": [
                {"server": c.server, "streams": c.streams, "round": c.round, **asdict(c.reading)}
                for c in self.cells
            ],
            "targets": self.targets_json(),
            "passed": self.passed,
        }


# -- the tables' columns: each reads its cell off a Row, from one server's side --------

#: What a column shows of one side.
_READ: dict[str, Callable[[Side], str]] = {
    "chunks/s": lambda side: f"{side.chunks_per_s:,.0f}",
    "us/chunk": lambda side: us(side.us_per_chunk),
    "tok/chunk": lambda side: "-" if (n := side.tokens_per_chunk) is None else f"{n:.2f}",
    "beats/s": lambda side: f"{side.heartbeats / side.window_s:,.0f}" if side.window_s else "-",
}


def _of(server: str, *shown: str, label: str = "") -> list[Column[Row]]:
    """The columns ``shown`` of ``server``'s side (headed ``label`` + the column); "-" in a
    row that has no such side."""

    def column(read: Callable[[Side], str]) -> Callable[[Row], str]:
        return lambda row: "-" if (side := getattr(row, server)) is None else read(side)

    return [(f"{label}{head}", column(_READ[head])) for head in shown]


def _over(server: str, base: str) -> Callable[[Row], str]:
    """One server's CPU per chunk over another's, as a multiple."""

    def cell(row: Row) -> str:
        side, other = getattr(row, server), getattr(row, base)
        return "-" if side is None or other is None else times(_ratio_of(side, other))

    return cell


_STREAMS: Column[Row] = ("streams", lambda row: f"{row.streams:,}")
_SIDE = ("chunks/s", "us/chunk", "tok/chunk")
_TEXT: list[Column[Row]] = [
    _STREAMS,
    ("interval", lambda row: f"{1e3 * row.token_interval:g} ms"),
    *_of("serve", *_SIDE, "beats/s"),
    *_of("floor", *_SIDE[:2]),
    ("serve/floor", _over("serve", "floor")),
    ("client", lambda row: us(max(side.client_us_per_chunk or 0.0 for side in row.sides))),
]
_SGLANG_TEXT: list[Column[Row]] = [
    _STREAMS,
    *_of("sglang", *_SIDE),
    ("sglang/floor", _over("sglang", "floor")),
    ("serve/sglang", _over("serve", "sglang")),
]
_HOSTED_TEXT: list[Column[Row]] = [
    _STREAMS,
    *_of("hosted", *_SIDE, "beats/s"),
    ("hosted/sglang", _over("hosted", "sglang")),
]
_MARKDOWN: list[Column[Row]] = [
    _STREAMS,
    *_of("serve", *_SIDE[:2], label="serve "),
    *_of("floor", *_SIDE[:2], label="floor "),
    ("serve/floor", _over("serve", "floor")),
]
_SGLANG_MARKDOWN: list[Column[Row]] = [
    *_of("sglang", "us/chunk", label="SGLang "),
    ("SGLang/floor", _over("sglang", "floor")),
    ("serve/SGLang", _over("serve", "sglang")),
]
_HOSTED_MARKDOWN: list[Column[Row]] = [
    *_of("hosted", "us/chunk", label="hosted "),
    ("hosted/SGLang", _over("hosted", "sglang")),
]
