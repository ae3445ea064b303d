"""Priority classes: who runs first when capacity is short (see ``docs/priorities.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _share(arg: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg} must be a number from 0 to 1, got {value!r}")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{arg} must be a number from 0 to 1, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PriorityClass:
    """One priority class of a gate: ``priorities=[...]`` lists them most important first.

    ``name`` is what ``admit(priority=...)`` names. ``min_share`` is the fraction of the
    gate's limit the class is guaranteed: ``floor(min_share * limit)`` slots, at least one
    when ``min_share > 0``, recomputed as the limit moves (an adaptive limit, a
    ``reconfigure``). A class using less than its guarantee lends the rest to the others, and
    takes it back at the next releases (running turns are never cancelled). ``max_share`` is
    a hard cap: ``floor(max_share * limit)`` slots, at least one, even while slots are free.
    The ``min_share`` values of a gate's classes may sum to at most 1.
    """

    name: str
    min_share: float = 0.0
    max_share: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise (TypeError if not isinstance(self.name, str) else ValueError)(
                f"name must be a non-empty str, got {self.name!r}"
            )
        object.__setattr__(self, "min_share", _share("min_share", self.min_share))
        object.__setattr__(self, "max_share", _share("max_share", self.max_share))
        if self.min_share > self.max_share:
            raise ValueError(
                f"min_share ({self.min_share!r}) of priority class {self.name!r} must be <= "
                f"its max_share ({self.max_share!r})"
            )
