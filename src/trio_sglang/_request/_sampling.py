"""SGLang's ``SamplingParams``, checked before the engine sees them.

SGLang 0.5.23 builds ``SamplingParams(**sampling_params)`` and runs its
``normalize`` and ``verify`` while it tokenizes, after the rid is registered
(``TokenizerManager._create_tokenized_object``): whatever they refuse there is
refused here first, with their ranges and, where they read well, their words.
``SAMPLING_PARAMS`` is every parameter a caller may set, with SGLang's default
(``SamplingParams``' fields); the fields SGLang sets itself are refused
(``REFUSED_SAMPLING_PARAMS``, each with why), as is any other name, as SGLang's
``/generate`` refuses it (its contract check: ``unknown field``).

The checks name a parameter as the caller named it (``name``): a native body
says ``sampling_params.top_p``, an OpenAI request ``top_p`` (or ``min_tokens``
for ``min_new_tokens``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import InvalidRequest
from ._values import MAX_INT, is_int, is_number, is_token_list, is_unicode, shown

__all__ = [
    "REFUSED_SAMPLING_PARAMS",
    "SAMPLING_PARAMS",
    "check_sampling_params",
    "check_watermark",
    "native_name",
]

#: SGLang's ``TOP_K_ALL``: the whole vocabulary (what ``top_k = -1`` becomes).
TOP_K_ALL = 1 << 30

#: Every ``SamplingParams`` field a caller may set, with SGLang 0.5.23's default.
SAMPLING_PARAMS: Mapping[str, object] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": TOP_K_ALL,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
    "custom_params": None,
    "watermark": None,
}

#: ``SamplingParams`` fields that SGLang fills in itself, and why a caller may not.
REFUSED_SAMPLING_PARAMS: Mapping[str, str] = {
    "stop_strs": "SGLang copies 'stop' into it (__post_init__)",
    "stop_regex_strs": "SGLang copies 'stop_regex' into it (__post_init__)",
    "stop_str_max_len": "SGLang's normalize() computes it from the stop strings",
    "stop_regex_max_len": "SGLang's normalize() computes it from the stop patterns",
    "is_normalized": "SGLang's normalize() sets it; set by a caller, it skips SGLang's own checks",
    "ebnf_full_assistant": "SGLang's chat serving sets it for a tool-call grammar",
}

#: SGLang's ``MAX_STOP_COUNT``, ``MAX_STOP_REGEX_COUNT`` and ``MAX_STOP_REGEX_LEN`` (bytes).
MAX_STOPS = 32
MAX_STOP_REGEX_BYTES = 256
#: The grammars a request may constrain its output by, at most one (SGLang's ``verify``).
GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
_INT64 = 2**63
_BOOLS = frozenset({"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"})
_WATERMARK_KEYS = frozenset({"enabled", "key", "context_window"})
_HEX = frozenset("0123456789abcdefABCDEF")


def native_name(key: str) -> str:
    """A sampling parameter as a native ``/generate`` body names it."""
    return f"sampling_params.{key}"


def check_sampling_params(
    params: object, name: Callable[[str], str] = native_name
) -> dict[str, Any]:
    """One request's (or one prompt's) sampling parameters, checked; a copy.

    Null is SGLang's default for every parameter, as in its ``__post_init__``,
    but for ``max_new_tokens``: null is no limit there (the context length's).
    """
    if not isinstance(params, Mapping):
        raise InvalidRequest(
            f"sampling_params must be a mapping (or a list of them for a batch), "
            f"got {type(params).__name__}"
        )
    checked = dict(params)
    for key, value in checked.items():
        if key in REFUSED_SAMPLING_PARAMS:
            raise InvalidRequest(
                f"{name(key)} is SGLang's own: {REFUSED_SAMPLING_PARAMS[key]}", param=name(key)
            )
        if key not in SAMPLING_PARAMS:
            raise InvalidRequest(f"unknown sampling parameter {key!r}", param=name(key))
        if value is not None:
            _check_value(key, value, name(key))
    _check_together(checked, name)
    return checked


def _check_together(params: Mapping[str, Any], name: Callable[[str], str]) -> None:
    """The cross-parameter rules of SGLang's ``verify``, and the lifecycle's one."""
    # Absent, max_new_tokens is SGLang's default; null is no limit (SGLang checks none).
    max_new = params.get("max_new_tokens", SAMPLING_PARAMS["max_new_tokens"])
    min_new = params.get("min_new_tokens")
    if max_new is not None and min_new is not None and min_new > max_new:
        raise InvalidRequest(
            f"{name('min_new_tokens')} ({min_new}) exceeds {name('max_new_tokens')} ({max_new})",
            param=name("min_new_tokens"),
        )
    # An empty grammar is no grammar, as SGLang reads it (``self.regex or None``).
    grammars = [name(key) for key in GRAMMARS if params.get(key)]
    if len(grammars) > 1:
        raise InvalidRequest(
            f"only one of {', '.join(name(key) for key in GRAMMARS)} may be set, got {grammars}",
            param=grammars[1],
        )
    if (params.get("beam_width") or 1) > 1 and (params.get("n") or 1) > 1:
        # SGLang returns a beam request's n sequences as one request (no fan-out), which
        # the lifecycle's one stream per sample does not model.
        raise InvalidRequest(
            f"{name('beam_width')} > 1 with {name('n')} > 1 is not supported: "
            "send n = 1 with beam search",
            param=name("n"),
        )


def _check_value(key: str, value: object, field: str) -> None:
    def bad(expected: str) -> InvalidRequest:
        return InvalidRequest(f"{field} must be {expected}, got {shown(value)}", param=field)

    if key in ("max_new_tokens", "min_new_tokens"):
        if not is_int(value) or not 0 <= value <= MAX_INT:
            raise bad("an int >= 0")
    elif key == "n":
        if not is_int(value) or not 1 <= value <= 1024:
            raise bad("an int from 1 to 1024")
    elif key == "beam_width":
        if not is_int(value) or value < 1:
            raise bad("an int >= 1")
    elif key == "top_k":
        if not is_int(value) or not (value == -1 or value >= 1):
            raise bad("an int >= 1, or -1 for no limit")
    elif key == "temperature":
        if not is_number(value) or value < 0:
            raise bad("a number >= 0")
    elif key == "top_p":
        if not is_number(value) or not 0 < value <= 1:
            raise bad("a number in (0, 1]")
    elif key == "min_p":
        if not is_number(value) or not 0 <= value <= 1:
            raise bad("a number in [0, 1]")
    elif key in ("frequency_penalty", "presence_penalty"):
        if not is_number(value) or not -2 <= value <= 2:
            raise bad("a number in [-2, 2]")
    elif key == "repetition_penalty":
        if not is_number(value) or not 0 < value <= 2:
            raise bad("a number in (0, 2] (1 is no penalty)")
    elif key in ("stop", "stop_regex"):
        _check_stops(key, value, bad)
    elif key == "stop_token_ids":
        if not is_token_list(value) and value != []:
            raise bad("a list of token ids")
    elif key in GRAMMARS:
        if not (isinstance(value, str) and is_unicode(value)):
            raise bad("a string")
    elif key in _BOOLS or key == "no_stop_trim":
        if not isinstance(value, bool):
            raise bad("a bool")
    elif key == "stream_interval":
        if not is_int(value):
            raise bad("an int")
    elif key == "logit_bias":
        if not _is_logit_bias(value):
            raise bad("an object of token ids (ints >= 0, as strings) to numbers")
    elif key == "sampling_seed":
        if not is_int(value) or not -_INT64 <= value < _INT64:
            raise bad("an int in [-2**63, 2**63 - 1]")
    elif key == "custom_params":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise bad("an object")
    elif key == "watermark":
        check_watermark(value, field)


def _check_stops(key: str, value: object, bad: Callable[[str], InvalidRequest]) -> None:
    """``stop`` and ``stop_regex``: a string or a list, as many as SGLang's ``normalize`` takes."""
    stops = [value] if isinstance(value, str) else value
    # Tokenized by the engine: a lone surrogate would fail there, after registration.
    if not (isinstance(stops, list) and all(isinstance(s, str) and is_unicode(s) for s in stops)):
        raise bad("a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad(f"at most {MAX_STOPS} strings")
    if key == "stop_regex":
        for pattern in stops:
            if len(pattern.encode()) > MAX_STOP_REGEX_BYTES:
                raise bad(f"patterns of at most {MAX_STOP_REGEX_BYTES} bytes")
            try:
                re.compile(pattern)
            except (re.error, RecursionError, OverflowError):
                raise bad("regular expressions") from None


def _is_logit_bias(value: object) -> bool:
    """Token ids to numbers; SGLang reads each key with ``int()`` (JSON's keys are strings)."""
    if not isinstance(value, Mapping):
        return False
    for token, bias in value.items():
        if isinstance(token, str):
            if not token.isdecimal() or len(token) > 10:
                return False
            token = int(token)
        if not (is_int(token) and 0 <= token <= MAX_INT and is_number(bias)):
            return False
    return True


def check_watermark(value: object, field: str) -> None:
    """``watermark``: SGLang's ``normalize_watermark_request`` and ``parse_watermark_key``."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{field} must be an object, got {shown(value)}", param=field)
    unknown = sorted(str(key) for key in value if key not in _WATERMARK_KEYS)
    if unknown:
        raise InvalidRequest(
            f"{field} has unknown fields {unknown}; it takes {sorted(_WATERMARK_KEYS)}",
            param=field,
        )
    enabled, key, window = value.get("enabled"), value.get("key"), value.get("context_window")
    if enabled is not None and not isinstance(enabled, bool):
        raise InvalidRequest(f"{field}.enabled must be a bool", param=field)
    if key is not None:
        digits = key[2:] if isinstance(key, str) and key.lower().startswith("0x") else key
        if not (isinstance(digits, str) and 1 <= len(digits) <= 16 and set(digits) <= _HEX):
            raise InvalidRequest(f"{field}.key must be a hex string of 1 to 16 digits", param=field)
    if window is not None and not (is_int(window) and window >= 1):
        raise InvalidRequest(f"{field}.context_window must be an int >= 1", param=field)
