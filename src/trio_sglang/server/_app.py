"""The ASGI application: one worker behind SGLang-native and OpenAI endpoints.

A response that is being generated always has a second task reading the
connection: hypercorn delivers ``http.disconnect`` the moment the client goes,
even while the response is idle between tokens, and that task turns it into
``ctx.kill()``. So a disconnect stops the request through the worker's
lifecycle at once, with no fixed delay. ``POST /abort_request`` reaches the
same lifecycle from another connection: it stops the context of the request
it names (``_inflight.py``), and that request's response ends as SGLang ends
an aborted one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from .._core._context import RequestContext
from .._core._disagg import PrefillPeer
from .._core._worker import PreparedRequest, ResponseStream, Worker
from .._engine import ChatTemplating
from .._errors import EngineError, EngineShutdown, InvalidRequest
from .._hosted_app import HostedApp
from .._kv_rooms import HostedKVRooms
from .._limits import ServerLimits
from .._phases import Phase
from .._protocol import ChatPlan, CompletionPlan, NativePlan, OpenAIPlan, Plan, sse_event
from ._admission import Admission, Refused
from ._asgi import (
    SSE_DONE,
    SSE_HEARTBEAT,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_json_within,
    send_early,
    send_json,
    send_sse,
    send_text,
    start_sse,
)
from ._connection import DropReason, current_connection
from ._hosted import HostedRoutes
from ._http_errors import HTTPError, error_body, method_not_allowed
from ._inflight import InFlight, abort_target, bootstrap_rooms
from ._kv_rooms_http import ROOMS_PATH, KVRoomsApp
from ._metrics import Outcome, ServerMetrics
from ._outbox import Heartbeats, Outbox

__all__ = ["ServerApp"]

logger = logging.getLogger("trio_sglang.server")

#: The routes ``serve`` answers itself in front of a hosted application: its
#: ``/abort_request`` by exact id, its metrics, its capabilities.
_OWN_ROUTES = frozenset({"/abort_request", "/metrics", "/capabilities"})

#: The model an OpenAI request names when it names none (SGLang's ``DEFAULT_MODEL_NAME``).
_SGLANG_DEFAULT_MODEL = "default"


class ServerApp:
    def __init__(
        self,
        worker: Worker,
        metrics: ServerMetrics,
        *,
        model: str | Sequence[str],
        limits: ServerLimits | None = None,
        kv_rooms: HostedKVRooms | None = None,
        prefill: PrefillPeer | None = None,
        enable_cache_report: bool = False,
        hosted: HostedApp | None = None,
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        #: The served model's names, the first one its own (``--served-model-name``, repeated).
        self.models = (model,) if isinstance(model, str) else tuple(model)
        if not self.models or not all(isinstance(name, str) and name for name in self.models):
            raise ValueError(f"model must be a name or names, got {model!r}")
        self.limits = ServerLimits() if limits is None else limits
        #: SGLang's ``--enable-cache-report``: OpenAI usage says how much of the prompt was cached.
        self.enable_cache_report = enable_cache_report
        self._admission = Admission(
            self.limits,
            metrics,
            context_length=worker.features.context_length,
            decode=worker.role == "decode",
            prefill=prefill,
            no_transfer_host=None if hosted is None else hosted.no_transfer_host,
        )
        self.created = int(time.time())
        #: What renders chat messages: the engine, if it knows its model's chat template.
        self._chat_template = worker.engine if isinstance(worker.engine, ChatTemplating) else None
        #: Run by the server for as long as it takes requests (``HTTPServer.run``).
        self.heartbeats = Heartbeats(
            self.limits.sse_heartbeat, self.limits.max_sse_heartbeats_per_second
        )
        self._closing = False
        self._inflight = InFlight()
        # A prefill server's bootstrap routes; served while it shuts down too,
        # so that the decode side's last abort notifications still land.
        self._rooms = (
            None
            if kv_rooms is None
            else KVRoomsApp(
                kv_rooms,
                read_timeout=self.limits.request_read_timeout,
                on_decode_aborted=self._inflight.stop_room,
            )
        )
        self._hosted_app = hosted
        #: The engine's own HTTP application (SGLang's server), which serves every route
        #: but ``_OWN_ROUTES``, its requests through the lifecycle (``_hosted.py``).
        self._hosted = (
            None
            if hosted is None
            else HostedRoutes(
                hosted,
                worker=worker,
                admission=self._admission,
                inflight=self._inflight,
                metrics=metrics,
                heartbeats=self.heartbeats,
                limits=self.limits,
                closing=lambda: self._closing,
            )
        )
        metrics.watch(worker)
        if kv_rooms is not None:
            metrics.watch_kv_rooms(kv_rooms)

    def close(self) -> None:
        """Stop taking requests and end every response being generated.

        Synchronous, for the signal handler; the streams end at once and
        their engine-side cleanup goes on in the worker.
        """
        self._closing = True
        self._inflight.stop_all()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # HTTP only: ``serve_http`` runs no ASGI lifespan (the worker is entered
        # around the server instead), and hypercorn's websockets are not routed.
        if scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        posts: dict[str, Callable[[dict[str, Any]], Plan]] = {
            "/generate": NativePlan.parse,
            "/v1/completions": lambda body: CompletionPlan.parse(body, self._model_of(body)),
            "/v1/chat/completions": lambda body: ChatPlan.parse(
                body, self._model_of(body), self._chat_template
            ),
        }
        gets: dict[str, Callable[[Send], Any]] = {
            "/health": self._health,
            "/v1/models": self._models,
            "/capabilities": self._capabilities,
            "/metrics": self._metrics,
            # What sglang-router asks a worker at registration (SGLang's names).
            "/server_info": self._server_info,
            "/get_server_info": self._server_info,
            "/model_info": self._model_info,
            "/get_model_info": self._model_info,
        }
        actions: dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            "/abort_request": self._abort_request,
        }
        rooms = self._rooms if path.startswith(ROOMS_PATH) else None
        try:
            # /health is for load balancers, which send no key; the rooms take the
            # key too (the decode side's HTTPKVRooms sends its own: a pair shares one).
            self._admission.check_access(scope, needs_key=path != "/health")
            if rooms is not None and method == "POST":  # a decode peer's events: JSON only
                self._admission.check_content_type(scope)
        except HTTPError as exc:
            await self._send_early(receive, send, exc)
            return
        allowed = ("POST",) if path in posts or path in actions else ("GET", "HEAD")
        if rooms is not None:
            await rooms(scope, receive, send)
        elif self._hosted is not None and path not in _OWN_ROUTES:
            if self._closing:  # a new request now would only wait for the engine's close
                await self._send_early(receive, send, _shutting_down())
            else:
                await self._hosted(scope, receive, send)
        elif path not in posts and path not in actions and path not in gets:
            await self._send_early(receive, send, HTTPError(404, f"no route {path}"))
        elif method not in allowed:
            await self._send_early(receive, send, method_not_allowed(method, path, allowed))
        elif path in posts:
            await self._generate(path, posts[path], scope, receive, send)
        elif path in actions:
            await actions[path](scope, receive, send)
        else:
            await gets[path](send)

    def _model_of(self, body: dict[str, Any]) -> str:
        """The model name a response carries: whichever the client sent, as SGLang does.

        SGLang 0.5.23 serves any ``model`` on its OpenAI routes: nothing checks
        the name (``OpenAIServingBase.handle_request``), it defaults to
        ``"default"`` (``CompletionRequest.model``, ``ChatCompletionRequest.model``
        in ``protocol.py``), and responses carry the name sent
        (``model=request.model`` in ``serving_completions.py`` and
        ``serving_chat.py``). Except ``name:adapter``, which asks for a LoRA
        adapter (``OpenAIServingBase._parse_model_parameter``): a server without
        LoRA refuses it (``TokenizerManager._validate_and_resolve_lora``), and
        this one has none.
        """
        model = body.get("model")
        if model is None:
            return _SGLANG_DEFAULT_MODEL
        if not isinstance(model, str):
            raise HTTPError(400, "'model' must be a string", param="model")
        adapter = _lora_adapter(model, self.models)
        if adapter is not None:
            raise HTTPError(
                400,
                f"LoRA adapter '{adapter}' was requested, but this server serves no "
                f"LoRA adapters; its models: {', '.join(self.models)}",
                code="model_not_found",
                param="model",
            )
        return model

    async def _health(self, send: Send) -> None:
        if self._closing:
            await send_json(send, 503, {"status": "shutting down"})
        else:
            await send_json(send, 200, {"status": "ok"})

    async def _models(self, send: Send) -> None:
        models = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "trio-sglang"}
            for name in self.models
        ]
        await send_json(send, 200, {"object": "list", "data": models})

    async def _server_info(self, send: Send) -> None:
        caps = self.worker.capabilities()
        await send_json(
            send,
            200,
            {
                "served_model_name": self.models[0],
                "model_path": self.models[0],
                "version": caps["engine"]["sglang_version"],
                "trio_sglang": caps["package"]["version"],
            },
        )

    async def _model_info(self, send: Send) -> None:
        await send_json(send, 200, {"model_path": self.models[0], "is_generation": True})

    async def _capabilities(self, send: Send) -> None:
        await send_json(send, 200, self.worker.capabilities())

    async def _metrics(self, send: Send) -> None:
        text = self.metrics.render()
        if self._hosted_app is not None and self._hosted_app.keeps_metrics:  # SGLang's own
            text += await trio.to_thread.run_sync(self._hosted_app.metrics)
        await send_text(send, 200, text.decode(), b"text/plain; version=0.0.4")

    async def _abort_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's ``POST /abort_request``, by exact public id (see ``_inflight.py``).

        SGLang answers 200 and no body, found or not (``abort_request`` in its
        ``http_server.py``); this answers 200 too, with what it stopped:
        ``{"found": bool, "aborted": count}``.
        """
        try:
            # JSON only, as for generation: a web page must not stop anyone's requests.
            self._admission.check_content_type(scope)
        except HTTPError as exc:
            await self._send_early(receive, send, exc)
            return
        try:
            target = abort_target(await self._read_body(scope, receive))
        except ClientGone:
            return
        except HTTPError as exc:
            await send_json(send, exc.status, exc.body(), exc.headers)
            return
        aborted = self._inflight.abort(target)
        await send_json(send, 200, {"found": aborted > 0, "aborted": aborted})

    # -- generation ----------------------------------------------------------

    async def _generate(
        self,
        endpoint: str,
        parse: Callable[[dict[str, Any]], Plan],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        try:
            self._admission.check_content_type(scope)
        except HTTPError as exc:
            self._count(endpoint, "rejected")
            await self._send_early(receive, send, exc)
            return
        try:
            body = await self._read_body(scope, receive)
            plan = parse(body)
            if isinstance(plan, OpenAIPlan):
                plan.cache_report = self.enable_cache_report
            # First the server's bounds, as SGLang refuses a request past its context
            # length before any field of it; then the worker checks it, once.
            children = self._admission.check_request(endpoint, body, plan.native)
            prepared = plan.prepare(self.worker)
            if self._closing:
                raise _shutting_down()
            self._admission.check_load(self._inflight.children, children)
            # Every request in flight holds a context, from here to its last byte.
            # A prefill server on hosted rooms finds the request by its room as well.
            rooms = () if self._rooms is None else bootstrap_rooms(plan.native)
            ctx = self._inflight.add(plan.public_id, children, rooms)
        except ClientGone:
            self._count(endpoint, "cancelled", phase="before_headers")
            return
        except InvalidRequest as exc:
            self._count(endpoint, "rejected")
            await send_json(send, 400, error_body(str(exc), param=exc.param))
            return
        except HTTPError as exc:
            self._count(endpoint, "rejected")
            await send_json(send, exc.status, exc.body(), exc.headers)
            return
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, ctx)
                outcome = await self._respond(plan, prepared, ctx, send)
                nursery.cancel_scope.cancel()
        finally:
            self._inflight.discard(ctx)
        phase: Phase | None = None
        if outcome == "cancelled":
            phase = "mid_stream" if plan.children else "before_first_token"
        self._count(endpoint, outcome, phase=phase)

    async def _send_early(self, receive: Receive, send: Send, error: HTTPError) -> None:
        """``error``, answered before the body was read (see ``send_early``)."""
        seconds = self.limits.request_read_timeout
        refusal = isinstance(error, Refused)
        await send_early(
            receive, send, seconds, error.status, error.body(), error.headers, refusal=refusal
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        limits = self.limits
        return await read_json_within(
            scope, receive, limits.max_body_bytes, limits.request_read_timeout
        )

    async def _watch_disconnect(self, receive: Receive, ctx: RequestContext) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        ctx.kill()

    async def _respond(
        self, plan: Plan, prepared: PreparedRequest, ctx: RequestContext, send: Send
    ) -> Outcome:
        """Generate and answer; every failure becomes a response, never an exception."""
        started = False
        try:
            async with self.worker.generate(prepared, ctx, output="native") as chunks:
                if plan.stream:
                    await start_sse(send)
                    started = True
                    await self._stream(plan, chunks, ctx, send)
                else:
                    async for out in chunks:
                        plan.add(out)
        except InvalidRequest as exc:
            await send_json(send, 400, error_body(str(exc), param=exc.param))
            return "rejected"
        except EngineShutdown:
            await self._fail(send, started, _shutting_down())
            return "shutdown"
        except EngineError as exc:  # already logged once by the worker, with its ids
            await self._fail(
                send, started, HTTPError(502, str(exc), kind="server_error", code="engine_error")
            )
            return "failed"
        except Exception:
            logger.exception("request %s failed", plan.public_id)
            await self._fail(
                send, started, HTTPError(500, "internal server error", kind="server_error")
            )
            return "failed"
        if ctx.killed:
            return "cancelled"  # the client is gone: nothing more to send
        aborted = self._inflight.aborted(ctx)
        if ctx.stopped and not aborted:
            await self._fail(send, started, _shutting_down())
            return "shutdown"
        if aborted:
            # As SGLang ends a request /abort_request stopped: each unfinished
            # child's last output, finish reason "abort", then the usual end.
            ends = plan.aborted_outputs(ctx.id)
            if plan.stream:
                if not started:
                    await start_sse(send)
                await send_sse(send, self._render(plan, ends))
            else:
                for out in ends:
                    plan.add(out)
        if plan.stream:
            for event in plan.closing_events():
                await send_sse(send, sse_event(event))
            await send_sse(send, SSE_DONE, more=False)
        else:
            await send_json(send, 200, plan.body())
        return "aborted" if aborted else "completed"

    async def _stream(
        self, plan: Plan, chunks: ResponseStream, ctx: RequestContext, send: Send
    ) -> None:
        """Send the outputs as SSE events at the client's pace; see ``Outbox``.

        The engine is read by a task of its own, so that a client that is slow
        to take its bytes never leaves outputs piling up at the engine: they
        wait in the outbox, coalesced, within its bound. A client that takes no
        bytes within the stall timeout, or falls behind past the bound, is gone.
        While there is nothing to send (before the first token, in a long gap),
        a heartbeat goes out every ``sse_heartbeat`` (``Heartbeats``; less often
        past ``max_sse_heartbeats_per_second`` in all): a proxy that only
        notices a gone client when it writes to it (sglang-router) notices
        within that.
        """
        outbox = Outbox(self.limits.max_unsent_tokens)
        # Under ``serve`` the connection bounds every write: at the socket, and
        # over HTTP/2 at the stream's flow-control window too (``BoundedH2``).
        # Any other ASGI server gets the bound here.
        bound_here = current_connection() is None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_engine, chunks, outbox, ctx)
            with self.heartbeats.watching(outbox):
                while (held := await outbox.take()) != []:
                    payload = SSE_HEARTBEAT if held is None else self._render(plan, held)
                    if not bound_here:
                        await send_sse(send, payload)
                        continue
                    with trio.move_on_after(self.limits.client_stall_timeout) as bound:
                        await send_sse(send, payload)
                    if bound.cancelled_caught:
                        _drop_client(ctx, "stalled")
                        break
            nursery.cancel_scope.cancel()
        if outbox.error is not None:  # raised here, not in the nursery: as itself, not a group
            raise outbox.error

    @staticmethod
    def _render(plan: Plan, held: list[dict[str, Any]]) -> bytes:
        return b"".join([plan.sse(plan.add(out)[0], out) for out in held])

    @staticmethod
    async def _read_engine(chunks: ResponseStream, outbox: Outbox, ctx: RequestContext) -> None:
        try:
            async for out in chunks:
                outbox.put(out)
                if outbox.behind:
                    _drop_client(ctx, "behind")
        except Exception as exc:  # raised by the sender, once it has sent what came before
            outbox.close(exc)
        else:
            outbox.close()

    async def _fail(self, send: Send, started: bool, error: HTTPError) -> None:
        """The error as the response, or, once a stream has started, as its last event."""
        if not started:
            await send_json(send, error.status, error.body(), error.headers)
            return
        await send_sse(send, sse_event(error.body()))
        await send_sse(send, SSE_DONE, more=False)

    def _count(self, endpoint: str, outcome: Outcome, *, phase: Phase | None = None) -> None:
        self.metrics.requests.labels(endpoint, outcome).inc()
        if phase is not None:
            self.metrics.cancellations.labels(phase).inc()


def _lora_adapter(model: str, names: Sequence[str]) -> str | None:
    """The LoRA adapter ``model`` asks for (``name:adapter``), read as SGLang reads it.

    SGLang's ``_parse_model_parameter``: a served name is never split, even
    with a colon in it; after a served name and a colon comes the adapter;
    otherwise after the first colon. An empty adapter is none.
    """
    if ":" not in model or model in names:
        return None
    served = next((name for name in names if model.startswith(f"{name}:")), None)
    adapter = model[len(served) + 1 :] if served is not None else model.split(":", 1)[1]
    return adapter.strip() or None


def _shutting_down() -> HTTPError:
    return HTTPError(503, "the server is shutting down", kind="server_error", code="shutting_down")


def _drop_client(ctx: RequestContext, reason: DropReason) -> None:
    """The client is gone, though connected: stop its request and reset its connection.

    Over HTTP/2 only the request stops: its stream ends with the handler, and
    the connection's other streams, which may be other users', go on.
    """
    ctx.kill()
    connection = current_connection()
    if connection is not None and connection.http1:
        connection.drop(reason)
