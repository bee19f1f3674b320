"""Prefill/decode disaggregation in the worker: roles, the prefill peer, the prefill leg.

A worker's role follows its engine's ``disaggregation_mode``:

- *aggregated*: what it always was;
- *prefill*: each request is a prefill leg (it must carry its
  ``bootstrap_room``); the lifecycle is the aggregated one, so a cancel stops
  it in any queue (bootstrap, waiting, prefilling, transferring), which is
  what ``disagg_prefill_cancel_anytime_v1`` advertises;
- *decode*: a request that already carries its bootstrap fields (a router
  ran its prefill leg) is decoded as is; one that does not gets a fresh
  ``bootstrap_room`` and runs its prefill leg at the worker's ``PrefillPeer``
  beside its decode leg, both under the request's one cancel scope.

Why both legs must stop together (SGLang's disaggregation code, and
ai-dynamo/dynamo #13691, #14368): aborting the prefill side does not tell
the decode side, which then holds its KV cache waiting for the transfer
until its timeout (300 s); and a
prefill whose client left keeps the prefill GPU busy and delays every
request queued behind it. A prefill peer that does not advertise
``disagg_prefill_cancel_anytime_v1`` is not cancelled (its prefill runs to
its end, bounded, and the worker says so once in its logs).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any, Protocol

import trio

from .._engine import Role
from ._reports import Reports

__all__ = [
    "CANCEL_ANYTIME",
    "PEER_CHECK_TIMEOUT",
    "PrefillFailed",
    "PrefillLeg",
    "PrefillPeer",
    "Role",
    "new_bootstrap",
    "peer_cancels_anytime",
]

logger = logging.getLogger("trio_sglang")

#: The capability a prefill worker advertises when a cancel stops it in any queue.
CANCEL_ANYTIME = "disagg_prefill_cancel_anytime_v1"

#: How long a decode worker waits, at start-up, for its prefill peer's capabilities.
#: Longer than a peer's own bound (``HTTPPrefill``'s is 5 s), so that the
#: peer's own, more precise error is the one a user sees.
PEER_CHECK_TIMEOUT = 30.0


class PrefillFailed(Exception):
    """The prefill worker ended the prefill leg with an error or an abort."""


class PrefillPeer(Protocol):
    """Where a decode worker runs the prefill legs of its requests: a prefill worker."""

    #: For logs: which prefill worker this is.
    name: str
    #: Where the decode engine reaches the prefill side's bootstrap server.
    bootstrap_host: str
    bootstrap_port: int

    async def capabilities(self) -> Mapping[str, Any]:
        """The prefill worker's ``capabilities()``; ``PrefillFailed`` if it cannot tell."""
        ...

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        """Run one prefill leg to its end; raise ``PrefillFailed`` if it did not succeed.

        Cancelling the call cancels the leg at the prefill worker.
        """
        ...


async def peer_cancels_anytime(peer: PrefillPeer) -> bool:
    """Whether ``peer`` advertises that a cancel stops its prefill in any queue.

    ``PrefillFailed`` if it does not answer within ``PEER_CHECK_TIMEOUT``.
    """
    with trio.move_on_after(PEER_CHECK_TIMEOUT):
        capabilities = await peer.capabilities()
        features = capabilities.get("features")
        if isinstance(features, Mapping) and features.get(CANCEL_ANYTIME) is True:
            return True
        logger.warning(
            "prefill worker %s does not advertise %s: cancels are not sent to it, and the "
            "prefill of a cancelled request runs to its end there (bounded by cleanup_timeout)",
            peer.name,
            CANCEL_ANYTIME,
        )
        return False
    raise PrefillFailed(
        f"{peer.name} did not answer with its capabilities in {PEER_CHECK_TIMEOUT} s"
    )


def new_bootstrap(peer: PrefillPeer) -> dict[str, Any]:
    """The bootstrap fields of a new prefill leg at ``peer``: a fresh room for each request."""
    return {
        "bootstrap_host": peer.bootstrap_host,
        "bootstrap_port": peer.bootstrap_port,
        # Random 63 bits, as SGLang's router picks them.
        "bootstrap_room": secrets.randbits(63),
    }


class PrefillLeg:
    """One request's prefill leg, run by the worker beside the request's decode leg.

    It runs in the worker's nursery, in its own ``scope``: ``end`` cancels
    that scope when the request ends, however it ends (if the peer can be
    cancelled at any time), or gives it ``cleanup_timeout`` to finish (if
    not), and the worker cancels it at shutdown after the grace. If the leg fails while
    the request is open, the decode leg can never get its KV cache: the leg
    cancels the request's scope (the caller's stream closes, and the decode
    leg stops as for a cancel) and ``error`` says why.
    """

    def __init__(
        self,
        peer: PrefillPeer,
        request: Mapping[str, Any],
        public_id: str,
        rids: tuple[str, ...],
        request_scope: trio.CancelScope,
        reports: Reports,
        *,
        cancel_anytime: bool,
        cleanup_timeout: float,
    ) -> None:
        self._peer = peer
        self._request = request
        self._public_id = public_id
        self._rids = rids
        self._request_scope = request_scope
        self._reports = reports
        #: Whether the peer stops a cancelled prefill in any queue (it advertises so).
        self._cancel_anytime = cancel_anytime
        self._cleanup_timeout = cleanup_timeout
        self.scope = trio.CancelScope()
        #: Set when the leg failed while the request was still open.
        self.error: Exception | None = None
        self._request_over = False

    def end(self) -> None:
        """The request is over: stop the leg, or bound it if the peer cannot stop; idempotent.

        A failure from now on concerns nobody.
        """
        self._request_over = True
        if self._cancel_anytime:
            self.scope.cancel()
        else:
            self.scope.deadline = min(
                self.scope.deadline, trio.current_time() + self._cleanup_timeout
            )

    async def run(self) -> None:
        with self.scope:
            try:
                await self._peer.prefill(self._request, self._public_id)
            except Exception as exc:
                if self._request_over or self._request_scope.cancel_called:
                    # The request was over: a prefill failing now (its decode
                    # side aborted) is the expected end, not a fault.
                    logger.debug("prefill leg of %s ended with %r", self._public_id, exc)
                    return
                self._reports.fault(
                    "prefill_failed",
                    self._public_id,
                    self._rids,
                    f"the prefill leg at {self._peer.name} "
                    f"(room {self._request['bootstrap_room']}) failed: {exc!r}",
                )
                self.error = exc
                self._request_scope.cancel()
