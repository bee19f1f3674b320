"""The floor of Dynamo's runtime: a plain asyncio worker that yields tokens and polls nothing.

Run by ``dynamo_cancel.py`` beside ``trio-sglang dynamo-worker``
(docs/benchmarks.md, "Behind Dynamo"): the same tiny model, registered the
same way, on uvloop, with the SimEngine's token timing; no engine, no
tokenizer work, no lifecycle. Whatever it costs, or takes to let go, is the
runtime's and asyncio's own. Every GET on ``--metrics-port`` answers its live
requests as a bare number, as ``GET /live_requests`` of a trio-sglang worker
does, so the benchmark reads both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import uvloop
from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime

from trio_sglang.dynamo import SIM_MODEL_PATH, RuntimePlanes
from trio_sglang.sim._scheduler import VOCAB_SIZE


class PlainWorker:
    def __init__(self, first_token_delay: float, token_interval: float) -> None:
        self.first_token_delay = first_token_delay
        self.token_interval = token_interval
        self.live = 0

    async def generate(
        self, request: dict[str, Any], context: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.live += 1
        stopped: asyncio.Future[bool] = context.async_killed_or_stopped()
        tokens = request["stop_conditions"].get("max_tokens") or 16
        try:
            wait = self.first_token_delay
            for k in range(tokens):
                await asyncio.wait([stopped], timeout=wait)  # a future: no task is made
                if stopped.done():
                    return
                wait = self.token_interval
                chunk: dict[str, Any] = {"index": 0, "token_ids": [k % VOCAB_SIZE]}
                if k == tokens - 1:
                    chunk["finish_reason"] = "length"
                yield chunk
        finally:
            self.live -= 1
            stopped.cancel()

    async def serve_metrics(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """HTTP/1.1 with keep-alive, enough for the benchmark's polling."""
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                body = b"%d\n" % self.live
                head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    planes = RuntimePlanes.from_env()
    runtime = DistributedRuntime(
        loop,
        planes.discovery_backend,
        planes.request_plane,
        event_plane=planes.event_plane,
        response_plane=planes.response_plane,
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runtime.shutdown)
    worker = PlainWorker(args.first_token_delay, args.token_interval)
    metrics = await asyncio.start_server(worker.serve_metrics, "127.0.0.1", args.metrics_port)
    async with metrics:
        endpoint = runtime.endpoint(f"dynamo.{args.model_name}.generate")
        serving = endpoint.serve_endpoint(worker.generate)
        await register_model(
            ModelInput.Tokens,
            ModelType.Chat | ModelType.Completions,
            endpoint,
            str(SIM_MODEL_PATH),
            args.model_name,
            worker_type=WorkerType.Aggregated,
        )
        await serving


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-name", default="plain")
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--first-token-delay", type=float, default=0.05)
    parser.add_argument("--token-interval", type=float, default=0.02)
    uvloop.run(main(parser.parse_args()))
