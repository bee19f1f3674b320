"""One chat request two ways: what trio-sglang's chat route and SGLang's feed the scheduler.

SGLang renders chat messages in its server, so a worker serving OpenAI's
chat route over SGLang must render them as SGLang's server would, or a real
model answers a prompt it was never trained on. The host process runs the
same body through trio-sglang's route (``ChatPlan`` over
``SGLangEngine.render_chat``) and through SGLang's own ``OpenAIServingChat``
(set up as SGLang's server sets it up), each as a one-token request to the
same TokenizerManager, and reports the token ids the stand-in scheduler
received for each: the prompt the model would have been fed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from trio_sglang import ChatTemplating, InvalidRequest, RequestContext, Worker

__all__ = ["ChatPrompts", "observe_chat"]

#: Marks the scheduler's log; the mark returns the ids of each request received since.
LogMark = Callable[[], Callable[[], list[list[int]]]]


@dataclass(frozen=True)
class ChatPrompts:
    """Per route: the ids the scheduler received, or the route's refusal (its message)."""

    ours: list[int] | str
    sglang: list[int] | str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def observe_chat(
    worker: Worker,
    engine: ChatTemplating,
    sglang_serving: Any,
    body: Mapping[str, Any],
    mark: LogMark,
) -> ChatPrompts:
    """``body`` (an OpenAI chat request) through both routes, on a worker over ``engine``."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    from trio_sglang._protocol import ChatPlan

    ours: dict[str, Any] | str
    theirs: dict[str, Any] | str
    try:
        ours = ChatPlan.parse(dict(body), "harness", engine).native
    except InvalidRequest as exc:
        ours = str(exc)
    try:
        adapted, _ = sglang_serving._convert_to_internal_request(ChatCompletionRequest(**body))
        theirs = {"text": adapted.text, "input_ids": adapted.input_ids}
    except ValueError as exc:  # how SGLang's route refuses (its 400)
        theirs = str(exc)
    return ChatPrompts(await _fed(worker, ours, mark), await _fed(worker, theirs, mark))


async def _fed(worker: Worker, prompt: dict[str, Any] | str, mark: LogMark) -> list[int] | str:
    """The ids the scheduler got for ``prompt`` (its ``text`` or ``input_ids``) as one request."""
    if isinstance(prompt, str):
        return prompt
    request = {key: prompt[key] for key in ("text", "input_ids") if prompt.get(key) is not None}
    since = mark()
    ctx = RequestContext("chat-conformance")
    one_token = {**request, "sampling_params": {"max_new_tokens": 1}}
    async with worker.generate(one_token, ctx, output="native") as outputs:
        async for _ in outputs:
            pass
    # The scheduler logged the request before it answered it.
    [ids] = since()
    return ids
