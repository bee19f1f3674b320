"""Validate a caller's SGLang ``/generate`` body before anything reaches the engine.

Everything the engine would reject (or worse, accept and then fail on after
registering the rid) is rejected here with ``InvalidRequest``, so a bad request
never leaves state at the engine. The request's shape is checked here (the
prompt, a batch, ``n``, ``rid``, ``stream``); its other fields are SGLang's
``GenerateReqInput`` fields (``_fields.py``), its sampling parameters SGLang's
``SamplingParams`` (``_request/_sampling.py``). A field SGLang does not know is refused,
as SGLang's ``Engine.generate`` refuses an unknown keyword (the HTTP server's
``/generate`` ignores one instead, as SGLang's HTTP server does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from .._engine import EngineFeatures
from .._errors import InvalidRequest
from ._bootstrap import BOOTSTRAP_FIELDS, check_bootstrap
from ._fields import GENERATE_FIELDS, OWN_FIELDS, REFUSED_FIELDS, check_field, check_honoured
from ._ids import mint_rid
from ._sampling import check_sampling_params
from ._values import is_token_list, is_unicode, shown

__all__ = ["OutputMode", "ParsedRequest", "parse_request"]

OutputMode = Literal["tokens", "text", "native"]
_OUTPUT_MODES: tuple[str, ...] = get_args(OutputMode)


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
    def bootstrapped(self) -> bool:
        """Whether it names its disaggregation bootstrap (a router ran its prefill)."""
        return any(self.body.get(name) is not None for name in BOOTSTRAP_FIELDS)

    def mint_rids(self) -> tuple[str, ...]:
        """Fresh engine rids: one per prompt of a native batch, else one.

        With ``n > 1`` SGLang replaces child rids anyway, so one suffices.
        """
        count = self.batch_size if self.batch_size is not None and self.n == 1 else 1
        return tuple(mint_rid() for _ in range(count))

    def engine_request(self, rids: tuple[str, ...]) -> dict[str, Any]:
        """The body for the engine: one minted rid, or one per prompt for a batch."""
        # A batch of one is still a batch: SGLang names its child <rid>_0 unless given a list.
        rid: str | list[str] = (
            list(rids) if self.batch_size is not None and self.n == 1 else rids[0]
        )
        return {**self.body, "rid": rid, "stream": True}


def parse_request(
    request: object,
    output: object,
    features: EngineFeatures,
    names: Mapping[str, str],
) -> ParsedRequest:
    """``request`` checked as SGLang checks it, and against what ``features`` say the engine does.

    ``names`` maps a native field (``sampling_params.min_new_tokens``) to the
    caller's name for it (``min_tokens``): a refusal of a field names it in
    the caller's words.
    """
    if output not in _OUTPUT_MODES:
        raise InvalidRequest(f"output must be one of {_OUTPUT_MODES}, got {output!r}")
    if not isinstance(request, Mapping):
        raise InvalidRequest(f"request must be a mapping, got {type(request).__name__}")
    for key, value in request.items():
        if not isinstance(key, str):
            raise InvalidRequest(f"request keys must be strings, got {key!r}")
        if key in GENERATE_FIELDS or key in REFUSED_FIELDS:
            check_field(key, value)
        elif key not in OWN_FIELDS:
            raise InvalidRequest(f"unknown request field {key!r}", param=key)
    stream = request.get("stream", True)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be a bool, got {type(stream).__name__}")

    batch_size = _check_prompt(request)
    _check_per_prompt(request, batch_size)
    sampling = _check_sampling_params(request.get("sampling_params"), batch_size)
    _check_one_watermark(request, sampling)
    n = _check_same_n(sampling)
    caller_rid = _check_rid(request.get("rid"), batch_size)

    body = {k: v for k, v in request.items() if k not in ("rid", "stream")}
    body["sampling_params"] = sampling
    parsed = ParsedRequest(
        body=body,
        caller_rid=caller_rid,
        batch_size=batch_size,
        n=n,
        output=cast(OutputMode, output),
    )
    _check_for_engine(parsed, features, names)
    return parsed


def _check_for_engine(
    parsed: ParsedRequest, features: EngineFeatures, names: Mapping[str, str]
) -> None:
    """What this engine cannot run: a field it does not honour, ``n > 1`` on a batch, a
    bootstrap its role cannot use."""
    check_honoured(parsed.body, features, names)
    if parsed.batch_size is not None and parsed.n > 1 and not features.batch_parallel_sampling:
        raise InvalidRequest(
            "this engine cannot run parallel sampling (n > 1) on a native batch; "
            "send one prompt per request"
        )
    if parsed.bootstrapped or features.role == "prefill":
        check_bootstrap(parsed.body, parsed.batch_size, features.role)


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
        if not all(is_unicode(t) for t in prompts):
            raise InvalidRequest(
                "'text' must be Unicode, without a lone surrogate (an unpaired \\ud800-\\udfff)"
            )
        return batch_size
    ids = request["input_ids"]
    if is_token_list(ids):
        return None
    if isinstance(ids, list) and ids and all(is_token_list(p) for p in ids):
        return len(ids)
    raise InvalidRequest(
        "'input_ids' must be a non-empty list of token ids (ints >= 0), or a list of them"
    )


def _check_per_prompt(request: Mapping[str, Any], batch_size: int | None) -> None:
    """A field given per prompt (a list) needs a batch, and one entry per prompt."""
    for key, value in request.items():
        field = GENERATE_FIELDS.get(key)
        if field is None or not field.per_prompt or not isinstance(value, list):
            continue
        if batch_size is None:
            raise InvalidRequest(f"a list {key!r} needs a batch prompt", param=key)
        if len(value) != batch_size:
            raise InvalidRequest(
                f"{key!r} has {len(value)} entries but the batch has {batch_size} prompts",
                param=key,
            )


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
        return [check_sampling_params(p) for p in params]
    return check_sampling_params(params)


def _each(sampling: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sampling if isinstance(sampling, list) else [sampling]


def _check_one_watermark(
    request: Mapping[str, Any], sampling: dict[str, Any] | list[dict[str, Any]]
) -> None:
    """A watermark at the top or in the sampling parameters, as SGLang takes it; not both."""
    if request.get("watermark") is not None and any(
        p.get("watermark") is not None for p in _each(sampling)
    ):
        # SGLang's words (TokenizerManager._create_tokenized_object), for the same refusal.
        raise InvalidRequest(
            "watermark must be provided either at the request top level or inside "
            "sampling_params, not both",
            param="watermark",
        )


def _check_same_n(sampling: dict[str, Any] | list[dict[str, Any]]) -> int:
    """SGLang runs one ``n`` per request; a null ``n`` reads as 1."""
    ns = {cast(int, p.get("n") or 1) for p in _each(sampling)}
    if len(ns) > 1:
        raise InvalidRequest(f"every prompt of a batch must have the same n, got {sorted(ns)}")
    return ns.pop()


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
    raise InvalidRequest(f"'rid' must be a string (or a list for a batch), got {shown(rid)}")
