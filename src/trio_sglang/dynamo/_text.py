"""``ModelInput.Text``: the client's OpenAI body in, OpenAI chunks out, through ``serve``'s plans.

Registered with ``ModelInput.Text``, the worker gets the client's body as
Dynamo's frontend (1.6.1) parsed it: ``messages`` for ``/v1/chat/completions``,
``prompt`` for ``/v1/completions``. The frontend refuses the fields it does
not know itself (SGLang's extensions among them: ``rid``, ``regex``,
``input_ids``). It sends the client the worker's chunks as they are, and
folds them into one body for a request that did not ask to stream: the
choices' text added up, the id and usage of the last chunk that has them.

So a request here is parsed, checked and rendered by the plans of
``serve``'s OpenAI routes (``_protocol/_openai.py``): the same fields taken,
refused by name or ignored, chat prompts rendered with the engine's chat
template as ``serve`` renders them (``ChatTemplating``, the plain transcript
without one), and the same chunks, as objects. The stream always carries the
usage chunk for a body, which has no other way to get its usage. The
frontend takes only OpenAI's finish reasons: SGLang's ``abort`` goes as
``stop``, as the frontend itself reports a cancelled chat choice in tokens
mode. No engine rid is in any chunk: the id is the response's own
(``chatcmpl-``, ``cmpl-``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from .._engine import ChatTemplating, Engine
from .._errors import InvalidRequest
from .._protocol import ChatPlan, CompletionPlan, OpenAIPlan
from ._translation import InputMode, Translation

__all__ = ["merge_text_chunks", "text_mode"]


def text_mode(engine: Engine, model: str) -> InputMode:
    """``ModelInput.Text`` over ``engine``; ``model`` names the model in every chunk."""
    templating = engine if isinstance(engine, ChatTemplating) else None

    def translate(request: Mapping[str, Any]) -> Translation:
        plan = _plan(request, model, templating)
        plan.check_sampling()
        chunk = partial(_chunk, plan)
        return Translation(plan.native, "native", chunk, plan.closing_events, plan.names)

    return InputMode(translate, merge_text_chunks)


def _plan(request: Mapping[str, Any], model: str, templating: ChatTemplating | None) -> OpenAIPlan:
    if not isinstance(request, Mapping):
        raise InvalidRequest(f"an OpenAI request is a JSON object, got {type(request).__name__}")
    body = dict(request)
    plan: OpenAIPlan
    if "messages" in body:
        plan = ChatPlan.parse(body, model, templating)
    else:
        plan = CompletionPlan.parse(body, model)
    if not plan.stream:
        # The frontend makes the body out of a stream: its usage comes from a chunk.
        plan.stream = plan.include_usage = True
    return plan


def _chunk(plan: OpenAIPlan, out: dict[str, Any]) -> dict[str, Any]:
    index, _ = plan.add(out)
    chunk = plan.chunk(index, out)
    for choice in chunk["choices"]:
        if choice["finish_reason"] == "abort":
            choice["finish_reason"] = "stop"
    return chunk


def merge_text_chunks(last: dict[str, Any], chunk: dict[str, Any]) -> bool:
    """``chunk`` into ``last`` if both are one unfinished choice's: the text added, the rest newer.

    A chunk of usage alone (no choice) is never merged: it closes the stream.
    """
    before, after = last["choices"], chunk["choices"]
    if not (len(before) == len(after) == 1) or before[0]["index"] != after[0]["index"]:
        return False
    mine, newer = before[0], after[0]
    if mine["finish_reason"] is not None:
        return False
    if "delta" in mine:
        mine["delta"]["content"] += newer["delta"]["content"]
    else:
        mine["text"] += newer["text"]
    mine["finish_reason"] = newer["finish_reason"]
    if "usage" in chunk:  # continuous usage: the newer counts every token so far
        last["usage"] = chunk["usage"]
    return True
