"""The edge scenario's bad KV peers: a hostile prefill peer, a decode server that meets
it, and the clients whose requests send the decode server there.

A decode server (``--disaggregation-mode decode``) reads answers from other
servers: its ``--prefill-url`` peer's ``/capabilities`` and ``/generate``
(each request's prefill leg), and the KV rooms (SGLang's bootstrap server)
at the address a request names, or at that peer for a request it gave a room
itself. The **hostile peer** is all of these at once: a loopback trio server
that answers ``/capabilities`` as a prefill server that can be cancelled at
any time (else the decode server would not start, or would leave its legs
running), and every other request with the next of ``ANSWERS``, in rotation:
JSON nested 100,000 deep, a body that never ends, one that trickles, a gzip
bomb (1 GiB of zeros in 1 MB), bytes that are not HTTP, JSON of the wrong
shape, and no answer at all. It times how long the decode server kept each
answer's connection: from the answer's start to the decode server hanging up.

Why a decode server of its own, beside the load's server: only a decode
server reaches peers (an aggregated one takes the bootstrap fields and never
connects anywhere), and a decode server cannot serve the normal clients:
without a prefill peer it refuses every request without bootstrap fields, and
with a good prefill server in front every normal request would become two
over HTTP, a load other than the baseline's. So the load's server stays as it
is, and a decode server whose ``--prefill-url`` is the hostile peer runs
beside it for the whole run (started before the baseline, so that its
start-up does not land in the edge phase).

A **bad-peer client** sends non-streaming ``/generate`` requests to the decode
server, at most one every ``pace`` s, by each of ``ROUTES`` in turn: without
bootstrap fields (the decode server runs the prefill leg at the peer, and
waits for the KV cache in a room there), and with bootstrap fields naming the
peer (the ``--prefill-url`` server's bootstrap address is allowed, as any in
``--allowed-bootstrap-hosts`` is; only the KV rooms). Each request must end
in one of ``EXPECTED``: a 502 (the prefill leg failed on a bad answer), or,
where no bad answer ends it sooner (a hang, a trickle, the rooms, which the
decode side polls again until it gives up), a 200 with ``finish_reason``
abort once its wait for the KV cache runs out (``--sim-kv-wait-timeout``), as
SGLang ends a decode request whose KV transfer failed.

Every wait is bounded: a request, and a peer's answer, by ``bound``
(reaching it is a finding, counted), the clients by a ``trio.fail_after``
only a bug can reach; the peer serves in a nursery that ends with the run.
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any, Literal

import httpx
import trio

from _load_clients import http_client
from _load_config import Config, EdgeConfig
from _load_hostile import repeat
from _load_metrics import Scrape
from _load_report import exit_check, pairs, seconds, zero
from _load_server import ServerProcess, open_server
from _output import wrap
from _stats import percentiles
from _verdict import Target

__all__ = [
    "ANSWERS",
    "EXPECTED",
    "ROUTES",
    "BadPeerRun",
    "BadPeerShape",
    "BadPeers",
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
#: A body that never ends: this much every ``_ENDLESS_EVERY`` s, past the decode
#: server's 32 MiB bound on a prefill leg's answer within about 1.5 s.
_ENDLESS_CHUNK = b"1," * (1 << 17)
_ENDLESS_EVERY = 0.01
_ENDLESS_CHUNKS = 1000
#: A body that trickles: one byte every ``_TRICKLE_EVERY`` s, of ``_TRICKLE_BYTES``.
_TRICKLE_EVERY = 0.1
_TRICKLE_BYTES = 1000


@dataclass(frozen=True, slots=True)
class BadPeerShape:
    """What the bad-peer clients and the decode server do; times in seconds."""

    clients: int
    #: No client sends a request after this; they start within ``ramp``.
    duration: float
    ramp: float
    #: A client sends at most one request every ``pace``.
    pace: float
    #: The decode server's wait for a KV cache.
    kv_wait_timeout: float
    #: The longest a request, or a peer's answer, is waited for.
    bound: float
    seed: int

    @classmethod
    def for_edge(cls, edge: EdgeConfig, config: Config) -> BadPeerShape:
        return cls(
            clients=edge.bad_peers,
            duration=config.duration,
            ramp=config.ramp,
            pace=edge.pace,
            kv_wait_timeout=edge.kv_wait_timeout,
            bound=edge.hold_bound,
            seed=config.seed,
        )

    @property
    def deadline(self) -> float:
        """The most the clients can take: the last ones start just before the end."""
        return self.duration + self.bound + self.pace + 5.0

    def serve_args(self, peer_url: str) -> list[str]:
        return [
            *("--disaggregation-mode", "decode", "--prefill-url", peer_url),
            *("--sim-kv-wait-timeout", f"{self.kv_wait_timeout:g}"),
        ]


# -- the hostile peer --------------------------------------------------------------


def _http(body: bytes, *headers: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"content-length: %d" % len(body), b"connection: close"]
    return b"\r\n".join([*head, *headers, b"", body])


_OPEN_ENDED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"


@cache
def _gzip_bomb() -> bytes:
    """1 GiB of zeros, gzipped: about 1 MB on the wire (made once, in about 50 ms)."""
    return _http(gzip.compress(bytes(1 << 24), 9) * 64, b"content-encoding: gzip")


async def _send(data: bytes, stream: trio.SocketStream) -> None:
    await stream.send_all(data)


async def _bomb(stream: trio.SocketStream) -> None:
    await stream.send_all(_gzip_bomb())


async def _endless(stream: trio.SocketStream) -> None:
    await stream.send_all(_OPEN_ENDED + b"[")
    for _ in range(_ENDLESS_CHUNKS):
        await stream.send_all(_ENDLESS_CHUNK)
        await trio.sleep(_ENDLESS_EVERY)


async def _trickle(stream: trio.SocketStream) -> None:
    length = b"\r\ncontent-length: %d\r\n\r\n" % _TRICKLE_BYTES
    await stream.send_all(_OPEN_ENDED.replace(b"\r\n\r\n", length))
    for _ in range(_TRICKLE_BYTES):
        await trio.sleep(_TRICKLE_EVERY)
        await stream.send_all(b" ")


async def _hang(stream: trio.SocketStream) -> None:
    """No answer at all: the wait for the decode server to hang up is the whole of it."""


#: The hostile answers, in the order the peer gives them.
ANSWERS: dict[str, Callable[[trio.SocketStream], Awaitable[None]]] = {
    "nested 100,000 deep": partial(_send, _http(b"[" * 100_000)),
    "endless": _endless,
    "trickle": _trickle,
    "gzip bomb": _bomb,
    "not HTTP": partial(_send, b"\x00\xff" * 1000),
    "wrong shape": partial(_send, _http(b'{"events": 7, "meta_info": []}')),
    "hang": _hang,
}


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
                        await stream.send_all(_http(_CAPABILITIES))
                        return
                    kind = next(self.rotation)
                    started = trio.current_time()
                    await ANSWERS[kind](stream)
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
    shape: BadPeerShape,
    tally: RequestTally,
) -> None:
    sent = trio.current_time()
    outcome = f"no answer within {shape.bound:g} s"
    with trio.move_on_after(shape.bound):
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

    shape: BadPeerShape
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
                f"bad-peer answers the decode server still read at {self.shape.bound:g} s",
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
        if self.shape.clients:
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
        shape, requests, decode = self.shape, self.requests, self.decode
        answered = percentiles(requests.answered)
        held = percentiles([s for kind in ANSWERS for s in self.peer.held[kind]])
        routes = "; ".join(
            f"{route}: {pairs(ended.items())}" for route, ended in requests.by_route().items()
        )
        paragraphs = [
            f"bad KV peers ({shape.clients:,}; a non-streaming /generate every {shape.pace:g} s "
            "at most, to a decode server whose --prefill-url and KV rooms are the hostile peer, "
            f"--sim-kv-wait-timeout {shape.kv_wait_timeout:g}): "
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
            "clients": self.shape.clients,
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

    shape: BadPeerShape
    server: ServerProcess
    port: int
    peer: PeerTally
    requests: RequestTally = field(default_factory=RequestTally)

    async def run_clients(self) -> None:
        """The bad-peer clients for ``shape.duration`` s; return once every request ended."""
        stop_at = trio.current_time() + self.shape.duration
        with trio.fail_after(self.shape.deadline):
            async with trio.open_nursery() as nursery:
                for index in range(self.shape.clients):
                    nursery.start_soon(self._client, index, stop_at)

    async def _client(self, index: int, stop_at: float) -> None:
        shape = self.shape
        rng = random.Random(f"{shape.seed}/bad-peer/{index}")
        routes = itertools.cycle(ROUTES)
        await trio.sleep(rng.uniform(0.0, shape.ramp))
        async with http_client(self.server.url, shape.bound) as client:

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
                return _request(client, body, route, shape, self.requests)

            await repeat(stop_at, shape.pace, next_request)

    async def finish(self, settle_bound: float, stop_bound: float) -> BadPeers:
        """Let the decode server settle, stop it with SIGINT; what it all came to."""
        settle_s, after = await self.server.settle(settle_bound)
        exit_status, stop_s = await self.server.stop(stop_bound)
        log = self.server.log
        decode = DecodeServer(
            self.shape.serve_args(_url(self.port)),
            settle_s,
            settle_bound,
            after,
            exit_status,
            stop_s,
            stop_bound,
            dict(log.levels),
            list(log.notable),
        )
        return BadPeers(self.shape, self.requests, self.peer, decode)


@asynccontextmanager
async def open_bad_peers(
    shape: BadPeerShape, *, start_timeout: float, http_timeout: float
) -> AsyncIterator[BadPeerRun]:
    """The hostile peer on a free loopback port, and a decode server whose prefill peer it
    is; at the end, the peer stops (and the decode server, if ``finish`` did not)."""
    tally = PeerTally()
    peer = _HostilePeer(shape.bound, tally)
    _gzip_bomb()  # made before the load, not while it runs
    async with trio.open_nursery() as nursery:
        try:
            listeners: list[trio.SocketListener] = await nursery.start(
                partial(trio.serve_tcp, peer.answer, 0, host=_HOST)
            )
            port = int(listeners[0].socket.getsockname()[1])
            async with open_server(
                shape.serve_args(_url(port)), start_timeout=start_timeout, http_timeout=http_timeout
            ) as server:
                yield BadPeerRun(shape, server, port, tally)
        finally:
            nursery.cancel_scope.cancel()
