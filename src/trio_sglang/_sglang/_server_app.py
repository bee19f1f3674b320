"""SGLang's own HTTP server application, run by ``serve --engine sglang`` over the lifecycle.

SGLang's server is its FastAPI ``app`` (``sglang.srt.entrypoints.http_server``):
every route, its request models and their validation, the chat template,
tool-call and reasoning parsers, usage, error bodies. Rather than write that
again, ``serve`` runs the installed release's ``app`` itself, on the
engine's asyncio loop (``SGLangEngine.asyncio_side``), with SGLang's own
start-up (its ``lifespan``: the ``OpenAIServing*`` objects, the warm-up
request) and one change: the TokenizerManager its routes see
(``_LifecycleTokenizerManager``) is SGLang's own, but for
``generate_request``, which starts the request through the worker's
lifecycle (the HTTP request's ``Exchange``, ``_hosted_app.py``) and hands
back what the engine streamed, in the form SGLang's routes expect of their
TokenizerManager. Everything else (``abort_request``, ``flush_cache``,
the registry, ``server_args``) is SGLang's TokenizerManager's, untouched.

What the lifecycle hands over differs from what the TokenizerManager yields
in three ways, each undone here:

- its outputs are incremental (``SGLangEngine``); unless the server streams
  incrementally (``--incremental-streaming-output``), SGLang's routes expect
  the text and token ids so far in each, and get them;
- the engine always streams; a request that did not ask to stream gets its
  one final output (a list of them, in order, for a batch or ``n > 1``), as
  the TokenizerManager gives it;
- ``/abort_request`` (trio-sglang's, by exact id) ends a feed without an
  output; each unfinished child then gets its last output with SGLang's
  abort finish reason, as SGLang's own abort would end it.

A request the worker refuses is a ``ValueError`` (SGLang's routes answer
400 with its message), one the server turns away an ``HTTPException`` with its
status (503 with ``Retry-After`` when it is at its limit), and one that is not
generation (an ``EmbeddingReqInput``) a 501: the lifecycle runs generation only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import threading
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from .._asyncio_bridge._asyncio_side import TrioCalls
from .._asyncio_bridge._handoff import Handoff, aio_receive, aio_send
from .._errors import InvalidRequest
from .._hosted_app import (
    EXCHANGE_KEY,
    SEND_NOW_KEY,
    Exchange,
    Feed,
    HostedApp,
    HTTPRefusal,
    SendNow,
)
from .._increments import IncrementQueue
from ._semantics import streams_increments

__all__ = ["hosted_sglang_app"]

logger = logging.getLogger("trio_sglang.server")

#: SGLang's words for a request its ``/abort_request`` stopped (``FINISH_ABORT``).
_ABORTED = {"type": "abort", "message": "Aborted by AbortReq.", "status_code": None}
#: Fields SGLang's HTTP server stamps, which the worker refuses from a client: the
#: TokenizerManager stamps ``received_time`` itself when it is missing.
_STAMPED = ("received_time",)
#: A 501's words, for what SGLang's server runs that the lifecycle cannot.
_NOT_SERVED = (
    "trio-sglang serve does not serve {} (embeddings, classification, rerank, scores): "
    "its lifecycle runs generation requests only"
)
#: Seconds SGLang's lifespan may take to end (it joins its warm-up thread).
_LIFESPAN_EXIT = 10.0
#: Where the ``TrioCalls`` of an HTTP request are, in the scope SGLang's app gets.
TRIO_CALLS_KEY = "trio_sglang.trio_calls"
#: The ASGI version the hosted app is told (2.4: a response's ``send`` raises
#: ``OSError`` once the client is gone), so that Starlette streams a response
#: without a task of its own waiting on ``receive`` for the client to leave:
#: ``serve`` ends the request when the client leaves.
_ASGI = {"version": "3.0", "spec_version": "2.4"}


@asynccontextmanager
async def hosted_sglang_app(
    engine: Any, served_at: Callable[[], str | None]
) -> AsyncIterator[HostedApp]:
    """SGLang's ``app`` over ``engine`` (a running ``SGLangEngine``), for the block.

    SGLang's code runs on the engine's asyncio loop (``asyncio_side``).
    ``served_at()`` is the URL the server listens on, once it does:
    SGLang's warm-up request (unless ``--skip-server-warmup``) waits for it
    and goes there, as SGLang's server sends its own to itself.
    """
    http_server = await trio.to_thread.run_sync(_import_http_server)
    tm = engine.tokenizer_manager
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=_LifecycleTokenizerManager(tm),
            template_manager=engine.template_manager,
            scheduler_info=_scheduler_info(engine.sglang_engine),
        )
    )
    app = http_server.app
    # As SGLang's launch_server sets them for its lifespan, in its one-tokenizer mode.
    app.is_single_tokenizer_mode = True
    app.server_args = tm.server_args
    stopping = threading.Event()
    app.warmup_thread_kwargs = {
        "server_args": tm.server_args,
        "execute_warmup_func": _warm_up_at(tm, served_at, stopping),
    }
    side = engine.asyncio_side
    lifespan = app.router.lifespan_context(app)
    await side.call(lifespan.__aenter__)
    try:
        yield _SGLangApp(
            partial(side.call, app),
            bool(tm.server_args.enable_metrics),
            http_server.FAKE_BOOTSTRAP_HOST,
        )
    finally:
        # SGLang's lifespan joins the warm-up thread, blocking: by now the server has
        # stopped listening, so a warm-up request in flight has failed, and one not
        # sent yet stops waiting for the URL.
        stopping.set()
        with trio.move_on_after(_LIFESPAN_EXIT, shield=True):
            await side.call(lifespan.__aexit__, None, None, None)


class _SGLangApp:
    """SGLang's ``app`` as a trio ASGI application, and its ``sglang:*`` metrics."""

    def __init__(
        self, run_app: Callable[..., Any], enable_metrics: bool, no_transfer_host: str
    ) -> None:
        self._run_app = run_app
        self.keeps_metrics = enable_metrics
        self.no_transfer_host: str | None = no_transfer_host

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # SGLang's app runs on asyncio, and calls back into trio for the connection:
        # the request's body and its start through the request's TrioCalls (a task
        # each, cancelled when the app returns), each message of its response written
        # at once where it can be, else through a handoff.
        sender = _Sender(scope.get(SEND_NOW_KEY))
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.send_all, send)
            async with trio.open_nursery() as calls:
                in_trio = TrioCalls(calls)
                scope = {**scope, "asgi": dict(_ASGI), TRIO_CALLS_KEY: in_trio}
                try:
                    await self._run_app(scope, partial(in_trio, receive), sender)
                except Exception as exc:  # raised as itself, once what was handed over is sent
                    failure = exc
                finally:
                    sender.outbox.close()
                    calls.cancel_scope.cancel()
        if failure is None:
            failure = sender.error  # a failed send the app did not meet: not lost
        if failure is not None:
            raise failure

    def metrics(self) -> bytes:
        """SGLang's metrics with ``--enable-metrics``, as its ``/metrics`` would show them.

        SGLang's processes write theirs to ``PROMETHEUS_MULTIPROC_DIR``, which
        its ``/metrics`` reads (``add_prometheus_middleware``); the
        TokenizerManager's, kept in this process in prometheus_client's own
        registry (it was imported before SGLang set the folder), are added to them.
        """
        from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess

        processes = CollectorRegistry()
        collect_files: Any = multiprocess.MultiProcessCollector  # untyped in prometheus_client
        collect_files(processes)
        families = list(processes.collect())
        shown = {family.name for family in families}
        families += [
            family
            for family in REGISTRY.collect()
            if family.name.startswith("sglang:") and family.name not in shown
        ]
        exposed = CollectorRegistry()
        exposed.register(_Families(families))
        return generate_latest(exposed)


class _Families:
    """Metric families already collected, as a collector (each name once)."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> Any:
        return iter(self._families)


class _Sender:
    """The hosted app's ``send``: each message written at once, or handed to a trio task.

    A chunk of a streamed body goes out at once (``send_now``, the server's
    ``SendNow``) when the socket takes it and nothing handed over before it
    is still unsent; every other message is handed to a trio task, which
    sends them in order. The app goes on while its last message is being
    written, as on uvicorn, and waits only while the one before is not taken
    yet. A message that cannot be sent fails the app's next ``send``, with
    the error as its cause.
    """

    def __init__(self, send_now: SendNow | None) -> None:
        self.outbox: Handoff[Any] = Handoff()
        self.error: Exception | None = None
        self._send_now = send_now
        #: Messages handed over and not sent yet (or not sent at all: a send failed).
        self._unsent = 0

    async def __call__(self, message: Any) -> None:
        """asyncio: write ``message``, or hand it over."""
        if self._unsent == 0 and self._send_now is not None and self._send_now(message):
            return
        self._unsent += 1
        try:
            await aio_send(self.outbox, message)
        except trio.ClosedResourceError:
            error, self.error = self.error, None  # the app has it now
            raise OSError("the response could not be sent") from error
        except BaseException:  # cancelled: never handed over
            self._unsent -= 1
            raise

    async def send_all(self, send: Callable[[Any], Awaitable[None]]) -> None:
        """trio: send every message handed over, until the outbox closes or a send fails."""
        while True:
            try:
                message = await self.outbox.receive()
            except trio.EndOfChannel:
                return
            try:
                await send(message)
            except Exception as exc:
                self.error = exc
                self.outbox.close()
                return
            self._unsent -= 1


def _import_http_server() -> Any:
    """SGLang's server module, imported in a thread: its imports set uvloop's loop policy."""
    from sglang.srt.entrypoints import http_server

    return http_server


def _scheduler_info(sglang_engine: Any) -> dict[str, Any]:
    """What the scheduler told the engine at start (``/get_server_info`` reports it)."""
    result = getattr(sglang_engine, "_scheduler_init_result", None)  # 0.5.20 and newer
    if result is not None:
        return dict(result.scheduler_infos[0])
    return dict(getattr(sglang_engine, "scheduler_info", None) or {})


def _warm_up_at(
    tm: Any, served_at: Callable[[], str | None], stopping: threading.Event
) -> Callable[[Any], bool]:
    """SGLang's warm-up, sent to the URL this server listens on once it does.

    SGLang's server warms itself up with one ``/generate`` request to itself
    and reports healthy only after it (``/health`` is 503 until then). Its own
    warm-up (``_execute_server_warmup``) also kills the whole process tree
    when the request fails, which an embedding program must not meet; this
    sends SGLang's request and marks the server unhealthy instead; for a
    prefill or decode server, SGLang's disaggregation warm-up request, whose
    fake bootstrap host makes the engine skip the KV transfer. The wait for
    the URL ends when the server stops.
    """
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    def warm_up(server_args: Any) -> bool:
        while (url := served_at()) is None:
            if stopping.wait(0.05):
                return False
        body: dict[str, Any] = {
            "text": "The capital city of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        }
        if server_args.disaggregation_mode in ("prefill", "decode"):
            body = {
                "input_ids": [10, 11, 12, 13],
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
                "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                "bootstrap_room": 0,
            }
        headers = {"Content-Type": "application/json"}
        if server_args.api_key:
            headers["Authorization"] = f"Bearer {server_args.api_key}"
        request = urllib.request.Request(
            f"{url}/generate", json.dumps(body).encode(), headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as answer:
                ok = bool(answer.status == 200)
        except OSError:  # urllib's errors, a refused or reset connection, a timeout
            ok = False
        tm.server_status = ServerStatus.Up if ok else ServerStatus.UnHealthy
        if not ok and not stopping.is_set():
            logger.error("SGLang's warm-up request to %s failed: the server reports unhealthy", url)
        return ok

    return warm_up


class _LifecycleTokenizerManager:
    """SGLang's TokenizerManager as its routes see it: ``generate_request`` on the lifecycle."""

    __slots__ = ("_tm",)

    def __init__(self, tm: Any) -> None:
        object.__setattr__(self, "_tm", tm)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tm, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tm, name, value)  # SGLang's server sets server_status, for one

    def create_abort_task(self, obj: Any) -> None:
        """No background abort after a response: the lifecycle has stopped the request."""
        return None

    async def score_request(self, *args: Any, **kwargs: Any) -> Any:
        """Scoring (``/v1/score``, ``/v1/rerank`` of a generation model) runs around the
        lifecycle in SGLang's TokenizerManager: refused, not run unmanaged."""
        from fastapi import HTTPException

        raise HTTPException(501, _NOT_SERVED.format("scoring requests"))

    score_prompts = score_request

    async def generate_request(self, obj: Any, request: Any = None) -> AsyncIterator[Any]:
        from fastapi import HTTPException
        from sglang.srt.managers.io_struct import GenerateReqInput

        scope = getattr(request, "scope", {})
        exchange, in_trio = scope.get(EXCHANGE_KEY), scope.get(TRIO_CALLS_KEY)
        if not isinstance(exchange, Exchange) or not isinstance(in_trio, TrioCalls):
            raise RuntimeError("an SGLang route started a request outside an HTTP request")
        if not isinstance(obj, GenerateReqInput):
            # Embeddings, classification, rerank: the lifecycle runs generation only.
            raise HTTPException(501, _NOT_SERVED.format(f"{type(obj).__name__} requests"))
        # SGLang's own first check of a request, in its words (the TokenizerManager's
        # first step), on a copy: the worker's checks come after it.
        copy.deepcopy(obj).normalize_batch_and_arguments()
        try:
            feed = await in_trio(exchange.start, _body_of(obj))
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from exc
        except HTTPRefusal as exc:
            if exc.status == 400:  # the checks SGLang makes too, in its words: as its own
                raise ValueError(str(exc)) from exc
            raise HTTPException(exc.status, str(exc), headers=exc.headers) from exc
        incremental = streams_increments(self._tm)
        outputs = _Outputs(feed, incremental=incremental)
        while True:
            try:
                out = await aio_receive(feed)
            except trio.EndOfChannel:
                break
            if obj.stream:
                yield outputs.streamed(out)
            else:
                outputs.held(out)
        # A stream's error is a ValueError, which SGLang's routes send as the stream's
        # last event; before a response, an HTTPException is its status.
        if feed.end == "failed":
            refusal = feed.error.__cause__ if feed.error is not None else None
            if isinstance(refusal, ValueError):  # the TokenizerManager's own: SGLang's 400
                raise refusal
            if obj.stream:
                raise ValueError(f"the engine failed: {feed.error}")
            raise HTTPException(502, f"the engine failed: {feed.error}")
        if feed.end == "shutdown":
            if obj.stream:
                raise ValueError("the server is shutting down")
            raise HTTPException(503, "the server is shutting down")
        ends = outputs.aborted() if feed.end == "aborted" else []
        if obj.stream:
            for out in ends:
                yield outputs.streamed(out)
            return
        for out in ends:
            outputs.held(out)
        final = outputs.final()
        yield final[0] if feed.single else final


def _body_of(obj: Any) -> dict[str, Any]:
    """The ``/generate`` body of a ``GenerateReqInput`` SGLang's route built: its set fields."""
    body = {}
    for field in dataclasses.fields(obj):
        if field.name in _STAMPED:
            continue
        value = getattr(obj, field.name)
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            body[field.name] = value
            continue
        if value != default:
            body[field.name] = value
    return body


class _Outputs:
    """One feed's outputs in the form SGLang's routes expect of its TokenizerManager."""

    def __init__(self, feed: Feed, *, incremental: bool) -> None:
        self._feed = feed
        self._incremental = incremental
        #: Per child (output ``index``): its text and token ids so far, its last output.
        self._text: dict[int, str] = {}
        self._ids: dict[int, list[int]] = {}
        self._last: dict[int, dict[str, Any]] = {}
        self._merged = IncrementQueue()

    def streamed(self, out: dict[str, Any]) -> dict[str, Any]:
        index = out.get("index", 0)
        self._last[index] = out
        if self._incremental:
            return out
        text = self._text[index] = self._text.get(index, "") + (out.get("text") or "")
        ids = self._ids[index] = self._ids.get(index, []) + list(out.get("output_ids") or ())
        return {**out, "text": text, "output_ids": ids}

    def held(self, out: dict[str, Any]) -> None:
        """An output of a request that did not ask to stream: kept for ``final``."""
        if self._incremental:  # every per-token list is a delta: merged as SGLang merges them
            self._last[out.get("index", 0)] = out
            self._merged.put(out)
        else:
            self.streamed(out)

    def final(self) -> list[dict[str, Any]]:
        """Each child's whole output, in order, without the ``index`` only streams carry."""
        if self._incremental:
            merged = self._merged.take_all()
        else:
            merged = [
                {**out, "text": self._text.get(i, ""), "output_ids": self._ids.get(i, [])}
                for i, out in self._last.items()
            ]
        merged.sort(key=lambda out: int(out.get("index", 0)))
        return [{key: value for key, value in out.items() if key != "index"} for out in merged]

    def aborted(self) -> list[dict[str, Any]]:
        """The last output (a delta) of each child not finished, as SGLang ends an aborted one."""
        ends = []
        for index, public_id in enumerate(self._feed.ids):
            last = self._last.get(index)
            meta: Mapping[str, Any] = {} if last is None else last.get("meta_info", {})
            if meta.get("finish_reason") is not None:
                continue
            out: dict[str, Any] = {
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "completion_tokens": 0,
                    **meta,
                    "id": public_id,
                    "finish_reason": dict(_ABORTED),
                },
            }
            if not self._feed.single:
                out["index"] = index
            ends.append(out)
        return ends
