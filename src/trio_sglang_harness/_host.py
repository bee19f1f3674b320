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

With ``--real-engine`` there is no stand-in: the host launches the whole
``sglang.Engine`` (SGLang's own scheduler and detokenizer processes and the
tiny model's forward) through ``SGLangEngine(device="cpu")``, from inside
trio as a user's program does, and sees the scheduler through a tap on the
TokenizerManager's sockets (``_tap.py``). A request there is watched as a
group, children included (SGLang never registers an ``n > 1`` request's own
rid), and after each scenario the host waits, bounded, for the scheduler's
own load snapshot to show it holds nothing.

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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from trio_sglang import AbortPolicy, RequestPhase, SGLangEngine, open_worker
from trio_sglang._asyncio_bridge._asyncio_side import LOOP_KINDS
from trio_sglang._asyncio_bridge._guest import run_beside_asyncio

from ._chat import observe_chat
from ._exit import exit_at_once
from ._peer import DisaggSetup
from ._protocol import ANSWER
from ._scenarios import (
    RidRecorder,
    Scenario,
    SchedulerEvent,
    Watched,
    observe_caller,
    run_scenario,
    staged_kind,
)
from ._tap import SchedulerTap
from ._tiny_model import build_tiny_model
from ._tokenizer_manager import logged_since, open_tokenizer_manager

if TYPE_CHECKING:
    from ._dynamo_handler import DynamoHandler


@dataclass(frozen=True)
class _SchedulerView:
    """How the host sees the scheduler: the stand-in's log, or a tap on the real one."""

    #: From now on: the scheduler's events.
    events_since_now: Callable[[], Callable[[], list[SchedulerEvent]]]
    #: From now on: the prompt ids of each request the scheduler receives.
    prompts_since_now: Callable[[], Callable[[], list[list[int]]]]
    #: Where a scenario's phase is read, made anew per scenario (None: the engine, by rid).
    watch: Callable[[], Watched] | None = None
    #: The scheduler's own count of what it still holds, once it settles (None: not known).
    held: Callable[[], Awaitable[int]] | None = None


def _logged(log: Path, since: os.stat_result) -> list[dict[str, Any]]:
    """What the scheduler logged after ``since`` (the log's size then)."""
    return logged_since(log, since.st_size)


def _stand_in_view(log: Path) -> _SchedulerView:
    """The stand-in scheduler's log, read from where it was when a mark was taken."""

    def events() -> Callable[[], list[SchedulerEvent]]:
        since = log.stat()
        return lambda: [
            (e["t"], staged_kind(e["kind"], e.get("stage")), e["rid"]) for e in _logged(log, since)
        ]

    def prompts() -> Callable[[], list[list[int]]]:
        since = log.stat()
        return lambda: [e["input_ids"] for e in _logged(log, since) if e["kind"] == "request"]

    return _SchedulerView(events, prompts)


#: How often the real engine's host looks at the registry and at the scheduler's load.
_LOOK_INTERVAL = 0.0005
#: The most the real scheduler may take to show it holds nothing once a scenario is done.
_SETTLE_BOUND = 5.0


class _GroupWatch:
    """The phase of the one request the host has in flight, its children included.

    SGLang registers an ``n > 1`` request only under its children's ids (and
    replaces them with fresh ones), so a cancel "while tokenizing" or "after
    dispatch" is timed by what the registry holds at all, and by the tap's
    dispatches since the scenario began (warm-ups left out). Polled: nothing
    announces either.
    """

    def __init__(self, tm: Any, tap: SchedulerTap) -> None:
        self._tm = tm
        self._tap = tap
        self._since = time.monotonic()

    def phase(self, rid: str) -> RequestPhase:
        if self._tap.dispatched_since(self._since):
            return RequestPhase.DISPATCHED
        return RequestPhase.REGISTERED if self._tm.rid_to_state else RequestPhase.ABSENT

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        while (now := self.phase(rid)) is phase:  # noqa: ASYNC110 (nothing announces it)
            await trio.sleep(_LOOK_INTERVAL)
        return now

    def live_requests(self) -> int:
        return len(self._tm.rid_to_state)


def _real_view(engine: SGLangEngine) -> _SchedulerView:
    """The real scheduler, through a tap on the running engine's TokenizerManager."""
    tm = engine.tokenizer_manager
    tap = SchedulerTap(tm)

    async def held() -> int:
        """Until the scheduler's load snapshot shows nothing (bounded): what it still holds."""
        with trio.move_on_after(_SETTLE_BOUND):
            while engine.scheduler_requests():  # noqa: ASYNC110 (nothing announces it)
                await trio.sleep(_LOOK_INTERVAL * 20)
        return engine.scheduler_requests()

    return _SchedulerView(
        tap.events_since_now, tap.prompts_since_now, partial(_GroupWatch, tm, tap), held
    )


def _slow_tokenizer(tm: Any, original: Callable[..., Awaitable[Any]], delay: float) -> None:
    if delay <= 0:
        tm._tokenize_one_request = original
        return

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(delay)
        return await original(*args, **kwargs)

    tm._tokenize_one_request = slow


def _described(exc: BaseException) -> str:
    """What failed, with the leaves of a group spelled out (a group's own words say little)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_described(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def _answer(data: dict[str, Any]) -> None:
    sys.stdout.write(ANSWER + json.dumps(data) + "\n")
    sys.stdout.flush()


async def _serve(
    engine: SGLangEngine,
    view_of: Callable[[SGLangEngine], _SchedulerView],
    templates: Any,
    dynamo: bool,
) -> None:
    """Answer commands over a worker on ``engine``, the scheduler seen through ``view_of``.

    ``templates`` is SGLang's template manager for its chat route (None: the
    engine's own, once it runs).
    """
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    recorder = RidRecorder(engine)
    async with open_worker(recorder, policy=AbortPolicy(shutdown_grace=5.0)) as worker:
        tm = engine.tokenizer_manager
        original = tm._tokenize_one_request
        view = view_of(engine)
        # SGLang's own chat route, made as its server makes it.
        sglang_chat = OpenAIServingChat(
            tm, engine.template_manager if templates is None else templates
        )

        async def run(handler: DynamoHandler | None, command: dict[str, Any]) -> dict[str, Any]:
            if command["op"] == "chat":
                chat = await observe_chat(
                    worker, engine, sglang_chat, command["body"], view.prompts_since_now
                )
                return {"chat": chat.to_json()}
            scenario = Scenario.from_json(command["scenario"])
            _slow_tokenizer(tm, original, scenario.tokenize_delay)
            events = view.events_since_now()
            watch = None if view.watch is None else view.watch()
            if command.get("caller", "trio-sglang") == "trio-sglang":
                seen = await run_scenario(
                    worker, recorder, scenario, events, clock=time.monotonic, watch=watch
                )
            elif handler is None:
                raise RuntimeError("the host was started without --dynamo")
            else:
                seen = await observe_caller(
                    handler.stream, watch or recorder, scenario, events, clock=time.monotonic
                )
            if view.held is not None:
                seen.scheduler_held_after = await view.held()
            return {"observation": seen.to_json()}

        async with _maybe_dynamo(engine, dynamo) as handler:
            _answer(
                {
                    "ready": True,
                    "capabilities": worker.capabilities(),
                    "tokenizer_manager": type(tm).__name__,
                }
            )
            while line := await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True):
                command = json.loads(line)
                if command["op"] == "quit":
                    break
                try:
                    _answer(await run(handler, command))
                except Exception as exc:
                    _answer({"error": _described(exc)})


@asynccontextmanager
async def _maybe_dynamo(engine: SGLangEngine, wanted: bool) -> AsyncIterator[DynamoHandler | None]:
    """Dynamo's handler over the engine's TokenizerManager if ``wanted`` (inside the worker:
    it runs on the engine's asyncio loop)."""
    if not wanted:
        yield None
        return
    from ._dynamo_handler import open_dynamo_handler

    async with open_dynamo_handler(engine.tokenizer_manager, engine.asyncio_side) as handler:
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
    parser.add_argument(
        "--real-engine",
        action="store_true",
        help="the whole sglang.Engine on the CPU instead of the stand-in scheduler",
    )
    parser.add_argument(
        "--tokenizer-workers", type=int, default=1, help="the real engine's tokenizer_worker_num"
    )
    parser.add_argument(
        "--loop",
        choices=LOOP_KINDS,
        default="trio-asyncio",
        help="where SGLang's asyncio code runs: the loop trio is the guest of, or trio-asyncio's",
    )
    args = parser.parse_args(argv)
    if args.real_engine:
        several = args.tokenizer_workers > 1
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is local
        model = build_tiny_model(args.workdir / "tiny-llama")

        def real(loop: asyncio.AbstractEventLoop | None) -> SGLangEngine:
            return SGLangEngine(
                model_path=str(model),
                device="cpu",
                incremental_streaming_output=True,
                log_level="warning",
                chat_template=args.chat_template,
                asyncio_loop=loop,
                **({"tokenizer_worker_num": args.tokenizer_workers} if several else {}),
            )

        run_beside_asyncio(args.loop, _serve_made, real, _real_view, None, args.dynamo)
        return
    with open_tokenizer_manager(
        args.workdir,
        first_token_delay=args.first_token_delay,
        token_interval=args.token_interval,
        disagg=args.disagg,
        chat_template=args.chat_template,
    ) as hosted:

        def over_stand_in(loop: asyncio.AbstractEventLoop | None) -> SGLangEngine:
            return SGLangEngine(tokenizer_manager=hosted.tokenizer_manager, asyncio_loop=loop)

        run_beside_asyncio(
            args.loop,
            _serve_made,
            over_stand_in,
            lambda _: _stand_in_view(hosted.scheduler_log),
            hosted.templates,
            args.dynamo,
        )
    # The stand-in scheduler has exited; the whole engine (above) is left to its own
    # shutdown and the interpreter's, as SGLang may finish stopping its processes there.
    exit_at_once(0)


async def _serve_made(
    loop: asyncio.AbstractEventLoop | None,
    make: Callable[[asyncio.AbstractEventLoop | None], SGLangEngine],
    *rest: Any,
) -> None:
    """``_serve`` over the engine ``make(loop)`` builds for the asyncio loop of this run."""
    await _serve(make(loop), *rest)


if __name__ == "__main__":
    main()
