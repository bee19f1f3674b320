"""SGLang 0.5.23's ``/generate`` fields: which a request may set, and which an engine honours.

SGLang's ``GenerateReqInput`` has some seventy top-level fields. Each one is
here: the request's own (``OWN_FIELDS``: the prompt, ``sampling_params``,
``rid``, ``stream``, which ``_request/_parse.py`` checks), the ones passed to the
engine as they are (``GENERATE_FIELDS``: what value each takes, and the values
that ask for nothing), and the few refused, each with why (``REFUSED_FIELDS``:
SGLang's own plumbing, which SGLang fills in itself).

What follows from it:

- ``check_field`` refuses a value of the wrong kind before the engine sees it:
  SGLang's dataclass takes anything, and a wrong value would fail inside the
  engine, after the rid was registered;
- an engine lists the fields it acts on in ``features().honoured_fields``
  (top-level names, and ``sampling_params.<name>``); ``check_honoured`` refuses a
  request that asks for anything else (a value other than null or SGLang's
  default), naming the field, so that no field is ever silently dropped. An
  engine without the entry honours every field, as ``SGLangEngine`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from .._engine import EngineFeatures
from .._errors import InvalidRequest
from ._sampling import SAMPLING_PARAMS, check_watermark, native_name
from ._values import is_int, is_one_of, is_token_list, shown

__all__ = [
    "GENERATE_FIELDS",
    "OWN_FIELDS",
    "REFUSED_FIELDS",
    "SGLANG_FIELDS",
    "check_field",
    "check_honoured",
    "unhonoured",
]


@dataclass(frozen=True, slots=True)
class Kind:
    """What a field's value must be: ``valid(value)``, said as ``expected``."""

    expected: str
    valid: Callable[[object], bool]


def _list_of(kind: Kind) -> Kind:
    return Kind(
        f"a list of {kind.expected}",
        lambda value: isinstance(value, list) and all(kind.valid(v) for v in value),
    )


_ANY = Kind("any value", lambda value: True)
_BOOL = Kind("a bool", lambda value: isinstance(value, bool))
_INT = Kind("an int", is_int)
_COUNT = Kind("an int >= 0", lambda value: is_int(value) and value >= 0)
_STR = Kind("a string", lambda value: isinstance(value, str))
_OBJECT = Kind("an object", lambda value: isinstance(value, Mapping))
_LABELS = Kind(
    "an object of strings",
    lambda value: (
        isinstance(value, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ),
)
_TOKEN_IDS = Kind(
    "a list of token ids, or one per prompt",
    lambda value: (
        is_token_list(value)
        or (isinstance(value, list) and bool(value) and all(is_token_list(v) for v in value))
    ),
)
_HIDDEN_STATES = Kind("a bool or 'last'", lambda value: isinstance(value, bool) or value == "last")
_LOGPROBS_MODE = Kind("'selected' or 'support'", lambda value: value in ("selected", "support"))


@dataclass(frozen=True, slots=True)
class Field:
    """A top-level field passed to the engine as it is."""

    kind: Kind
    #: The values that ask the engine for nothing: null, SGLang's default and its equals.
    off: tuple[object, ...] = (None,)
    #: One value, or a list with one per prompt of a batch (SGLang's ``X or List[X]``).
    per_prompt: bool = False

    def valid(self, value: object) -> bool:
        return self.kind.valid(value) or (
            self.per_prompt
            and isinstance(value, list)
            and all(one is None or self.kind.valid(one) for one in value)
        )

    @property
    def expected(self) -> str:
        return f"{self.kind.expected}, or one per prompt" if self.per_prompt else self.kind.expected

    def asks(self, value: object) -> bool:
        """Whether ``value`` asks the engine for something (per prompt: whether any does)."""
        values = value if self.per_prompt and isinstance(value, list) else [value]
        return any(not is_one_of(one, self.off) for one in values)


_FLAG = Field(_BOOL, (None, False))

#: The request's own fields, which ``parse_request`` checks: every engine takes them.
OWN_FIELDS = frozenset({"text", "input_ids", "sampling_params", "rid", "stream"})

#: Every other field of SGLang's ``GenerateReqInput`` that a request may set, as SGLang reads it.
GENERATE_FIELDS: Mapping[str, Field] = {
    # Multimodal input (SGLang checks the media themselves).
    "image_data": Field(_ANY),
    "video_data": Field(_ANY),
    "audio_data": Field(_ANY),
    "mm_hashes": Field(_ANY),
    "mm_content_hashes": Field(_ANY),
    "use_audio_in_video": _FLAG,
    "video_config": Field(_OBJECT),
    "modalities": Field(_list_of(Kind("strings", lambda v: v is None or isinstance(v, str)))),
    "max_dynamic_patch": Field(_INT),
    "min_dynamic_patch": Field(_INT),
    "image_max_dynamic_patch": Field(_INT),
    "video_max_dynamic_patch": Field(_INT),
    "images_config": Field(_OBJECT),
    "mm_processor_kwargs": Field(_OBJECT),
    # Log probabilities, and what else a response may carry.
    "return_logprob": Field(_BOOL, (None, False), per_prompt=True),
    "logprob_start_len": Field(_INT, (None, -1), per_prompt=True),
    "top_logprobs_num": Field(_COUNT, (None, 0), per_prompt=True),
    "token_ids_logprob": Field(_TOKEN_IDS),
    "return_sampling_mask": Field(_BOOL, (None, False), per_prompt=True),
    "sampling_logprobs_mode": Field(_LOGPROBS_MODE, per_prompt=True),
    "return_text_in_logprobs": _FLAG,
    "return_flat_raw_top_logprobs": _FLAG,
    "return_flat_raw_output_top_logprobs": _FLAG,
    "return_flat_raw_top_logprobs_b64": _FLAG,
    "return_hidden_states": Field(_HIDDEN_STATES, (None, False), per_prompt=True),
    "return_routed_experts": _FLAG,
    "routed_experts_start_len": Field(_COUNT, (None, 0)),
    "return_indexer_topk": _FLAG,
    "return_bytes": _FLAG,
    "return_entropy": _FLAG,
    "return_prompt_token_ids": _FLAG,
    "multi_item_delimiter_indices": Field(_ANY),
    "token_indices_to_pool": Field(_ANY),
    # What the model runs with.
    "watermark": Field(_ANY),  # checked as sampling_params.watermark is
    "lora_path": Field(_STR, per_prompt=True),
    "custom_logit_processor": Field(_STR, per_prompt=True),
    "positional_embed_overrides": Field(_ANY),
    "session_params": Field(_OBJECT),
    "require_reasoning": _FLAG,
    "max_thinking_tokens": Field(_COUNT),
    # Prefill/decode pairing (``_core/_disagg.py`` checks the bootstrap address) and routing.
    "bootstrap_host": Field(_ANY),
    "bootstrap_port": Field(_ANY),
    "bootstrap_room": Field(_ANY),
    "bootstrap_pair_key": Field(_STR, per_prompt=True),
    "decode_tp_size": Field(_INT, per_prompt=True),
    "routed_dp_rank": Field(_INT),
    "data_parallel_rank": Field(_INT),
    "disagg_prefill_dp_rank": Field(_INT),
    "routing_key": Field(_STR),
    "priority": Field(_INT),
    # Caching, sessions and bookkeeping.
    "session_id": Field(_STR),
    "conversation_id": Field(_STR),
    "extra_key": Field(_STR, per_prompt=True),
    "cache_salt": Field(_STR, per_prompt=True),
    "kv_hints": Field(_ANY),
    "log_metrics": Field(_BOOL, (None, True)),
    "background": _FLAG,
    "no_logs": _FLAG,
    "custom_labels": Field(_LABELS),
    "external_trace_header": Field(_OBJECT),
}

#: Fields of ``GenerateReqInput`` a request may not set, and why.
REFUSED_FIELDS: Mapping[str, str] = {
    "input_embeds": (
        "a prompt of embeddings is not supported: the lifecycle counts a request's "
        "prompts, and mints their rids, from 'text' or 'input_ids'"
    ),
    "lora_id": "SGLang's TokenizerManager sets it from lora_path",
    "http_worker_ipc": "SGLang's own route for outputs between its HTTP workers",
    "received_time": "SGLang's HTTP server stamps it when the request arrives",
    "need_wait_for_mm_inputs": "SGLang sets it for encoder disaggregation",
    "num_items_assigned": "SGLang sets it for encoder disaggregation",
    "encoder_urls": "SGLang sets it for encoder disaggregation",
}

#: Every field of SGLang 0.5.23's ``GenerateReqInput``; SGLang's ``/generate`` ignores the rest.
SGLANG_FIELDS = OWN_FIELDS | GENERATE_FIELDS.keys() | REFUSED_FIELDS.keys()


def check_field(key: str, value: object) -> None:
    """A top-level field that is neither the request's own nor unknown: refused, or its kind."""
    if key in REFUSED_FIELDS:
        raise InvalidRequest(f"{key!r} may not be set: {REFUSED_FIELDS[key]}", param=key)
    if value is None:
        return
    if key == "watermark":
        check_watermark(value, key)
        return
    field = GENERATE_FIELDS[key]
    if not field.valid(value):
        raise InvalidRequest(f"{key} must be {field.expected}, got {shown(value)}", param=key)


def unhonoured(body: Mapping[str, Any], honoured: AbstractSet[str]) -> str | None:
    """The first field ``body`` asks for that is not in ``honoured``, as the body names it.

    A top-level name, or ``sampling_params.<name>``. Reads a body of any shape
    without fail (it may not have been checked yet).
    """
    for key, value in body.items():
        field = GENERATE_FIELDS.get(key)
        if field is not None and key not in honoured and field.asks(value):
            return key
    for params in _sampling_params(body.get("sampling_params")):
        for key, value in params.items():
            name = native_name(key)
            default = SAMPLING_PARAMS.get(key)
            if key in SAMPLING_PARAMS and name not in honoured and value not in (None, default):
                return name
    return None


def _sampling_params(params: object) -> Iterator[Mapping[str, Any]]:
    for one in params if isinstance(params, list) else [params]:
        if isinstance(one, Mapping):
            yield one


def check_honoured(
    body: Mapping[str, Any], features: EngineFeatures, names: Mapping[str, str]
) -> None:
    """Refuse a request that asks for a field the engine does not honour, naming it.

    ``names`` maps a native field to the caller's name for it, when the
    caller sent another body (OpenAI's ``min_tokens``).
    """
    honoured = features.honoured_fields
    if honoured is None:
        return  # an engine that lists none honours every field
    field = unhonoured(body, honoured)
    if field is not None:
        name = names.get(field, field)
        raise InvalidRequest(_unsupported(name, features), param=name)


def _unsupported(field: str, features: EngineFeatures) -> str:
    kind = features.kind
    version = features.sglang_version
    if kind == "sglang" and version is not None:
        kind = f"{kind} engine (SGLang {version})"  # a release older than the field tables
    else:
        kind = f"{kind} engine"
    return f"'{field}' is not supported by the {kind}: leave it out, or at its default"
