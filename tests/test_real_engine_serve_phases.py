"""``serve`` on the whole engine: a client leaving in each phase, judged by the real scheduler.

The benchmark's own server and clients (``benchmarks/_server_sweep.py``):
``serve --engine sglang --device cpu`` with SGLang's TokenizerManager slowed
for marked prompts (``benchmarks/_http_servers_cpu.py``), so that a client can
leave during a slow tokenization; a client closing its socket right after
sending, 0.1 s into that tokenization, or after two chunks. After each, the
scheduler's own load snapshot (``trio_sglang_scheduler_requests``), polled for
a window much shorter than the request's decode: a request that reached the
scheduler before its client left must be gone from it, one that had not must
never reach it. Marker ``real_engine``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

from trio_sglang_harness import build_tiny_model

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def sweep() -> Any:
    import _server_sweep

    return _server_sweep


@pytest.fixture(scope="module")
def server(sweep: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("real-engine-phases")
    model = build_tiny_model(folder / "tiny-llama")
    with sweep.started("trio-sglang-serve", model, folder) as started:
        yield started


def test_a_client_gone_during_a_slow_tokenization_never_reaches_the_scheduler(
    sweep: Any, server: Any
) -> None:
    for _ in range(3):
        _, ran, left = sweep.watch(server, sweep.leave(server, "slow_tokenization"))
        assert (ran, left) == (False, False)


@pytest.mark.parametrize("phase", ["before_headers", "mid_stream"])
def test_a_client_gone_before_headers_or_mid_stream_is_stopped_at_once(
    sweep: Any, server: Any, phase: str
) -> None:
    """Stopped within a fraction of the request's decode (400 tokens: about a second)."""
    for _ in range(3):
        until_idle, _, left = sweep.watch(server, sweep.leave(server, phase))
        assert not left
        assert until_idle < 0.5, until_idle
