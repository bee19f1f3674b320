"""The process that hosts a real SGLang ``TokenizerManager`` for the harness.

Run by ``open_sglang_harness``, never imported by a test runner: SGLang's
TokenizerManager kills its whole process tree when its receive loop fails.
It builds the tiny model, builds the TokenizerManager the way
``sglang.Engine`` does (without the GPU parts; with SGLang's template
manager, ``--chat-template`` loaded as SGLang's server loads it) and starts
the stand-in scheduler as its child, all in ``open_tokenizer_manager`` (the
serving benchmark's SGLang server starts up with it too); then it opens one
worker over ``SGLangEngine`` and answers scenario and chat requests read as
JSON lines on stdin with JSON lines on stdout (prefixed, so that stray
prints cannot be mistaken for answers). With ``--dynamo`` it also opens
NVIDIA Dynamo 1.6.1's own SGLang handler over the same TokenizerManager
(``_dynamo_handler.py``), and a scenario can name it as its caller instead
of the worker.

With ``--disagg`` (a ``DisaggSetup`` as JSON) the TokenizerManager is a
prefill or decode server's (``disaggregation_mode``, the default ``mooncake``
transfer backend: SGLang refuses ``fake`` for prefill), and so is the
stand-in scheduler. A prefill TokenizerManager starts SGLang's own KV
bootstrap server (an HTTP server in a thread; no GPU needed): it gets a free
port, and the host waits until it answers ``/health``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .._policy import AbortPolicy
from .._sglang_engine import SGLangEngine
from .._worker import Worker, open_worker
from ._chat import observe_chat
from ._peer import DisaggSetup
from ._protocol import ANSWER
from ._scenarios import (
    RidRecorder,
    Scenario,
    SchedulerEvent,
    observe_caller,
    run_scenario,
    staged_kind,
)
from ._tokenizer_manager import open_tokenizer_manager

if TYPE_CHECKING:
    from ._dynamo_handler import DynamoHandler


def _logged(log: Path, since: os.stat_result) -> list[dict[str, Any]]:
    """What the scheduler logged after ``since`` (the log's size then)."""
    with log.open("rb") as f:
        f.seek(since.st_size)
        lines = f.read().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _scheduler_events(log: Path, since: os.stat_result) -> list[SchedulerEvent]:
    return [(e["t"], staged_kind(e["kind"], e.get("stage")), e["rid"]) for e in _logged(log, since)]


def _mark(log: Path) -> Callable[[], list[list[int]]]:
    """From now on: the prompt ids of each request the scheduler receives."""
    since = log.stat()
    return lambda: [e["input_ids"] for e in _logged(log, since) if e["kind"] == "request"]


def _slow_tokenizer(tm: Any, original: Callable[..., Awaitable[Any]], delay: float) -> None:
    if delay <= 0:
        tm._tokenize_one_request = original
        return

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(delay)
        return await original(*args, **kwargs)

    tm._tokenize_one_request = slow


def _answer(data: dict[str, Any]) -> None:
    sys.stdout.write(ANSWER + json.dumps(data) + "\n")
    sys.stdout.flush()


async def _serve(tm: Any, templates: Any, log: Path, dynamo: bool) -> None:
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    engine = SGLangEngine(tokenizer_manager=tm)
    recorder = RidRecorder(engine)
    # SGLang's own chat route, made as its server makes it.
    sglang_chat = OpenAIServingChat(tm, templates)
    original = tm._tokenize_one_request

    async def run(
        worker: Worker, handler: DynamoHandler | None, command: dict[str, Any]
    ) -> dict[str, Any]:
        if command["op"] == "chat":
            mark = partial(_mark, log)
            chat = await observe_chat(worker, engine, sglang_chat, command["body"], mark)
            return {"chat": chat.to_json()}
        scenario = Scenario.from_json(command["scenario"])
        _slow_tokenizer(tm, original, scenario.tokenize_delay)
        events = partial(_scheduler_events, log, await trio.Path(log).stat())
        if command.get("caller", "trio-sglang") == "trio-sglang":
            seen = await run_scenario(worker, recorder, scenario, events, clock=time.monotonic)
        elif handler is None:
            raise RuntimeError("the host was started without --dynamo")
        else:
            seen = await observe_caller(
                handler.stream, recorder, scenario, events, clock=time.monotonic
            )
        return {"observation": seen.to_json()}

    async with (
        open_worker(recorder, policy=AbortPolicy(shutdown_grace=5.0)) as worker,
        _maybe_dynamo(tm, dynamo) as handler,
    ):
        _answer({"ready": True, "capabilities": worker.capabilities()})
        while line := await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True):
            command = json.loads(line)
            if command["op"] == "quit":
                break
            try:
                _answer(await run(worker, handler, command))
            except Exception as exc:
                _answer({"error": f"{type(exc).__name__}: {exc}"})


@asynccontextmanager
async def _maybe_dynamo(tm: Any, wanted: bool) -> AsyncIterator[DynamoHandler | None]:
    """Dynamo's handler over ``tm`` if ``wanted`` (inside the worker: it needs the asyncio loop)."""
    if not wanted:
        yield None
        return
    from ._dynamo_handler import open_dynamo_handler

    async with open_dynamo_handler(tm) as handler:
        yield handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--first-token-delay", type=float, default=0.2)
    parser.add_argument("--token-interval", type=float, default=0.05)
    parser.add_argument("--disagg", type=DisaggSetup.from_text, help="a DisaggSetup as JSON")
    parser.add_argument("--chat-template", help="SGLang's --chat-template: a file or a name")
    parser.add_argument(
        "--dynamo", action="store_true", help="also open Dynamo 1.6.1's SGLang handler (ai-dynamo)"
    )
    args = parser.parse_args(argv)
    with open_tokenizer_manager(
        args.workdir,
        first_token_delay=args.first_token_delay,
        token_interval=args.token_interval,
        disagg=args.disagg,
        chat_template=args.chat_template,
    ) as hosted:
        trio.run(
            _serve, hosted.tokenizer_manager, hosted.templates, hosted.scheduler_log, args.dynamo
        )


if __name__ == "__main__":
    main()
