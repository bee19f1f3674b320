"""The SimEngine's prefix cache: how much of a prompt SGLang's radix cache would hold.

SGLang keeps the KV cache of the prompts it has run in a radix tree and
reports, per request, how many prompt tokens it found there
(``meta_info.cached_tokens``, which ``--enable-cache-report`` puts in OpenAI
usage). The SimEngine models it coarsely, and deterministically: a prompt
(the same text or token ids, and the same ``cache_salt``) dispatched before,
among the last ``capacity`` distinct prompts, finds all its tokens but the
last cached (SGLang always computes the last prompt token); any other prompt
finds none, and is cached from its dispatch on. So the samples of an ``n > 1``
request find their prompt cached, after the warm-up request SGLang sends first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["PrefixCache"]


class PrefixCache:
    """The last ``capacity`` distinct prompts dispatched, by key."""

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._prompts: OrderedDict[Hashable, None] = OrderedDict()

    def dispatch(self, key: Hashable, tokens: int) -> int:
        """A prompt of ``tokens`` tokens is dispatched: how many of them were cached."""
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return max(tokens - 1, 0)
        self._prompts[key] = None
        if len(self._prompts) > self._capacity:
            self._prompts.popitem(last=False)
        return 0
