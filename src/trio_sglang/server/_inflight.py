"""``InFlight``: the requests being generated, by public id, for ``POST /abort_request``.

SGLang's ``/abort_request`` finds what to stop by prefix: its scheduler
aborts every request whose rid starts with the one given
(``Scheduler.abort_request``, SGLang 0.5.23: ``req.rid.startswith(recv_req.rid)``),
so aborting ``abc`` also stops another client's ``abcd``. Here the lookup is
a dict's, exact, and by the id the client was answered with: ``cmpl-...``,
``chatcmpl-...``, the ``rid`` it sent to ``/generate``, or the ``gen-...`` id
of a ``/generate`` request that sent none. One id names one request: a
``/generate`` request whose ``rid`` is in flight already is refused, as
SGLang's TokenizerManager refuses it. An id names the whole request: a
child's id (``<rid>_<i>`` of ``n > 1``, an entry of a ``rid`` list) is not a
request's, and aborts nothing; such a request ends with its connection.

An abort stops the request through the same lifecycle as a disconnect, with
``ctx.stop()`` rather than ``ctx.kill()``: the client is still there, and its
response ends as SGLang ends an aborted one (``_app.py``).

A prefill server also finds its requests by bootstrap room: when a room's
decode side aborts, the prefill leg in that room is for nobody, and is
stopped at once (``stop_room``) rather than prefilled to its end, which is
what SGLang's prefill side does and what a router that keeps the prefill leg
open when its client leaves (smg's prefill/decode mode) would cost.
"""

from __future__ import annotations

from typing import Any

from .._core._context import RequestContext
from ._http_errors import HTTPError

__all__ = ["InFlight", "abort_target", "bootstrap_rooms"]


class InFlight:
    """Every generation request from its admission to its response's last byte."""

    def __init__(self) -> None:
        self._by_id: dict[str, RequestContext] = {}
        self._by_room: dict[int, set[RequestContext]] = {}
        self._rooms: dict[RequestContext, tuple[int, ...]] = {}
        self._children: dict[RequestContext, int] = {}
        self._aborted: set[RequestContext] = set()
        #: The completions of every request in flight: the engine requests they make.
        self.children = 0

    def add(self, public_id: str, children: int, rooms: tuple[int, ...] = ()) -> RequestContext:
        """The context of a new request of ``children`` completions, in bootstrap ``rooms``
        (a prefill server's); 400 if its id is in flight."""
        if public_id in self._by_id:
            # SGLang's words (TokenizerManager), for the same refusal.
            raise HTTPError(400, f"Duplicate request ID detected: {public_id}", param="rid")
        ctx = self._by_id[public_id] = RequestContext(public_id)
        self._children[ctx] = children
        self.children += children
        self._rooms[ctx] = rooms
        for room in rooms:
            self._by_room.setdefault(room, set()).add(ctx)
        return ctx

    def discard(self, ctx: RequestContext) -> None:
        del self._by_id[ctx.id]
        self.children -= self._children.pop(ctx)
        for room in self._rooms.pop(ctx):
            in_room = self._by_room[room]
            in_room.discard(ctx)
            if not in_room:
                del self._by_room[room]
        self._aborted.discard(ctx)

    def abort(self, public_id: str | None) -> int:
        """Stop the request with exactly this id, or every one (``None``); how many it stopped.

        A request already ending (its client gone, the server shutting down,
        aborted before) is not stopped again, and not counted.
        """
        if public_id is None:
            targets = list(self._by_id.values())
        else:
            target = self._by_id.get(public_id)
            targets = [] if target is None else [target]
        stopped = [ctx for ctx in targets if not ctx.cancelled]
        for ctx in stopped:
            self._aborted.add(ctx)
            ctx.stop()
        return len(stopped)

    def stop_room(self, room: int) -> None:
        """The decode side of ``room`` aborted: stop the requests in it (a room is one
        request's, but nothing stops two clients from naming the same one)."""
        for ctx in list(self._by_room.get(room, ())):
            if not ctx.cancelled:
                self._aborted.add(ctx)
                ctx.stop()

    def aborted(self, ctx: RequestContext) -> bool:
        """Whether an abort stopped this request: ``/abort_request``, or its room's decode side."""
        return ctx in self._aborted

    def stop_all(self) -> None:
        """End every response being generated: the server is shutting down."""
        for ctx in list(self._by_id.values()):
            ctx.stop()


def abort_target(body: dict[str, Any]) -> str | None:
    """The id a ``/abort_request`` body names, ``None`` for all: SGLang's ``AbortReq``.

    ``{"rid": "<id>"}``, or ``{"abort_all": true}`` (which wins over a
    ``rid``, as in SGLang); SGLang's other fields are its internals, and ignored.
    SGLang ignores an empty ``rid`` silently; here it is a 400.
    """
    abort_all = body.get("abort_all")
    if not isinstance(abort_all, bool | None):
        raise HTTPError(400, "'abort_all' must be a bool", param="abort_all")
    if abort_all:
        return None
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise HTTPError(
            400,
            "'rid' must be the id of a request (or send \"abort_all\": true)",
            param="rid",
        )
    return rid


def bootstrap_rooms(body: dict[str, Any]) -> tuple[int, ...]:
    """The bootstrap rooms a checked request names: one, one per prompt of a batch, or none."""
    value = body.get("bootstrap_room")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
