"""The demo behind ``trio-sglang demo``: stream, then cancel in two phases, on the SimEngine."""

from __future__ import annotations

import sys
from typing import Any, TextIO

import trio

from .._core._context import RequestContext
from .._core._worker import Worker, open_worker
from ..sim import SimEngine, TraceKind

__all__ = ["run_demo"]


async def run_demo(
    *, max_new_tokens: int = 12, token_interval: float = 0.02, out: TextIO = sys.stdout
) -> bool:
    """Run the three scenes; return True when the engine ends up holding nothing."""
    engine = SimEngine(tokenize_delay=0.2, token_interval=token_interval)
    request: dict[str, Any] = {
        "text": "Tell me about structured concurrency",
        "sampling_params": {"max_new_tokens": max_new_tokens},
    }
    async with open_worker(engine) as worker:
        caps = worker.capabilities()
        print(
            f"trio-sglang {caps['package']['version']} on {engine!r}\n"
            f"capabilities: {sorted(k for k, v in caps['features'].items() if v)}",
            file=out,
        )
        print("\n1. stream to the end:", file=out)
        await _stream(
            worker, engine, request, RequestContext("demo-full"), stop_after=None, out=out
        )
        print("\n2. stop mid-stream after 3 chunks:", file=out)
        await _stream(worker, engine, request, RequestContext("demo-stop"), stop_after=3, out=out)
        print("\n3. client gone during a slow (0.2 s) tokenization:", file=out)
        await _stream(worker, engine, request, RequestContext("demo-kill"), stop_after=0, out=out)
    # Leaving the worker let any pending cleanup finish first.
    left = engine.live_rids()
    print(f"\nengine holds {len(left)} request(s) at the end", file=out)
    return not left


async def _stream(
    worker: Worker,
    engine: SimEngine,
    request: dict[str, Any],
    ctx: RequestContext,
    *,
    stop_after: int | None,
    out: TextIO,
) -> None:
    first_event = len(engine.trace)
    cancelled_at: float | None = None
    async with trio.open_nursery() as nursery:
        if stop_after == 0:

            async def kill_soon() -> None:
                nonlocal cancelled_at
                await trio.sleep(0.1)
                cancelled_at = trio.current_time()
                ctx.kill()

            nursery.start_soon(kill_soon)
        async with worker.generate(request, ctx, output="text") as chunks:
            received = 0
            async for chunk in chunks:
                print(chunk["choices"][0]["text"], end="", flush=True, file=out)
                received += 1
                if received == stop_after:
                    cancelled_at = trio.current_time()
                    ctx.stop()
        closed_at = trio.current_time()
    print(file=out)
    if cancelled_at is None:
        return
    await trio.sleep(0.01)  # let the detached cleanup report to the engine
    events = engine.trace[first_event:]
    ended: dict[TraceKind, str] = {
        "abort_applied": "abort applied at the scheduler",
        "released": "released before dispatch, never sent to the scheduler",
    }
    end = next((e for e in events if e.kind in ended), None)
    print(f"   stream closed {(closed_at - cancelled_at) * 1e3:.3f} ms after the cancel", file=out)
    if end is not None:
        delay = (end.time - cancelled_at) * 1e3
        print(f"   engine: {ended[end.kind]} {delay:.3f} ms after the cancel", file=out)
    print(f"   engine events: {[e.kind for e in events]}", file=out)
