"""One load run's plan: the clients, the server's SimEngine timing, and every bound."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from _load_clients import LoadShape

__all__ = ["Config"]


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
