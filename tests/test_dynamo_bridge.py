"""``trio_sglang.dynamo`` without Dynamo: the bridge between the runtime and the worker.

The bridge runs here as it runs in a worker, trio as a guest of an asyncio
loop, with the SimEngine behind it and a stand-in for the runtime's
per-request ``Context`` (an id, ``is_killed``, and the future that
``async_killed_or_stopped`` returns). What it must get right: every chunk
in Dynamo's shape (token chunks, or OpenAI chunks in text mode), and a kill,
a stop or a generator the runtime closes stopping the engine. The real
runtime and frontend: ``test_dynamo.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import importlib.util
import subprocess
import sys
import traceback
import types
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import pytest
import trio

from _dynamo_captured import with_fields
from trio_sglang import SimEngine, open_worker
from trio_sglang._cli._parser import build_parser
from trio_sglang._protocol._transcript import plain_transcript
from trio_sglang.dynamo import MODEL_INPUTS
from trio_sglang.dynamo._bridge import RequestBridge
from trio_sglang.dynamo._mapping import TOKENS
from trio_sglang.dynamo._text import text_mode
from trio_sglang.dynamo._translation import InputMode

# -- the bridge, trio as asyncio's guest ---------------------------------------


class StandInContext:
    """The runtime's per-request ``Context``, as far as the bridge uses it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, id: str = "ctx-1") -> None:
        self._id = id
        self.killed_or_stopped: asyncio.Future[bool] = loop.create_future()
        self.killed = False

    def id(self) -> str:
        return self._id

    def is_killed(self) -> bool:
        return self.killed

    def async_killed_or_stopped(self) -> asyncio.Future[bool]:
        return self.killed_or_stopped

    def fire(self, *, kill: bool) -> None:
        self.killed = kill
        self.killed_or_stopped.set_result(True)


Scenario = Callable[[RequestBridge, asyncio.AbstractEventLoop], Awaitable[None]]


def run_bridge(scenario: Scenario, engine: SimEngine, mode: InputMode = TOKENS) -> int:
    """``scenario(bridge, loop)`` on asyncio, the bridge's worker in a trio guest run.

    Returns the requests the engine still held once the bridge and the worker
    had nothing left running, before the engine closed (its close lets go of
    everything, which would hide a request nobody stopped).
    """
    live: list[int] = []

    async def host() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[RequestBridge] = loop.create_future()
        finish = trio.Event()
        done: asyncio.Future[Any] = loop.create_future()

        async def trio_side() -> None:
            async with open_worker(engine) as worker, trio.open_nursery() as requests:
                bridge = RequestBridge(worker, requests, loop, mode=mode)
                ready.set_result(bridge)
                await finish.wait()
                with trio.fail_after(5):
                    await bridge.wait_idle()
                    await worker.wait_idle()
                live.append(engine.live_requests())

        trio.lowlevel.start_guest_run(
            trio_side,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
            host_uses_signal_set_wakeup_fd=True,
        )
        bridge = await ready
        try:
            await asyncio.wait_for(scenario(bridge, loop), 30)
        finally:
            bridge._token.run_sync_soon(finish.set)  # after what the scenario scheduled
            (await done).unwrap()

    asyncio.run(host(), debug=True)  # debug: a call from the wrong thread raises
    return live[0]


def sim() -> SimEngine:
    return SimEngine(tokenize_delay=0, first_token_delay=0.001, token_interval=0.002)


def request(max_tokens: int) -> dict[str, Any]:
    return with_fields("stop_conditions", max_tokens=max_tokens)


def test_the_bridge_streams_every_token_in_dynamos_shape() -> None:
    engine = sim()
    seen: list[dict[str, Any]] = []

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        async for chunk in bridge.generate(request(20), StandInContext(loop)):
            seen.append(chunk)

    assert run_bridge(scenario, engine) == 0
    assert sum(len(chunk["token_ids"]) for chunk in seen) == 20
    assert seen[-1]["finish_reason"] == "length"
    assert seen[-1]["completion_usage"]["completion_tokens"] == 20
    assert "completion_usage" in seen[0]


@pytest.mark.parametrize("how", ["kill", "stop", "close"])
def test_a_kill_a_stop_or_a_closed_generator_stops_the_engine_at_once(how: str) -> None:
    engine = sim()
    taken = 0

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        nonlocal taken
        context = StandInContext(loop)
        chunks: AsyncGenerator[dict[str, Any], None] = bridge.generate(request(10_000), context)
        async for chunk in chunks:
            taken += len(chunk["token_ids"])
            if taken >= 5:
                break
        if how == "close":
            await chunks.aclose()  # the runtime's GeneratorExit
        else:
            context.fire(kill=how == "kill")
            async for _ in chunks:  # the stream ends
                pass

    assert run_bridge(scenario, engine) == 0
    counts = engine.event_counts()
    assert counts["abort_applied"] == 1
    assert counts["abort_lost"] == 0
    assert counts["token"] < 10_000


def test_a_generator_the_runtime_drops_in_its_own_thread_still_stops_the_engine() -> None:
    """The runtime iterates handlers from its threads and may drop one unfinished there.

    No asyncgen hooks are installed in such a thread, so the generator's
    ``finally`` runs right there at its finalization, outside any loop.
    """
    engine = sim()

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        held = [bridge.generate(request(10_000), StandInContext(loop))]

        def step_from_elsewhere() -> concurrent.futures.Future[Any]:
            return asyncio.run_coroutine_threadsafe(held[0].__anext__(), loop)

        for _ in range(3):
            chunk = await asyncio.wrap_future(await loop.run_in_executor(None, step_from_elsewhere))
            assert chunk["token_ids"]

        def drop() -> None:
            held.clear()
            gc.collect()

        await loop.run_in_executor(None, drop)

    assert run_bridge(scenario, engine) == 0
    assert engine.event_counts()["abort_applied"] == 1


@pytest.mark.usefixtures("dynamo_errors")  # the runtime's EngineShutdown reaches the frontend
def test_a_request_after_close_ends_with_engine_shutdown_and_reaches_nothing() -> None:
    engine = sim()

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        bridge._token.run_sync_soon(bridge.close)  # before the request's start: FIFO
        chunks = bridge.generate(request(5), StandInContext(loop))
        with pytest.raises(Exception, match="shutting down") as ended:
            async for _ in chunks:
                pass
        assert type(ended.value).__name__ == "EngineShutdown"

    run_bridge(scenario, engine)
    assert engine.event_counts()["registered"] == 0


@pytest.mark.parametrize("refusal", ["InvalidArgument", "EngineShutdown"])
@pytest.mark.usefixtures("dynamo_errors")
def test_a_refusal_reaches_the_runtime_as_one_line_without_traceback_or_chain(
    refusal: str,
) -> None:
    """The runtime prints each exception a handler raises, traceback and chain included.

    It takes each item as here: ``__anext__()`` awaited in a task of its own,
    the exception read off the task. A refused request, routine under attack,
    must print as one line.
    """
    seen: list[BaseException] = []

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        if refusal == "EngineShutdown":
            bridge._token.run_sync_soon(bridge.close)  # before the request's start: FIFO
        invalid = refusal == "InvalidArgument"
        body = with_fields("output_options", logprobs=2) if invalid else request(5)
        chunks = bridge.generate(body, StandInContext(loop))
        taken = asyncio.ensure_future(chunks.__anext__())
        done, _ = await asyncio.wait([taken], timeout=5)
        assert done, "the refusal never reached the runtime"
        error = taken.exception()
        assert error is not None
        seen.append(error)

    engine = sim()
    run_bridge(scenario, engine)
    [error] = seen
    assert type(error).__name__ == refusal
    assert error.__traceback__ is None
    assert error.__cause__ is None
    assert error.__context__ is None
    assert len("".join(traceback.format_exception(error)).splitlines()) == 1
    assert engine.event_counts()["registered"] == 0


# -- the bridge in text mode ----------------------------------------------------


def chat_request(**fields: Any) -> dict[str, Any]:
    """A chat body as Dynamo's frontend hands it to a text worker (captured: nulls left out)."""
    return {"messages": [{"role": "user", "content": "the a"}], "model": "sim", **fields}


def completion_request(**fields: Any) -> dict[str, Any]:
    return {"model": "sim", "prompt": "the a of", **fields}


def collect(engine: SimEngine, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every chunk the text-mode bridge yields for ``body``; asserts the engine let go of it."""
    seen: list[dict[str, Any]] = []

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        seen.extend([chunk async for chunk in bridge.generate(body, StandInContext(loop))])

    assert run_bridge(scenario, engine, text_mode(engine, "sim-text")) == 0
    return seen


def words(chunks: list[dict[str, Any]]) -> list[str]:
    pieces = [
        choice["delta"]["content"] if "delta" in choice else choice["text"]
        for chunk in chunks
        for choice in chunk["choices"]
    ]
    return "".join(pieces).split()


def test_a_streamed_chat_is_openai_chunks_with_the_usage_asked_for() -> None:
    options = {"include_usage": True, "continuous_usage_stats": False}  # as the frontend sends
    chunks = collect(sim(), chat_request(max_tokens=12, stream=True, stream_options=options))
    *choices, usage = chunks
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert {chunk["model"] for chunk in chunks} == {"sim-text"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert choices[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in choices[1:])
    assert len(words(choices)) == 12
    assert [c["choices"][0]["finish_reason"] for c in choices][-1] == "length"
    assert usage["choices"] == []
    prompt = len(plain_transcript(chat_request()["messages"]).split())  # the SimEngine's template
    assert usage["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 12,
        "total_tokens": prompt + 12,
    }


def test_a_streamed_completion_of_two_choices_is_text_completion_chunks() -> None:
    chunks = collect(sim(), completion_request(max_tokens=5, n=2, stream=True))
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert chunks[0]["id"].startswith("cmpl-")
    for index in (0, 1):
        mine = [
            {**chunk, "choices": [choice]}
            for chunk in chunks
            for choice in chunk["choices"]
            if choice["index"] == index
        ]
        assert len(words(mine)) == 5
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in chunk for chunk in chunks)  # not asked for


def test_a_request_not_streamed_still_streams_and_ends_with_its_usage() -> None:
    """The frontend folds the stream into the body, its usage from the last chunk that has one."""
    *choices, usage = collect(sim(), completion_request(max_tokens=4))
    assert len(words(choices)) == 4
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_sglangs_abort_finishes_a_text_choice_as_stop_the_one_openai_reason_that_fits() -> None:
    """The frontend takes OpenAI's finish reasons only; tokens mode shows a cancel as stop."""
    translation = text_mode(sim(), "sim-text").translate(completion_request(stream=True))
    meta = {"finish_reason": {"type": "abort"}, "prompt_tokens": 3, "completion_tokens": 1}
    chunk = translation.chunk({"text": " a", "output_ids": [1], "meta_info": meta})
    assert chunk is not None
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert translation.output == "native"
    assert translation.body["text"] == "the a of"


@pytest.fixture
def dynamo_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Dynamo exceptions the bridge raises: the real ones, or stand-ins of the same names."""
    if importlib.util.find_spec("dynamo") is None:
        errors = types.ModuleType("dynamo.llm.exceptions")
        for name in ("InvalidArgument", "EngineShutdown", "HttpError"):
            setattr(errors, name, type(name, (Exception,), {}))
        for name in ("dynamo", "dynamo.llm"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "dynamo.llm.exceptions", errors)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (completion_request(logprobs=2), "logprobs"),
        (chat_request(messages=[{"role": "robot", "content": "x"}]), "role"),
        (completion_request(prompt=[]), "prompt"),
        (completion_request(prompt=""), "empty"),  # the worker's own check, past the plan's
        (chat_request(max_tokens=-1), "max_tokens"),
        (chat_request(temperature=-1.0), "temperature"),
    ],
)
@pytest.mark.usefixtures("dynamo_errors")
def test_a_bad_openai_request_is_refused_by_name_and_reaches_nothing(
    body: dict[str, Any], named: str
) -> None:
    engine = sim()

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        chunks = bridge.generate(body, StandInContext(loop))
        with pytest.raises(Exception, match=named) as refused:
            async for _ in chunks:
                pass
        assert type(refused.value).__name__ == "InvalidArgument"  # the frontend's 400

    assert run_bridge(scenario, engine, text_mode(engine, "sim-text")) == 0
    assert engine.event_counts()["registered"] == 0


@pytest.mark.parametrize("how", ["kill", "stop", "close"])
def test_a_text_stream_killed_stopped_or_closed_mid_stream_stops_the_engine(how: str) -> None:
    engine = sim()
    taken: list[str] = []

    async def scenario(bridge: RequestBridge, loop: asyncio.AbstractEventLoop) -> None:
        context = StandInContext(loop)
        body = chat_request(max_tokens=10_000, stream=True)
        chunks: AsyncGenerator[dict[str, Any], None] = bridge.generate(body, context)
        async for chunk in chunks:
            taken.extend(words([chunk]))
            if len(taken) >= 5:
                break
        if how == "close":
            await chunks.aclose()  # the runtime's GeneratorExit
        else:
            context.fire(kill=how == "kill")
            async for chunk in chunks:  # the stream ends, no choice finished
                assert all(choice["finish_reason"] is None for choice in chunk["choices"])

    assert run_bridge(scenario, engine, text_mode(engine, "sim-text")) == 0
    counts = engine.event_counts()
    assert counts["abort_applied"] == 1
    assert counts["abort_lost"] == 0
    assert counts["token"] < 10_000


# -- the command ---------------------------------------------------------------


def test_the_command_says_what_to_install_when_dynamo_is_missing() -> None:
    script = (
        "import sys; sys.modules['dynamo'] = None\n"  # as if not installed
        "from trio_sglang._cli._main import main\n"
        "sys.exit(main(['dynamo-worker', '--model-name', 'm']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'trio-sglang[dynamo]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_command_says_what_to_install_for_the_trio_asyncio_host() -> None:
    script = (
        "import sys, importlib.util\n"
        # As if Dynamo were here and trio-asyncio not.
        "importlib.util.find_spec = lambda name, *a: None if name == 'trio_asyncio' else object()\n"
        "from trio_sglang._cli._main import main\n"
        "sys.exit(main(['dynamo-worker', '--model-name', 'm', '--loop', 'trio-asyncio']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'trio-sglang[asyncio]'" in done.stderr


def test_the_commands_defaults() -> None:
    args = build_parser().parse_args(["dynamo-worker", "--model-name", "m"])
    assert (args.namespace, args.component, args.endpoint) == ("dynamo", "backend", "generate")
    assert args.loop is None  # guest
    assert args.metrics_port is None
    assert args.shutdown_grace == 1.0
    assert args.model_input == "tokens"


@pytest.mark.parametrize("model_input", MODEL_INPUTS)
def test_the_command_offers_each_model_input(model_input: str) -> None:
    argv = ["dynamo-worker", "--model-name", "m", "--model-input", model_input]
    assert build_parser().parse_args(argv).model_input == model_input


# -- the runtime's endpoint server stopping by itself -------------------------------------


class _Inline:
    """An ``AsyncioHost`` for calls that never touch asyncio: awaited here, in trio."""

    loop: Any = None

    async def aio(self, call: Callable[[], Awaitable[Any]]) -> Any:
        return await call()


def _served(fails: Exception | None) -> Any:
    async def serve_endpoint(generate: Any) -> None:
        if fails is not None:
            raise fails

    return types.SimpleNamespace(serve_endpoint=serve_endpoint)


async def test_an_endpoint_the_runtime_could_not_register_stops_the_worker_in_one_line() -> None:
    """etcd gone while the endpoint registers: Dynamo's runtime raises a bare ``Exception``."""
    from trio_sglang.dynamo._serve import RuntimeStopped, _serve_endpoint

    bridge = types.SimpleNamespace(generate=None)
    failure = Exception("Unable to register service for discovery. Check discovery service status")
    with pytest.raises(RuntimeStopped, match="could not serve the endpoint: Unable to register"):
        await _serve_endpoint(_Inline(), _served(failure), bridge, trio.Event())
    with pytest.raises(RuntimeStopped, match="stopped serving the endpoint by itself"):
        await _serve_endpoint(_Inline(), _served(None), bridge, trio.Event())
    # At shutdown, the end of serving is expected, and an error stays what it is.
    shutdown = trio.Event()
    shutdown.set()
    await _serve_endpoint(_Inline(), _served(None), bridge, shutdown)
    with pytest.raises(Exception, match="Unable to register") as raised:
        await _serve_endpoint(_Inline(), _served(failure), bridge, shutdown)
    assert not isinstance(raised.value, RuntimeStopped)
