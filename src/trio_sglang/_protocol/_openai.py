"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI's schemas over SGLang's outputs."""

from __future__ import annotations

import time
import uuid
from abc import abstractmethod
from functools import cached_property
from typing import Any, NamedTuple

from .._core._worker import PreparedRequest, Worker
from .._engine import ChatTemplating
from .._errors import InvalidRequest
from .._request._values import is_token_list
from ._json import Template
from ._openai_fields import Route, check_sampling, native_fields
from ._plan import Plan
from ._sse import sse_data
from ._transcript import plain_transcript

__all__ = ["ChatPlan", "CompletionPlan", "OpenAIPlan"]


def _native(
    body: dict[str, Any], route: Route, prompt: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The native body of ``prompt`` and ``body``'s other fields; and the names the client used.

    A ``rid`` is the request's id, as in SGLang: its response's ``id``, and what
    ``/abort_request`` stops it by.
    """
    fields = native_fields(body, route)
    native = {**prompt, "sampling_params": fields.sampling, **fields.passed}
    rid = body.get("rid")
    if rid is not None:
        if not (isinstance(rid, str) and rid):
            # SGLang also takes a list, one per prompt: these responses have one id.
            raise InvalidRequest("'rid' must be a non-empty string", param="rid")
        native["rid"] = rid
    return native, fields.names


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
        raise InvalidRequest("'stream' must be a bool", param="stream")
    options = body.get("stream_options")
    if not isinstance(options, dict | None):  # false, 0 and "" too: they are not options
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = (options or {}).get(key)
        if not isinstance(value, bool | None):
            raise InvalidRequest(f"'stream_options.{key}' must be a bool", param="stream_options")
        flags.append(bool(value))
    return _StreamFlags(stream, *flags)


class OpenAIPlan(Plan):
    """What both OpenAI routes share: the envelope, the stream chunks, the closing usage."""

    object_name = ""
    chunk_name = ""
    id_prefix = ""
    #: Usage reports the prompt's cached tokens (``--enable-cache-report``); the server sets it.
    cache_report = False

    def __init__(
        self,
        native: dict[str, Any],
        names: dict[str, str],
        model: str,
        flags: _StreamFlags,
    ) -> None:
        public_id = native.get("rid") or f"{self.id_prefix}{uuid.uuid4().hex}"
        super().__init__(native, public_id, flags.stream)
        #: Completions per prompt: the client's ``n``, as this plan wrote it into ``native``.
        self.n: int = native["sampling_params"].get("n") or 1
        self.names = names
        self.include_usage = flags.include_usage
        self.continuous_usage = flags.continuous_usage
        self.model = model
        self.created = int(time.time())

    def check_sampling(self) -> None:
        """The sampling parameters, refused in the client's words; after the context length."""
        check_sampling(self.native["sampling_params"], self.names)

    def prepare(self, worker: Worker) -> PreparedRequest:
        self.check_sampling()
        return super().prepare(worker)

    def usage(self) -> dict[str, Any]:
        """OpenAI usage: each prompt counted once (its cached tokens too), every child's completion.

        As SGLang's ``UsageProcessor``: a prompt's counts are its first child's.
        """
        prompts: dict[int, dict[str, Any]] = {}
        completion = 0
        for index, child in sorted(self.children.items()):
            prompts.setdefault(index // self.n, child.meta)
            completion += int(child.meta.get("completion_tokens", 0))
        prompt = sum(int(meta.get("prompt_tokens", 0)) for meta in prompts.values())
        cached = sum(int(meta.get("cached_tokens", 0)) for meta in prompts.values())
        return self._usage(prompt, completion, cached)

    def child_usage(self, index: int) -> dict[str, Any]:
        """One child's usage so far: its prompt and its completion.

        Read from the newest output's ``meta_info``, which counts every token
        so far, also when one event carries several (a client behind, ``Outbox``).
        """
        meta = self.children[index].meta
        return self._usage(
            int(meta.get("prompt_tokens", 0)),
            int(meta.get("completion_tokens", 0)),
            int(meta.get("cached_tokens", 0)),
        )

    def _usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.cache_report:
            # SGLang's --enable-cache-report: the prompt tokens its prefix cache held.
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _envelope(self, name: str, choices: object) -> dict[str, Any]:
        return {
            "id": self.public_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    @cached_property
    def _chunk(self) -> Template:
        """A stream chunk's id, object, created and model never change: encoded once."""
        shape = self._envelope(self.chunk_name, Template.HOLE)
        if self.continuous_usage:
            shape["usage"] = Template.HOLE
        return Template(shape)

    def sse(self, index: int, out: dict[str, Any]) -> bytes:
        """The SSE event of one output; with ``continuous_usage_stats``, its choice's usage so far.

        As SGLang's: every chunk that carries a choice carries that choice's
        own usage (its prompt, its completion so far), not the request's.
        """
        choice = self.stream_choice(index, out)
        if self.continuous_usage:
            return sse_data(self._chunk.render([choice], self.child_usage(index)))
        return sse_data(self._chunk.render([choice]))

    def chunk(self, index: int, out: dict[str, Any]) -> dict[str, Any]:
        """The chunk ``sse`` sends, as an object: for a transport that encodes it (Dynamo's)."""
        chunk = self._envelope(self.chunk_name, [self.stream_choice(index, out)])
        if self.continuous_usage:
            chunk["usage"] = self.child_usage(index)
        return chunk

    @abstractmethod
    def stream_choice(self, index: int, out: dict[str, Any]) -> dict[str, Any]:
        """The choice a stream chunk carries for one output, already added."""

    def closing_events(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self._envelope(self.chunk_name, []), "usage": self.usage()}]


class CompletionPlan(OpenAIPlan):
    object_name = "text_completion"
    chunk_name = "text_completion"
    id_prefix = "cmpl-"

    @classmethod
    def parse(cls, body: dict[str, Any], model: str) -> CompletionPlan:
        prompt = body.get("prompt")
        native: dict[str, Any]
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], str)
        ):
            native = {"text": prompt}
        elif isinstance(prompt, list) and prompt:
            native = {"input_ids": prompt}  # token ids, or a list of them
        else:
            raise InvalidRequest(
                "'prompt' must be a non-empty string, list of strings, or token ids",
                param="prompt",
            )
        return cls(*_native(body, "completions", native), model, _stream_flags(body))

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def stream_choice(self, index: int, out: dict[str, Any]) -> dict[str, Any]:
        return self._choice(index, out.get("text", ""), self.children[index].finish_reason)

    def body(self) -> object:
        choices = [
            self._choice(index, child.text, child.finish_reason)
            for index, child in sorted(self.children.items())
        ]
        return {**self._envelope(self.object_name, choices), "usage": self.usage()}


class ChatPlan(OpenAIPlan):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    @classmethod
    def parse(
        cls, body: dict[str, Any], model: str, templating: ChatTemplating | None = None
    ) -> ChatPlan:
        """``templating``: the engine's chat template (the plain transcript without one)."""
        ids = body.get("input_ids")
        if ids is None:
            native = _chat_prompt(body, templating)
        else:
            # As SGLang: token ids in place of the rendered messages, which are
            # still checked but never rendered (no template can refuse them).
            _checked_messages(body.get("messages"))
            if not is_token_list(ids):
                raise InvalidRequest(
                    "'input_ids' must be a non-empty list of token ids", param="input_ids"
                )
            native = {"input_ids": ids}
        return cls(*_native(body, "chat", native), model, _stream_flags(body))

    def __init__(
        self,
        native: dict[str, Any],
        names: dict[str, str],
        model: str,
        flags: _StreamFlags,
    ) -> None:
        super().__init__(native, names, model, flags)
        self._spoken: set[int] = set()  # children whose first delta (with the role) went out

    def stream_choice(self, index: int, out: dict[str, Any]) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": out.get("text", "")}
        if index not in self._spoken:
            self._spoken.add(index)
            delta = {"role": "assistant", **delta}
        return {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": self.children[index].finish_reason,
        }

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


def _chat_prompt(body: dict[str, Any], templating: ChatTemplating | None) -> dict[str, Any]:
    """The prompt of the native body: text, or token ids where the template gives them.

    As SGLang's chat route: it renders the model's template and hands the
    TokenizerManager the token ids. A template's refusal is the client's error.
    """
    messages = _checked_messages(body.get("messages"))
    continue_final = body.get("continue_final_message")
    if not isinstance(continue_final, bool | None):
        raise InvalidRequest(
            "'continue_final_message' must be a bool", param="continue_final_message"
        )
    render = plain_transcript if templating is None else templating.render_chat
    try:
        prompt = render(messages, continue_final_message=bool(continue_final))
    except ValueError as exc:
        raise InvalidRequest(
            f"the chat template refused the messages: {exc}", param="messages"
        ) from exc
    return {"input_ids": prompt} if isinstance(prompt, list) else {"text": prompt}


def _checked_messages(messages: object) -> list[dict[str, Any]]:
    """The messages as sent, once each has a known role and text content."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:  # a list or dict is unhashable
            raise InvalidRequest(
                f"messages[{i}] needs a role in {sorted(_ROLES)}", param="messages"
            )
        _check_content(message.get("content"), i)
    return messages


def _check_content(content: object, i: int) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return
    raise InvalidRequest(f"messages[{i}].content must be text", param="messages")
