"""The property tests' budget: fixed in CI, or as many examples as asked for."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hypothesis import HealthCheck, settings

#: Set it to run that many examples in all, from a fresh random seed (a
#: failure prints a reproduction blob), instead of CI's fixed budgets.
FUZZ_ENV = "TRIO_SGLANG_FUZZ_EXAMPLES"


def fuzz_settings(budgets: Mapping[str, int], test_name: str) -> settings:
    """CI's fixed, derandomized budget, or ``FUZZ_ENV`` examples shared in proportion to it."""
    common: dict[str, Any] = {
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow],
    }
    requested = os.environ.get(FUZZ_ENV)
    if not requested:
        return settings(max_examples=budgets[test_name], derandomize=True, database=None, **common)
    share = budgets[test_name] / sum(budgets.values())
    return settings(max_examples=max(1, round(int(requested) * share)), print_blob=True, **common)
