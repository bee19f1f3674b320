"""KV rooms across processes: a prefill server hosts its rooms, decode engines reach them.

SGLang pairs the two legs of a disaggregated request through the prefill
side's bootstrap server, which the decode side finds at the request's
``bootstrap_host:bootstrap_port``. ``serve`` does the same for the
SimEngine: a prefill server serves its ``SimKVRooms`` under
``/bootstrap/rooms/<room>`` on its own HTTP port (so its bootstrap port is
its HTTP port), and a decode SimEngine's ``HTTPKVRooms`` goes to whichever
prefill server each request names. That is what lets sglang-router's PD mode
pair two ``serve`` processes: it writes the prefill server's host and the
bootstrap port it was given into every request.

Only the SimEngine needs this bridge (SGLang runs its own bootstrap server),
yet it lives here, not in ``trio_sglang.sim``: it is HTTP routes of the
server's app and an HTTP client, and it knows the rooms only by the
``KVRooms`` and ``HostedKVRooms`` protocols (``trio_sglang._kv_rooms``), so
the server never imports the simulator and the simulator needs no HTTP.

Only the decode side's calls cross the network, as in SGLang:

- its events (``decode_ready``, the handshake; ``decode_aborted``, SGLang's
  abort notification) and its being done with the room are sent in order
  per room, a batch per ``POST``, by one task per room with messages
  pending; each attempt is bounded, and failures are retried for at most
  ``delivery_timeout`` seconds, then logged;
- its wait for ``kv_sent`` is a long poll (``GET ...?wait=kv_sent``) that the
  server holds at most ``hold`` seconds and the client sends again until the
  event comes. The decode scheduler bounds the whole wait (its KV timeout) and
  cancels it when the request is aborted; a cancelled poll closes its
  connection, which ends the hold at the server at once.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, get_args
from urllib.parse import parse_qs

import httpx
import trio

from .._bounded_http import BadAnswer, read_answer
from .._kv_rooms import BootstrapAddr, HostedKVRooms, RoomEvent
from ._asgi import ClientGone, Receive, Scope, Send, read_json_within, send_json
from ._http_errors import HTTPError, method_not_allowed

__all__ = ["ROOMS_PATH", "HTTPKVRooms", "KVRoomsApp", "bootstrap_base_url", "open_http_kv_rooms"]

logger = logging.getLogger("trio_sglang.server")

#: Where a prefill server serves its rooms: ``ROOMS_PATH + str(room)``.
ROOMS_PATH = "/bootstrap/rooms/"
#: The longest the server holds a long poll, whatever the client asks.
MAX_HOLD = 30.0
#: The most rooms a prefill server holds at once (a room per disaggregated request).
MAX_ROOMS = 65_536
#: A message, either way (a decode side's post, a room's answer), is a few events and a flag.
_MAX_MESSAGE_BYTES = 4096
_EVENTS: tuple[RoomEvent, ...] = get_args(RoomEvent)
#: Hosted rooms are the bootstrap server itself: the address is this one.
_HERE = BootstrapAddr()
#: A DNS name as RFC 1123 writes one: labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def bootstrap_base_url(host: str, port: int) -> str | None:
    """``http://host:port`` for a request's bootstrap address; ``None`` if ``host`` is no host.

    A host is a DNS name or an IP literal, written bare (an IPv6 literal gets
    its brackets here): anything else, ``[127.0.0.1]`` or a path or a space,
    would make a URL that is not the address that admission allowed, or none
    at all. Admission refuses what this refuses, so a request never gets as
    far as the connection.
    """
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        if len(host) > 253 or not _HOST_NAME.fullmatch(host):
            return None
        return f"http://{host}:{port}"
    return f"http://[{literal}]:{port}" if literal.version == 6 else f"http://{literal}:{port}"


# -- the prefill server's side -------------------------------------------------


class KVRoomsApp:
    """The bootstrap server's routes over a prefill server's hosted rooms (ASGI).

    ``POST <ROOMS_PATH><room>`` with ``{"events": [...], "done": bool}`` records
    the events in order, then, if ``done``, that the decode side is done with
    the room. ``GET <ROOMS_PATH><room>?wait=<event>,...&hold=<seconds>``
    answers ``{"events": [...]}``, those wanted that happened, as soon as one
    has; none after ``hold`` seconds, and none at once for a room the server
    does not hold (never handshaken, or forgotten by both sides): the client
    asks again later.

    A ``POST`` that would make a room past ``max_rooms`` held is a 503: a
    room is a few hundred bytes, held until both sides are done with it or
    until the rooms forget it (``SimKVRooms``: 300 s), and the routes take
    the server's API key, so only its peers can make one.

    ``on_decode_aborted(room)`` runs when a room's decode side reports its
    abort, after the room has recorded it: the server stops the prefill leg
    in that room (``InFlight.stop_room``).
    """

    def __init__(
        self,
        rooms: HostedKVRooms,
        *,
        read_timeout: float,
        on_decode_aborted: Callable[[int], None],
        max_rooms: int = MAX_ROOMS,
    ) -> None:
        self.rooms = rooms
        self._read_timeout = read_timeout
        self._on_decode_aborted = on_decode_aborted
        self._max_rooms = max_rooms

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            room = _room_of(scope["path"])
            if scope["method"] == "POST":
                body = await read_json_within(
                    scope, receive, _MAX_MESSAGE_BYTES, self._read_timeout
                )
                self._record(room, body)
                await send_json(send, 200, {})
            elif scope["method"] == "GET":
                wanted, hold = _wait_query(scope.get("query_string", b""))
                events = await self._wait(room, wanted, hold, receive)
                if events is not None:
                    await send_json(send, 200, {"events": sorted(events)})
            else:
                raise method_not_allowed(scope["method"], scope["path"], ("GET", "POST"))
        except ClientGone:
            return
        except HTTPError as exc:
            await send_json(send, exc.status, exc.body(), exc.headers)

    def _record(self, room: int, message: dict[str, Any]) -> None:
        events, done = message.get("events", []), message.get("done", False)
        if not isinstance(events, list) or not all(e in _EVENTS for e in events):
            raise HTTPError(400, f"'events' must be a list of {', '.join(_EVENTS)}")
        if not isinstance(done, bool):
            raise HTTPError(400, "'done' must be a bool")
        if events and room not in self.rooms and len(self.rooms) >= self._max_rooms:
            raise HTTPError(
                503,
                f"this prefill server holds {self._max_rooms} KV rooms, its limit",
                kind="server_error",
                headers=[(b"retry-after", b"1")],
            )
        for event in events:
            self.rooms.post(room, event, _HERE)
        if done:
            self.rooms.side_done(room, _HERE)
        if "decode_aborted" in events:
            self._on_decode_aborted(room)

    async def _wait(
        self, room: int, wanted: frozenset[RoomEvent], hold: float, receive: Receive
    ) -> frozenset[RoomEvent] | None:
        """The long poll; ``None`` if the client left first (its wait was cancelled)."""
        if room not in self.rooms:
            return frozenset()
        events: frozenset[RoomEvent] | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_at_disconnect, receive, nursery.cancel_scope)
            with trio.move_on_after(hold):
                events = await self.rooms.wait(room, wanted, _HERE)
            # Not reached when the disconnect cancelled the body: events stays None.
            events = frozenset() if events is None else events
            nursery.cancel_scope.cancel()
        return events


async def _cancel_at_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _room_of(path: str) -> int:
    text = path.removeprefix(ROOMS_PATH)
    # ASCII digits only (``int`` takes other scripts' too), and few enough for ``int``.
    if not (text.isascii() and text.isdigit() and len(text) <= 19) or int(text) >= 2**63:
        raise HTTPError(404, f"no route {path}: a room is an int in [0, 2**63)")
    return int(text)


def _wait_query(query: bytes) -> tuple[frozenset[RoomEvent], float]:
    params = parse_qs(query.decode("latin-1"))
    names = ",".join(params.get("wait", [])).split(",")
    wanted = frozenset(e for e in _EVENTS if e in names)
    if not wanted or len(wanted) != len(set(names)):
        raise HTTPError(400, f"'wait' must name events among {', '.join(_EVENTS)}")
    try:
        hold = float(params.get("hold", ["0"])[0])
    except ValueError:
        hold = -1.0
    if not 0 <= hold <= MAX_HOLD:
        raise HTTPError(400, f"'hold' must be seconds in [0, {MAX_HOLD}]")
    return wanted, hold


# -- the decode engine's side ----------------------------------------------------


@dataclass(eq=False, slots=True)
class _RemoteRoom:
    """What the decode side knows of one room at one prefill server."""

    #: ``None`` when the request named no complete bootstrap address.
    url: str | None
    #: Events posted from here or seen at the server: what ``happened`` knows.
    seen: set[RoomEvent] = field(default_factory=set)
    #: Events not sent yet, in order.
    outbox: list[RoomEvent] = field(default_factory=list)
    #: ``side_done`` was called; ``done_sent`` once the server was told (or given up on).
    done: bool = False
    done_sent: bool = False
    #: Set while a task sends this room's messages; set (the event) when it stops.
    sending: trio.Event | None = None
    #: A failed long poll is logged once per room, not at every retry.
    poll_failed: bool = False


class HTTPKVRooms:
    """``KVRooms`` for a decode SimEngine whose prefill sides are prefill ``serve`` processes.

    Made by ``open_http_kv_rooms``, whose nursery owns its sending tasks.
    ``happened`` answers from what this side posted and what its waits saw:
    the decode scheduler asks nothing more. A room is forgotten here once the
    server has been told that this side is done with it.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        nursery: trio.Nursery,
        *,
        hold: float,
        http_timeout: float,
        retry_interval: float,
        delivery_timeout: float,
    ) -> None:
        self._client = client
        self._nursery = nursery
        self._hold = hold
        self._http_timeout = http_timeout
        self._poll_timeout = httpx.Timeout(http_timeout, read=http_timeout + hold)
        self._retry_interval = retry_interval
        self._delivery_timeout = delivery_timeout
        self._rooms: dict[tuple[BootstrapAddr, int], _RemoteRoom] = {}

    def __len__(self) -> int:
        """Rooms this side has not told its prefill server it is done with."""
        return len(self._rooms)

    def post(self, room: int, event: RoomEvent, at: BootstrapAddr) -> None:
        state = self._room(room, at)
        state.seen.add(event)
        state.outbox.append(event)
        self._send_soon(room, at, state)

    def happened(self, room: int, event: RoomEvent, at: BootstrapAddr) -> bool:
        state = self._rooms.get((at, room))
        return state is not None and event in state.seen

    async def wait(
        self, room: int, wanted: frozenset[RoomEvent], at: BootstrapAddr
    ) -> frozenset[RoomEvent]:
        """Long polls until one of ``wanted`` happened; unbounded, as the caller bounds it."""
        state = self._room(room, at)
        while not (state.seen & wanted):
            if state.sending is not None:
                # The handshake has to reach the server before the poll does,
                # or the server answers at once that it holds no such room.
                await state.sending.wait()
            started = trio.current_time()
            state.seen |= await self._poll(room, state, wanted)
            if not (state.seen & wanted):
                # A poll answered early (an error, an unknown room) must not spin.
                await trio.sleep_until(started + self._retry_interval)
        return frozenset(state.seen & wanted)

    def side_done(self, room: int, at: BootstrapAddr) -> None:
        state = self._room(room, at)
        state.done = True
        self._send_soon(room, at, state)

    def _room(self, room: int, at: BootstrapAddr) -> _RemoteRoom:
        state = self._rooms.get((at, room))
        if state is None:
            base = None
            if at.host is not None and at.port is not None:
                base = bootstrap_base_url(at.host, at.port)
            state = self._rooms[at, room] = _RemoteRoom(
                None if base is None else f"{base}{ROOMS_PATH}{room}"
            )
        return state

    def _send_soon(self, room: int, at: BootstrapAddr, state: _RemoteRoom) -> None:
        if state.sending is None:
            state.sending = trio.Event()
            self._nursery.start_soon(self._send, room, at, state)

    async def _send(self, room: int, at: BootstrapAddr, state: _RemoteRoom) -> None:
        """Send the room's messages in order, a batch per ``POST``, until none is left."""
        assert state.sending is not None
        try:
            while state.outbox or (state.done and not state.done_sent):
                done = state.done
                message = {"events": state.outbox, "done": done}
                state.outbox = []
                await self._deliver(room, state, message)
                state.done_sent = done
        finally:
            state.sending.set()
            state.sending = None
            if state.done_sent:
                del self._rooms[at, room]

    async def _deliver(self, room: int, state: _RemoteRoom, message: dict[str, Any]) -> None:
        """``POST`` one message; retried for at most ``delivery_timeout``, then logged."""
        why = "the request named no bootstrap address that is a host and a port"
        with trio.move_on_after(self._delivery_timeout):
            while state.url is not None:
                started = trio.current_time()
                try:
                    answer = await read_answer(
                        self._client,
                        "POST",
                        state.url,
                        json=message,
                        max_bytes=_MAX_MESSAGE_BYTES,
                        within=self._http_timeout,
                    )
                except BadAnswer as exc:
                    why = str(exc)
                else:
                    if answer.ok:
                        return
                    why = f"HTTP {answer.status}: {answer.head}"
                    if 400 <= answer.status < 500:
                        break  # not a prefill server on the SimEngine: retrying will not help
                await trio.sleep_until(started + self._retry_interval)
        logger.warning(
            "could not tell the prefill side at %s about room %d (%s): %s; it may keep the "
            "room, and without decode_aborted its prefill, until that ends",
            state.url,
            room,
            message,
            why,
        )

    async def _poll(
        self, room: int, state: _RemoteRoom, wanted: frozenset[RoomEvent]
    ) -> frozenset[RoomEvent]:
        """One long poll: those of ``wanted`` the server saw within ``hold`` (maybe none)."""
        try:
            if state.url is None:
                raise BadAnswer("the request named no bootstrap address that is a host and a port")
            answer = await read_answer(
                self._client,
                "GET",
                state.url,
                params={"wait": ",".join(sorted(wanted)), "hold": self._hold},
                timeout=self._poll_timeout,
                max_bytes=_MAX_MESSAGE_BYTES,
                within=self._http_timeout + self._hold,
            )
            if not answer.ok:
                raise BadAnswer(f"HTTP {answer.status}: {answer.head}")
            payload = answer.json()
            events = payload.get("events") if isinstance(payload, dict) else None
            if not isinstance(events, list):
                raise BadAnswer(f"not a rooms answer: {answer.head!r}")
        except BadAnswer as exc:
            if not state.poll_failed:
                state.poll_failed = True
                logger.warning(
                    "waiting for room %d at %s failed (%r); trying again every %s s until the "
                    "decode side's KV timeout",
                    room,
                    state.url,
                    exc,
                    self._retry_interval,
                )
            return frozenset()
        return frozenset(event for event in wanted if event in events)


@asynccontextmanager
async def open_http_kv_rooms(
    *,
    api_key: str | None = None,
    hold: float = 5.0,
    http_timeout: float = 5.0,
    retry_interval: float = 0.1,
    delivery_timeout: float = 10.0,
    shutdown_grace: float = 1.0,
) -> AsyncIterator[HTTPKVRooms]:
    """``HTTPKVRooms`` for the life of the block: enter it before the decode engine runs.

    ``api_key`` is the prefill servers' ``--api-key`` (a pair shares one),
    sent as a bearer token. ``hold`` is how long the server holds one long
    poll; ``http_timeout`` bounds every other step of an HTTP call (connect,
    send, read); failed calls are tried again ``retry_interval`` seconds
    after they started. On exit,
    messages still going out (the abort notifications of the last requests)
    get ``shutdown_grace`` seconds, then are cancelled.
    """
    # Rooms are internal traffic: no proxy from the environment. Every decode
    # request waiting for its KV cache holds a connection, so the pool is not
    # capped (the server's own clients bound how many requests there are).
    limits = httpx.Limits(max_connections=None)
    async with (
        httpx.AsyncClient(
            timeout=http_timeout,
            limits=limits,
            trust_env=False,
            headers={} if api_key is None else {"authorization": f"Bearer {api_key}"},
        ) as client,
        trio.open_nursery() as nursery,
    ):
        try:
            yield HTTPKVRooms(
                client,
                nursery,
                hold=hold,
                http_timeout=http_timeout,
                retry_interval=retry_interval,
                delivery_timeout=delivery_timeout,
            )
        finally:
            nursery.cancel_scope.deadline = min(
                nursery.cancel_scope.deadline, trio.current_time() + shutdown_grace
            )
