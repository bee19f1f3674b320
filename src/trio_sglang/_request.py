"""Validate a caller's SGLang ``/generate`` body before anything reaches the engine.

Everything the engine would reject (or worse, accept and then fail on after
registering the rid) is rejected here with ``InvalidRequest``, so a bad request
never leaves state at the engine.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from ._errors import InvalidRequest

__all__ = ["OutputMode", "ParsedRequest", "parse_request"]

OutputMode = Literal["tokens", "text", "native"]
_OUTPUT_MODES: tuple[str, ...] = get_args(OutputMode)

#: Top-level fields of SGLang's ``GenerateReqInput`` that are passed through.
_PASSTHROUGH_FIELDS = frozenset(
    {
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_text_in_logprobs",
        "return_hidden_states",
        "lora_path",
        "custom_logit_processor",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "data_parallel_rank",
        "priority",
        # Bookkeeping flags that routers (sglang-router) add to every request.
        "log_metrics",
        "background",
        "no_logs",
        "return_bytes",
        "return_entropy",
    }
)
_OWN_FIELDS = frozenset({"text", "input_ids", "sampling_params", "rid", "stream"})

#: ``SamplingParams`` keyword arguments in SGLang 0.5.x (unknown ones raise there).
_SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "n",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "custom_params",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
    }
)
_MAX_INT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request: what to send the engine and whom to name in replies."""

    #: The SGLang body to send, without ``rid`` and ``stream`` (the worker sets both).
    body: Mapping[str, Any]
    #: The caller's own rid (str, or a list for a native batch), if any.
    caller_rid: str | tuple[str, ...] | None
    #: Number of prompts for a native batch (``text`` or ``input_ids`` a list
    #: of prompts); ``None`` for a single prompt.
    batch_size: int | None
    #: Parallel samples per prompt (``sampling_params.n``).
    n: int
    output: OutputMode

    @property
    def single_sample(self) -> bool:
        return self.batch_size is None and self.n == 1

    @property
    def children(self) -> int:
        """How many outputs streams the engine will run: prompts times samples."""
        return (self.batch_size or 1) * self.n

    @property
    def stable_ids(self) -> bool:
        """Whether every engine id is known before the request starts.

        True for one sample and for a native batch (SGLang keeps the rid list
        it is given); false for ``n > 1``, where SGLang swaps every child to a
        fresh uuid that only the child's first output reveals.
        """
        return self.n == 1

    @property
    def rid_count(self) -> int:
        """How many rids the worker mints: one per prompt of a native batch, else one.

        With ``n > 1`` SGLang replaces child rids anyway, so one suffices.
        """
        return self.batch_size if self.batch_size is not None and self.n == 1 else 1

    def engine_request(self, rids: tuple[str, ...]) -> dict[str, Any]:
        """The body for the engine: one minted rid, or one per prompt for a batch."""
        # A batch of one is still a batch: SGLang names its child <rid>_0 unless given a list.
        rid: str | list[str] = (
            list(rids) if self.batch_size is not None and self.n == 1 else rids[0]
        )
        return {**self.body, "rid": rid, "stream": True}


def parse_request(request: object, output: object) -> ParsedRequest:
    if output not in _OUTPUT_MODES:
        raise InvalidRequest(f"output must be one of {_OUTPUT_MODES}, got {output!r}")
    if not isinstance(request, Mapping):
        raise InvalidRequest(f"request must be a mapping, got {type(request).__name__}")
    for key in request:
        if not isinstance(key, str):
            raise InvalidRequest(f"request keys must be strings, got {key!r}")
        if key not in _OWN_FIELDS and key not in _PASSTHROUGH_FIELDS:
            raise InvalidRequest(f"unknown request field {key!r}")
    stream = request.get("stream", True)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be a bool, got {type(stream).__name__}")

    batch_size = _check_prompt(request)
    sampling = _check_sampling_params(request.get("sampling_params"), batch_size)
    n = _check_same_n(sampling)
    caller_rid = _check_rid(request.get("rid"), batch_size)

    body = {k: v for k, v in request.items() if k not in ("rid", "stream")}
    body["sampling_params"] = sampling
    return ParsedRequest(
        body=body,
        caller_rid=caller_rid,
        batch_size=batch_size,
        n=n,
        output=cast(OutputMode, output),
    )


def _check_prompt(request: Mapping[str, Any]) -> int | None:
    has_text = request.get("text") is not None
    has_ids = request.get("input_ids") is not None
    if has_text == has_ids:
        raise InvalidRequest("a request needs exactly one of 'text' or 'input_ids'")
    if has_text:
        text = request["text"]
        prompts: list[str]
        batch_size: int | None
        if isinstance(text, str):
            if not text:
                raise InvalidRequest("'text' is empty")
            prompts, batch_size = [text], None
        elif isinstance(text, list) and text and all(isinstance(t, str) and t for t in text):
            prompts, batch_size = text, len(text)
        else:
            raise InvalidRequest("'text' must be a non-empty string or a non-empty list of them")
        if not all(_is_unicode(t) for t in prompts):
            raise InvalidRequest(
                "'text' must be Unicode, without a lone surrogate (an unpaired \\ud800-\\udfff)"
            )
        return batch_size
    ids = request["input_ids"]
    if _is_token_list(ids):
        return None
    if isinstance(ids, list) and ids and all(_is_token_list(p) for p in ids):
        return len(ids)
    raise InvalidRequest(
        "'input_ids' must be a non-empty list of token ids (ints >= 0), or a list of them"
    )


def _is_unicode(text: str) -> bool:
    """Whether a tokenizer can encode ``text``.

    JSON lets a string escape half a surrogate pair (``"\\ud800"``), which
    decodes to a Python ``str`` that UTF-8 cannot encode; the engine would
    fail on it while tokenizing, after the rid was registered.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _is_token_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(_is_int(t) and 0 <= t <= _MAX_INT for t in value)
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite number that survives SGLang's float conversion (10**400 does not)."""
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(cast(float, value)))
    except OverflowError:
        return False


def _check_sampling_params(
    params: object, batch_size: int | None
) -> dict[str, Any] | list[dict[str, Any]]:
    """One mapping, or (for a native batch, as SGLang allows) one per prompt."""
    if params is None:
        return {}
    if isinstance(params, list) and batch_size is not None:
        if len(params) != batch_size:
            raise InvalidRequest(
                f"sampling_params has {len(params)} entries but the batch has {batch_size} prompts"
            )
        return [_check_one_sampling_params(p) for p in params]
    return _check_one_sampling_params(params)


def _check_same_n(sampling: dict[str, Any] | list[dict[str, Any]]) -> int:
    """SGLang runs one ``n`` per request; a null ``n`` reads as 1."""
    per_prompt = sampling if isinstance(sampling, list) else [sampling]
    ns = {cast(int, p.get("n") or 1) for p in per_prompt}
    if len(ns) > 1:
        raise InvalidRequest(f"every prompt of a batch must have the same n, got {sorted(ns)}")
    return ns.pop()


def _check_one_sampling_params(params: object) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise InvalidRequest(
            f"sampling_params must be a mapping (or a list of them for a batch), "
            f"got {type(params).__name__}"
        )
    checked = dict(params)
    for key, value in checked.items():
        if key not in _SAMPLING_FIELDS:
            raise InvalidRequest(f"unknown sampling parameter {key!r}")
        if value is not None:
            _check_sampling_value(key, value)
    # The cross-field rules of SGLang's SamplingParams.verify, which SGLang
    # itself only applies after the rid is registered.
    max_new, min_new = checked.get("max_new_tokens"), checked.get("min_new_tokens")
    if max_new is not None and min_new is not None and min_new > max_new:
        raise InvalidRequest(
            f"sampling_params.min_new_tokens ({min_new}) exceeds max_new_tokens ({max_new})"
        )
    grammars = [k for k in ("regex", "json_schema", "ebnf") if checked.get(k) is not None]
    if len(grammars) > 1:
        raise InvalidRequest(f"only one of regex, json_schema and ebnf may be set, got {grammars}")
    return checked


def _check_sampling_value(key: str, value: object) -> None:
    def bad(expected: str) -> InvalidRequest:
        # reprlib: bounded in depth and length, so neither a value nested close to
        # the JSON parser's limit (RecursionError) nor a megabyte string gets in.
        return InvalidRequest(
            f"sampling_params.{key} must be {expected}, got {reprlib.repr(value)}"
        )

    if key in ("max_new_tokens", "min_new_tokens"):
        if not _is_int(value) or not 0 <= cast(int, value) <= _MAX_INT:
            raise bad("an int >= 0")
    elif key == "n":
        if not _is_int(value) or not 1 <= cast(int, value) <= 1024:
            raise bad("an int from 1 to 1024")
    elif key == "top_k":
        if not _is_int(value) or not (value == -1 or cast(int, value) >= 1):
            raise bad("an int >= 1, or -1 for no limit")
    elif key == "temperature":
        if not _is_number(value) or cast(float, value) < 0:
            raise bad("a number >= 0")
    elif key == "top_p":
        if not _is_number(value) or not 0 < cast(float, value) <= 1:
            raise bad("a number in (0, 1]")
    elif key == "min_p":
        if not _is_number(value) or not 0 <= cast(float, value) <= 1:
            raise bad("a number in [0, 1]")
    elif key in ("frequency_penalty", "presence_penalty"):
        if not _is_number(value) or not -2 <= cast(float, value) <= 2:
            raise bad("a number in [-2, 2]")
    elif key == "repetition_penalty":
        if not _is_number(value) or not 0 < cast(float, value) <= 2:
            raise bad("a number in (0, 2]")
    elif key == "stop":
        if not (
            isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(s, str) for s in value))
        ):
            raise bad("a string or a list of strings")
    elif key == "stop_token_ids":
        if not _is_token_list(value) and value != []:
            raise bad("a list of token ids")
    elif key in (
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    ) and not isinstance(value, bool):
        raise bad("a bool")


def _check_rid(rid: object, batch_size: int | None) -> str | tuple[str, ...] | None:
    if rid is None:
        return None
    if isinstance(rid, str):
        if not rid:
            raise InvalidRequest("'rid' is empty")
        return rid
    if isinstance(rid, list):
        if batch_size is None:
            raise InvalidRequest("a list 'rid' needs a batch prompt ('text' or 'input_ids' list)")
        if not all(isinstance(r, str) and r for r in rid):
            raise InvalidRequest("every 'rid' in the list must be a non-empty string")
        if len(rid) != batch_size:
            raise InvalidRequest(
                f"'rid' has {len(rid)} entries but the batch has {batch_size} prompts"
            )
        if len(set(rid)) != len(rid):
            raise InvalidRequest("'rid' has duplicate entries")
        return tuple(rid)
    raise InvalidRequest(f"'rid' must be a string (or a list for a batch), got {reprlib.repr(rid)}")
