"""The endpoint's handler: each Dynamo request becomes a trio task under the worker.

The runtime calls ``RequestBridge.generate`` on its asyncio loop for each
request and iterates what it yields. That generator only starts the
request's trio task (``TrioToken.run_sync_soon``) and passes on the chunks
the task hands it (``Exchange``). The request itself, from validation to the
engine's cleanup, runs in trio through ``Worker.generate``, in a nursery the
bridge's owner gives it. The input mode (``TOKENS``, or ``text_mode``) says
what a request becomes and what its chunks look like; nothing else differs.

Cancellation takes no polling. Dynamo's stop and kill resolve the context's
``async_killed_or_stopped()`` future; its done-callback becomes
``ctx.stop()`` or ``ctx.kill()`` in the trio run at once. A generator the
runtime closes (its consumer went away, ``GeneratorExit``) is a kill too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Literal, Protocol

import trio

from .._core._context import RequestContext
from .._core._drain import Drain
from .._core._worker import Worker
from .._errors import EngineError, EngineShutdown, InvalidRequest
from ._exchange import Exchange
from ._mapping import TOKENS
from ._translation import InputMode

__all__ = ["DynamoContext", "RequestBridge", "RequestsObserver"]

logger = logging.getLogger("trio_sglang.dynamo")

Outcome = Literal["completed", "cancelled", "rejected", "failed", "shutdown"]


class DynamoContext(Protocol):
    """What the bridge uses of the runtime's per-request ``Context``."""

    def id(self) -> str: ...
    def is_killed(self) -> bool: ...
    def async_killed_or_stopped(self) -> asyncio.Future[bool]: ...


class RequestsObserver(Protocol):
    """Hears how each request ended (the worker's metrics)."""

    def request_ended(self, outcome: Outcome, *, tokens_sent: bool) -> None: ...


class RequestBridge:
    """Runs each request in ``nursery`` until ``close()``; ``generate`` is the handler."""

    def __init__(
        self,
        worker: Worker,
        nursery: trio.Nursery,
        loop: asyncio.AbstractEventLoop,
        observer: RequestsObserver | None = None,
        mode: InputMode = TOKENS,
    ) -> None:
        self._worker = worker
        self._nursery = nursery
        self._loop = loop
        self._observer = observer
        self._mode = mode
        self._token = trio.lowlevel.current_trio_token()
        #: The requests whose trio task is running.
        self._requests: Drain[RequestContext] = Drain()

    def close(self) -> None:
        """Take no more requests: a late one ends at once with ``EngineShutdown``."""
        self._requests.close()

    def hurry(self) -> None:
        """End ``drain``'s grace now (a second signal)."""
        self._requests.hurry()

    async def drain(self, deadline: float) -> int:
        """Wait for open requests until ``deadline`` (trio clock); how many are still open."""
        await self._requests.wait(deadline)
        return len(self._requests)

    async def wait_idle(self) -> None:
        """Return once no request is open (at once if none is)."""
        await self._requests.wait(math.inf)

    # -- the asyncio side -----------------------------------------------------

    async def generate(
        self, request: Mapping[str, Any], context: DynamoContext
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Dynamo's handler: the request's chunks, as Dynamo's own SGLang worker yields them."""
        exchange = Exchange(self._loop, self._mode.merge)
        ctx = RequestContext(context.id())
        self._token.run_sync_soon(self._start, request, ctx, exchange)
        signal = context.async_killed_or_stopped()
        signal.add_done_callback(lambda done: self._on_signal(done, ctx, context))
        refusal: Exception | None = None
        try:
            while (chunk := await exchange.get()) is not None:
                yield chunk
        except (InvalidRequest, EngineShutdown, EngineError) as exc:
            refusal = _as_dynamo(exc)
        finally:
            # The runtime may drop this generator unfinished, from one of its
            # own threads: its finalization then runs this block there, out of
            # any event loop. So both calls here are thread-safe ones.
            if not exchange.ended:  # closed by the runtime: nobody reads any more
                self._to_trio(ctx.kill)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to stop
                # The request is over: stop watching (a no-op once fired).
                self._loop.call_soon_threadsafe(signal.cancel)
        if refusal is not None:
            # The runtime prints every exception a handler raises, with its
            # traceback and its chain (``PyErr::display``). A refusal is
            # routine, and an engine fault is already logged, with its
            # traceback, by the worker: so the error goes out with neither,
            # and the runtime prints it as one line. Raised here, past the
            # ``except``, it has no context; a bare re-raise adds no frame.
            try:
                raise refusal
            except Exception:
                refusal.__traceback__ = None
                raise

    def _on_signal(
        self, done: asyncio.Future[bool], ctx: RequestContext, context: DynamoContext
    ) -> None:
        if not done.cancelled():
            self._to_trio(ctx.kill if context.is_killed() else ctx.stop)

    def _to_trio(self, call: Any) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the worker is gone, its requests too
            self._token.run_sync_soon(call)

    # -- the trio side --------------------------------------------------------

    def _start(self, request: Mapping[str, Any], ctx: RequestContext, exchange: Exchange) -> None:
        if self._requests.closed:
            exchange.end(EngineShutdown("the worker is shutting down"))
            return
        self._requests.add(ctx)
        self._nursery.start_soon(self._serve, request, ctx, exchange)

    async def _serve(
        self, request: Mapping[str, Any], ctx: RequestContext, exchange: Exchange
    ) -> None:
        outcome: Outcome = "shutdown"  # unless it gets further: cancelled by the nursery
        sent = False
        try:
            served = self._mode.translate(request)
            prepared = self._worker.prepare(served.body, served.output, names=served.names)
            async with self._worker.generate(prepared, ctx, output=served.output) as stream:
                async for out in stream:
                    chunk = served.chunk(out)
                    if chunk is not None:
                        sent = True
                        exchange.put(chunk)
            for chunk in served.closing():
                exchange.put(chunk)
            outcome = "cancelled" if ctx.cancelled else "completed"
            exchange.end()
        except InvalidRequest as exc:
            outcome = "rejected"
            exchange.end(exc)
        except EngineShutdown as exc:
            exchange.end(exc)
        except EngineError as exc:
            outcome = "failed"
            exchange.end(exc)
        finally:
            exchange.end(EngineShutdown("the worker stopped while the request was open"))
            self._requests.discard(ctx)
            if self._observer is not None:
                self._observer.request_ended(outcome, tokens_sent=sent)


def _as_dynamo(exc: InvalidRequest | EngineShutdown | EngineError) -> Exception:
    """The runtime's own error for ours, so that its frontend answers the client rightly."""
    from dynamo.llm.exceptions import EngineShutdown as Shutdown
    from dynamo.llm.exceptions import HttpError, InvalidArgument

    error: Exception
    if isinstance(exc, InvalidRequest):
        error = InvalidArgument(str(exc))  # 400, the message kept
    elif isinstance(exc, EngineShutdown):
        error = Shutdown(str(exc))  # the frontend may migrate the request
    else:
        error = HttpError(500, str(exc))
    return error
