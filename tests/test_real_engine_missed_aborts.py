"""Aborts SGLang's scheduler misses, on the whole engine: ``serve`` sends them again.

Both servers run with SGLang's scheduler missing the first abort of every
request (``benchmarks/_http_servers_cpu.py``, SGLang issue #36876), and clients
leave after two chunks of seconds of decoding (``benchmarks/missed_aborts.py``).
Judged by the scheduler's own load snapshot and by its log of the aborts it
missed: with ``serve`` every request stops, its abort sent again (and counted
in ``/metrics``); SGLang's own server, with the same fault, leaves it
decoding (on 0.5.23 its one abort is missed; 0.5.19's sends none at all).
``nox -s real-engine`` runs it on SGLang 0.5.23 and 0.5.19, whose close
forgets the request, after which only the scheduler's own outputs tell that
it decodes on. Marker ``real_engine``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

import missed_aborts as bench
from _server_sweep import started, watch
from trio_sglang_harness import build_tiny_model

pytestmark = pytest.mark.real_engine

CANCELS = 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("missed-aborts")


@pytest.fixture(scope="module")
def model(folder: Path) -> Path:
    return build_tiny_model(folder / "tiny-llama")


def test_serve_stops_every_request_whose_first_abort_the_scheduler_missed(
    folder: Path, model: Path
) -> None:
    with started("trio-sglang-serve", model, folder, "--miss-first-abort") as server:
        runs = [watch(server, bench.leave(server)) for _ in range(CANCELS)]
        assert bench.missed(folder / "trio-sglang-serve.log") == CANCELS  # the fault took
        assert bench.resent(server) == CANCELS
    assert [still for _, _, still in runs] == [False] * CANCELS
    assert max(until for until, _, _ in runs) < 1.0, runs  # of seconds of decoding


def test_sglangs_own_server_with_the_same_fault_leaves_the_request_decoding(
    folder: Path, model: Path
) -> None:
    with started("sglang-server", model, folder, "--miss-first-abort") as server:
        until, _, still = watch(server, bench.leave(server))
    assert still, until
