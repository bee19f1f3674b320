"""Release detection and the adapter's release path, on classes shaped as each SGLang release's.

No SGLang here (the main suite): each class below has the shape that
decides the lifecycle in one release line, condensed from that release's
``tokenizer_manager.py``. ``nox -s sglang-matrix`` checks the detection on
the real releases (``test_sglang_release.py``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from trio_sglang._sglang._release import (
    Orphans,
    abort_dispatched,
    dispatched,
    forget_leftovers,
    states_of,
)
from trio_sglang._sglang._semantics import (
    CloseRelease,
    DispatchMark,
    SGLangSemantics,
    UnsupportedSGLang,
    detect_semantics,
    require_supported,
)


@dataclasses.dataclass
class OldState:  # 0.5.9 and older
    out_list: list[Any]
    finished: bool


@dataclasses.dataclass
class TimeStatsState:  # 0.5.10 to 0.5.16, 0.5.18, 0.5.19
    out_list: list[Any]
    finished: bool
    time_stats: Any = None


@dataclasses.dataclass
class FlagState:  # 0.5.17
    finished: bool
    time_stats: Any = None
    dispatched: bool = False
    abort_requested: bool = False


@dataclasses.dataclass
class DedupeState:  # 0.5.20 on
    finished: bool
    time_stats: Any = None
    dispatched: bool = False
    abort_sent: bool = False


class RegistersAtSend:  # 0.5.9
    async def generate_request(self, obj):
        tokenized = await self._tokenize_one_request(obj)
        self._send_one_request(obj, tokenized)
        yield None

    def _send_one_request(self, obj, tokenized):
        self.send_to_scheduler.send_pyobj(tokenized)
        self.rid_to_state[obj.rid] = OldState([], False)


class KeepsOnClose:  # 0.5.10 to 0.5.16: `except Exception` does not catch a cancel
    async def generate_request(self, obj):
        self._init_req_state(obj)
        try:
            yield await self._tokenize_one_request(obj)
        except Exception:
            self._discard_pending_req_states(obj)
            raise

    def _send_one_request(self, tokenized):
        self.send_to_scheduler.send_pyobj(tokenized)
        tokenized.time_stats.set_api_server_dispatch_finish_time()

    def _discard_pending_req_states(self, obj):
        self.rid_to_state.pop(obj.rid, None)

    async def _handle_batch_request(self, obj):
        obj.regenerate_rid()

    def _handle_abort_req(self, recv_obj):  # 0.5.14 on
        state = self.rid_to_state.get(recv_obj.rid)
        state.finished = True
        del self.rid_to_state[recv_obj.rid]


class KeepsAbortedInQueue(KeepsOnClose):  # 0.5.10 to 0.5.12
    def _handle_abort_req(self, recv_obj):
        self.rid_to_state[recv_obj.rid].finished = True


class ForgetsOnClose(KeepsOnClose):  # 0.5.18, 0.5.19
    async def generate_request(self, obj):
        self._init_req_state(obj)
        try:
            yield await self._tokenize_one_request(obj)
        except BaseException:
            self._discard_pending_req_states(obj)
            raise


class AbortsOnClose(ForgetsOnClose):  # 0.5.17
    def _discard_pending_req_states(self, obj):
        for rid in obj.rid:
            self._dispatch_to_scheduler(AbortReq(rid=rid))
            self._remove_req_state(rid)

    async def _handle_batch_request(self, obj):
        obj.regenerate_rid(prefix=obj.rid)


class ReleasesOnClose(KeepsOnClose):  # 0.5.20 on
    async def generate_request(self, obj):
        self._init_req_state(obj)
        try:
            yield await self._tokenize_one_request(obj)
        except BaseException:
            self._release_req_states_on_failure([obj.rid])
            raise

    def _release_req_states_on_failure(self, rids):
        for rid in rids:
            self.abort_request(rid)


def AbortReq(**kwargs: Any) -> Any:
    return kwargs


NONE, STATS, FLAG = DispatchMark.NONE, DispatchMark.TIME_STATS, DispatchMark.FLAG


@pytest.mark.parametrize(
    ("tm", "state", "expected"),
    [
        (
            RegistersAtSend,
            OldState,
            (False, NONE, CloseRelease.KEEPS, False, False, False, False),
        ),
        (
            KeepsAbortedInQueue,
            TimeStatsState,
            (True, STATS, CloseRelease.KEEPS, False, False, False, False),
        ),
        (
            KeepsOnClose,
            TimeStatsState,
            (True, STATS, CloseRelease.KEEPS, False, False, True, False),
        ),
        (
            ForgetsOnClose,
            TimeStatsState,
            (True, STATS, CloseRelease.FORGETS, False, False, True, False),
        ),
        (AbortsOnClose, FlagState, (True, FLAG, CloseRelease.ABORTS, False, True, True, True)),
        (
            ReleasesOnClose,
            DedupeState,
            (True, FLAG, CloseRelease.RELEASES, True, False, True, False),
        ),
    ],
)
def test_each_release_lines_shape_is_detected(
    tm: type, state: type, expected: tuple[Any, ...]
) -> None:
    found = detect_semantics(tm, state)
    assert (
        found.registered_before_dispatch,
        found.dispatch_mark,
        found.close,
        found.abort_dedupe,
        found.children_named_by_parent,
        found.queued_abort_forgets,
        found.early_abort_kept,
    ) == expected


def semantics(version: str | None, **changes: Any) -> SGLangSemantics:
    supported = SGLangSemantics(
        version, True, FLAG, CloseRelease.RELEASES, True, False, True, False
    )
    return dataclasses.replace(supported, **changes)


def test_a_release_that_registers_at_the_send_is_refused_in_one_line_naming_the_minimum() -> None:
    old = semantics("0.5.9", registered_before_dispatch=False, dispatch_mark=NONE)
    with pytest.raises(UnsupportedSGLang) as refused:
        require_supported(old)
    message = str(refused.value)
    assert "\n" not in message
    assert "SGLang 0.5.9" in message
    assert "registers a request only once it is sent" in message
    assert ">= 0.5.10" in message


@pytest.mark.parametrize("version", ["0.5.9", "0.4.10.post2", "0.5.8.post1"])
def test_a_release_older_than_the_minimum_is_refused_whatever_its_shape(version: str) -> None:
    with pytest.raises(UnsupportedSGLang, match=r"older than .*>= 0\.5\.10$"):
        require_supported(semantics(version))


@pytest.mark.parametrize("version", ["0.5.10", "0.5.10.post1", "0.5.23", "0.6.0rc1", None, "dev"])
def test_the_minimum_and_newer_or_unversioned_builds_of_a_supported_shape_run(
    version: str | None,
) -> None:
    require_supported(semantics(version))


def test_only_releases_whose_close_aborts_need_no_cover() -> None:
    covered = {c for c in CloseRelease if not semantics(None, close=c).close_stops_dispatched}
    assert covered == {CloseRelease.KEEPS, CloseRelease.FORGETS}


# -- the adapter's release path, on SGLang-shaped states ------------------------


@dataclasses.dataclass
class Obj:
    """The fields of ``GenerateReqInput`` the release path reads, normalised as SGLang does."""

    rid: str | list[str]
    sampling_params: dict[str, Any] | list[dict[str, Any]]
    parallel_sample_num: int = 1


@dataclasses.dataclass
class State:
    obj: Any
    finished: bool = False
    dispatched: bool = False


class Recorder:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)


def test_the_dispatch_mark_is_read_whichever_the_release_has() -> None:
    stamped = SimpleNamespace(time_stats=SimpleNamespace(api_server_dispatch_finish_time=12.5))
    unstamped = SimpleNamespace(time_stats=SimpleNamespace(api_server_dispatch_finish_time=0.0))
    assert dispatched(stamped)
    assert not dispatched(unstamped)
    assert dispatched(SimpleNamespace(dispatched=True))
    assert not dispatched(SimpleNamespace())


def test_an_n_gt_1_requests_children_are_found_by_the_params_they_share_and_nobody_elses() -> None:
    params = {"n": 2}
    obj = Obj(["r_0", "r_1"], [params, params], parallel_sample_num=2)
    other = State(Obj("x", {"n": 2}), dispatched=True)
    registry = {
        # SGLang registers each of them with obj[i], which carries params[i].
        "r_0": State(Obj("r_0", params)),
        "r_1": State(Obj("r_1", params)),
        "warm": State(Obj("warm", params), dispatched=True, finished=True),
        "child-a": State(Obj("child-a", params), dispatched=True),
        "child-b": State(Obj("child-b", params)),
        "x": other,
        # Equal parameters, but another request's.
        "stranger": State(Obj("stranger", {"n": 2})),
    }
    assert [rid for rid, _ in states_of(registry, obj, children=True)] == [
        "r_0",
        "r_1",
        "warm",
        "child-a",
        "child-b",
    ]
    assert [rid for rid, _ in states_of(registry, obj, children=False)] == ["r_0", "r_1"]


def test_a_rid_held_by_another_requests_state_is_not_the_requests() -> None:
    obj = Obj("r", {"max_new_tokens": 3})
    assert states_of({"r": State(Obj("r", {"max_new_tokens": 3}))}, obj, children=True) == []


def test_only_dispatched_unfinished_states_are_aborted_and_each_once() -> None:
    params: dict[str, Any] = {}
    states = [
        ("queued", State(Obj("queued", params))),
        ("running", State(Obj("running", params), dispatched=True)),
        ("done", State(Obj("done", params), dispatched=True, finished=True)),
    ]
    tm, sent = Recorder(), set[str]()
    abort_dispatched(tm, states, sent)
    abort_dispatched(tm, states, sent)
    assert tm.aborted == ["running"]


def test_what_the_dead_generator_left_is_forgotten_and_the_running_ones_once_finished() -> None:
    params: dict[str, Any] = {}
    registry = {
        "undispatched": State(Obj("undispatched", params)),
        "finished": State(Obj("finished", params), dispatched=True, finished=True),
        "running": State(Obj("running", params), dispatched=True),
    }
    orphans = Orphans()
    forget_leftovers(registry, list(registry.items()), orphans)
    assert list(registry) == ["running"]
    orphans.sweep(registry)
    assert list(registry) == ["running"]  # its abort has not finished it yet
    registry["running"].finished = True
    orphans.sweep(registry)
    assert registry == {}


def test_an_orphan_sglang_forgot_itself_is_dropped_without_touching_the_registry() -> None:
    orphans = Orphans()
    orphans.add("gone")
    registry: dict[str, Any] = {}
    orphans.sweep(registry)
    orphans.sweep(registry)
    assert registry == {}
