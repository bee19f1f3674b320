"""The request fields the installed SGLang release takes, where it lacks some trio-sglang knows.

trio-sglang's field tables are SGLang 0.5.23's (``_request/_fields.py``, ``_request/_sampling.py``).
An older release's ``GenerateReqInput`` or ``SamplingParams`` lacks some of
them, and a request that sets one would fail inside SGLang at the first
pull, after its rid was registered. Listing what the release does take as the
engine's ``honoured_fields`` makes the worker refuse such a request up front,
naming the field, before anything reaches the engine.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from .._request._fields import GENERATE_FIELDS
from .._request._sampling import SAMPLING_PARAMS, native_name

__all__ = ["fields_taken"]


def fields_taken() -> frozenset[str] | None:
    """``honoured_fields`` for the installed release; None where it takes every field."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    top, sampling = _field_names(GenerateReqInput), _field_names(SamplingParams)
    if GENERATE_FIELDS.keys() <= top and SAMPLING_PARAMS.keys() <= sampling:
        return None
    return frozenset(
        {key for key in GENERATE_FIELDS if key in top}
        | {native_name(key) for key in SAMPLING_PARAMS if key in sampling}
    )


def _field_names(cls: Any) -> set[str]:
    """A dataclass's fields, a msgspec struct's (0.5.17 on), or else its constructor's."""
    if dataclasses.is_dataclass(cls):
        return {field.name for field in dataclasses.fields(cls)}
    struct_fields = getattr(cls, "__struct_fields__", None)
    if struct_fields is not None:
        return set(struct_fields)
    return set(inspect.signature(cls.__init__).parameters) - {"self"}
