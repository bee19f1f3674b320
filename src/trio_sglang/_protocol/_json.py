"""JSON text exactly as ``json.dumps`` writes it, with less work per call.

``json.dumps`` builds a new C encoder at every call (through two Python
layers); a streamed response encodes an event per token, so the encoder is
built once here and called directly. The text is the same, byte for byte:
the same separators, ASCII only, NaN and the infinities as ``json.dumps``
writes them, the same ``TypeError`` for what JSON cannot hold. The one check
left out is for a value that contains itself (it raises ``RecursionError``
here, not ``ValueError``): the server encodes its own dicts and the engine's
outputs, and neither can.

``Template`` goes further for events whose every field but one or two is the
same throughout a response (OpenAI's stream chunks): the constant text is
encoded once, and each event encodes only what changes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

__all__ = ["Template", "dumps"]


def _encoder() -> Callable[[object], str]:
    if c_make_encoder is None:  # a Python without the C accelerator
        return json.dumps
    encode = c_make_encoder(
        None,  # markers: no check for a value that contains itself
        json.JSONEncoder().default,  # its TypeError
        encode_basestring_ascii,
        None,  # indent
        ": ",
        ", ",
        False,  # sort_keys
        False,  # skipkeys
        True,  # allow_nan
    )
    return lambda value: "".join(encode(value, 0))


#: ``json.dumps(value)``, byte for byte.
dumps: Callable[[object], str] = _encoder()

#: Stands for a value filled in per event; random, so that no client's text can be taken for it.
_HOLE = f"\x00{uuid.uuid4().hex}"


class Template:
    """The JSON of a dict whose values at its holes change per call, the rest encoded once.

    ``Template({"id": "x", "choices": Template.HOLE}).render([...])`` is
    ``dumps({"id": "x", "choices": [...]})``: the constant text around each
    hole is kept, and a call encodes only the values it is given, in the
    order of the holes.
    """

    HOLE = _HOLE

    def __init__(self, shape: dict[str, Any]) -> None:
        text = dumps(shape)
        marker = dumps(_HOLE)
        self._parts = tuple(text.split(marker))
        holes = sum(1 for value in shape.values() if value is _HOLE)
        if len(self._parts) != holes + 1:
            raise ValueError("each hole must be a top-level value of the shape")

    def render(self, *values: object) -> str:
        parts = self._parts
        if len(values) != len(parts) - 1:
            raise TypeError(f"{len(parts) - 1} values expected, got {len(values)}")
        pieces = [parts[0]]
        for value, after in zip(values, parts[1:], strict=True):
            pieces += (dumps(value), after)
        return "".join(pieces)
