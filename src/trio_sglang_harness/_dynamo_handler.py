"""NVIDIA Dynamo 1.6.1's own SGLang handler, on the harness's real TokenizerManager.

The benchmark's ``dynamo-1.6`` approach is not a model of Dynamo's SGLang
worker but its code: ``DecodeWorkerHandler`` and its ``CancellationMixin``
from the ``ai-dynamo`` wheel (the ``bench-dynamo`` extra; the wheel itself
goes in with ``--no-deps``), each request with the runtime's real
``Context``. Around the handler, only what it cannot run without:

- ``EngineShape``, what the handler uses of an ``sglang.Engine``: the
  TokenizerManager, the ``ServerArgs`` SGLang runs with, and SGLang's own
  ``Engine.async_generate`` bound to it (which builds the
  ``GenerateReqInput`` and hands it to the TokenizerManager);
- Dynamo's configuration, from Dynamo's own argument groups with their
  defaults: the frontend tokenizes, so the handler gets token ids and yields
  token ids;
- the runtime's side of a stream (``DynamoHandler.stream``). It pulls the
  handler's generator on the asyncio loop and never cancels a pull: the
  runtime delivers no ``CancelledError`` into a handler. The cancel signal is
  ``Context.stop_generating()``. A client's disconnect reaches a worker as a
  kill, which sets both of the context's flags, and the handler reads only
  ``is_stopped()`` and ``async_killed_or_stopped()``, so to it the two are
  one signal (the runtime's ``Context`` has no kill to call from Python).
  After the signal the runtime keeps pulling until the handler ends its
  stream (the handler drains SGLang's for at most 1 s); a caller that leaves
  without a signal makes it close the generator (``aclose()``).

Dynamo is imported only when a ``DynamoHandler`` is made, with its log level
at ``error`` (one INFO line per request otherwise) and SGLang's log format
left alone.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from types import MethodType
from typing import Any

import trio

from trio_sglang._asyncio_bridge._asyncio_side import AsyncioSide

from ._scenarios import CallerStream

__all__ = ["DynamoHandler", "EngineShape", "open_dynamo_handler"]

#: The most a stream may take to end once it was cancelled or left (Dynamo drains 1 s).
STREAM_END_BOUND = 10.0


class _PickedRid:
    """The rid Dynamo's handler mints for the one request in flight."""

    def __init__(self) -> None:
        self.rid = ""
        self.picked = trio.Event()

    async def wait(self) -> str:
        await self.picked.wait()
        return self.rid


class EngineShape:
    """What Dynamo's handler uses of an ``sglang.Engine``, over a TokenizerManager built alone.

    ``async_generate`` is SGLang's own method, bound to this object; the
    handler reads its signature (which keywords it may pass), so the wrapper
    that notes each request's rid keeps it.
    """

    def __init__(self, tokenizer_manager: Any) -> None:
        import sglang

        self.tokenizer_manager = tokenizer_manager
        self.server_args = tokenizer_manager.server_args
        self._resolve_routed_dp_rank = MethodType(sglang.Engine._resolve_routed_dp_rank, self)
        self.request = _PickedRid()
        sglang_generate = MethodType(sglang.Engine.async_generate, self)

        @functools.wraps(sglang_generate)
        async def async_generate(*args: Any, **kwargs: Any) -> Any:
            self.request.rid = str(kwargs["rid"])
            self.request.picked.set()
            return await sglang_generate(*args, **kwargs)

        self.async_generate = async_generate

    def shutdown(self) -> None:
        """Called by the handler's cleanup; the harness host owns the TokenizerManager."""


class DynamoHandler:
    """Dynamo 1.6.1's ``DecodeWorkerHandler`` over a TokenizerManager, one stream at a time."""

    def __init__(self, tokenizer_manager: Any, side: AsyncioSide) -> None:
        self._side = side
        os.environ.setdefault("DYN_LOG", "error")
        os.environ.setdefault("DYN_SKIP_SGLANG_LOG_FORMATTING", "1")
        from dynamo.common.configuration.groups.runtime_args import DynamoRuntimeArgGroup
        from dynamo.sglang.args import Config, DynamoConfig
        from dynamo.sglang.backend_args import DynamoSGLangArgGroup
        from dynamo.sglang.request_handlers.llm.decode_handler import DecodeWorkerHandler

        parser = argparse.ArgumentParser()
        DynamoRuntimeArgGroup().add_arguments(parser)
        DynamoSGLangArgGroup().add_arguments(parser)
        dynamo_args = DynamoConfig.from_cli_args(parser.parse_args([]))
        self._tm = tokenizer_manager
        self._engine = EngineShape(tokenizer_manager)
        self._handler = DecodeWorkerHandler(
            self._engine, Config(tokenizer_manager.server_args, dynamo_args)
        )
        if not self._handler._supports_ordered_cancellation:
            raise RuntimeError("Dynamo does not see SGLang's registry and dispatch time")

    @asynccontextmanager
    async def stream(self, request: Mapping[str, Any]) -> AsyncIterator[CallerStream]:
        """One request through the handler, as Dynamo's runtime streams it."""
        from dynamo._core import Context

        context = Context()
        self._engine.request = _PickedRid()
        pulled = _Pulled(self._handler.generate(self._dynamo_request(request), context), self._side)
        signalled = False

        def cancel() -> None:
            nonlocal signalled
            signalled = True
            context.stop_generating()

        try:
            yield CallerStream(pulled, "tokens", cancel, self._engine.request.wait)
        finally:
            with trio.fail_after(STREAM_END_BOUND):
                if signalled:
                    await pulled.drain()
                else:
                    await pulled.aclose()

    def _dynamo_request(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """What Dynamo's frontend sends for a text prompt: its token ids and the stop conditions."""
        text = request.get("text")
        params = request.get("sampling_params") or {}
        if not isinstance(text, str) or set(params) - {"max_new_tokens", "ignore_eos"}:
            raise ValueError(
                "the Dynamo handler takes one text prompt, max_new_tokens and ignore_eos only"
            )
        stop = {"max_tokens": params.get("max_new_tokens")}
        if "ignore_eos" in params:  # the frontend's stop condition, which the handler maps
            stop["ignore_eos"] = params["ignore_eos"]
        return {
            "token_ids": self._tm.tokenizer.encode(text),
            "stop_conditions": stop,
            "sampling_options": {},
        }

    async def aclose(self) -> None:
        """Dynamo's cleanup (it cancels the detached abort tasks), then wait for those to end."""
        handler = self._handler

        async def cleanup() -> None:
            detached = list(handler._abort_tasks)
            handler.cleanup()
            await asyncio.gather(*detached, return_exceptions=True)

        with trio.move_on_after(STREAM_END_BOUND, shield=True):
            await self._side.call(cleanup)


class _Pulled:
    """The handler's generator, pulled as the runtime pulls it: on the asyncio loop, uncancelled."""

    def __init__(self, agen: Any, side: AsyncioSide) -> None:
        self._agen = agen
        self._side = side
        self._ended = False

    def __aiter__(self) -> _Pulled:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._ended:
            raise StopAsyncIteration
        try:
            chunk: dict[str, Any] = await self._side.call(self._agen.__anext__)
        except StopAsyncIteration:
            self._ended = True
            raise
        # Dynamo leaves the key out until the last chunk.
        return {**chunk, "finish_reason": chunk.get("finish_reason")}

    async def drain(self) -> None:
        """Pull, and drop, until the handler ends its stream."""
        async for _ in self:
            pass

    async def aclose(self) -> None:
        """Close the generator where it stopped (at its last ``yield``)."""
        if not self._ended:
            self._ended = True
            await self._side.call(self._agen.aclose)


@asynccontextmanager
async def open_dynamo_handler(
    tokenizer_manager: Any, side: AsyncioSide
) -> AsyncIterator[DynamoHandler]:
    """A ``DynamoHandler`` for the block, its asyncio code on ``side`` (the engine's)."""
    dynamo = DynamoHandler(tokenizer_manager, side)
    try:
        yield dynamo
    finally:
        await dynamo.aclose()
