"""``gateway.rate_limit``: the rate-limit block of a gateway config, read and checked.

praisonaiagents 1.7.17 documents ``gateway.rate_limit`` as the configuration of its
``SlidingWindowRateLimitPolicy`` (``max_requests``, ``window_seconds``, ``lockout_seconds``),
but nothing in praisonai-bot 0.1.16 reads the block: its gateway limits its approval,
WebSocket-upgrade, pairing and magic-link endpoints with fixed numbers. So check-config
validates the block as admitgate's drop-in (:func:`admitgate.praisonai.rate_limit_policy`)
takes it, says what it means, and warns that it takes effect only where the application
builds the policy from it.

The reference validates with ``int()`` and ``float()`` (so ``"5"``, ``5.9`` and ``true`` pass
as 5, 5 and 1); admitgate refuses what is not a whole number or a finite number of seconds,
naming the key, the value and the line.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from .document import Document
from .settings import ConfigProblem, ConfigWarning, RateLimitSettings

KEYS = ("max_requests", "window_seconds", "lockout_seconds")
__all__ = ["KEYS", "RateLimitSettings", "read_rate_limit"]
_DEFAULTS = {"max_requests": 0, "window_seconds": 60.0, "lockout_seconds": 0.0}


def read_rate_limit(
    doc: Document,
) -> tuple[RateLimitSettings | None, list[ConfigProblem], list[ConfigWarning]]:
    """The block's settings (``None`` when absent), its problems and its warnings."""
    if "rate_limit" not in doc.gateway:
        return None, [], []
    line = doc.line("gateway", "rate_limit")
    block = doc.gateway["rate_limit"]
    if block is None:
        block = {}
    if not isinstance(block, dict):
        reason = f"rate_limit must be a mapping of {', '.join(KEYS)}, not a {type(block).__name__}"
        return None, [ConfigProblem("rate_limit", block, "gateway", line, reason)], []

    problems: list[ConfigProblem] = []

    def refuse(key: str, value: Any, reason: str) -> None:
        problems.append(ConfigProblem(f"rate_limit.{key}", value, "gateway", line, reason))

    values: dict[str, Any] = dict(_DEFAULTS)
    for key in KEYS:
        if key not in block or block[key] is None:
            continue
        value = block[key]
        if key == "max_requests":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                refuse(key, value, "max_requests must be a whole number >= 0 (0: off)")
                continue
        else:
            bound = "> 0" if key == "window_seconds" else ">= 0"
            number = (
                value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            )
            if (
                number is None
                or not math.isfinite(number)
                or number < 0
                or (number == 0 and key == "window_seconds")
            ):
                refuse(key, value, f"{key} must be a finite number of seconds {bound}")
                continue
            value = float(number)
        values[key] = value

    warnings: list[ConfigWarning] = []
    for key in block:
        if key in KEYS:
            continue
        close = difflib.get_close_matches(str(key).strip().lower(), KEYS, n=1, cutoff=0.7)
        hint = f"; did you mean {close[0]}?" if close else f" (it reads {', '.join(KEYS)})"
        warnings.append(
            ConfigWarning(
                "unknown-key",
                f"gateway.rate_limit.{key} is not a setting the rate-limit policy reads, so "
                f"it is ignored{hint}",
                (f"rate_limit.{close[0]}" if close else "rate_limit",),
            )
        )
    if problems:
        return None, problems, warnings
    settings = RateLimitSettings(
        values["max_requests"], values["window_seconds"], values["lockout_seconds"], line
    )
    warnings.append(
        ConfigWarning(
            "rate-limit-not-read",
            "praisonai-bot 0.1.16 does not read gateway.rate_limit (its gateway limits its "
            "endpoints with fixed numbers): it takes effect only where your code builds the "
            "policy, e.g. admitgate.praisonai.rate_limit_policy(**config['gateway']"
            "['rate_limit']).",
            ("rate_limit",),
        )
    )
    return settings, problems, warnings
