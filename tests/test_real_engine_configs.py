"""``serve`` on the whole engine in the configurations people run, judged by the real scheduler.

One ``serve --engine sglang --device cpu`` per configuration (SGLang's own
flags), on the tiny model, with the benchmark's clients
(``benchmarks/_server_sweep.py``): a client leaving right after sending, 0.1 s
into a slow tokenization, or after two chunks; and per configuration, the
moment it is about (a long prompt left in the middle of its chunked prefill,
a request left while it waits behind a full batch). After each, the
scheduler's own load snapshot (every DP rank's, summed) must let the request
go within the window, and the TokenizerManager must hold no state of it.
Marker ``real_engine``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from _processes import wait_until

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

import _server_sweep as sweep
from _leaving_client import close_after
from trio_sglang_harness import build_tiny_model

pytestmark = pytest.mark.real_engine

#: SGLang's flags for each configuration.
CONFIGS: dict[str, tuple[str, ...]] = {
    "data parallel": ("--dp-size", "2"),
    "dynamic batch tokenizer": ("--enable-dynamic-batch-tokenizer",),
    "chunked prefill": ("--chunked-prefill-size", "64"),
    "full batch": ("--max-running-requests", "1"),
    "priority scheduling": ("--enable-priority-scheduling",),
}
#: A prompt of token ids long enough that its chunked prefill takes a while (the model
#: takes 8,192 positions).
LONG_PROMPT = [7] * 7000


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def cores_per_rank(ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND``: this machine's cores, one group per rank.

    SGLang's CPU engine binds each rank's threads to a NUMA node, and with
    more ranks than nodes it asks for the groups to be given.
    """
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // ranks)
    groups = [cores[i * share : (i + 1) * share] or cores[-1:] for i in range(ranks)]
    return "|".join(",".join(map(str, group)) for group in groups)


@pytest.fixture(scope="module", params=CONFIGS)
def server(
    request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[sweep.Server]:
    folder = tmp_path_factory.mktemp("config")
    flags = CONFIGS[request.param]
    with pytest.MonkeyPatch.context() as patch:
        if "--dp-size" in flags:
            ranks = int(flags[flags.index("--dp-size") + 1])
            patch.setenv("SGLANG_CPU_OMP_THREADS_BIND", cores_per_rank(ranks))
        with sweep.started("trio-sglang-serve", model, folder, flags=flags) as started:
            yield started


def states(url: str) -> int:
    """Request states the TokenizerManager holds (``trio_sglang_engine_live_requests``)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.search(r"^trio_sglang_engine_live_requests (\S+)$", text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def test_the_configuration_serves(server: sweep.Server) -> None:
    """So that nothing below passes on a server that fails every request."""
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    answer = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["completion_tokens"] == 8


def test_a_client_leaving_in_each_phase_leaves_nothing_at_the_engine(server: sweep.Server) -> None:
    for phase in sweep.SERVER_PHASES:
        for _ in range(2):
            until_idle, _, left = sweep.watch(server, sweep.leave(server, phase))
            assert not left, (phase, until_idle)
            assert states(server.url) == 0, phase


def test_a_long_prompt_left_in_its_prefill_leaves_nothing(server: sweep.Server) -> None:
    body = {"input_ids": LONG_PROMPT, "sampling_params": {"max_new_tokens": 400}}
    for _ in range(2):
        until_idle, _, left = sweep.watch(server, close_after(server.url, body, 0.05, 0))
        assert not left, until_idle
        assert states(server.url) == 0


def test_a_request_left_while_it_waits_behind_a_running_one_leaves_nothing(
    server: sweep.Server,
) -> None:
    """With ``--max-running-requests 1`` the second waits; elsewhere both run. Either way,
    once its client leaves only the first one is held."""
    first = _stream(server.url, 1200)
    try:
        wait_until("the first request to run", lambda: server.holds() == 1, 30)
        params = {"max_new_tokens": 400, "ignore_eos": True}
        close_after(server.url, {"text": "second", "sampling_params": params}, 0.3, 0)
        wait_until("the second request to go", lambda: server.holds() <= 1, 2.5)
        assert server.holds() == 1  # the first one, still read by its client
    finally:
        first.close()
    wait_until("the first request to go", lambda: not server.holds(), 2.5)
    assert states(server.url) == 0


def _stream(url: str, tokens: int) -> socket.socket:
    """A streaming ``/generate`` of ``tokens`` tokens whose client reads on (the caller closes)."""
    host, port = url.removeprefix("http://").split(":")
    data = (
        '{"text": "first", "stream": true, "sampling_params": '
        f'{{"max_new_tokens": {tokens}, "ignore_eos": true}}}}'
    ).encode()
    client = socket.create_connection((host, int(port)), timeout=30)
    client.sendall(
        f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return client
