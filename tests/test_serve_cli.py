"""``trio-sglang serve`` as a user runs it: a subprocess, signals, streams open, and the
flags it refuses before it serves."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import trio

from _readme import readme_block


async def start(*args: str) -> tuple[trio.Process, str, bytearray]:
    """Start the CLI on a free loopback port; return it, its URL and its stderr so far."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_sglang", "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    log = bytearray()
    with trio.fail_after(20):
        while not (match := re.search(rb"serving \S+ on (http://\S+)", log)):
            chunk = await proc.stderr.receive_some()
            if not chunk:
                raise AssertionError(f"serve exited early: {log.decode()}")
            log += chunk
    return proc, match.group(1).decode(), log


async def drain_stderr(proc: trio.Process, log: bytearray) -> None:
    assert proc.stderr is not None
    while chunk := await proc.stderr.receive_some():
        log += chunk


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_a_signal_ends_open_streams_then_the_server(signum: signal.Signals) -> None:
    proc, url, log = await start("--sim-token-interval", "0.2")
    assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 1000}}
    events: list[str] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_stderr, proc, log)
            async with (
                httpx.AsyncClient(base_url=url, timeout=10) as client,
                client.stream("POST", "/generate", json=body) as response,
            ):
                with trio.fail_after(10):
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        events.append(line)
                        if len(events) == 2:
                            proc.send_signal(signum)  # two tokens in, 998 to go
            with trio.fail_after(10):
                assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    error = json.loads(events[-2].removeprefix("data: "))
    assert "shutting down" in error["error"]["message"]
    assert (error["error"]["type"], error["error"]["code"]) == ("server_error", "shutting_down")
    assert events[-1] == "data: [DONE]"
    assert len(events) < 50  # ended by the signal, not by the 1000 tokens
    assert f"received {signum.name}" in log.decode()


async def test_the_serving_page_curl_and_openai_examples_work() -> None:
    proc, url, _ = await start()
    try:
        readme_url = "http://127.0.0.1:8000"
        curl = readme_block("bash", "curl ", "docs/serving.md").replace(readme_url, url)
        result = await trio.run_process(["bash", "-c", curl], capture_stdout=True)
        events = [line for line in result.stdout.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert len(events) == 9  # eight tokens, then [DONE]

        sdk = readme_block("python", "from openai import OpenAI", "docs/serving.md")
        sdk = sdk.replace(readme_url, url)
        result = await trio.run_process(
            [sys.executable, "-c", sdk], capture_stdout=True, capture_stderr=True
        )
        assert result.stdout.decode().strip()
    finally:
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(10):
            await proc.wait()


@pytest.mark.parametrize(
    ("args", "role"),
    [
        ([], "aggregated"),
        (["--disaggregation-mode", "prefill"], "prefill"),
        (["--disaggregation-mode", "decode"], "decode"),
    ],
)
async def test_the_start_up_line_names_the_role_the_engine_and_the_address(
    args: list[str], role: str
) -> None:
    """A prefill server and its decode server log lines one tells apart."""
    proc, url, log = await start(*args)
    proc.send_signal(signal.SIGINT)
    with trio.fail_after(10):
        assert await proc.wait() == 0
    [line] = [line for line in log.decode().splitlines() if "serving " in line]
    assert line.endswith(f"serving trio-sglang-sim on {url} (role {role}, engine sim)")


async def test_served_model_name_repeated_names_aliases() -> None:
    proc, url, log = await start("--served-model-name", "primary", "--served-model-name", "alias")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            models = (await client.get("/v1/models")).json()["data"]
            info = (await client.get("/server_info")).json()
    finally:
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(10):
            await proc.wait()
    assert [model["id"] for model in models] == ["primary", "alias"]
    assert info["served_model_name"] == "primary"
    assert f"serving primary,alias on {url}" in log.decode()


# -- disaggregation flags that cannot work ---------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-url", "http://127.0.0.1:1"], "--disaggregation-mode decode"),
        (
            ["--disaggregation-mode", "prefill", "--prefill-url", "http://127.0.0.1:1"],
            "--disaggregation-mode decode",
        ),
        (["--disaggregation-mode", "decode", "--prefill-bootstrap-port", "9"], "--prefill-url"),
        (["--disaggregation-mode", "decode", "--prefill-url", "127.0.0.1:1"], "http(s)://"),
    ],
)
def test_serve_refuses_bad_disaggregation_flags(args: list[str], message: str) -> None:
    result = serve_exits(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.count("\n") == 1  # one line


def test_a_decode_server_whose_prefill_server_hangs_says_so_in_one_line() -> None:
    """A prefill server that accepts connections and never answers: its 5 s bound, then exit 2."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as hanging:  # never accepts
        url = f"http://127.0.0.1:{hanging.getsockname()[1]}"
        result = serve_exits("--disaggregation-mode", "decode", "--prefill-url", url)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"the prefill server is not usable: could not read {url}/capabilities: no answer in "
        "full within 5.0 s"
    ]
    assert result.stdout == ""


def serve_exits(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trio_sglang", "serve", "--port", "0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=15, check=False)
