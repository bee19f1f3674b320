"""The floor under ``serve``: a minimal ASGI app on the same hypercorn, streaming the same bytes.

    python benchmarks/_sse_floor.py --events PATH --token-interval S [--first-token-delay S]

What ``serve_throughput.py`` measures ``trio-sglang serve`` against (docs/benchmarks.md,
"Serving throughput"). The events are ``serve``'s own bytes, recorded by the
benchmark (``--events``: a JSON list of strings, each one event's bytes): a
request for ``k`` tokens gets the recording's first ``k - 1`` events and its
last one. It prints ``serving floor on http://HOST:PORT`` once listening (the
line ``_load_server`` waits for), answers ``GET /health``, and stops on SIGINT
or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework

from trio_sglang.server._asgi import SSE_DONE, Receive, Scope, Send, send_sse, start_sse

__all__ = ["FloorApp", "main"]


class FloorApp:
    """Streams the recorded events at the SimEngine's pace; nothing else per token."""

    def __init__(self, events: Sequence[bytes], first_token_delay: float, interval: float) -> None:
        if not events:
            raise ValueError("no events to stream")
        self._events = tuple(events)
        self._first = first_token_delay
        self._interval = interval

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http" and scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        elif scope["type"] == "http":
            tokens = _tokens_asked(await _body(receive))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await self._stream(tokens, send)
                nursery.cancel_scope.cancel()

    async def _stream(self, tokens: int, send: Send) -> None:
        events = self._events
        if tokens < len(events):
            events = (*events[: tokens - 1], events[-1])
        await start_sse(send)  # serve's own SSE headers
        due = trio.current_time() + self._first
        for event in events:
            await trio.sleep_until(due)
            await send_sse(send, event)
            due += self._interval
        await send_sse(send, SSE_DONE, more=False)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        kind = (await receive())["type"]
        if kind == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif kind == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        part: bytes = message.get("body", b"")
        body += part
        if not message.get("more_body", False):
            return body


def _tokens_asked(body: bytes) -> int:
    """``max_tokens`` (OpenAI) or ``sampling_params.max_new_tokens`` (SGLang); at least 1."""
    request = json.loads(body)
    tokens = request.get("max_tokens") or request.get("sampling_params", {}).get("max_new_tokens")
    return max(1, int(tokens or 1))


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _stopped() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


async def run(app: FloorApp, host: str, port: int) -> None:
    config = Config()
    config.bind = [f"{host}:{port}"]
    # As ``serve`` configures hypercorn (server/_serving.py): a deep accept queue, no
    # access log, errors through logging, ``serve``'s default keep-alive.
    config.backlog = 4096
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 5.0
    config.graceful_timeout = 1.0
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(serve, cast("ASGIFramework", app), config, shutdown_trigger=_stopped)
        )
        print(f"INFO serving floor on {urls[0]}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_sse_floor.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=Path, required=True, help="a JSON list of events")
    parser.add_argument("--token-interval", type=float, required=True, help="seconds")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    events = [event.encode() for event in json.loads(args.events.read_text())]
    app = FloorApp(events, args.first_token_delay, args.token_interval)
    trio.run(run, app, args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
