"""One load run's plan: the clients, the server's SimEngine timing, and every bound;
and the edge scenario's hostile share, with the short server bounds it runs under."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from _load_clients import LoadShape

__all__ = ["HOSTILE_CAPS", "HOSTILE_SHARE", "Config", "EdgeConfig"]

#: The edge scenario's default: this share of the normal clients of each hostile
#: kind, at most its ``HOSTILE_CAPS`` entry. Bad peers are capped lower: each of
#: their requests makes the decode server call the hostile peer dozens of times
#: (its KV rooms poll again every 0.1 s), so ten of them already make about a
#: hundred hostile answers a second.
HOSTILE_SHARE = 0.1
#: Flooders, pipeliners, resetters and fan-out clients are capped lower still: each
#: costs the server about one attack a second, and a flood or a burst of 50 streams is
#: far more than a request.
HOSTILE_CAPS = {
    "nonreaders": 50,
    "tricklers": 50,
    "zero_window": 50,
    "bad_peers": 10,
    "flooders": 5,
    "pipeliners": 20,
    "resetters": 5,
    "fanout": 4,
}


@dataclass(frozen=True, slots=True)
class Config:
    """Seconds throughout.

    The SimEngine's defaults (a token every 20 ms) would ask 1,000 streams for
    50,000 server-sent events a second, several cores' worth of HTTP framing
    on either side. A token every 250 ms and 16 tokens a request (a request
    lives about 4 s) keeps 1,000 streams at about 3,300 events a second: on
    the project's 2-core machine the server then needs about 0.7 of a core and
    the clients about 0.6, so neither side is starved and what is measured is
    the server under load, not an overloaded machine.
    """

    clients: int = 1000
    duration: float = 30.0
    disconnect_fraction: float = 1 / 3
    seed: int = 0
    max_tokens: int = 16
    token_interval: float = 0.25
    tokenize_delay: float = 0.005
    dispatch_delay: float = 0.001
    first_token_delay: float = 0.05
    #: Clients start at random moments within the first ``ramp`` seconds.
    ramp: float = 1.0
    warmup_clients: int = 50
    warmup_duration: float = 2.0
    request_timeout: float = 30.0
    start_timeout: float = 30.0
    #: Any one HTTP exchange of the operator's client (health, metrics).
    admin_timeout: float = 10.0
    #: How long the server may take to finish its cleanups after the run.
    settle_timeout: float = 10.0
    #: How long the server may take to exit after SIGINT.
    stop_timeout: float = 10.0

    def serve_args(self) -> list[str]:
        timing = {
            "--sim-tokenize-delay": self.tokenize_delay,
            "--sim-dispatch-delay": self.dispatch_delay,
            "--sim-first-token-delay": self.first_token_delay,
            "--sim-token-interval": self.token_interval,
        }
        return [part for flag, seconds in timing.items() for part in (flag, f"{seconds:g}")]

    def shape(self, *, warmup: bool = False) -> LoadShape:
        return LoadShape(
            clients=min(self.clients, self.warmup_clients) if warmup else self.clients,
            duration=self.warmup_duration if warmup else self.duration,
            disconnect_fraction=self.disconnect_fraction,
            max_tokens=self.max_tokens,
            first_token_after=self.tokenize_delay + self.dispatch_delay + self.first_token_delay,
            token_interval=self.token_interval,
            ramp=min(self.ramp, self.warmup_duration) if warmup else self.ramp,
            request_timeout=self.request_timeout,
            seed=self.seed,
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "serve_args": self.serve_args()}


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """The hostile clients beside the normal ones, and the server's bounds; seconds.

    ``for_clients`` gives the default share (docs/benchmarks.md, "Hostile clients beside
    the load"). The server gets short bounds (a stall of 2 s, a body read of 3 s, against
    10 s and 30 s by default), so that every hostile client is dropped, and the run seen
    to its end, within seconds; the bad peers' decode server waits 3 s for a KV cache
    (SGLang's 300 s would hold each of their requests for the whole run). HTTP/2 is on
    (``--http2``): the flooders, resetters and zero-window clients attack it.
    """

    nonreaders: int = 50
    tricklers: int = 50
    zero_window: int = 50
    bad_peers: int = 10
    stall_timeout: float = 2.0
    read_timeout: float = 3.0
    #: A non-reader's request: why several samples of a long answer, see ``_load_hostile``.
    samples: int = 4
    max_tokens: int = 1024
    receive_buffer: int = 4096
    trickle_interval: float = 0.5
    #: A zero-window client's HTTP/2 streams on each connection, and the tokens each asks for.
    streams: int = 10
    zero_window_tokens: int = 8
    #: A zero-window or bad-peer client starts at most one connection (or request)
    #: every ``pace`` s: the server is done with each at once, and a hostile client is
    #: not a flood.
    pace: float = 1.0
    kv_wait_timeout: float = 3.0
    hold_bound: float = 60.0
    flooders: int = 5
    pipeliners: int = 20
    resetters: int = 5
    fanout: int = 4
    #: A fan-out client's ``n``; a resetter's streams in its one burst.
    fanout_children: int = 128
    burst_streams: int = 50
    #: The normal clients (one engine request each at most): sizes the server's bound.
    clients: int = 1000

    @classmethod
    def for_clients(cls, clients: int, **counts: int | None) -> EdgeConfig:
        """The default share of ``clients``, unless a count is given (by field name)."""
        share = round(HOSTILE_SHARE * clients)
        chosen = {name: max(1, min(cap, share)) for name, cap in HOSTILE_CAPS.items()}
        given = {name: n for name, n in counts.items() if n is not None}
        return cls(**chosen | given, clients=clients)

    @property
    def max_running_requests(self) -> int:
        """What every client but the fan-out ones can hold at the engine at once, and all
        the fan-out clients' requests but one."""
        others = (
            self.clients
            + self.nonreaders * self.samples
            + self.zero_window * self.streams
            + self.resetters * self.burst_streams
            + self.pipeliners
        )
        return others + max(0, self.fanout - 1) * self.fanout_children

    def zero_window_bound(self, first_token_s: float, token_s: float) -> float:
        """The longest the server may hold a zero-window connection once it answered: until
        the answers of its streams (``zero_window_tokens`` each) have been made, a first
        token taking ``first_token_s`` and each other ``token_s`` (under load, the normal
        clients' p99: they wait as long), then as long as any client that takes none of
        its bytes (its stall timeout), and a second. ``serve`` without ``--http2`` closes
        one at once."""
        making = first_token_s + self.zero_window_tokens * token_s
        return making + self.stall_timeout + 1.0

    def serve_args(self) -> list[str]:
        return [
            *("--client-stall-timeout", f"{self.stall_timeout:g}"),
            *("--request-read-timeout", f"{self.read_timeout:g}"),
            *("--max-running-requests", str(self.max_running_requests)),
            "--http2",
        ]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "serve_args": self.serve_args()}
