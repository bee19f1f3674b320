"""Dynamo's preprocessed requests in, SGLang's native request out; token chunks back.

A worker registered with ``ModelInput.Tokens`` gets what Dynamo's frontend
made of an OpenAI request: ``token_ids``, ``stop_conditions`` and
``sampling_options``. They map to SGLang's ``input_ids`` and
``sampling_params`` field for field as Dynamo's own SGLang worker maps them,
so a client sees the same behaviour from either. What the tokens output
cannot carry (log probabilities) or SGLang cannot do (beam search) is refused
by name instead of ignored. Stop strings are the frontend's: it detokenizes
and cuts the text there.

Each chunk back is Dynamo's: ``index``, ``token_ids``, ``finish_reason``
(SGLang's ``abort`` as Dynamo's ``cancelled``), and ``completion_usage`` on a
choice's first and last chunks. No engine rid is in any of them. ``TOKENS``
is this mode, for the bridge.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .._errors import InvalidRequest
from ._translation import InputMode, Translation

__all__ = ["TOKENS", "ChunkMapper", "engine_request", "merge_token_chunks"]

#: Passed through under the same name (``seed`` becomes ``sampling_seed``).
_SAMPLING_OPTIONS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
)

#: Asked for but not done here: (where it sits, name, why).
_REFUSED = (
    ("sampling_options", "use_beam_search", "SGLang has no beam search"),
    ("sampling_options", "length_penalty", "SGLang has no beam search"),
    ("output_options", "logprobs", "token chunks carry no log probabilities"),
    ("output_options", "prompt_logprobs", "token chunks carry no log probabilities"),
    ("stop_conditions", "max_thinking_tokens", "no thinking budget on this worker"),
)


def engine_request(request: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's native request for one of Dynamo's; ``InvalidRequest`` names what cannot be."""
    if not isinstance(request, Mapping):
        raise InvalidRequest(f"a Dynamo request is a JSON object, got {type(request).__name__}")
    stop = _section(request, "stop_conditions")
    sampling = _section(request, "sampling_options")
    output = _section(request, "output_options")
    sections = {"stop_conditions": stop, "sampling_options": sampling, "output_options": output}
    for section, name, why in _REFUSED:
        if sections[section].get(name) not in (None, False):
            raise InvalidRequest(f"'{name}' is not supported: {why}", param=name)
    best_of = sampling.get("best_of")
    if isinstance(best_of, int) and best_of > (sampling.get("n") or 1):
        raise InvalidRequest(
            "'best_of' is not supported: ask for n samples instead", param="best_of"
        )
    token_ids = request.get("token_ids")
    if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], list):
        raise InvalidRequest("'token_ids' is one prompt: a list of token ids", param="token_ids")
    # The client's, then the hidden ones (EOS), each once.
    stop_ids = list(
        dict.fromkeys(
            [*(stop.get("stop_token_ids") or ()), *(stop.get("stop_token_ids_hidden") or ())]
        )
    )
    params: dict[str, Any] = {
        "n": sampling.get("n"),
        "min_new_tokens": stop.get("min_tokens"),
        "ignore_eos": stop.get("ignore_eos"),
        "stop_token_ids": stop_ids or None,
        **{name: sampling.get(name) for name in _SAMPLING_OPTIONS},
        "sampling_seed": sampling.get("seed"),
        **_guided(sampling.get("guided_decoding")),
    }
    kept = {name: value for name, value in params.items() if value is not None}
    # Kept when None: SGLang then generates up to the context length, as
    # the client asked by giving no max_tokens (omitted, it would be 128).
    kept["max_new_tokens"] = stop.get("max_tokens")
    return {"input_ids": token_ids, "sampling_params": kept}


def _section(request: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = request.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"'{name}' must be an object", param=name)
    return value


def _guided(guided: object) -> dict[str, Any]:
    """One guided-decoding constraint as SGLang's sampling field for it."""
    if not isinstance(guided, Mapping):
        return {}
    if guided.get("json") is not None:
        return {"json_schema": json.dumps(guided["json"])}
    if guided.get("regex") is not None:
        return {"regex": guided["regex"]}
    choices = [str(choice) for choice in guided.get("choice") or () if choice is not None]
    if choices:  # SGLang has no choice constraint; its regex matches whole outputs
        return {"regex": "(" + "|".join(re.escape(choice) for choice in choices) + ")"}
    if guided.get("grammar") is not None:
        return {"ebnf": guided["grammar"]}
    return {}


class ChunkMapper:
    """One request's token chunks as Dynamo's, with the usage SGLang would report."""

    __slots__ = ("_completion", "_prompt_tokens")

    def __init__(self, prompt_tokens: int) -> None:
        self._prompt_tokens = prompt_tokens
        self._completion: dict[int, int] = {}  # tokens so far, per choice

    def __call__(self, chunk: Mapping[str, Any]) -> dict[str, Any] | None:
        """Dynamo's chunk, or None for one with nothing in it (no tokens, not the last)."""
        index: int = chunk["index"]
        token_ids: list[int] = chunk["token_ids"]
        finish = chunk["finish_reason"]
        first = index not in self._completion
        if not token_ids and finish is None:
            return None
        completion = self._completion[index] = self._completion.get(index, 0) + len(token_ids)
        out: dict[str, Any] = {"index": index, "token_ids": token_ids}
        if finish is not None:
            out["finish_reason"] = "cancelled" if finish.startswith("abort") else finish
        if first or finish is not None:
            out["completion_usage"] = {
                "prompt_tokens": self._prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": self._prompt_tokens + completion,
            }
        return out


def merge_token_chunks(last: dict[str, Any], chunk: dict[str, Any]) -> bool:
    """``chunk`` into ``last`` if both are one unfinished choice's: ids added, the rest newer."""
    if last["index"] != chunk["index"] or "finish_reason" in last:
        return False
    last["token_ids"].extend(chunk["token_ids"])
    last.update((key, value) for key, value in chunk.items() if key != "token_ids")
    return True


def _translate(request: Mapping[str, Any]) -> Translation:
    body = engine_request(request)
    ids = body["input_ids"]
    # Not a list of ids: the worker refuses the request before its first chunk.
    to_dynamo = ChunkMapper(len(ids) if isinstance(ids, list) else 0)
    return Translation(body, "tokens", to_dynamo, _no_chunks)


def _no_chunks() -> list[dict[str, Any]]:
    """A token stream has nothing after its last chunk: usage rides on each choice's last."""
    return []


#: ``ModelInput.Tokens``: the frontend tokenizes; requests mapped here, token chunks back.
TOKENS = InputMode(_translate, merge_token_chunks)
