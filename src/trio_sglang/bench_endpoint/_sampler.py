"""The server's own view, sampled fast: requests in flight and tokens generated, every few ms.

Every ``interval`` seconds each metrics URL is scraped at once (one kept-alive
connection each) and the sums of the kind's series go into one ``Sample``,
stamped on the trio clock when the first scrape was sent and when the last
answer came: the gauges were read somewhere in between. A tick whose scrapes
take longer than the interval delays the next one (none is skipped to catch
up), so the spacing actually achieved is part of the report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import trio

from .._bounded_http import BadAnswer, read_answer
from ._prometheus import parse_series
from ._servers import ServerKind

__all__ = ["MAX_PAGE_BYTES", "Sample", "Sampler", "ScrapeFailed", "scrape"]

#: The largest metrics page read (SGLang's, histograms and all, is a few hundred kB).
MAX_PAGE_BYTES = 8 << 20


class ScrapeFailed(Exception):
    """A metrics URL did not answer a page (``status``: the HTTP status it gave, if any)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Sample:
    sent: float
    received: float
    in_flight: float
    tokens: float | None

    @property
    def at(self) -> float:
        """The best guess of when the gauges were read: halfway through the scrape."""
        return (self.sent + self.received) / 2


async def scrape(client: httpx.AsyncClient, url: str, *, within: float) -> str:
    """One metrics page, whole within ``within`` seconds and ``MAX_PAGE_BYTES``;
    ``ScrapeFailed`` naming the URL and what went wrong."""
    try:
        answer = await read_answer(client, "GET", url, max_bytes=MAX_PAGE_BYTES, within=within)
    except BadAnswer as exc:
        raise ScrapeFailed(str(exc)) from exc
    if answer.status != 200:
        raise ScrapeFailed(f"{url}: HTTP {answer.status}", answer.status)
    return answer.body.decode("utf-8", "replace")


class Sampler:
    """Samples until cancelled; ``samples`` grows in time order."""

    def __init__(
        self,
        urls: Sequence[str],
        kind: ServerKind,
        *,
        interval: float,
        timeout: float,
        headers: dict[str, str],
        with_tokens: bool,
    ) -> None:
        self._urls = list(urls)
        self._in_flight = kind.in_flight
        self._tokens = kind.tokens if with_tokens else None
        self._interval = interval
        self._timeout = timeout
        self._headers = headers
        self.samples: list[Sample] = []
        #: Scrapes that failed (each one's tick is lost), with the last reason.
        self.failures = 0
        self.last_failure: str | None = None
        self._new_sample = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        clients = [
            httpx.AsyncClient(timeout=self._timeout, headers=self._headers, trust_env=False)
            for _ in self._urls
        ]
        try:
            await self._tick(clients)  # the first sample exists once started
            task_status.started()
            next_tick = trio.current_time()
            while True:
                next_tick = max(next_tick + self._interval, trio.current_time())
                await trio.sleep_until(next_tick)
                await self._tick(clients)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self._timeout):
                for client in clients:
                    await client.aclose()

    async def _tick(self, clients: Sequence[httpx.AsyncClient]) -> None:
        pages: list[str | None] = [None] * len(clients)

        async def one(index: int) -> None:
            try:
                pages[index] = await scrape(clients[index], self._urls[index], within=self._timeout)
            except ScrapeFailed as exc:
                self.failures += 1
                self.last_failure = str(exc)

        sent = trio.current_time()
        async with trio.open_nursery() as nursery:
            for index in range(len(clients)):
                nursery.start_soon(one, index)
        received = trio.current_time()
        if any(page is None for page in pages):
            return
        in_flight, tokens = 0.0, 0.0
        wanted = (*self._in_flight, *([self._tokens] if self._tokens else []))
        for page in pages:
            assert page is not None
            sums = parse_series(page, wanted)
            in_flight += sum(sums[series] or 0.0 for series in self._in_flight)
            tokens += (sums[self._tokens] or 0.0) if self._tokens else 0.0
        self.samples.append(Sample(sent, received, in_flight, tokens if self._tokens else None))
        self._new_sample.set()
        self._new_sample = trio.Event()

    def latest(self) -> Sample:
        return self.samples[-1]

    async def wait_for(self, condition: Callable[[Sample], bool]) -> None:
        """Until a sample meets ``condition`` (the latest counts); the caller bounds the wait."""
        while not condition(self.latest()):
            await self._new_sample.wait()
