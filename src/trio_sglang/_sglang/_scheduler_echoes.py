"""How ``SGLangEngine`` hears its scheduler on an aborted id, and aborts it again.

SGLang's TokenizerManager hands every message from the scheduler to
``_handle_batch_output`` (outputs, each with its finish reason) or to
``_result_dispatcher`` (an ``AbortReq`` echo for a request aborted in the
waiting queue), and sends every abort through ``abort_request``; its receive
loop and its release path call all three through the instance, in every
release from 0.5.10 to 0.5.23. While the engine runs, each is wrapped on the
instance (never on the class: another TokenizerManager in the process is
not touched):

- ``abort_request``: an abort that left for an id the TokenizerManager holds
  (its first, where the release sends only the first) starts its echo;
- ``_handle_batch_output`` and ``_result_dispatcher``: each output of an id
  with an echo is told to it, before SGLang looks the id up, so that an id
  whose state SGLang already forgot (0.5.18 and 0.5.19 forget on close,
  and log "the state was deleted" for each output after) is heard too.

``send_abort`` is the abort that ``abort_request`` would send, sent past its
once-only flag: straight to the scheduler's socket.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .._echoes import Echoes

__all__ = ["hearing_scheduler", "send_abort"]

_WRAPPED = ("abort_request", "_handle_batch_output", "_result_dispatcher")


@contextmanager
def hearing_scheduler(tm: Any, echoes: Echoes) -> Iterator[bool]:
    """For the block, tell ``echoes`` what ``tm`` sends and hears; whether it could."""
    originals: dict[str, Any] = {name: getattr(tm, name, None) for name in _WRAPPED}
    if not all(map(callable, originals.values())) or any(
        getattr(original, "hears_scheduler", False) for original in originals.values()
    ):
        yield False  # not the TokenizerManager this was written for, or already heard
        return
    own = {name: vars(tm)[name] for name in _WRAPPED if name in vars(tm)}
    abort_request, handle_batch_output, result_dispatcher = originals.values()

    def aborting(*args: Any, **kwargs: Any) -> Any:
        rid = kwargs.get("rid", args[0] if args else "")
        everything = kwargs.get("abort_all", args[1] if len(args) > 1 else False)
        registry = getattr(tm, "rid_to_state", None)
        state = registry.get(rid) if isinstance(registry, Mapping) and not everything else None
        first = state is not None and not getattr(state, "abort_sent", False)
        result = abort_request(*args, **kwargs)
        if first:
            echoes.sent(rid)
        return result

    async def outputs(recv_obj: Any) -> Any:
        # Never raises: an error here would end SGLang's receive loop, and its process tree.
        if echoes:
            reasons = getattr(recv_obj, "finished_reasons", None) or ()
            for i, rid in enumerate(getattr(recv_obj, "rids", None) or ()):
                echoes.heard(rid, finished=i < len(reasons) and reasons[i] is not None)
        return await handle_batch_output(recv_obj)

    def results(recv_obj: Any) -> Any:
        if echoes and type(recv_obj).__name__ == "AbortReq":
            echoes.heard(getattr(recv_obj, "rid", ""), finished=True)
        return result_dispatcher(recv_obj)

    for name, wrapper in zip(_WRAPPED, (aborting, outputs, results), strict=True):
        wrapper.hears_scheduler = True  # type: ignore[attr-defined]
        setattr(tm, name, wrapper)
    try:
        yield True
    finally:
        for name in _WRAPPED:
            if name in own:
                setattr(tm, name, own[name])
            else:
                vars(tm).pop(name, None)


def send_abort(tm: Any, rid: str) -> None:
    """``AbortReq(rid)`` to the scheduler, as ``abort_request`` sends it, flag or no flag."""
    from sglang.srt.managers.io_struct import AbortReq

    request = AbortReq(rid=rid)
    dispatch = getattr(tm, "_dispatch_to_scheduler", None)  # 0.5.19 on (stamps a worker's ipc)
    if dispatch is not None:
        dispatch(request)
    else:
        tm.send_to_scheduler.send_pyobj(request)
