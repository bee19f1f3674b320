"""``trio-sglang serve --engine sglang --device cpu``: the real engine over real HTTP.

One server process for the module, started as a user starts it (SGLang's own
flags on the command line, nothing in the environment), over the tiny local
model. Each test judges by the real scheduler, from outside the process:
``trio_sglang_scheduler_requests`` in ``/metrics`` is what SGLang's scheduler
publishes it runs or queues, and it must be back at 0 at once after a client
disconnects, is stopped, or is aborted by id, long before a request nobody
stopped would end (it asks for seconds of decoding). Marker ``real_engine``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

import psutil  # one of SGLang's requirements

from _processes import Process, gauge, start_workers, wait_until
from trio_sglang_harness import build_tiny_model

pytestmark = pytest.mark.real_engine

#: Seconds of decoding on this CPU (hundreds of tokens a second): nobody mistakes it for a stop.
LONG = {"max_new_tokens": 3000, "ignore_eos": True}
#: The most a stop may take to empty the scheduler, as the server sees it (loopback, a
#: 0.1 s heartbeat for a silent stream, the abort's trip): a fraction of the decode above.
STOPPED_WITHIN = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, str]]:
    folder = tmp_path_factory.mktemp("real-engine-serve")
    model = build_tiny_model(folder / "tiny-llama")
    [(process, url)] = start_workers(
        ["real-engine"],
        folder,
        "--engine",
        "sglang",
        "--model-path",
        str(model),
        "--device",
        "cpu",
        "--max-running-requests",
        "16",
        "--enable-metrics",
        # A thinking chat streams reasoning_content (the tiny model never writes <think>).
        "--reasoning-parser",
        "qwen3",
        timeout=240,
    )
    try:
        yield process, url
    finally:
        process.stop(timeout=30)


def scheduler_holds(url: str) -> float:
    return gauge(url, "trio_sglang_scheduler_requests")


def wait_idle(url: str, within: float) -> float:
    """Seconds until the scheduler and the tokenizer side hold nothing; fails after ``within``."""
    return wait_until(
        "the real scheduler to hold no request",
        lambda: not (scheduler_holds(url) or gauge(url, "trio_sglang_engine_live_requests")),
        within,
    )


def decoding_within(url: str, within: float) -> None:
    """Until the scheduler publishes that it runs the request (it publishes every few steps)."""
    wait_until("the scheduler to show the request", lambda: scheduler_holds(url) == 1, within)


def events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line.removeprefix("data: "))


def test_the_server_came_up_on_sglangs_flags_and_the_real_engine(
    server: tuple[Process, str],
) -> None:
    _, url = server
    capabilities = httpx.get(f"{url}/capabilities", timeout=5).json()
    assert capabilities["engine"]["kind"] == "sglang"
    assert capabilities["features"]["cancel_before_first_output_v1"] is True
    assert scheduler_holds(url) == 0


def test_enable_metrics_shows_sglangs_own_metrics_beside_serves(
    server: tuple[Process, str],
) -> None:
    _, url = server
    httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    text = httpx.get(f"{url}/metrics", timeout=5).text
    families = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
    assert len(families) == len(set(families)), "a metric family named twice"
    ours = [name for name in families if name.startswith("trio_sglang_")]
    sglangs = [name for name in families if name.startswith("sglang:")]
    assert ours
    assert len(sglangs) > 50  # SGLang 0.5.23 has about a hundred
    # The TokenizerManager's, kept in serve's own process, and the scheduler's, in files.
    assert re.search(r"^sglang:num_requests_total\{.*\} [1-9]", text, re.MULTILINE)
    assert "sglang:num_running_reqs" in sglangs


def test_a_whole_answer_streams_and_leaves_nothing(server: tuple[Process, str]) -> None:
    _, url = server
    body = {"prompt": "hello world", "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        chunks = list(events(response))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # SGLang's own server names a request by a uuid's 32 hex digits, and so does serve's.
    assert len({c["id"] for c in chunks}) == 1
    assert re.fullmatch("[0-9a-f]{32}", chunks[0]["id"])
    wait_idle(url, STOPPED_WITHIN)


def test_a_client_that_disconnects_stops_the_real_scheduler(server: tuple[Process, str]) -> None:
    _, url = server
    body = {"text": "hello world", "sampling_params": LONG, "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as response:
        stream = events(response)
        next(stream), next(stream)
        decoding_within(url, STOPPED_WITHIN)  # for the client, still here
    wait_idle(url, STOPPED_WITHIN)


def test_abort_request_by_public_id_stops_the_real_scheduler(server: tuple[Process, str]) -> None:
    _, url = server
    body = {"text": "hello world", "sampling_params": LONG, "stream": True, "rid": "user-7"}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as response:
        stream = events(response)
        next(stream)
        # A prefix of its id touches nothing (SGLang's own matches by prefix).
        missed = httpx.post(f"{url}/abort_request", json={"rid": "user-"}, timeout=5).json()
        assert missed == {"found": False, "aborted": 0}
        decoding_within(url, STOPPED_WITHIN)
        found = httpx.post(f"{url}/abort_request", json={"rid": "user-7"}, timeout=5).json()
        assert found == {"found": True, "aborted": 1}
        rest = list(stream)
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert {chunk["meta_info"]["id"] for chunk in rest} == {"user-7"}
    wait_idle(url, STOPPED_WITHIN)


def test_parallel_samples_and_a_batch_leave_nothing_when_the_client_goes(
    server: tuple[Process, str],
) -> None:
    _, url = server
    for body in (
        {"text": "hi", "sampling_params": {**LONG, "n": 3}, "stream": True},
        {"text": ["hi", "there"], "sampling_params": LONG, "stream": True},
    ):
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as response:
            stream = events(response)
            next(stream), next(stream)
        wait_idle(url, STOPPED_WITHIN)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": "tiny-llama", "input": "hello"}),
        ("/v1/score", {"query": "hello", "items": ["a", "b"], "label_token_ids": [1, 2]}),
    ],
)
def test_what_the_lifecycle_cannot_run_is_a_501_naming_it(
    server: tuple[Process, str], path: str, body: dict[str, Any]
) -> None:
    """Never run around the lifecycle, unmanaged: refused, in words that say so."""
    _, url = server
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 501, response.text
    assert "lifecycle runs generation requests only" in response.text
    assert scheduler_holds(url) == 0


#: Streams of SGLang's other routes, each long enough that only a stop ends it early: the
#: route, and its body (``MODEL`` stands for the served model's name).
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MODEL = "served model"
HELLO = [{"role": "user", "content": "hello"}]
OTHER_STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    # Anthropic's API has no ignore_eos: greedy, the tiny model never says EOS here.
    "messages": (
        "/v1/messages",
        {"model": "tiny-llama", "max_tokens": 3000, "messages": HELLO, "temperature": 0},
    ),
    "chat with tools": (
        "/v1/chat/completions",
        {"messages": HELLO, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 3000},
    ),
    "thinking chat": (
        "/v1/chat/completions",
        {
            "messages": HELLO,
            "chat_template_kwargs": {"enable_thinking": True},
            "separate_reasoning": True,
            "max_tokens": 3000,
        },
    ),
    # The Responses API has no ignore_eos either.
    "responses": (
        "/v1/responses",
        {"model": MODEL, "input": "hello", "max_output_tokens": 3000, "temperature": 0},
    ),
}


@pytest.mark.parametrize("name", OTHER_STREAMS)
def test_a_client_leaving_sglangs_other_routes_stops_the_real_scheduler(
    server: tuple[Process, str], name: str
) -> None:
    """Anthropic's Messages API, a chat with tools, a thinking chat (reasoning_content),
    the Responses API: SGLang's own routes, each of whose requests runs through the
    lifecycle."""
    _, url = server
    path, body = OTHER_STREAMS[name]
    body = {**body, "stream": True}
    if body.get("model") == MODEL:
        body["model"] = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    if path == "/v1/chat/completions":
        body["ignore_eos"] = True
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        stream = events(response)
        first, second = next(stream), next(stream)
        decoding_within(url, STOPPED_WITHIN)  # for the client, still here
    wait_idle(url, STOPPED_WITHIN)
    if name == "thinking chat":  # what SGLang's reasoning parser made of the tokens
        assert second["choices"][0]["delta"].get("reasoning_content"), (first, second)
    if name == "responses":
        assert first["type"] == "response.created", first


def test_sigterm_ends_the_server_and_sglangs_processes(server: tuple[Process, str]) -> None:
    """Last in the module: it stops the server. SGLang must not take SIGTERM for itself."""
    process, url = server
    sglang = psutil.Process(process.pid).children(recursive=True)
    assert sglang, "SGLang's scheduler and detokenizer are the server's children"
    body = {"text": "hello world", "sampling_params": LONG, "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as response:
        next(events(response))
        process.stop(timeout=30)  # SIGTERM: the open stream ends, then the engine
        assert process.wait(0) == 0, process.tail()
    assert "shutting down" in process.output()  # serve's ordered shutdown, not SGLang's
    _, alive = psutil.wait_procs(sglang, timeout=10)
    assert not alive, f"SGLang's processes outlived the server: {alive}"
