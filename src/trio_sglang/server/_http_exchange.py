"""``HTTPExchange``: the engine requests one HTTP request to the hosted app starts.

The hosted application (SGLang's own server, ``_hosted_app.py``) builds each
engine request; this starts it through the worker's lifecycle, in a task of
the HTTP request's own nursery, and hands its outputs over one at a time
(a ``Handoff``, which the route on the asyncio side reads without a
trio task per output: while the route is busy sending, one output waits
there and the rest in SGLang's TokenizerManager, which merges a backlog as
it does for its own server). Each request is in flight under its public id
(``InFlight``: ``/abort_request`` finds it) from its start to the end of
the HTTP request, and is admitted as ``serve``'s own routes admit theirs: the
server's limit of engine requests in flight, its shutdown, an id in flight.

The exchange ends with its HTTP request: a client that left ends every
request it started (``leave``), and whatever is still running when the
route has answered stops with the nursery.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

import trio

from .._asyncio_bridge._handoff import Handoff
from .._core._context import RequestContext
from .._core._outputs import PublicIds
from .._core._worker import PreparedRequest, Worker
from .._errors import EngineError, EngineShutdown
from .._hosted_app import FeedEnd, HTTPRefusal
from ._admission import Admission
from ._asgi import Scope
from ._http_errors import HTTPError
from ._inflight import InFlight

__all__ = ["HTTPExchange"]


class _Feed:
    """One engine request's outputs, from the lifecycle's task to the hosted route."""

    def __init__(self, ids: PublicIds) -> None:
        self.outputs: Handoff[dict[str, Any]] = Handoff()
        self.ids = ids.children or (ids.request,)
        self.single = not ids.children
        self.end: FeedEnd | None = None
        self.error: Exception | None = None
        #: Whether any output reached the route (the phase a leaving client is counted in).
        self.delivered = False

    async def receive(self) -> dict[str, Any]:
        out = await self.outputs.receive()
        self.delivered = True
        return out

    def receive_nowait(self) -> dict[str, Any]:
        out = self.outputs.receive_nowait()
        self.delivered = True
        return out

    def when_changed(self, callback: Callable[[], None]) -> None:
        self.outputs.when_changed(callback)


class HTTPExchange:
    """The engine requests of one HTTP request to the hosted app; see the module."""

    def __init__(
        self,
        nursery: trio.Nursery,
        scope: Scope,
        worker: Worker,
        admission: Admission,
        inflight: InFlight,
        closing: Callable[[], bool],
    ) -> None:
        self._nursery = nursery
        self._scope = scope
        self._worker = worker
        self._admission = admission
        self._inflight = inflight
        self._closing = closing
        self._contexts: list[RequestContext] = []
        self.feeds: list[_Feed] = []
        #: The client left: every request ends, and none starts.
        self.left = False

    async def start(self, request: Mapping[str, Any]) -> _Feed:
        await trio.lowlevel.checkpoint()
        try:
            # A web page's form cannot make the engine generate: JSON bodies only (a
            # GET starts SGLang's own requests, its health check's one token).
            if self._scope["method"] not in ("GET", "HEAD"):
                self._admission.check_content_type(self._scope)
            # The server's bounds first, as for its own routes; then the worker's checks.
            self._admission.check_request("/generate", request, request)
        except HTTPError as exc:
            raise _refusal(exc) from None
        prepared = self._worker.prepare(request, "native")  # InvalidRequest: the route's 400
        parsed = prepared.parsed
        if self._closing():
            raise HTTPRefusal(503, "the server is shutting down")
        try:
            self._admission.check_load(self._inflight.children, parsed.children)
            # SGLang names a request by the rid it was given, or a fresh uuid.
            rid = parsed.caller_rid if isinstance(parsed.caller_rid, str) else uuid.uuid4().hex
            ctx = self._inflight.add(rid, parsed.children)
        except HTTPError as exc:
            raise _refusal(exc) from None
        self._contexts.append(ctx)
        if self.left:
            ctx.kill()
        feed = _Feed(PublicIds.for_request(parsed, ctx.id))
        self.feeds.append(feed)
        self._nursery.start_soon(self._run, prepared, ctx, feed)
        return feed

    async def _run(
        self,
        prepared: PreparedRequest,
        ctx: RequestContext,
        feed: _Feed,
    ) -> None:
        end: FeedEnd = "left"  # unless it gets further: cancelled with its HTTP request
        try:
            async with self._worker.generate(prepared, ctx, output="native") as chunks:
                async for out in chunks:
                    # The route has nearly always taken the last output: this hands
                    # the next one over without a second schedule point (each pull is one).
                    try:
                        feed.outputs.send_nowait(out)
                    except trio.WouldBlock:
                        await feed.outputs.send(out)
            end = "finished"
        except EngineShutdown:
            end = "shutdown"
        except EngineError as exc:  # already logged once by the worker, with its ids
            end, feed.error = "failed", exc
        finally:
            if ctx.killed:
                end = "left"
            elif ctx.stopped:
                end = "aborted" if self._inflight.aborted(ctx) else "shutdown"
            feed.end = end
            feed.outputs.close()  # once ``end`` is set: the route reads it at the end

    def leave(self) -> None:
        """The client is gone: every request it started stops, and no other starts."""
        self.left = True
        for ctx in self._contexts:
            ctx.kill()

    def cancel(self) -> None:
        """End the HTTP request's task group: the route, and what runs for it, stop now."""
        self._nursery.cancel_scope.cancel()

    def close(self) -> None:
        """The HTTP request is over: its requests are no longer in flight."""
        for ctx in self._contexts:
            self._inflight.discard(ctx)
        self._contexts.clear()


def _refusal(error: HTTPError) -> HTTPRefusal:
    headers = {name.decode(): value.decode() for name, value in error.headers}
    return HTTPRefusal(error.status, error.message, headers)
