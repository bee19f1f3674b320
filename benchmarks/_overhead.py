"""What the lifecycle costs when nothing is cancelled: throughput and memory per request.

Both compare ``worker.generate`` with iterating the same SimEngine directly,
so that the engine model's own cost is in both and the difference is the
worker's.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

import trio_sglang as ts
from _cells import wait_events

__all__ = ["memory_per_request", "throughput_ratio"]

#: Bound on one throughput run.
BOUND = 120.0

_PROMPT: dict[str, Any] = {"input_ids": [1, 2, 3, 4]}


async def _direct(engine: ts.SimEngine, request: dict[str, Any], index: int) -> int:
    tokens = 0
    stream = engine.generate({**request, "rid": f"{index:032x}", "stream": True})
    async for out in stream:
        tokens += len(out["output_ids"])
    return tokens


async def _through_worker(worker: ts.Worker, request: dict[str, Any], index: int) -> int:
    tokens = 0
    async with worker.generate(request, ts.RequestContext(f"req-{index}"), output="tokens") as s:
        async for chunk in s:
            tokens += len(chunk["token_ids"])
    return tokens


@asynccontextmanager
async def _consumer(
    engine: ts.SimEngine, via_worker: bool, request: dict[str, Any]
) -> AsyncIterator[Callable[[int], Awaitable[int]]]:
    """Reads the stream with this index to its end, through a worker over the engine or from
    the engine itself; either way the engine runs for the block."""
    if via_worker:
        async with ts.open_worker(engine) as worker:
            yield partial(_through_worker, worker, request)
    else:
        async with engine.running():
            yield partial(_direct, engine, request)


async def _tokens_per_second(via_worker: bool, streams: int, tokens: int) -> float:
    """All delays zero: the engine decodes as fast as the consumers can take it."""
    engine = ts.SimEngine(tokenize_delay=0, dispatch_delay=0, first_token_delay=0, token_interval=0)
    request = {**_PROMPT, "sampling_params": {"max_new_tokens": tokens}}
    read = 0

    async def one(consume: Callable[[int], Awaitable[int]], index: int) -> None:
        nonlocal read
        tokens = await consume(index)  # read after the await, not before
        read += tokens

    gc.collect()
    async with _consumer(engine, via_worker, request) as consume:
        started = time.perf_counter()
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for index in range(streams):
                    nursery.start_soon(one, consume, index)
        elapsed = time.perf_counter() - started
    if read != streams * tokens:
        raise RuntimeError(f"read {read} tokens, expected {streams * tokens}")
    return read / elapsed


async def throughput_ratio(rounds: int, streams: int = 100, tokens: int = 1000) -> dict[str, Any]:
    """Tokens/s through the worker over tokens/s direct, runs interleaved (the method is in
    docs/benchmarks.md, "Method"): the best run of each is the least disturbed by the machine."""
    direct: list[float] = []
    worker: list[float] = []
    for via_worker in (False, True):  # warm-up, not counted
        await _tokens_per_second(via_worker, streams, tokens)
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        for via_worker in order:
            rate = await _tokens_per_second(via_worker, streams, tokens)
            (worker if via_worker else direct).append(rate)
    ratios = [w / d for w, d in zip(worker, direct, strict=True)]
    return {
        "ratio": max(worker) / max(direct),
        "method": "best of each over interleaved rounds",
        "median_round_ratio": statistics.median(ratios),
        "direct_tokens_per_s": max(direct),
        "worker_tokens_per_s": max(worker),
        "rounds": rounds,
        "streams": streams,
        "tokens_per_stream": tokens,
        "output": "tokens",
    }


async def _parked_bytes(via_worker: bool, count: int) -> int:
    """Traced bytes held by ``count`` streams parked before their first token."""
    engine = ts.SimEngine(
        tokenize_delay=0, dispatch_delay=0, first_token_delay=3600, token_interval=1
    )
    request = {**_PROMPT, "sampling_params": {"max_new_tokens": 16}}
    gc.collect()
    tracemalloc.start()
    try:
        async with (
            _consumer(engine, via_worker, request) as consume,
            trio.open_nursery() as nursery,
        ):
            before = tracemalloc.get_traced_memory()[0]
            for index in range(count):
                nursery.start_soon(consume, index)
            await wait_events(engine, "dispatched", count)
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
            # Tracing slows the cancel of every stream below several-fold: stop it first.
            tracemalloc.stop()
            nursery.cancel_scope.cancel()
    finally:
        tracemalloc.stop()
    return used


async def memory_per_request(count: int) -> dict[str, Any]:
    """Worker bytes per in-flight request: (worker path - direct path) / count. Both sides hold
    the same engine state and one consumer task per stream."""
    direct = await _parked_bytes(False, count)
    worker = await _parked_bytes(True, count)
    return {
        "streams": count,
        "direct_bytes": direct,
        "worker_bytes": worker,
        "bytes_per_request": (worker - direct) / count,
        "method": "tracemalloc, streams parked before their first token",
    }
