"""What the installed SGLang does with a request's state, read from its own code at run time.

SGLang's cancellation semantics changed from release to release (when a
request is registered, which mark says it was dispatched, what closing its
generator does, whether a repeated abort is dropped, how ``n > 1`` children
are named, what becomes of an abort that comes before the dispatch). A
version table would be wrong for every patched or unreleased build, so this
module reads the installed ``TokenizerManager`` instead: the fields of its
``ReqState`` and, with ``ast``, the few methods whose shape decides the
lifecycle. ``SGLangEngine`` detects once, at start, refuses a
release it cannot stop requests on, and covers what the release's own close
leaves undone (``_sglang/_release.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "MINIMUM_RELEASE",
    "CloseRelease",
    "DispatchMark",
    "SGLangSemantics",
    "UnsupportedSGLang",
    "detect_semantics",
    "engine_keeps_a_tokenizer",
    "require_supported",
    "streams_increments",
]

#: The oldest SGLang release trio-sglang stops requests on correctly.
MINIMUM_RELEASE = "0.5.10"


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is older than ``MINIMUM_RELEASE``, or behaves as if it were."""


class DispatchMark(enum.Enum):
    """What on a request's ``ReqState`` says it has been sent to the scheduler."""

    #: ``ReqState.dispatched`` (0.5.17, and 0.5.20 on).
    FLAG = "dispatched"
    #: ``ReqState.time_stats.api_server_dispatch_finish_time`` (0.5.10 to 0.5.19).
    TIME_STATS = "time_stats"
    #: Nothing: the state is made only once the request is sent (0.5.9 and older).
    NONE = "none"


class CloseRelease(enum.Enum):
    """What closing (or cancelling) ``generate_request`` does with the request it was serving."""

    #: Nothing: every state stays registered and nothing is sent (0.5.16 and older).
    KEEPS = "keeps"
    #: Forgets the request's own states, dispatched or not, and sends nothing (0.5.18, 0.5.19).
    FORGETS = "forgets"
    #: Aborts what was dispatched, children included, and forgets it all (0.5.17).
    ABORTS = "aborts"
    #: Forgets what was not dispatched; aborts what was, keeping its state (0.5.20 on).
    RELEASES = "releases"


@dataclasses.dataclass(frozen=True)
class SGLangSemantics:
    """One SGLang build's request lifecycle, as detected from its code."""

    #: ``sglang.version.__version__``, or None where it cannot be read.
    version: str | None
    #: The request's state exists before it is sent (False: only from its send on).
    registered_before_dispatch: bool
    dispatch_mark: DispatchMark
    close: CloseRelease
    #: A second abort of a dispatched request is dropped (``ReqState.abort_sent``).
    abort_dedupe: bool
    #: ``n > 1`` children are named ``{rid}_{uuid}`` and tracked by their parent
    #: (False: a fresh uuid each, which only their first output reveals).
    children_named_by_parent: bool
    #: A request aborted in the scheduler's waiting queue is forgotten when its
    #: abort comes back (False, 0.5.12 and older: its state stays registered).
    queued_abort_forgets: bool
    #: An abort that comes before the dispatch is kept (``ReqState.abort_requested``,
    #: 0.5.17 only): the request is never sent, and its generator raises SGLang's
    #: ``RequestAbortedError``. Elsewhere such an abort is lost, which the lifecycle
    #: never lets happen (it aborts only after the dispatch).
    early_abort_kept: bool

    @property
    def supported(self) -> bool:
        """Whether a cancel can be stopped here: the dispatch must be visible before the send."""
        return self.registered_before_dispatch and self.dispatch_mark is not DispatchMark.NONE

    @property
    def close_stops_dispatched(self) -> bool:
        """Whether SGLang's own close aborts what was dispatched (else the adapter must)."""
        return self.close in (CloseRelease.ABORTS, CloseRelease.RELEASES)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "registered_before_dispatch": self.registered_before_dispatch,
            "dispatch_mark": self.dispatch_mark.value,
            "close": self.close.value,
            "abort_dedupe": self.abort_dedupe,
            "children_named_by_parent": self.children_named_by_parent,
            "queued_abort_forgets": self.queued_abort_forgets,
            "early_abort_kept": self.early_abort_kept,
        }


def detect_semantics(
    tokenizer_manager_class: Any = None, req_state_class: Any = None
) -> SGLangSemantics:
    """Read the semantics off SGLang's classes (the installed ones by default)."""
    if tokenizer_manager_class is None or req_state_class is None:
        from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager

        tokenizer_manager_class = tokenizer_manager_class or TokenizerManager
        req_state_class = req_state_class or ReqState
    tm = tokenizer_manager_class
    fields = {f.name for f in dataclasses.fields(req_state_class)}
    registered_at_send = _assigns_registry(_method(tm, "_send_one_request"))
    if "dispatched" in fields:
        mark = DispatchMark.FLAG
    elif "time_stats" in fields and _calls(
        _method(tm, "_send_one_request"), "set_api_server_dispatch_finish_time"
    ):
        mark = DispatchMark.TIME_STATS
    else:
        mark = DispatchMark.NONE
    return SGLangSemantics(
        version=_version(),
        registered_before_dispatch=not registered_at_send,
        dispatch_mark=mark,
        close=_close_release(tm),
        abort_dedupe="abort_sent" in fields,
        children_named_by_parent=_regenerates_with_prefix(_method(tm, "_handle_batch_request")),
        queued_abort_forgets=_forgets(_method(tm, "_handle_abort_req")),
        early_abort_kept="abort_requested" in fields,
    )


def require_supported(semantics: SGLangSemantics) -> None:
    """Raise ``UnsupportedSGLang`` (one line: what, why, the minimum) unless supported."""
    version = semantics.version or "of unknown version"
    if not semantics.supported:
        raise UnsupportedSGLang(
            f"SGLang {version} registers a request only once it is sent to the scheduler, "
            "so a cancel cannot be ordered before its abort; trio-sglang needs SGLang "
            f">= {MINIMUM_RELEASE}"
        )
    release, minimum = _release_tuple(semantics.version), _release_tuple(MINIMUM_RELEASE)
    assert minimum is not None  # a release number, by definition
    if release is not None and release < minimum:
        raise UnsupportedSGLang(
            f"SGLang {version} is older than the oldest release trio-sglang is tested on; "
            f"trio-sglang needs SGLang >= {MINIMUM_RELEASE}"
        )


def engine_keeps_a_tokenizer() -> bool:
    """Whether ``sglang.Engine`` with ``tokenizer_worker_num`` above 1 keeps a tokenizer here.

    Such an Engine puts a router between its tokenizer workers and the
    scheduler. Newer ones also give their own process a worker, and the
    ``attach_tokenizer_worker`` that lets other processes join; older ones
    keep the router alone, which generates nothing. Read from the engine
    module's source, not imported: importing it sets uvloop's event loop policy.
    """
    import importlib.util

    spec = importlib.util.find_spec("sglang.srt.entrypoints.engine")
    if spec is None or spec.origin is None:
        return False
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    return any(
        isinstance(node, ast.ClassDef)
        and node.name == "Engine"
        and any(
            isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            and item.name == "attach_tokenizer_worker"
            for item in node.body
        )
        for node in tree.body
    )


def streams_increments(tm: Any) -> bool:
    """Whether ``tm``'s streamed outputs are increments (``--incremental-streaming-output``).

    From 0.5.17 the TokenizerManager keeps its own copy of the flag, and its
    generator reads that; older ones read their server arguments' on every
    output, and have no copy.
    """
    own = getattr(tm, "incremental_streaming_output", None)
    if own is None:
        own = getattr(getattr(tm, "server_args", None), "incremental_streaming_output", False)
    return bool(own)


def _version() -> str | None:
    try:
        from sglang.version import __version__
    except ImportError:
        return None
    return __version__ if isinstance(__version__, str) else None


def _release_tuple(version: str | None) -> tuple[int, ...] | None:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; None for what does not start with a release."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version or "")
    return None if found is None else tuple(int(part) for part in found.groups())


def _method(cls: Any, name: str) -> ast.AST | None:
    """The parsed source of ``cls.name`` (None if it has none, or no readable source)."""
    fn = getattr(cls, name, None)
    if fn is None:
        return None
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


def _walk(tree: ast.AST | None) -> Iterator[ast.AST]:
    return iter(()) if tree is None else ast.walk(tree)


def _called_names(tree: ast.AST | None) -> set[str]:
    """The names of everything called in ``tree``: ``f(...)`` and ``x.f(...)`` give ``f``."""
    names = set()
    for node in _walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute):
                names.add(fn.attr)
            elif isinstance(fn, ast.Name):
                names.add(fn.id)
    return names


def _calls(tree: ast.AST | None, name: str) -> bool:
    return name in _called_names(tree)


def _assigns_registry(tree: ast.AST | None) -> bool:
    """Whether ``tree`` stores into ``self.rid_to_state[...]``."""
    for node in _walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == "rid_to_state"
                ):
                    return True
    return False


def _forgets(tree: ast.AST | None) -> bool:
    """Whether ``tree`` removes from the registry (``pop``, ``del``, or a helper that does)."""
    return any(isinstance(node, ast.Delete) for node in _walk(tree)) or bool(
        _called_names(tree) & {"pop", "_remove_req_state"}
    )


def _catches_cancellation(handler: ast.ExceptHandler) -> bool:
    """``except:``, ``except BaseException`` or ``CancelledError``/``GeneratorExit``, named."""
    if handler.type is None:
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = {k.attr if isinstance(k, ast.Attribute) else getattr(k, "id", "") for k in kinds}
    return bool(names & {"BaseException", "CancelledError", "GeneratorExit"})


def _close_release(tm: Any) -> CloseRelease:
    """What ``generate_request``'s handler for cancellation (if it has one) calls, read."""
    called: set[str] = set()
    for node in _walk(_method(tm, "generate_request")):
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                if _catches_cancellation(handler):
                    called |= _called_names(ast.Module(body=handler.body, type_ignores=[]))
    releases = [name for name in sorted(called) if name.startswith("_") and hasattr(tm, name)]
    if "_release_req_states_on_failure" in releases:
        return CloseRelease.RELEASES
    helpers = [_method(tm, name) for name in releases]
    if any(_calls(h, "AbortReq") or _calls(h, "abort_request") for h in helpers):
        return CloseRelease.ABORTS
    if any(_forgets(h) for h in helpers):
        return CloseRelease.FORGETS
    return CloseRelease.KEEPS


def _regenerates_with_prefix(tree: ast.AST | None) -> bool:
    """Whether children get their rid from ``regenerate_rid(prefix=...)``."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "regenerate_rid"
        and any(keyword.arg == "prefix" for keyword in node.keywords)
        for node in _walk(tree)
    )
