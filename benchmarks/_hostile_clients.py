"""What the hostile clients send, how they watch without reading, and how they leave.

The load test's edge scenario runs these clients (``_load_hostile.py``), and
the tests of the rules each of them once broke (``tests/test_hostile_clients.py``,
``tests/test_edge_admission.py``, ``tests/_edge_server.py``) are the same
clients: one copy, so that what a test holds the server to is what the load
test measures.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import sys
import termios

import h2.config
import h2.connection
import h2.settings
import trio

__all__ = ["flood_preface", "h2_client", "h2_frame", "h2_requests", "reset", "unread"]


def h2_client(initial_window: int | None = None) -> h2.connection.H2Connection:
    """An HTTP/2 client with prior knowledge, its preface and SETTINGS queued (granting
    ``initial_window``, if given, as every stream's flow-control window)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    if initial_window is not None:
        conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window},
        )
    conn.initiate_connection()
    return conn


def h2_requests(
    authority: str,
    streams: int,
    body: bytes | None = None,
    *,
    path: str = "/generate",
    zero_window: bool = False,
) -> bytes:
    """An HTTP/2 client's first bytes: its preface, then ``streams`` requests, POSTs of
    ``body`` (GETs without one). ``zero_window``: SETTINGS grant an initial window of 0, so
    that a server speaking HTTP/2 can send no byte of any answer but its headers."""
    conn = h2_client(0 if zero_window else None)
    method = "GET" if body is None else "POST"
    head = [(":method", method), (":path", path), (":scheme", "http"), (":authority", authority)]
    for stream_id in range(1, 2 * streams, 2):
        if body is None:
            conn.send_headers(stream_id, head, end_stream=True)
        else:
            conn.send_headers(stream_id, [*head, ("content-type", "application/json")])
            conn.send_data(stream_id, body, end_stream=True)
    return conn.data_to_send()


def h2_frame(kind: int, stream: int, payload: bytes) -> bytes:
    """One HTTP/2 frame written by hand (no flags), where h2 would refuse to send it."""
    return (
        struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) + struct.pack(">I", stream) + payload
    )


def flood_preface(streams: int = 999, frames: int = 5000) -> bytes:
    """An HTTP/2 client's preface, then PRIORITY frames for ``streams`` idle streams, each
    made a child of the root again and again: ``frames`` of 14 bytes, that ask for nothing
    (each such frame cost hypercorn's priority tree about 1.5 ms once it held 999 streams)."""
    flood = bytearray(h2_client().data_to_send())
    for i in range(frames):
        flood += h2_frame(2, 1 + 2 * (i % streams), bytes(4) + b"\x10")
    return bytes(flood)


def unread(sock: socket.socket | trio.socket.SocketType) -> int:
    """Bytes of the server's answer waiting in the receive buffer (``FIONREAD``): seen
    without reading them, so that the window the client advertises stays as it is."""
    waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4))
    return int.from_bytes(waiting, sys.byteorder)


def reset(sock: socket.socket | trio.socket.SocketType) -> None:
    """Close with a reset (SO_LINGER on, 0 s), as a client that crashed or timed out."""
    with contextlib.suppress(OSError):  # the server's reset came first
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
