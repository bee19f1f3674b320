"""``trio-sglang dynamo-worker`` behind NVIDIA Dynamo's own frontend, as real processes.

Dynamo's frontend (``python -m dynamo.frontend``) and trio-sglang workers run
as subprocesses on loopback, with discovery in a temporary folder and no etcd
or NATS (``benchmarks/_dynamo_local.py``). Clients speak OpenAI to the
frontend over HTTP; what reached the engine is read from each worker's own
``--metrics-port``: live requests, outcomes, and the SimEngine's event
counts (``abort_lost`` above all). Bounds on time here are generous limits
that only a request left running would pass, never performance targets;
speed is ``benchmarks/dynamo_cancel.py``'s.

Run by ``nox -s dynamo`` (the ``dynamo`` extra plus Dynamo's frontend).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from _dynamo_workers import RELEASE_BOUND, Worker, run_readme_block, start_worker
from _leaving_client import stream_then_leave
from _processes import wait_until
from _readme import ROOT, readme_block

pytest.importorskip("dynamo.runtime", reason="needs the dynamo extra (nox -s dynamo)")


pytestmark = pytest.mark.dynamo

WORKER = (sys.executable, "-m", "trio_sglang", "dynamo-worker")


@pytest.fixture(scope="module")
def local() -> Any:
    """The benchmarks' local Dynamo deployment and subprocesses, imported as they import them."""
    import _dynamo_local
    import _subprocesses

    return SimpleNamespace(
        Deployment=_dynamo_local.Deployment,
        Process=_subprocesses.Process,
        free_port=_subprocesses.free_port,
        wait_until=_subprocesses.wait_until,
    )


@pytest.fixture(scope="module")
def deployment(local: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with local.Deployment(tmp_path_factory.mktemp("dynamo")) as running:
        running.start_frontend()
        yield running


@pytest.fixture(scope="module", params=["guest", "trio-asyncio"])
def worker(request: pytest.FixtureRequest, deployment: Any) -> Iterator[Worker]:
    """A SimEngine worker at 10 ms a token, on each host in turn."""
    host = request.param
    model = f"sim-{host}"
    started = start_worker(deployment, model, "--loop", host, "--sim-token-interval", "0.01")
    yield started
    started.process.stop()


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# -- completions and chat ------------------------------------------------------


def test_completions_and_chat_through_the_frontend(deployment: Any, worker: Worker) -> None:
    url = deployment.url
    body = {"model": worker.model, "prompt": "the a of", "max_tokens": 5}
    done = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    assert done["choices"][0]["finish_reason"] == "length"
    assert len(done["choices"][0]["text"].split()) == 5
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    chat = {"model": worker.model, "messages": [{"role": "user", "content": "the a"}]}
    answer = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=30)
    message = answer.json()["choices"][0]
    assert message["finish_reason"] == "length"
    assert len(message["message"]["content"].split()) == 4

    for route, payload in (("chat/completions", chat), ("completions", body)):
        stream_six_tokens(url, route, payload)
    assert worker.live() == 0


def stream_six_tokens(url: str, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """``body`` streamed for 6 tokens with its usage: the words, the one finish, the usage."""
    streamed = {**body, "max_tokens": 6, "stream": True}
    streamed["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/{route}", json=streamed, timeout=30) as response:
        assert response.status_code == 200
        events = sse_events(list(response.iter_lines()))
    pieces = [
        choice.get("delta", {}).get("content") or choice.get("text") or ""
        for event in events
        for choice in event["choices"]
    ]
    assert len("".join(pieces).split()) == 6
    finishes = [choice.get("finish_reason") for event in events for choice in event["choices"]]
    assert [reason for reason in finishes if reason] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 6
    return events


def test_a_request_the_worker_cannot_serve_is_refused_by_name(
    deployment: Any, worker: Worker
) -> None:
    refuse_logprobs(deployment.url, worker)


def refuse_logprobs(url: str, worker: Worker) -> None:
    """A completion asking for log probabilities: a 400 that names them; the engine sees nothing."""
    registered = worker.events("registered")
    body = {"model": worker.model, "prompt": "the a", "max_tokens": 3, "logprobs": 2}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert "'logprobs' is not supported" in answer.json()["message"]
    assert worker.events("registered") == registered  # nothing reached the engine


def test_each_refusal_is_one_line_in_the_workers_log(deployment: Any, worker: Worker) -> None:
    """Dynamo's runtime prints what the handler raises; a refusal goes without a traceback.

    Under a stream of bad requests the worker's log grows by one line each.
    """
    start = len(worker.process.output())

    def refusal_lines() -> list[str]:
        log = worker.process.output()[start:]
        return [line for line in log.splitlines() if "'logprobs' is not supported" in line]

    refuse_logprobs(deployment.url, worker)
    body = {"model": worker.model, "prompt": "the a", "max_tokens": 3, "logprobs": 2}
    url = f"{deployment.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        [error] = [json.loads(line[6:]) for line in response.iter_lines() if "error" in line]
    assert error["error"]["code"] == 400
    assert "'logprobs' is not supported" in error["error"]["message"]
    wait_until(
        "both refusals in the worker's log", lambda: len(refusal_lines()) >= 2, RELEASE_BOUND
    )
    log = worker.process.output()[start:]
    assert "Traceback" not in log, log
    assert len(refusal_lines()) == 2, log


def test_capabilities_are_published_with_the_registration(deployment: Any, worker: Worker) -> None:
    cards = [
        json.loads(path.read_text())
        for path in (deployment.folder / "discovery").rglob("*")
        if path.is_file() and path.parent.name == "mdc"
    ]
    configs = [
        card["card_json"]["runtime_config"]
        for card in cards
        if card.get("card_json", {}).get("display_name") == worker.model
    ]
    assert len(configs) == 1, cards
    published = configs[0]["runtime_data"]["trio_sglang"]
    assert published["package"]["name"] == "trio-sglang"
    assert published["engine"]["kind"] == "sim"
    assert published["features"]["cancel_before_first_output_v1"] is True
    assert configs[0]["context_length"] == 32768  # the SimEngine's


# -- clients that leave --------------------------------------------------------


def leave_a_long_stream(
    url: str, model: str, chunks: int, *, after: float = 0.0, route: str = "completions"
) -> None:
    """Open a long stream, read ``chunks`` events (or wait ``after`` s), then close."""
    body: dict[str, Any] = {"model": model, "max_tokens": 3000, "stream": True}
    if route == "completions":
        body["prompt"] = "the a"
    else:
        body["messages"] = [{"role": "user", "content": "the a"}]
    stream_then_leave(url, f"/v1/{route}", body, chunks=chunks, after=after)


def test_clients_leaving_before_the_first_token_and_mid_stream_stop_the_engine(
    deployment: Any,
) -> None:
    worker = start_worker(
        deployment,
        "sim-leaving",
        "--sim-first-token-delay",
        "0.6",
        "--sim-token-interval",
        "0.01",
    )
    try:
        leave_a_long_stream(deployment.url, worker.model, 0, after=0.3)
        wait_until("released before the first token", lambda: worker.live() == 0, RELEASE_BOUND)
        assert worker.sample("trio_sglang_cancellations_total", phase="before_first_token") == 1
        assert worker.events("token") == 0

        leave_a_long_stream(deployment.url, worker.model, 5)
        wait_until("released mid-stream", lambda: worker.live() == 0, RELEASE_BOUND)
        assert worker.sample("trio_sglang_cancellations_total", phase="mid_stream") == 1
        assert worker.events("token") < 3000 / 4
        assert worker.events("abort_lost") == 0
        assert worker.outcomes("cancelled") == 2
    finally:
        worker.process.stop()


def test_half_of_128_streams_leaving_at_once_lose_nothing(deployment: Any, worker: Worker) -> None:
    tokens = 100  # for those who stay; those who leave would run for 30 s
    lost_before = worker.events("abort_lost")
    cancelled_before = worker.outcomes("cancelled")
    everyone_streaming = threading.Barrier(128, timeout=60)

    def client(leaves: bool) -> int | None:
        body = {"model": worker.model, "prompt": "the a", "stream": True}
        body |= {"max_tokens": 3000 if leaves else tokens}
        body["stream_options"] = {"include_usage": True}
        url = f"{deployment.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            everyone_streaming.wait()
            if leaves:
                return None  # all 64 close their connections together
            events = sse_events(list(lines))
        return int(events[-1]["usage"]["completion_tokens"])

    with concurrent.futures.ThreadPoolExecutor(128) as pool:
        counts = list(pool.map(client, [k % 2 == 0 for k in range(128)]))
    assert counts == [None, tokens] * 64  # every token to those who stayed
    wait_until("every stream released", lambda: worker.live() == 0, RELEASE_BOUND)
    assert worker.outcomes("cancelled") - cancelled_before == 64
    assert worker.events("abort_lost") == lost_before == 0


# -- ModelInput.Text ----------------------------------------------------------


@pytest.fixture(scope="module")
def text_worker(deployment: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A SimEngine worker with ``--model-input text``, its model folder without a tokenizer."""
    empty = tmp_path_factory.mktemp("no-tokenizer")
    started = start_worker(
        deployment,
        "sim-text",
        "--model-input",
        "text",
        "--model-path",
        str(empty),
        "--sim-token-interval",
        "0.01",
    )
    yield started
    started.process.stop()


def test_text_mode_answers_chat_and_completions_streamed_and_not(
    deployment: Any, text_worker: Worker
) -> None:
    url, model = deployment.url, text_worker.model
    chat = {"model": model, "messages": [{"role": "user", "content": "the a"}], "max_tokens": 4}
    completion = {"model": model, "prompt": "the a of", "max_tokens": 5}
    for route, body, prefix in (
        ("chat/completions", chat, "chatcmpl-"),
        ("completions", completion, "cmpl-"),
    ):
        done = httpx.post(f"{url}/v1/{route}", json=body, timeout=30).json()
        assert done["id"].startswith(prefix), done
        assert done["model"] == model
        choice = done["choices"][0]
        assert choice["finish_reason"] == "length"
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert len(text.split()) == body["max_tokens"]
        usage = done["usage"]  # the worker's, folded in by the frontend from the last chunk
        assert usage["completion_tokens"] == body["max_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + body["max_tokens"] > 4
        events = stream_six_tokens(url, route, body)
        assert {event["id"] for event in events} == {events[0]["id"]}
        assert events[0]["id"].startswith(prefix)
        assert events[-1]["choices"] == []  # the worker's usage chunk, as it sent it
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert text_worker.live() == 0


def test_text_mode_refuses_a_bad_request_by_name_before_the_engine(
    deployment: Any, text_worker: Worker
) -> None:
    rejected = text_worker.outcomes("rejected")
    refuse_logprobs(deployment.url, text_worker)
    registered = text_worker.events("registered")
    chat = {"model": text_worker.model, "messages": [{"role": "user", "content": "the a"}]}
    streamed = {**chat, "max_tokens": 3, "logprobs": True, "stream": True}
    url = f"{deployment.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=streamed, timeout=30) as response:
        # The frontend's way with any refusal of a stream, in either mode: an error event.
        assert response.status_code == 200
        [error] = [json.loads(line[6:]) for line in response.iter_lines() if "error" in line]
    assert error["error"]["code"] == 400
    assert "'logprobs' is not supported" in error["error"]["message"]
    assert text_worker.events("registered") == registered  # nothing reached the engine
    assert text_worker.outcomes("rejected") == rejected + 2


def test_text_mode_a_client_leaving_mid_stream_stops_the_engine(
    deployment: Any, text_worker: Worker
) -> None:
    mid_stream = text_worker.sample("trio_sglang_cancellations_total", phase="mid_stream")
    tokens = text_worker.events("token")
    leave_a_long_stream(deployment.url, text_worker.model, 5, route="chat/completions")
    wait_until("released mid-stream", lambda: text_worker.live() == 0, RELEASE_BOUND)
    after = text_worker.sample("trio_sglang_cancellations_total", phase="mid_stream")
    assert after == mid_stream + 1
    assert text_worker.events("token") - tokens < 3000 / 4
    assert text_worker.events("abort_lost") == 0


# -- shutdown ------------------------------------------------------------------


def test_sigterm_unregisters_first_then_drains_the_streams(deployment: Any) -> None:
    worker = start_worker(
        deployment,
        "sim-draining",
        "--sim-token-interval",
        "0.02",
        "--shutdown-grace",
        "10",
    )
    entries = deployment.folder / "discovery"

    def ours() -> list[Path]:  # its instance and its model card
        named = f"/{worker.model}/"  # namespace/component/endpoint/instance, %-encoded
        return [p for p in entries.rglob("*") if p.is_file() and named in unquote(p.name)]

    assert len(ours()) == 2
    body = {"model": worker.model, "prompt": "the a", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{deployment.url}/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        worker.process.signal(signal.SIGTERM)
        # Out of discovery while its stream is still running: no new requests.
        wait_until("the worker out of discovery", lambda: not ours(), RELEASE_BOUND)
        assert worker.process.alive()
        rest = [line for line in lines if line.startswith("data: {")]
    assert len(rest) >= 40  # the stream ran to its end
    assert worker.process.wait(timeout=30) == 0
    assert not ours()
    output = worker.process.output()
    assert "Traceback" not in output, output


def test_a_worker_killed_without_unregistering(deployment: Any) -> None:
    """What the frontend does meanwhile (docs/dynamo.md): 503s, until it forgets the model."""
    worker = start_worker(deployment, "sim-killed", "--sim-token-interval", "0.01")
    worker.process.signal(signal.SIGKILL)
    worker.process.wait(timeout=10)
    body = {"model": worker.model, "prompt": "the a", "max_tokens": 3}
    statuses: list[int] = []

    def forgotten() -> bool:
        answer = httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=30)
        statuses.append(answer.status_code)
        return answer.status_code == 404

    waited = wait_until("the frontend to forget the killed worker", forgotten, timeout=90)
    print(f"a killed worker: {sorted(set(statuses))} for {waited:.1f} s, then 404")
    assert set(statuses[:-1]) <= {503}, statuses


def test_the_worker_refuses_a_model_folder_without_a_tokenizer(tmp_path: Path) -> None:
    done = subprocess.run(
        [*WORKER, "--model-name", "m", "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert re.search(r"no tokenizer\.json", done.stderr), done.stderr


# -- the README's and the docs' commands, as written ------------------------------


def test_the_readmes_commands_run_as_written(deployment: Any, local: Any, tmp_path: Path) -> None:
    """The export, the two processes and the curl."""
    block = readme_block("bash", "export DYN_DISCOVERY_BACKEND=file")
    port = local.free_port()
    replacements = {
        "/tmp/dynamo-discovery": str(tmp_path / "discovery"),
        "8000": str(port),
        "9100": str(local.free_port()),
    }
    answer = run_readme_block(block, replacements, port, jobs=2, cwd=tmp_path)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5


def test_the_readmes_install_is_what_nox_installs() -> None:
    block = readme_block("bash", "ai-dynamo==")
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "'.[dynamo]'" in block
    for package in re.findall(r'"([^"]+)"', noxfile.split("DYNAMO_FRONTEND = ", 1)[1][:200]):
        assert package in block


def test_the_python_example_serves_until_sigterm(deployment: Any, local: Any) -> None:
    example = readme_block("python", "run_hosted", "docs/dynamo.md")
    process = local.Process(
        "example",
        [sys.executable, "-c", example],
        deployment.folder / "example.log",
        deployment.env,
    )
    deployment.processes.append(process)
    local.wait_until(
        "the example's model at the frontend",
        lambda: "my-sim" in httpx.get(f"{deployment.url}/v1/models", timeout=5).text,
        60,
        process,
    )
    body = {"model": "my-sim", "prompt": "the a", "max_tokens": 2}
    answer = httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.tail()
