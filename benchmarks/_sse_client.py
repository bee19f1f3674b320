"""The serving benchmark's clients: many SSE streams, read by one lean process.

    python benchmarks/_sse_client.py --url URL --endpoint PATH --model NAME
        --streams N --max-tokens M --warmup S --window S --server-pid PID [--seed N]

What it does is in docs/benchmarks.md, "Serving throughput"; it prints one JSON
line (``Reading``). Why not httpx: the server is measured, so the client must
read far more events per second than the server can send while spending little
of the machine. Here nothing is parsed that does not need to be: one
``selectors`` loop, no event loop framework, and every read counted with
``bytes.count``. A data event starts a line with ``data: `` (JSON escapes a
newline in a string, so the marker occurs nowhere else); a heartbeat is a chunk
of its own holding two blank lines (``2\\r\\n\\n\\n``: no event is that short);
the response ends with chunked transfer-encoding's last chunk,
``\\r\\n0\\r\\n\\r\\n`` (a chunk size never has a leading zero). A marker split
across two reads is found by counting over the previous read's last bytes too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from _leaving_client import post_head
from trio_sglang.bench_endpoint._apis import request_body

__all__ = ["ENDED", "Reading", "Response", "cpu_seconds", "main", "reading_from"]

_DATA = b"\ndata: "
_BEAT = b"\r\n2\r\n\n\n"
_DONE = b"\ndata: [DONE]"
_END = b"\r\n0\r\n\r\n"
#: As many of a read's last bytes as a marker can straddle (the longest, less one).
_KEEP = len(_DONE) - 1
_READ_BYTES = 1 << 18
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The counts of a ``Reading`` that are taken over the window only.
_WINDOWED = ("chunks", "heartbeats", "responses", "bytes", "reads")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid``, all its threads (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


@dataclass(slots=True)
class Reading:
    """What one run of the clients saw; counts over the window unless named otherwise."""

    streams: int
    window_s: float = 0.0
    #: The warm-up as it went: seconds, and the streams that had no token by its end.
    warmup_s: float = 0.0
    late_streams: int = 0
    #: Data events with a token (``[DONE]`` not counted), heartbeats, responses ended.
    chunks: int = 0
    heartbeats: int = 0
    responses: int = 0
    #: Bytes read, and reads (a read takes whatever events arrived since the last).
    bytes: int = 0
    reads: int = 0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    #: Over the whole run: tokens asked by the responses read to their end, and the
    #: data events those responses carried (fewer than tokens: the server coalesced).
    tokens_completed: int = 0
    chunks_completed: int = 0
    #: Over the whole run: why requests failed (a status, a connection closed early).
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1


@dataclass(slots=True, eq=False)
class Response:
    """One streamed response, read as it comes: counted, never parsed further.

    ``take`` is given each read in turn and counts what it adds to ``reading``;
    it says when the response ended (``ENDED``) or failed (a message).
    """

    #: Tokens the request asked for.
    asked: int
    chunks: int = 0
    done: bool = False
    head: bytes = b""
    in_body: bool = False
    #: The previous read's last bytes: a marker split between two reads is still found.
    tail: bytes = b""

    def take(self, data: bytes, reading: Reading) -> str | None:
        if not self.in_body:
            head = self.head + data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                self.head = head
                return None
            if not head.startswith(b"HTTP/1.1 200 "):
                return f"HTTP {head[9:12].decode(errors='replace')}"
            self.in_body, data = True, head[end + 2 :]  # a newline before the body's first line
        old = self.tail
        seen = old + data
        events = seen.count(_DATA) - old.count(_DATA)
        done = seen.count(_DONE) - old.count(_DONE)
        reading.chunks += events - done
        reading.heartbeats += seen.count(_BEAT) - old.count(_BEAT)
        self.chunks += events - done
        self.done = self.done or done > 0
        if _END not in seen:
            self.tail = seen[-_KEEP:]
            return None
        if not self.done:
            return "ended without [DONE]"
        reading.responses += 1
        reading.tokens_completed += self.asked
        reading.chunks_completed += self.chunks
        return ENDED


#: What ``Response.take`` says when the response ended well.
ENDED = "ended"


@dataclass(slots=True, eq=False)
class _Stream:
    """One connection, streaming one response at a time."""

    index: int
    sock: socket.socket
    response: Response = field(default_factory=lambda: Response(0))


class _Clients:
    def __init__(self, args: argparse.Namespace) -> None:
        url = urlsplit(args.url)
        self._address = (url.hostname or "127.0.0.1", url.port or 80)
        self._host = url.netloc
        self._args = args
        self._rng = random.Random(args.seed)
        self._selector = selectors.DefaultSelector()
        self.total = Reading(args.streams)
        #: The streams that have not had a token yet.
        self._waiting = set(range(args.streams))

    def request(self, tokens: int) -> bytes:
        body = json.dumps(
            request_body(self._args.endpoint, "hello", tokens, model=self._args.model)
        ).encode()
        return post_head(self._host, self._args.endpoint, len(body)) + body

    def open(self, index: int, tokens: int) -> None:
        sock = socket.create_connection(self._address, timeout=self._args.connect_timeout)
        sock.setblocking(False)
        stream = _Stream(index, sock)
        self._selector.register(sock, selectors.EVENT_READ, stream)
        self._send(stream, tokens)

    def _send(self, stream: _Stream, tokens: int) -> None:
        request = self.request(tokens)
        # A few hundred bytes into an idle connection's empty send buffer: all of it goes.
        if stream.sock.send(request) != len(request):
            raise RuntimeError("a request did not fit in an empty socket buffer")
        stream.response = Response(tokens)

    def _reopen(self, stream: _Stream, why: str) -> None:
        self.total.fail(why)
        self._selector.unregister(stream.sock)
        stream.sock.close()
        self.open(stream.index, self._args.max_tokens)

    def _read(self, stream: _Stream) -> None:
        try:
            data = stream.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._reopen(stream, type(exc).__name__)
            return
        if not data:
            self._reopen(stream, "closed mid-response")
            return
        self.total.reads += 1
        self.total.bytes += len(data)
        said = stream.response.take(data, self.total)
        if stream.response.chunks:
            self._waiting.discard(stream.index)
        if said == ENDED:
            self._send(stream, self._args.max_tokens)
        elif said is not None:
            self._reopen(stream, said)

    def run(self) -> Reading:
        """Open the streams, read through the warm-up, then measure over the window.

        The warm-up lasts ``warmup`` s, and then until every stream has had a
        token: a server still starting its streams (at 1,000, a busy second or
        two) is not in its steady state yet. At most ``flowing_bound`` s more;
        streams still waiting then are counted (``late_streams``).
        """
        args = self._args
        started = time.monotonic()
        for index in range(args.streams):
            self.open(index, self._rng.randint(1, args.max_tokens))
        self._read_until(started + args.warmup)
        self._read_until(started + args.warmup + args.flowing_bound, until_flowing=True)
        before = {name: getattr(self.total, name) for name in _WINDOWED}
        wall, server_cpu, client_cpu = (
            time.monotonic(),
            cpu_seconds(args.server_pid),
            time.process_time(),
        )
        reading = self.total
        reading.warmup_s, reading.late_streams = wall - started, len(self._waiting)
        self._read_until(wall + args.window)
        reading.window_s = time.monotonic() - wall
        reading.server_cpu_s = cpu_seconds(args.server_pid) - server_cpu
        reading.client_cpu_s = time.process_time() - client_cpu
        for name, count in before.items():
            setattr(reading, name, getattr(reading, name) - count)
        return reading

    def _read_until(self, deadline: float, *, until_flowing: bool = False) -> None:
        while (wait := deadline - time.monotonic()) > 0:
            if until_flowing and not self._waiting:
                return
            for key, _ in self._selector.select(timeout=wait):
                self._read(key.data)
            # A pause between rounds: a read then takes all a stream's events since the
            # last, so the client's CPU per event falls as the rate rises. The server
            # is not affected: it writes each event as it comes, into the socket buffer.
            time.sleep(self._args.read_pause)

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            key.data.sock.close()
        self._selector.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="_sse_client.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--warmup", type=float, required=True)
    parser.add_argument("--window", type=float, required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--connect-timeout", type=float, default=10.0)
    parser.add_argument("--read-pause", type=float, default=0.0, help="s between read rounds")
    parser.add_argument(
        "--flowing-bound", type=float, default=30.0, help="s past the warm-up, at most"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    clients = _Clients(build_parser().parse_args(argv))
    try:
        reading = clients.run()
    finally:
        clients.close()
    print(json.dumps(asdict(reading)))
    return 0


def reading_from(line: str) -> Reading:
    """The ``Reading`` a client printed."""
    data: dict[str, Any] = json.loads(line)
    return Reading(**data)


if __name__ == "__main__":
    sys.exit(main())
