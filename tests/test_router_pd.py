"""A prefill/decode pair of ``trio-sglang serve`` behind each router in its PD mode.

The router sends one body to both servers. sglang-router answers nothing
before the prefill server has, then streams the decode server's answer: a
client gone during the prefill is noticed at once (nothing answered yet,
heartbeats or not); one gone in a gap of the decode stream, at the next
heartbeat. smg answers at once and keeps the prefill leg open, which the
prefill server's rooms make up for. Real processes on loopback, as in
``test_router.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

import _router_cluster
from _processes import Process, post_raw, start_router, start_workers, wait_until
from _router_cluster import (
    BEHAVIOURS,
    HEARTBEAT_BOUND,
    LONG,
    TIMEOUT,
    TOKEN_GAP,
    Behaviour,
    deltas,
    first_token_then_heartbeat,
    generate_body,
    leave,
    live,
    metric,
    nothing_received,
    open_streams,
    pd_registered,
    scrape,
)

#: Each router in ROUTERS, the module's tests run behind each in turn.
router_name = _router_cluster.router_name


# -- a prefill/decode pair behind the router in PD mode -------------------------------------
#
# The router sends one body to both servers. sglang-router answers nothing before
# the prefill server has, then streams the decode server's answer: a client gone
# during the prefill is noticed at once (nothing answered yet, heartbeats or
# not); one gone in a gap of the decode stream, at the next heartbeat. smg
# answers at once and keeps the prefill leg open (``BEHAVIOURS``).

#: 0.05 s per prompt token in forwards of 4: a PD_PROMPT of 100 words prefills in 5 s,
#: and a cancel takes effect after the forward in progress (0.2 s).
PD_PREFILL_ARGS = (
    "--disaggregation-mode", "prefill",
    "--sim-prefill-time-per-token", "0.05",
    "--sim-prefill-chunk-tokens", "4",
)  # fmt: skip
#: A decode server without a prefill peer (the router's requests carry their
#: bootstrap fields), TOKEN_GAP between tokens.
PD_DECODE_ARGS = (
    "--disaggregation-mode", "decode",
    "--allowed-bootstrap-hosts", "127.0.0.1",
    "--sim-token-interval", str(TOKEN_GAP),
)  # fmt: skip
PD_PROMPT = " ".join(["word"] * 100)
#: The prefill server's SimEngine events a test counts from.
PD_PREFILL_EVENTS = ("prefill_chunk", "abort_applied", "kv_failed", "kv_sent")


@dataclass
class PD:
    router: str
    prefill: str
    decode: str
    behaviour: Behaviour

    @property
    def servers(self) -> list[str]:
        return [self.prefill, self.decode]

    def events(self, kind: str) -> list[float]:
        """Each server's SimEngine events of ``kind``: [prefill, decode]."""
        return [metric(scrape(s), "trio_sglang_sim_events_total", kind=kind) for s in self.servers]


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, router_name: str) -> Iterator[PD]:
    log_dir = tmp_path_factory.mktemp("pd")
    started: list[Process] = []
    try:
        ((prefill, prefill_url),) = start_workers(["prefill"], log_dir, *PD_PREFILL_ARGS)
        started.append(prefill)
        ((decode, decode_url),) = start_workers(["decode"], log_dir, *PD_DECODE_ARGS)
        started.append(decode)
        bootstrap_port = prefill_url.rsplit(":", 1)[1]
        args = ["--pd-disaggregation", "--prefill", prefill_url, bootstrap_port]
        args += ["--decode", decode_url, "--log-level", "warn"]
        router, url = start_router(
            log_dir, [], *args, watched=[prefill, decode], router=router_name
        )
        started.append(router)
        roles = {prefill_url: "prefill", decode_url: "decode"}
        wait_until(
            "the router to register both sides",
            lambda: pd_registered(url, roles),
            TIMEOUT,
            *started,
        )
        yield PD(url, prefill_url, decode_url, BEHAVIOURS[router_name])
    finally:
        for process in reversed(started):
            process.stop()


def pd_idle(pd: PD) -> bool:
    """Neither server holds a request, and the prefill server holds no KV room."""
    prefill = scrape(pd.prefill)
    held = metric(prefill, "trio_sglang_engine_live_requests") + metric(
        prefill, "trio_sglang_kv_rooms"
    )
    return held == 0 and live(pd.decode) == 0


def test_behind_the_router_in_pd_mode_a_client_gone_during_a_long_prefill_stops_both(
    pd: PD, record_property: Callable[[str, object], None]
) -> None:
    """sglang-router has answered nothing yet, so it sees the client gone at once and drops
    both legs. smg has answered the stream's headers (the decode server's heartbeats follow),
    lets the decode leg go within a heartbeat, and keeps the prefill leg open: the decode
    side's abort notification stops that one, at the prefill server."""
    wait_until("both servers idle", lambda: pd_idle(pd), TIMEOUT)
    requests = "trio_sglang_requests_total"
    cancelled = [metric(scrape(s), requests, outcome="cancelled") for s in pd.servers]
    aborted_requests = metric(scrape(pd.prefill), requests, outcome="aborted")
    chunks, aborted, failed, sent = (pd.events(kind) for kind in PD_PREFILL_EVENTS)
    body = {**generate_body(50), "text": PD_PROMPT}
    with contextlib.closing(post_raw(pd.router, "/generate", body, TIMEOUT)) as sock:
        wait_until(
            "the prefill computing, the decode server holding the request",
            lambda: pd.events("prefill_chunk")[0] > chunks[0] and live(pd.decode) == 1,
            TIMEOUT,
        )
        assert nothing_received(sock) is not pd.behaviour.keeps_the_prefill_leg
        left = time.monotonic()
    # Within a heartbeat (the decode leg) and the forward in progress (0.2 s, the prefill).
    wait_until("both servers idle, no room left", lambda: pd_idle(pd), HEARTBEAT_BOUND)
    took = time.monotonic() - left
    print(f"PD: client gone during the prefill -> both servers idle: {took:.3f} s")
    record_property("pd_prefill_let_go_s", round(took, 3))

    # The prefill stopped before its end (25 forwards) and sent no KV cache.
    forwards = pd.events("prefill_chunk")[0] - chunks[0]
    assert forwards < len(PD_PROMPT.split()) / 4
    stops = pd.events("abort_applied")[0] - aborted[0] + pd.events("kv_failed")[0] - failed[0]
    assert stops == 1
    assert pd.events("kv_sent")[0] == sent[0]
    assert pd.events("abort_applied")[1] == aborted[1] + 1  # and the decode leg aborted
    after = [metric(scrape(s), requests, outcome="cancelled") for s in pd.servers]
    aborted_after = metric(scrape(pd.prefill), requests, outcome="aborted")
    if pd.behaviour.keeps_the_prefill_leg:  # stopped by its room, its connection still open
        assert (deltas(after, cancelled), aborted_after - aborted_requests) == ([0, 1], 1)
    else:
        assert (deltas(after, cancelled), aborted_after - aborted_requests) == ([1, 1], 0)


def test_behind_the_router_in_pd_mode_a_client_whose_prefill_waits_in_the_queue_stops_both(
    pd: PD, record_property: Callable[[str, object], None]
) -> None:
    """The second of two long prompts waits for the prefill server's one forward at a time;
    its client leaves there. Its legs stop, and the first request's carry on."""
    wait_until("both servers idle", lambda: pd_idle(pd), TIMEOUT)
    chunks = pd.events("prefill_chunk")[0]
    body = {**generate_body(50), "text": PD_PROMPT}
    with contextlib.closing(post_raw(pd.router, "/generate", body, TIMEOUT)) as first:
        wait_until(
            "the first prompt prefilling",
            lambda: pd.events("prefill_chunk")[0] > chunks,
            TIMEOUT,
        )
        with contextlib.closing(post_raw(pd.router, "/generate", body, TIMEOUT)):
            wait_until(
                "both requests at both servers",
                lambda: live(pd.prefill) == 2 and live(pd.decode) == 2,
                TIMEOUT,
            )
            left = time.monotonic()
        wait_until(
            "the second request gone from both servers",
            lambda: live(pd.prefill) == 1 and live(pd.decode) == 1,
            HEARTBEAT_BOUND,
        )
        took = time.monotonic() - left
        # The first is still being prefilled: one forward at a time, 25 in all, so the
        # second never had one.
        assert pd.events("prefill_chunk")[0] - chunks < len(PD_PROMPT.split()) / 4
        assert nothing_received(first) is not pd.behaviour.keeps_the_prefill_leg
    wait_until("both servers idle, no room left", lambda: pd_idle(pd), HEARTBEAT_BOUND)
    print(f"PD: client gone while its prefill waited -> its legs gone: {took:.3f} s")
    record_property("pd_waiting_let_go_s", round(took, 3))


def test_behind_the_router_in_pd_mode_a_client_gone_in_a_decode_gap_is_let_go_within_a_heartbeat(
    pd: PD, record_property: Callable[[str, object], None]
) -> None:
    wait_until("both servers idle", lambda: pd_idle(pd), TIMEOUT)
    tokens = pd.events("token")[1]
    mid_stream = metric(scrape(pd.decode), "trio_sglang_cancellations_total", phase="mid_stream")
    with contextlib.ExitStack() as stack:
        streams = open_streams(stack, pd.router, [("/generate", generate_body(LONG))])
        ((_, _, lines),) = streams
        assert len(first_token_then_heartbeat(lines)) == 1  # the first token, then a gap
        left = leave(streams)
        wait_until("both servers idle", lambda: pd_idle(pd), HEARTBEAT_BOUND)
        took = time.monotonic() - left
    print(f"PD: client gone mid-stream -> both servers idle: {took:.3f} s")
    record_property("pd_mid_stream_let_go_s", round(took, 3))
    assert pd.events("token")[1] == tokens + 1  # the second token never came
    gained = metric(scrape(pd.decode), "trio_sglang_cancellations_total", phase="mid_stream")
    assert gained == mid_stream + 1
