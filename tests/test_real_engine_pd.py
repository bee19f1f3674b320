"""A real prefill/decode pair: two ``serve --engine sglang`` over Mooncake's TCP transport.

SGLang's ``fake`` KV transfer backend is for a decode server alone (a prefill
server refuses it), so the pair runs on Mooncake, the backend production
pairs run, over TCP: the ``mooncake-transfer-engine-non-cuda`` wheel and the
``libibverbs`` it links to (``nox -s real-engine`` brings both). The prefill
server runs SGLang's bootstrap server; the decode server, in front, runs each
request's prefill leg there (``--prefill-url``) and decodes the KV cache that
Mooncake moved. On this CPU the prefill's KV sender takes its plain path
(``benchmarks/_http_servers_cpu.py``). Each server's cores are its own
(``SGLANG_CPU_OMP_THREADS_BIND``).

Clients of the decode server leave at moments spread over both legs (a slow
tokenization, the prefill leg's bootstrap and queue, its prefill of a long
prompt, its KV transfer, the decode leg's pre-allocation and its decoding).
Each is judged by both schedulers' load snapshots (``/v1/loads``): every
queue of both legs empty and no KV token held, within the bound, and no
request state left in either TokenizerManager. Marker ``real_engine``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from _processes import wait_until

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")
if importlib.util.find_spec("mooncake") is None:
    pytest.skip(
        "needs mooncake-transfer-engine-non-cuda: run `nox -s real-engine`",
        allow_module_level=True,
    )

import _server_sweep as sweep
from _leaving_client import close_after
from _subprocesses import free_port
from trio_sglang_harness import build_tiny_model

pytestmark = pytest.mark.real_engine

#: A prompt whose prefill takes long enough on this CPU to leave in the middle of it.
LONG_PROMPT = [7] * 7000
#: Seconds from a client's leaving to both legs holding nothing.
BOUND = 5.0
#: The queues of a leg, as ``/v1/loads?include=all`` names them, that hold a request.
PREFILL_QUEUES = ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs")
DECODE_QUEUES = (
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
)
#: Where a client leaves: (prompt, seconds after sending, data chunks read first). On this
#: CPU the long prompt waits in the prefill leg's bootstrap queue for about a second (its
#: decode leg pre-allocated, waiting for the KV cache), is prefilled in two chunks for
#: about 1.5 s, is transferred, and decodes from about 3 s on. The decoding client reads
#: 200 chunks (about a second of decoding): 20 took so little that the legs' load
#: snapshots, sampled every few tens of milliseconds, missed the decoding now and then.
LEAVES: dict[str, tuple[str | list[int], float, int]] = {
    "slow tokenization": (sweep.SLOW_PROMPT + "hello", 0.1, 0),
    "right after sending": (LONG_PROMPT, 0.0, 0),
    "in the bootstrap queue": (LONG_PROMPT, 0.3, 0),
    "in the prefill": (LONG_PROMPT, 1.5, 0),
    "late in the prefill": (LONG_PROMPT, 2.4, 0),
    "at the first token": (LONG_PROMPT, 0.0, 1),
    "decoding": (LONG_PROMPT, 0.0, 200),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The prefill server's URL and the decode server's, both serving."""
    bootstrap = free_port()
    cores = sorted(os.sched_getaffinity(0))
    with ExitStack() as stack, pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOONCAKE_PROTOCOL", "tcp")

        def leg(mode: str, core: int, *flags: str) -> sweep.Server:
            """One side of the pair on its own core, over Mooncake."""
            patch.setenv("SGLANG_CPU_OMP_THREADS_BIND", str(core))
            mooncake = ("--disaggregation-transfer-backend", "mooncake")
            flags = ("--disaggregation-mode", mode, *mooncake, *flags)
            folder = tmp_path_factory.mktemp(mode)
            return stack.enter_context(
                sweep.started("trio-sglang-serve", model, folder, flags=flags)
            )

        prefill = leg(
            "prefill",
            cores[0],
            "--disaggregation-bootstrap-port",
            str(bootstrap),
            # A prefix sent early (a radix-cache hit, a chunked prefill's first chunks)
            # waits on a CUDA event under the overlap scheduler.
            "--disable-radix-cache",
            "--disable-overlap-schedule",
        )
        decode = leg(
            "decode",
            cores[-1],
            # The default backup registers host memory with CUDA.
            "--disaggregation-decode-retraction-backup",
            "cpu_tensor",
            "--prefill-url",
            prefill.url,
            "--prefill-bootstrap-port",
            str(bootstrap),
        )
        yield {"prefill": prefill.url, "decode": decode.url}


def load(url: str) -> dict[str, int]:
    """What one leg's scheduler holds: its requests by queue, and its KV tokens in use."""
    (rank,) = httpx.get(f"{url}/v1/loads", params={"include": "all"}, timeout=5).json()["loads"]
    held = {
        "running": int(rank["num_running_reqs"]),
        "waiting": int(rank["num_waiting_reqs"]),
        "kv_tokens": int(rank["num_used_tokens"]),
    }
    queues = rank.get("disaggregation") or {}
    held |= {name: int(queues.get(name, 0)) for name in (*PREFILL_QUEUES, *DECODE_QUEUES)}
    return held


def states(url: str) -> int:
    """Request states the TokenizerManager holds (``trio_sglang_engine_live_requests``)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.search(r"^trio_sglang_engine_live_requests (\S+)$", text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def idle(pair: dict[str, str]) -> bool:
    """Both schedulers hold nothing and both TokenizerManagers no state.

    The state goes last: a TokenizerManager lets go of an aborted request when
    its scheduler says the abort took, and a scheduler that is idle but for a
    request in its bootstrap queue may not have published that it holds it.
    """
    return all(not any(load(url).values()) and not states(url) for url in pair.values())


class Sampler:
    """Each leg's busy queues, sampled until stopped: where the request was when it left."""

    def __init__(self, pair: dict[str, str]) -> None:
        self.seen: set[str] = set()
        self._pair = pair
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for leg, url in self._pair.items():
                self.seen |= {f"{leg}:{name}" for name, n in load(url).items() if n}
            self._stop.wait(0.01)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def leave(pair: dict[str, str], prompt: str | list[int], after: float, chunks: int) -> set[str]:
    """A client of the decode server that leaves so; what the legs held before it left."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    # The long prompt and its completion within the model's 8,192 positions.
    tokens = 2000 if isinstance(prompt, str) else 8000 - len(prompt)
    body: dict[str, Any] = {
        key: prompt,
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }
    with Sampler(pair) as sampler:
        close_after(pair["decode"], body, after, chunks)
    return sampler.seen


def test_the_pair_serves_a_request_across_both_legs(pair: dict[str, str]) -> None:
    """So that nothing below passes on a pair that fails every request."""
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
    answer = httpx.post(f"{pair['decode']}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["completion_tokens"] == 16
    wait_until("both legs to let the request go", lambda: idle(pair), BOUND)


@pytest.mark.parametrize("moment", list(LEAVES))
def test_a_client_leaving_stops_both_legs(pair: dict[str, str], moment: str) -> None:
    wait_until("both legs to be idle before the client", lambda: idle(pair), 60)
    seen = leave(pair, *LEAVES[moment])
    left = time.monotonic()
    wait_until(f"both legs to let go after {moment}", lambda: idle(pair), BOUND)
    print(f"{moment}: held {sorted(seen)}; idle {time.monotonic() - left:.3f} s after")
    if moment not in ("slow tokenization", "right after sending"):
        assert seen, "the request never reached a scheduler (refused?)"


def test_the_moments_cover_both_legs(pair: dict[str, str]) -> None:
    """The leaves above are timed, so this says they landed where they aim, over a few tries."""
    covered: set[str] = set()
    wanted: dict[str, Callable[[set[str]], bool]] = {
        "the prefill leg queued or running": lambda seen: any(
            s.startswith("prefill:") for s in seen
        ),
        "the decode leg waiting for its KV cache": lambda seen: any(
            s in {"decode:decode_prealloc_queue_reqs", "decode:decode_transfer_queue_reqs"}
            for s in seen
        ),
        "the decode leg decoding": lambda seen: "decode:running" in seen,
    }
    for _ in range(3):
        for moment in ("in the bootstrap queue", "in the prefill", "decoding"):
            wait_until("both legs to be idle before the client", lambda: idle(pair), 60)
            seen = leave(pair, *LEAVES[moment])
            covered |= {name for name, hit in wanted.items() if hit(seen)}
            wait_until(f"both legs to let go after {moment}", lambda: idle(pair), BOUND)
        if covered == set(wanted):
            break
    assert covered == set(wanted)


def test_the_pair_still_serves_after_every_client_left(pair: dict[str, str]) -> None:
    """A leg that died (its scheduler gone) would hold nothing too: it must still serve."""
    test_the_pair_serves_a_request_across_both_legs(pair)
