"""The edge scenario's bad KV peers: a hostile prefill peer, a decode server that meets
it, and the clients whose requests send the decode server there.

What the peer answers, what the clients send, and why a decode server of its own beside
the load's server: docs/benchmarks.md, "Hostile clients beside the load" (bad peers).
``ANSWERS`` are also the answers of ``tests/test_peer_answers.py``'s peer: one copy, so
that what the tests hold a decode server to is what the load test measures. Every wait is
bounded: a request, and a peer's answer, by ``hold_bound`` (reaching it is a finding,
counted), the clients by a ``trio.fail_after`` only a bug can reach; the peer serves in a
nursery that ends with the run.
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import httpx
import trio

from _load_clients import http_client
from _load_config import Config, EdgeConfig
from _load_hostile import repeat
from _load_metrics import Scrape
from _load_report import exit_check, pairs, zero
from _load_server import ServerProcess, open_server
from _output import wrap
from _stats import percentiles
from _units import seconds
from _verdict import Target

__all__ = [
    "ANSWERS",
    "EXPECTED",
    "ROUTES",
    "BadPeerRun",
    "BadPeers",
    "PeerAnswer",
    "http_answer",
    "open_bad_peers",
]

_HOST = "127.0.0.1"


def _url(port: int) -> str:
    return f"http://{_HOST}:{port}"


#: The two ways a request reaches the peer through the decode server.
Route = Literal["prefill leg", "rooms named"]
ROUTES: tuple[Route, ...] = ("prefill leg", "rooms named")
#: How a bad-peer request may end: the prefill leg failed, or the KV cache never came.
EXPECTED = frozenset({"HTTP 502", "HTTP 200, finish_reason abort"})

_CAPABILITIES = json.dumps(
    {"role": "prefill", "features": {"disagg_prefill_cancel_anytime_v1": True}}
).encode()
#: The most of a request's head the peer reads.
_MAX_HEAD = 1 << 16


def _decode_args(edge: EdgeConfig, peer_url: str) -> list[str]:
    """The bad peers' decode server: the hostile peer as its prefill server."""
    return [
        *("--disaggregation-mode", "decode", "--prefill-url", peer_url),
        *("--sim-kv-wait-timeout", f"{edge.kv_wait_timeout:g}"),
    ]


# -- the hostile peer --------------------------------------------------------------


def http_answer(body: bytes, *headers: bytes, status: bytes = b"200 OK") -> bytes:
    head = [b"HTTP/1.1 " + status, b"content-length: %d" % len(body), b"connection: close"]
    return b"\r\n".join([*head, *headers, b"", body])


_OPEN_ENDED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    """``first`` at once, then ``then`` ``times`` times, each ``every`` s after the last.

    ``hold``: the peer then keeps the connection open without a word (the load's peer
    keeps every connection open until the decode server hangs up, to time it).
    """

    first: bytes
    then: bytes = b""
    times: int = 0
    every: float = 0.0
    hold: bool = False


#: The hostile answers, in the order the peer gives them. The endless body passes the
#: decode server's 32 MiB bound on a prefill leg's answer within about 1.5 s; the gzip
#: bomb is 1 GiB of zeros in about 1 MB, made at import, not while the load runs.
ANSWERS: dict[str, PeerAnswer] = {
    "nested 100,000 deep": PeerAnswer(http_answer(b"[" * 100_000)),
    "endless": PeerAnswer(_OPEN_ENDED + b"[", b"1," * (1 << 17), times=1000, every=0.01),
    "trickle": PeerAnswer(
        _OPEN_ENDED.replace(b"\r\n\r\n", b"\r\ncontent-length: 1000\r\n\r\n"),
        b" ",
        times=1000,
        every=0.1,
    ),
    "gzip bomb": PeerAnswer(
        http_answer(gzip.compress(bytes(1 << 24), 9) * 64, b"content-encoding: gzip")
    ),
    "not HTTP": PeerAnswer(b"\x00\xff" * 1000),
    "wrong shape": PeerAnswer(http_answer(b'{"events": 7, "meta_info": []}')),
    "hang": PeerAnswer(b"", hold=True),
}


async def _play(answer: PeerAnswer, stream: trio.SocketStream) -> None:
    await stream.send_all(answer.first)
    for _ in range(answer.times):
        await trio.sleep(answer.every)
        await stream.send_all(answer.then)


@dataclass(slots=True)
class PeerTally:
    """What the hostile peer answered, and how long the decode server kept each answer."""

    #: Seconds from each answer's start to the decode server hanging up, by answer.
    held: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    #: Answers the decode server still had open at the bound, by answer.
    past_bound: Counter[str] = field(default_factory=Counter)

    def answers(self) -> dict[str, int]:
        return {kind: len(self.held[kind]) + self.past_bound[kind] for kind in ANSWERS}


async def _request_target(stream: trio.SocketStream) -> str | None:
    """The path of the request whose head arrives, or None if none does."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) <= _MAX_HEAD:
        chunk = await stream.receive_some(_MAX_HEAD)
        if not chunk:
            return None
        head += chunk
    parts = head.split(b" ", 2)
    return parts[1].split(b"?", 1)[0].decode(errors="replace") if len(parts) == 3 else None


@dataclass(slots=True)
class _HostilePeer:
    bound: float
    tally: PeerTally
    rotation: itertools.cycle[str] = field(default_factory=lambda: itertools.cycle(ANSWERS))

    async def answer(self, stream: trio.SocketStream) -> None:
        """One connection: a good ``/capabilities``, or the next hostile answer, then wait
        for the decode server to hang up; at most ``bound`` s in all."""
        kind = "no request head"
        async with stream:
            with trio.move_on_after(self.bound) as scope:
                try:
                    target = await _request_target(stream)
                    if target is None:
                        return
                    if target == "/capabilities":
                        await stream.send_all(http_answer(_CAPABILITIES))
                        return
                    kind = next(self.rotation)
                    started = trio.current_time()
                    await _play(ANSWERS[kind], stream)
                    while await stream.receive_some():  # the rest of the request, until it hangs up
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # it hung up mid-answer, as it should once the answer is bad
                if kind in ANSWERS:
                    self.tally.held[kind].append(trio.current_time() - started)
            if scope.cancelled_caught:
                self.tally.past_bound[kind] += 1


# -- the bad-peer clients ----------------------------------------------------------


@dataclass(slots=True)
class RequestTally:
    """What the bad-peer clients saw."""

    #: How each request ended, by the way it went to the peer.
    outcomes: Counter[tuple[Route, str]] = field(default_factory=Counter)
    #: Seconds from each request sent to its answer.
    answered: list[float] = field(default_factory=list)

    def by_route(self) -> dict[Route, dict[str, int]]:
        """How the requests ended, for each route."""
        grouped: dict[Route, dict[str, int]] = {route: {} for route in ROUTES}
        for (route, outcome), n in self.outcomes.items():
            grouped[route][outcome] = n
        return grouped

    def unexpected(self) -> dict[str, int]:
        return {
            f"{route}: {outcome}": n
            for (route, outcome), n in self.outcomes.items()
            if outcome not in EXPECTED
        }


def _outcome(response: httpx.Response) -> str:
    """The status, and for a 200 the finish reason: ``finish_reason abort`` is the KV wait's."""
    status = f"HTTP {response.status_code}"
    if response.status_code != 200:
        return status
    try:
        reason = response.json()["meta_info"]["finish_reason"]["type"]
    except (ValueError, KeyError, TypeError):
        return f"{status}, not SGLang's answer"
    return f"{status}, finish_reason {reason}"


async def _request(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    route: Route,
    bound: float,
    tally: RequestTally,
) -> None:
    sent = trio.current_time()
    outcome = f"no answer within {bound:g} s"
    with trio.move_on_after(bound):
        try:
            response = await client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            outcome = f"transport error {type(exc).__name__}"
        else:
            outcome = _outcome(response)
        tally.answered.append(trio.current_time() - sent)
    tally.outcomes[route, outcome] += 1


# -- the run -----------------------------------------------------------------------


@dataclass(slots=True)
class DecodeServer:
    """How the decode server ended: its settle, its last scrape, its exit, its log."""

    args: list[str]
    settle_s: float | None
    settle_bound: float
    after: Scrape
    exit_status: int | None
    stop_s: float
    stop_bound: float
    log_levels: dict[str, int]
    log_notable: list[str]

    def faults(self) -> dict[str, int]:
        faults = self.after.by_label("trio_sglang_engine_faults_total", "kind")
        return {kind: round(n) for kind, n in faults.items() if n}

    def live(self) -> int:
        return round(self.after.value("trio_sglang_engine_live_requests"))


@dataclass(slots=True)
class BadPeers:
    """What the bad peers did, and what the decode server did with them."""

    edge: EdgeConfig
    requests: RequestTally
    peer: PeerTally
    decode: DecodeServer

    def cpu_s(self) -> float:
        """The decode server's CPU over its life: this run's own load, like the server's."""
        return self.decode.after.get("process_cpu_seconds_total") or 0.0

    def checks(self) -> list[Target]:
        requests, peer, decode = self.requests, self.peer, self.decode
        unexpected = requests.unexpected()
        faults = sum(decode.faults().values())
        errors = decode.log_levels.get("ERROR", 0)
        worse = decode.log_levels.get("CRITICAL", 0) + decode.log_levels.get("other", 0)
        checks = [
            zero(
                "bad-peer requests answered otherwise than 502 or the KV wait's abort",
                sum(unexpected.values()),
                pairs(unexpected.items()),
            ),
            zero(
                f"bad-peer answers the decode server still read at {self.edge.hold_bound:g} s",
                sum(peer.past_bound.values()),
                pairs(peer.past_bound.items()),
            ),
            Target(
                "bad peers' decode server settled, holding no request",
                f"within {decode.settle_bound:g} s, 0 live",
                f"{'no' if decode.settle_s is None else f'in {decode.settle_s:.2f} s'}, "
                f"{decode.live():,} live",
                decode.settle_s is not None and decode.live() == 0,
            ),
            Target(
                "bad peers' decode server log: an ERROR for engine faults, at most one each "
                "(ten of a kind in ten seconds; the metric counts each), nothing worse",
                f"1 to {faults:,} ERROR, 0 CRITICAL or without a level",
                f"{errors:,} ERROR, {worse:,} CRITICAL or without a level",
                (0 < errors <= faults or errors == faults == 0) and worse == 0,
            ),
            exit_check(
                "bad peers' decode server", decode.exit_status, decode.stop_s, decode.stop_bound
            ),
        ]
        if self.edge.bad_peers:
            answered = {route: sum(ended.values()) for route, ended in requests.by_route().items()}
            checks.append(
                Target(
                    "the bad peers ran: requests answered, by both routes",
                    "> 0 each",
                    pairs(answered.items()),
                    all(answered.values()),
                )
            )
        return checks

    def lines(self) -> list[str]:
        edge, requests, decode = self.edge, self.requests, self.decode
        answered = percentiles(requests.answered)
        held = percentiles([s for kind in ANSWERS for s in self.peer.held[kind]])
        routes = "; ".join(
            f"{route}: {pairs(ended.items())}" for route, ended in requests.by_route().items()
        )
        paragraphs = [
            f"bad KV peers ({edge.bad_peers:,}; a non-streaming /generate every {edge.pace:g} s "
            "at most, to a decode server whose --prefill-url and KV rooms are the hostile peer, "
            f"--sim-kv-wait-timeout {edge.kv_wait_timeout:g}): "
            f"{sum(requests.outcomes.values()):,} requests; {routes}; answered p50 "
            f"{seconds(answered['p50'])}, max "
            f"{seconds(answered['max'])} after sent",
            f"hostile peer: answered {pairs(self.peer.answers().items())}; the decode server hung "
            f"up p50 {seconds(held['p50'])}, max {seconds(held['max'])} after the answer began",
            f"bad peers' decode server: engine faults {pairs(decode.faults().items())}; log "
            f"{pairs(decode.log_levels.items())}; {decode.live():,} live at the end; exit status "
            f"{decode.exit_status} in {decode.stop_s:.2f} s",
        ]
        return [line for paragraph in paragraphs for line in wrap(paragraph, hang=2)]

    def to_json(self) -> dict[str, Any]:
        requests, peer, decode = self.requests, self.peer, self.decode
        return {
            "clients": self.edge.bad_peers,
            "requests": requests.by_route(),
            "answered_s": percentiles(requests.answered),
            "peer_answers": peer.answers(),
            "peer_held_s": {kind: percentiles(peer.held[kind]) for kind in ANSWERS},
            "peer_past_bound": dict(peer.past_bound),
            "decode_server": {
                "serve_args": decode.args,
                "engine_faults": decode.faults(),
                "live_requests": decode.live(),
                "settle_s": decode.settle_s,
                "exit_status": decode.exit_status,
                "stop_s": decode.stop_s,
                "cpu_s": self.cpu_s(),
                "log_levels": decode.log_levels,
                "log_notable": decode.log_notable,
            },
        }


@dataclass(slots=True)
class BadPeerRun:
    """The hostile peer and its decode server, running: the clients, then the end."""

    edge: EdgeConfig
    config: Config
    server: ServerProcess
    port: int
    peer: PeerTally
    requests: RequestTally = field(default_factory=RequestTally)

    async def run_clients(self) -> None:
        """The bad-peer clients for the run's duration; return once every request ended."""
        edge, duration = self.edge, self.config.duration
        stop_at = trio.current_time() + duration
        # The last ones start just before the end.
        with trio.fail_after(duration + edge.hold_bound + edge.pace + 5.0):
            async with trio.open_nursery() as nursery:
                for index in range(edge.bad_peers):
                    nursery.start_soon(self._client, index, stop_at)

    async def _client(self, index: int, stop_at: float) -> None:
        edge, config = self.edge, self.config
        rng = random.Random(f"{config.seed}/bad-peer/{index}")
        routes = itertools.cycle(ROUTES)
        await trio.sleep(rng.uniform(0.0, config.ramp))
        async with http_client(self.server.url, edge.hold_bound) as client:

            def next_request() -> Awaitable[None]:
                route = next(routes)
                body: dict[str, Any] = {
                    "text": f"bad peer {index}",
                    "sampling_params": {"max_new_tokens": 4},
                }
                if route == "rooms named":
                    room = rng.getrandbits(63)
                    body |= {
                        "bootstrap_host": _HOST,
                        "bootstrap_port": self.port,
                        "bootstrap_room": room,
                    }
                return _request(client, body, route, edge.hold_bound, self.requests)

            await repeat(stop_at, edge.pace, next_request)

    async def finish(self) -> BadPeers:
        """Let the decode server settle, stop it with SIGINT; what it all came to."""
        settle_bound, stop_bound = self.config.settle_timeout, self.config.stop_timeout
        settle_s, after = await self.server.settle(settle_bound)
        exit_status, stop_s = await self.server.stop(stop_bound)
        log = self.server.log
        decode = DecodeServer(
            _decode_args(self.edge, _url(self.port)),
            settle_s,
            settle_bound,
            after,
            exit_status,
            stop_s,
            stop_bound,
            dict(log.levels),
            list(log.notable),
        )
        return BadPeers(self.edge, self.requests, self.peer, decode)


@asynccontextmanager
async def open_bad_peers(edge: EdgeConfig, config: Config) -> AsyncIterator[BadPeerRun]:
    """The hostile peer on a free loopback port, and a decode server whose prefill peer it
    is; at the end, the peer stops (and the decode server, if ``finish`` did not)."""
    tally = PeerTally()
    peer = _HostilePeer(edge.hold_bound, tally)
    async with trio.open_nursery() as nursery:
        try:
            listeners: list[trio.SocketListener] = await nursery.start(
                partial(trio.serve_tcp, peer.answer, 0, host=_HOST)
            )
            port = int(listeners[0].socket.getsockname()[1])
            async with open_server(
                _decode_args(edge, _url(port)),
                start_timeout=config.start_timeout,
                http_timeout=config.admin_timeout,
            ) as server:
                yield BadPeerRun(edge, config, server, port, tally)
        finally:
            nursery.cancel_scope.cancel()
