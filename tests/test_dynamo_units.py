"""``trio_sglang.dynamo`` without Dynamo: the request mapping, the hand-over, the bridge.

The bridge runs here as it runs in a worker, trio as a guest of an asyncio
loop, with the SimEngine behind it and a stand-in for the runtime's
per-request ``Context`` (an id, ``is_killed``, and the future that
``async_killed_or_stopped`` returns). What it must get right: every chunk
in Dynamo's shape, and a kill, a stop or a generator the runtime closes
stopping the engine. The real runtime and frontend: ``test_dynamo.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_sglang import SimEngine, open_worker
from trio_sglang._chat import plain_transcript
from trio_sglang._cli import build_parser
from trio_sglang._errors import InvalidRequest
from trio_sglang.dynamo import SIM_MODEL_PATH, DynamoEndpoint, RuntimePlanes
from trio_sglang.dynamo._bridge import RequestBridge
from trio_sglang.dynamo._exchange import Exchange
from trio_sglang.dynamo._mapping import ChunkMapper, engine_request
from trio_sglang.sim._scheduler import VOCAB_SIZE
from trio_sglang.sim._tokenizer import _WORDS

#: A request as Dynamo 1.6.1's frontend sends it for ``/v1/completions`` (captured).
CAPTURED = {
    "model": "sim",
    "token_ids": [0, 1, 2],
    "stop_conditions": {
        "max_tokens": 5,
        "stop": None,
        "stop_token_ids": None,
        "stop_token_ids_visible": None,
        "stop_token_ids_hidden": [65],
        "min_tokens": None,
        "ignore_eos": None,
        "max_thinking_tokens": None,
    },
    "sampling_options": {
        "n": None,
        "best_of": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "use_beam_search": None,
        "length_penalty": None,
        "seed": None,
        "include_stop_str_in_output": None,
        "guided_decoding": None,
    },
    "output_options": {
        "logprobs": None,
        "prompt_logprobs": None,
        "skip_special_tokens": None,
        "formatted_prompt": None,
        "return_tokens_as_token_ids": None,
    },
    "eos_token_ids": [65],
    "annotations": [],
    "routing": {},
}


def with_fields(section: str, **fields: Any) -> dict[str, Any]:
    return {**CAPTURED, section: {**CAPTURED[section], **fields}}


# -- the request mapping -------------------------------------------------------


def test_a_captured_request_maps_to_sglang_input_ids_and_sampling_params() -> None:
    assert engine_request(CAPTURED) == {
        "input_ids": [0, 1, 2],
        "sampling_params": {"max_new_tokens": 5, "stop_token_ids": [65]},
    }


def test_every_sampling_field_maps_as_dynamos_own_sglang_worker_maps_it() -> None:
    request = with_fields(
        "sampling_options",
        n=2,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
    )
    request["stop_conditions"] = {
        **CAPTURED["stop_conditions"],
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [9, 65],
    }
    assert engine_request(request)["sampling_params"] == {
        "n": 2,
        "max_new_tokens": 5,
        "min_new_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [9, 65],  # the hidden (EOS) and the client's, once each
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "sampling_seed": 7,
    }


def test_no_max_tokens_is_sent_as_none_not_left_out() -> None:
    request = with_fields("stop_conditions", max_tokens=None)
    assert engine_request(request)["sampling_params"]["max_new_tokens"] is None


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        ({"json": {"type": "object"}}, {"json_schema": json.dumps({"type": "object"})}),
        ({"regex": "a+"}, {"regex": "a+"}),
        ({"choice": ["a.b", "c"]}, {"regex": r"(a\.b|c)"}),
        ({"grammar": "root ::= 'x'"}, {"ebnf": "root ::= 'x'"}),
    ],
)
def test_guided_decoding_maps_to_sglangs_constraint(
    guided: dict[str, Any], expected: dict[str, Any]
) -> None:
    params = engine_request(with_fields("sampling_options", guided_decoding=guided))
    assert {key: params["sampling_params"][key] for key in expected} == expected


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("output_options", "logprobs", 2),
        ("output_options", "prompt_logprobs", 1),
        ("sampling_options", "use_beam_search", True),
        ("sampling_options", "length_penalty", 0.5),
        ("sampling_options", "best_of", 3),
        ("stop_conditions", "max_thinking_tokens", 64),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(section: str, field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest, match=field) as refused:
        engine_request(with_fields(section, **{field: value}))
    assert refused.value.param == field


def test_a_malformed_request_is_refused_not_guessed() -> None:
    with pytest.raises(InvalidRequest, match="one prompt"):
        engine_request({**CAPTURED, "token_ids": [[1], [2]]})
    with pytest.raises(InvalidRequest, match="'sampling_options' must be an object"):
        engine_request({**CAPTURED, "sampling_options": [1]})
    with pytest.raises(InvalidRequest, match="JSON object"):
        engine_request([])  # type: ignore[arg-type]


def test_chunks_carry_usage_on_each_choices_first_and_last_and_abort_reads_cancelled() -> None:
    to_dynamo = ChunkMapper(prompt_tokens=3)
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    first = {"index": 0, "token_ids": [4], "finish_reason": None}
    assert to_dynamo(first) == {"index": 0, "token_ids": [4], "completion_usage": usage}
    assert to_dynamo({"index": 1, "token_ids": [], "finish_reason": None}) is None
    assert to_dynamo({"index": 0, "token_ids": [5, 6], "finish_reason": None}) == {
        "index": 0,
        "token_ids": [5, 6],
    }
    last = to_dynamo({"index": 0, "token_ids": [], "finish_reason": "abort"})
    assert last is not None
    assert last["finish_reason"] == "cancelled"
    assert last["completion_usage"]["completion_tokens"] == 3
    other = to_dynamo({"index": 1, "token_ids": [7], "finish_reason": "length"})
    assert other is not None
    assert other["completion_usage"]["completion_tokens"] == 1


# -- the hand-over -------------------------------------------------------------


def test_a_backlog_is_merged_per_choice_and_the_error_comes_after_the_last_chunk() -> None:
    async def main() -> list[dict[str, Any]]:
        exchange = Exchange(asyncio.get_running_loop())
        exchange.put({"index": 0, "token_ids": [1], "completion_usage": {"n": 1}})
        exchange.put({"index": 0, "token_ids": [2]})
        exchange.put({"index": 1, "token_ids": [3]})
        exchange.put({"index": 0, "token_ids": [4], "finish_reason": "length"})
        exchange.put({"index": 0, "token_ids": [5]})
        exchange.end(ValueError("late"))
        exchange.end()  # the first end is the one
        seen = []
        try:
            while (chunk := await exchange.get()) is not None:
                seen.append(chunk)
        except ValueError as exc:
            seen.append({"raised": str(exc)})
        return seen

    assert asyncio.run(main()) == [
        {"index": 0, "token_ids": [1, 2], "completion_usage": {"n": 1}},
        {"index": 1, "token_ids": [3]},
        {"index": 0, "token_ids": [4], "finish_reason": "length"},
        {"index": 0, "token_ids": [5]},
        {"raised": "late"},
    ]


# -- configuration -------------------------------------------------------------


def test_planes_come_from_dynamos_variables_with_dynamos_defaults() -> None:
    assert RuntimePlanes.from_env({}) == RuntimePlanes("etcd", "tcp", "tcp", None)
    local = {"DYN_DISCOVERY_BACKEND": "file", "DYN_EVENT_PLANE": "zmq"}
    assert RuntimePlanes.from_env(local) == RuntimePlanes("file", "tcp", "tcp", "zmq")
    with pytest.raises(ValueError, match="DYN_REQUEST_PLANE='udp'"):
        RuntimePlanes.from_env({"DYN_REQUEST_PLANE": "udp"})


def test_an_endpoint_needs_names_dynamo_accepts_and_a_tokenizer(tmp_path: Path) -> None:
    assert DynamoEndpoint("m").path == "dynamo.backend.generate"
    with pytest.raises(ValueError, match="component"):
        DynamoEndpoint("m", component="a.b")
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        DynamoEndpoint("m", model_path=tmp_path)
    with pytest.raises(ValueError, match="name"):
        DynamoEndpoint("")


def test_the_sim_tokenizer_is_the_sim_engines_vocabulary() -> None:
    tokenizer = json.loads((SIM_MODEL_PATH / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    words = _WORDS[:VOCAB_SIZE]
    assert {vocab[word]: word for word in words} == dict(enumerate(words))
    config = json.loads((SIM_MODEL_PATH / "config.json").read_text())
    eos = json.loads((SIM_MODEL_PATH / "generation_config.json").read_text())["eos_token_id"]
    assert config["eos_token_id"] == eos == vocab["<eos>"] >= VOCAB_SIZE  # never generated
    template = json.loads((SIM_MODEL_PATH / "tokenizer_config.json").read_text())["chat_template"]
    # Rendered by the frontend: the SimEngine's own chat transcript, line for line.
    assert "{{ message['role'] }}: {{ message['content'] }}\n" in template
    assert plain_transcript([{"role": "user", "content": "x"}]) == "user: x\nassistant:"


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


def run_bridge(scenario: Scenario, engine: SimEngine) -> int:
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
                bridge = RequestBridge(worker, requests, loop)
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
        chunks: AsyncIterator[dict[str, Any]] = bridge.generate(request(10_000), context)
        async for chunk in chunks:
            taken += len(chunk["token_ids"])
            if taken >= 5:
                break
        if how == "close":
            await chunks.aclose()  # type: ignore[attr-defined]  # the runtime's GeneratorExit
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


@pytest.mark.dynamo  # the runtime's own EngineShutdown is what the frontend gets
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


# -- the command ---------------------------------------------------------------


def test_the_command_says_what_to_install_when_dynamo_is_missing() -> None:
    script = (
        "import sys; sys.modules['dynamo'] = None\n"  # as if not installed
        "from trio_sglang._cli import main\n"
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
        "from trio_sglang._cli import main\n"
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
    assert args.loop is None  # guest, or trio-asyncio with --engine sglang
    assert args.metrics_port is None
    assert args.shutdown_grace == 1.0
