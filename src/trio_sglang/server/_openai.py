"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI's schemas over SGLang's outputs."""

from __future__ import annotations

import contextlib
import math
import reprlib
import time
import uuid
from typing import Any, NamedTuple

from ._errors import HTTPError
from ._plan import Plan

__all__ = ["ChatPlan", "CompletionPlan"]

_COMMON = {
    "model",
    "max_tokens",
    "n",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "user",
}
#: SGLang's extensions of OpenAI's schemas, which sglang-router sends on every request.
_SGLANG_SAMPLING = {"ignore_eos", "skip_special_tokens", "no_stop_trim"}
_SGLANG_IGNORED = {
    "return_hidden_states",
    "continue_final_message",
    "separate_reasoning",
    "stream_reasoning",
}
#: Prefill/decode pairing, which sglang-router's PD mode adds to every request;
#: passed to the worker as is (it checks them against its role).
_SGLANG_BOOTSTRAP = {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
_COMPLETION_FIELDS = (
    _COMMON
    | _SGLANG_SAMPLING
    | _SGLANG_IGNORED
    | _SGLANG_BOOTSTRAP
    | {"prompt", "echo", "logprobs", "best_of", "suffix"}
)
_CHAT_FIELDS = (
    _COMMON
    | _SGLANG_SAMPLING
    | _SGLANG_IGNORED
    | _SGLANG_BOOTSTRAP
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
)
#: OpenAI's default for completions; chat has none (we use the engine's).
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    for key in body:
        if key not in known:
            raise HTTPError(400, f"Unrecognized request argument supplied: {key}", param=key)


def _bootstrap(body: dict[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in _SGLANG_BOOTSTRAP if key in body}


# Values in messages go through reprlib: bounded in depth and length, so neither a value
# nested close to the JSON parser's limit (RecursionError) nor a megabyte string gets in.
def _int(body: dict[str, Any], key: str, *, low: int, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise HTTPError(
            400, f"'{key}' must be an integer >= {low}, got {reprlib.repr(value)}", param=key
        )
    return value


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int past a float's range, as 10**400
            if math.isfinite(number := float(value)):
                return number
    raise HTTPError(400, f"'{key}' must be a number, got {reprlib.repr(value)}", param=key)


def _sampling(body: dict[str, Any], max_tokens: int | None) -> tuple[dict[str, Any], int]:
    n = _int(body, "n", low=1, default=1)
    assert n is not None
    params: dict[str, Any] = {"n": n}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if not (
            isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise HTTPError(400, "'stop' must be a string or a list of strings", param="stop")
        params["stop"] = stop
    for key, target in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ):
        value = _number(body, key)
        if value is not None:
            params[target] = value
    seed = _int(body, "seed", low=0, default=None)
    if seed is not None:
        params["sampling_seed"] = seed
    for key in _SGLANG_SAMPLING:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise HTTPError(400, f"'{key}' must be a bool", param=key)
            params[key] = value
    return params, n


class _StreamFlags(NamedTuple):
    stream: bool
    #: A last chunk with the request's usage (``stream_options.include_usage``).
    include_usage: bool
    #: Every chunk with its choice's usage (``stream_options.continuous_usage_stats``).
    continuous_usage: bool


def _stream_flags(body: dict[str, Any]) -> _StreamFlags:
    """``stream``, and the two usage options of ``stream_options``.

    As in SGLang (``should_include_usage``), each option stands alone: continuous
    usage does not need ``include_usage``, and null is false.
    """
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be a bool", param="stream")
    options = body.get("stream_options")
    if not isinstance(options, dict | None):  # false, 0 and "" too: they are not options
        raise HTTPError(400, "'stream_options' must be an object", param="stream_options")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = (options or {}).get(key)
        if not isinstance(value, bool | None):
            raise HTTPError(400, f"'stream_options.{key}' must be a bool", param="stream_options")
        flags.append(bool(value))
    return _StreamFlags(stream, *flags)


class _OpenAIPlan(Plan):
    object_name = ""
    chunk_name = ""
    id_prefix = ""

    def __init__(
        self,
        native: dict[str, Any],
        model: str,
        flags: _StreamFlags,
        n: int,
    ) -> None:
        super().__init__(native, f"{self.id_prefix}{uuid.uuid4().hex}", flags.stream, n)
        self.include_usage = flags.include_usage
        self.continuous_usage = flags.continuous_usage
        self.model = model
        self.created = int(time.time())

    def _envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.public_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk of one choice; with ``continuous_usage_stats``, its usage so far.

        As SGLang's: every chunk that carries a choice carries that choice's
        own usage (its prompt, its completion so far), not the request's.
        """
        chunk = self._envelope(self.chunk_name, [choice])
        if self.continuous_usage:
            chunk["usage"] = self.child_usage(choice["index"])
        return chunk

    def closing_events(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self._envelope(self.chunk_name, []), "usage": self.usage()}]


class CompletionPlan(_OpenAIPlan):
    object_name = "text_completion"
    chunk_name = "text_completion"
    id_prefix = "cmpl-"

    @classmethod
    def parse(cls, body: dict[str, Any], model: str) -> CompletionPlan:
        _check_fields(body, _COMPLETION_FIELDS)
        if body.get("echo") or body.get("logprobs") or body.get("suffix") is not None:
            raise HTTPError(400, "echo, logprobs and suffix are not supported")
        if _int(body, "best_of", low=1, default=1) != 1:
            raise HTTPError(400, "best_of is not supported", param="best_of")
        prompt = body.get("prompt")
        native: dict[str, Any]
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], str)
        ):
            native = {"text": prompt}
        elif isinstance(prompt, list) and prompt:
            native = {"input_ids": prompt}  # token ids, or a list of them
        else:
            raise HTTPError(
                400,
                "'prompt' must be a non-empty string, list of strings, or token ids",
                param="prompt",
            )
        max_tokens = _int(body, "max_tokens", low=0, default=_COMPLETIONS_DEFAULT_MAX_TOKENS)
        native["sampling_params"], n = _sampling(body, max_tokens)
        return cls({**native, **_bootstrap(body)}, model, _stream_flags(body), n)

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def events(self, index: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        reason = self.children[index].finish_reason
        return [self._chunk(self._choice(index, out.get("text", ""), reason))]

    def body(self) -> object:
        choices = [
            self._choice(index, child.text, child.finish_reason)
            for index, child in sorted(self.children.items())
        ]
        return {**self._envelope(self.object_name, choices), "usage": self.usage()}


class ChatPlan(_OpenAIPlan):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    @classmethod
    def parse(cls, body: dict[str, Any], model: str) -> ChatPlan:
        _check_fields(body, _CHAT_FIELDS)
        if body.get("logprobs"):
            raise HTTPError(400, "logprobs is not supported", param="logprobs")
        native: dict[str, Any] = {"text": _chat_prompt(body.get("messages"))}
        max_tokens = _int(body, "max_completion_tokens", low=0, default=None)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", low=0, default=None)
        native["sampling_params"], n = _sampling(body, max_tokens)
        return cls({**native, **_bootstrap(body)}, model, _stream_flags(body), n)

    def __init__(
        self,
        native: dict[str, Any],
        model: str,
        flags: _StreamFlags,
        n: int,
    ) -> None:
        super().__init__(native, model, flags, n)
        self._spoken: set[int] = set()  # children whose first delta (with the role) went out

    def events(self, index: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        child = self.children[index]
        delta: dict[str, Any] = {"content": out.get("text", "")}
        if index not in self._spoken:
            self._spoken.add(index)
            delta = {"role": "assistant", **delta}
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": child.finish_reason,
        }
        return [self._chunk(choice)]

    def body(self) -> object:
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": child.text},
                "logprobs": None,
                "finish_reason": child.finish_reason,
            }
            for index, child in sorted(self.children.items())
        ]
        return {**self._envelope(self.object_name, choices), "usage": self.usage()}


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _chat_prompt(messages: object) -> str:
    """A plain-text transcript (the SimEngine has no chat template to apply)."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list", param="messages")
    lines = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:  # a list or dict is unhashable
            raise HTTPError(
                400, f"messages[{i}] needs a role in {sorted(_ROLES)}", param="messages"
            )
        lines.append(f"{role}: {_content_text(message.get('content'), i)}")
    lines.append("assistant:")
    return "\n".join(lines)


def _content_text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise HTTPError(400, f"messages[{i}].content must be text", param="messages")
