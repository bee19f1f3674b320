"""The installed SGLang release's scheduler messages, for the stand-in scheduler.

Releases differ in how messages travel (pickled dataclasses up to 0.5.16,
msgspec structs with ``sock_send``/``sock_recv`` from 0.5.17) and in which
fields a ``BatchStrOutput`` requires (0.5.19 adds
``output_token_sampling_logprobs``, 0.5.23 drops it again). Nothing here is
a per-release list: the fields come from the class's own definition. The
ones whose meaning the stand-in plays (ids, texts, token counts, finish
reasons) get real values; every other required field gets what its type
admits, ``None`` per request where it can (the TokenizerManager indexes
them per request) and ``None`` as a whole where only that is valid.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq

__all__ = ["batch_str_output", "receive", "round_trip", "send"]


def send(socket: zmq.Socket[bytes], message: object) -> None:
    from sglang.srt.managers import io_struct

    sock_send = getattr(io_struct, "sock_send", None)
    if sock_send is None:
        socket.send_pyobj(message)
    else:
        sock_send(socket, message)


def receive(socket: zmq.Socket[bytes], flags: int = 0) -> object:
    from sglang.srt.managers import io_struct

    sock_recv = getattr(io_struct, "sock_recv", None)
    if sock_recv is None:
        return socket.recv_pyobj(flags)
    return sock_recv(socket, flags)


def round_trip(message: object) -> object:
    """``message`` through the release's codec, as the TokenizerManager would decode it."""
    from sglang.srt.managers import io_struct

    encode = getattr(io_struct, "msgpack_encode", None)
    decode = getattr(io_struct, "msgpack_decode", None)
    if encode is None or decode is None:
        return pickle.loads(pickle.dumps(message))
    return decode(encode(message))


def batch_str_output(count: int, known: Mapping[str, Sequence[Any]]) -> Any:
    """A ``BatchStrOutput`` for ``count`` requests: ``known`` per-request values, the rest filled.

    A field in ``known`` that this release lacks is left out.
    """
    from sglang.srt.managers.io_struct import BatchStrOutput

    values: dict[str, Any] = {}
    for name, per_request in _required_fill(BatchStrOutput, frozenset(known)).items():
        values[name] = [None] * count if per_request else None
    for name, given in known.items():
        if name in _field_names(BatchStrOutput):
            values[name] = list(given)
    return BatchStrOutput(**values)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(name for name, _, _ in _fields(cls))


@functools.cache
def _required_fill(cls: type, known: frozenset[str]) -> dict[str, bool]:
    """Each required field not ``known``: True for ``None`` per request, False for ``None``."""
    fill: dict[str, bool] = {}
    for name, required, annotation in _fields(cls):
        if not required or name in known:
            continue
        if annotation is None or _admits(annotation, [None]):
            fill[name] = True
        elif _admits(annotation, None):
            fill[name] = False
        else:
            raise RuntimeError(f"{cls.__name__}.{name} ({annotation!r}) takes no None at all")
    return fill


def _fields(cls: type) -> list[tuple[str, bool, Any]]:
    """(name, required, type) per field; the type is None where nothing checks it (pickle)."""
    if dataclasses.is_dataclass(cls):
        missing = dataclasses.MISSING
        return [
            (f.name, f.default is missing and f.default_factory is missing, None)
            for f in dataclasses.fields(cls)
        ]
    import msgspec

    return [(f.name, f.required, f.type) for f in msgspec.structs.fields(cls)]


def _admits(annotation: Any, value: object) -> bool:
    import msgspec

    try:
        msgspec.convert(value, type=annotation)
    except (msgspec.ValidationError, TypeError):
        return False
    return True
