"""The hypothesis settings of the state-machine suites, chosen by ``HYPOTHESIS_PROFILE``:
``ci`` (the default, and for any other value), ``long`` (many more examples) and ``debug``
(find a failure fast: no shrinking, no replay). One reading of the variable for every suite;
each suite gives its own sizes."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "")
if PROFILE not in ("long", "debug"):
    PROFILE = "ci"


def stateful_settings(
    *,
    ci: tuple[int, int],
    long: tuple[int, int],
    debug: tuple[int, int],
    derandomize_ci: bool = False,
) -> settings:
    """The settings of ``PROFILE``; each size is ``(max_examples, stateful_step_count)``."""
    common = {
        "deadline": None,
        "database": None,
        "suppress_health_check": [HealthCheck.too_slow],
    }
    if PROFILE == "long":
        return settings(max_examples=long[0], stateful_step_count=long[1], **common)
    if PROFILE == "debug":
        return settings(
            max_examples=debug[0],
            stateful_step_count=debug[1],
            phases=[Phase.generate],
            **common,
        )
    return settings(
        max_examples=ci[0], stateful_step_count=ci[1], derandomize=derandomize_ci, **common
    )
