"""The warning rules: what is risky or surprising in a valid gateway config.

:func:`find_warnings` looks at the file as written (keys that differ between the top level
and ``gateway:``, duplicates, likely typos, what ``praisonai gateway start`` would ignore or
refuse), at what the ``reliability`` preset filled in, at risky combinations of the resolved
settings, and at this machine (memory limits, this process's RSS). Each warning has a stable
``code``; ``check-config --ignore CODE`` leaves it out.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from .._admitgate import RssSampler
from .document import Block, Document, Found
from .settings import (
    SETTING_NAMES,
    ConfigWarning,
    GateSettings,
    clip,
    show_number,
    show_value,
)

# Other keys praisonai-bot reads at these levels, never reported as typos of ours.
_KNOWN_KEYS = frozenset(
    {"reload_drain_timeout", "per_turn_timeout", "max_connections", "max_queued_frames"}
)


# Keys per block compared with the setting names for a likely typo (difflib, about 0.1 ms a
# key): a hand-written block has a few dozen keys, and a hostile file thousands.
_MAX_FUZZY_CHECKS = 200


def _at(line: int | None) -> str:
    return "" if line is None else f" (line {line})"


def _written_name(block: Block, key: str) -> str:
    """``max_rss_mb`` at the top level, ``gateway.max_rss_mb`` in the gateway: block."""
    key = clip(key)  # a key may be as long as the file
    return key if block == "top" else f"gateway.{key}"


def misspelt_keys(doc: Document) -> list[ConfigWarning]:
    """``unknown-key``: keys praisonai-bot ignores that look like a setting. Read from the file
    alone, so they are given with the errors of an invalid file too."""
    out: list[ConfigWarning] = []
    blocks: tuple[tuple[Block, dict[str, Any]], ...] = (("top", doc.data), ("gateway", doc.gateway))
    for block, keys in blocks:
        fuzzy_left = _MAX_FUZZY_CHECKS
        for key in keys:
            if not isinstance(key, str) or key in SETTING_NAMES or key in _KNOWN_KEYS:
                continue
            normal = key.strip().lower().replace("-", "_")
            match = normal if normal in SETTING_NAMES else None
            if match is None and fuzzy_left > 0:
                fuzzy_left -= 1
                close = difflib.get_close_matches(normal, SETTING_NAMES, n=1, cutoff=0.8)
                match = close[0] if close else None
            if match is not None:
                out.append(
                    ConfigWarning(
                        "unknown-key",
                        f"{_written_name(block, key)}{_at(doc.line(block, key))} is not a "
                        f"setting praisonai-bot reads, so it is ignored; did you mean {match}?",
                        (match,),
                    )
                )
    return out


def find_warnings(
    s: GateSettings, doc: Document, found: Mapping[str, Found | None]
) -> list[ConfigWarning]:
    """The warnings for resolved settings ``s``: the file itself (``doc``), the preset, risky
    combinations, and this machine. ``found`` is each setting as written, before the preset."""
    out: list[ConfigWarning] = []
    ceiling, depth, overflow = s.max_concurrent_runs, s.queue_depth, s.overflow_policy
    per_scope, rss = s.max_concurrent_runs_per_scope, s.max_rss_mb
    src = {name: setting.source for name, setting in s.settings.items()}

    def warn(code: str, message: str, *keys: str) -> None:
        out.append(ConfigWarning(code, message, keys))

    # The file itself.
    for name in SETTING_NAMES:
        if name in doc.data and name in doc.gateway and doc.data[name] != doc.gateway[name]:
            top_line, gw_line = _at(doc.line("top", name)), _at(doc.line("gateway", name))
            top, gw = show_value(doc.data[name]), show_value(doc.gateway[name])
            unset = " (unset, so the default applies)" if doc.data[name] is None else ""
            warn(
                "top-level-and-gateway-differ",
                f"{name} is {top} at the top level{top_line} and {gw} under gateway:"
                f"{gw_line}; BotOS.from_config uses the top-level {top}{unset}, "
                f"praisonai gateway start uses the gateway: {gw}. Keep one.",
                name,
            )
    for block, key, first, last in doc.duplicates:
        name = _written_name(block, key)
        warn(
            "duplicate-key",
            f"{name} is written twice (lines {first} and {last}); YAML keeps the last one "
            "silently.",
            key,
        )
    out += misspelt_keys(doc)
    top_admission = [n for n in SETTING_NAMES if n in doc.data]
    if top_admission:
        warn(
            "gateway-start-ignores-top-level",
            f"praisonai gateway start --config reads admission settings only under gateway: "
            f"and ignores the top-level {', '.join(top_admission)} (BotOS.from_config reads "
            "them).",
            *top_admission,
        )
    refused = [n for n in ("max_concurrent_runs_per_scope", "max_rss_mb") if n in doc.gateway]
    if refused:
        warn(
            "gateway-start-refuses-file",
            "praisonai gateway start --config (praisonai-bot 0.1.16) refuses this file: its "
            f"gateway: schema does not allow {' or '.join(refused)} (BotOS.from_config reads "
            "them).",
            *refused,
        )

    # The preset.
    if src["max_concurrent_runs"] == "preset":
        written = found["max_concurrent_runs"]
        if written is not None:
            warn(
                "zero-does-not-disable",
                f"max_concurrent_runs {show_value(written.value)} does not turn admission off: the "
                f"{s.reliability or 'safe default'} reliability preset sets {ceiling}. Set "
                'reliability: default (or "off") to run without a ceiling.',
                "max_concurrent_runs",
                "reliability",
            )
        warn(
            "ceiling-from-cpu-count",
            f"the ceiling {ceiling} comes from the reliability preset (4 per CPU, 4..32) and "
            f"was computed on this machine ({s.cpu_count} CPUs); praisonai-bot counts the "
            "host's CPUs, not a container's CPU quota, so set max_concurrent_runs for a "
            "ceiling that does not move between machines.",
            "max_concurrent_runs",
        )
    if src["overflow_policy"] == "preset" and found["overflow_policy"] is not None:
        warn(
            "preset-replaced-overflow",
            "overflow_policy reject was replaced by queue: with no max_concurrent_runs set, "
            "the reliability preset turns reject into queue. Set max_concurrent_runs to keep "
            "reject.",
            "overflow_policy",
        )

    # Combinations.
    if ceiling > 0:
        if per_scope >= ceiling:
            warn(
                "per-scope-not-below-ceiling",
                f"max_concurrent_runs_per_scope {per_scope} is not below the ceiling "
                f"{ceiling}, so one tenant can still take every slot; use a value below "
                f"{ceiling} (about ceiling / active tenants).",
                "max_concurrent_runs_per_scope",
                "max_concurrent_runs",
            )
        if overflow == "queue":
            detail = (
                "queue_depth 0 does not mean 'no waiting' here"
                if depth == 0
                else f"queue_depth {depth} has no effect"
            )
            warn(
                "unbounded-queue",
                f"overflow_policy queue waits without bound ({detail}): under a sustained "
                "burst the queue, its waiting time and the memory of its turns grow without "
                "limit. Use reject or shed_oldest with a queue_depth to bound it.",
                "overflow_policy",
                "queue_depth",
            )
        elif depth == 0:
            default = (
                " (praisonai-bot's default when max_concurrent_runs is set; the documented "
                "128 is GatewayConfig's, which BotOS does not use)"
                if src["queue_depth"] == "default"
                else ""
            )
            if overflow == "shed_oldest":
                warn(
                    "shed-without-queue",
                    f"overflow_policy shed_oldest with queue_depth 0{default}: nothing ever "
                    "waits, so there is no oldest waiter to shed and every turn over the "
                    "ceiling is rejected, as with reject. Set a queue_depth.",
                    "overflow_policy",
                    "queue_depth",
                )
            else:
                warn(
                    "reject-without-queue",
                    f"queue_depth is 0{default}: every turn that finds all {ceiling} slots "
                    "busy is rejected at once, none waits. Set a queue_depth to absorb bursts.",
                    "queue_depth",
                )
    else:
        idle = [
            name
            for name, unset in (
                ("queue_depth", depth == 0),
                ("overflow_policy", src["overflow_policy"] == "default"),
                ("max_concurrent_runs_per_scope", per_scope == 0),
            )
            if not unset
        ]
        if idle:
            warn(
                "limits-without-ceiling",
                f"max_concurrent_runs is 0 (no concurrency protection), so {', '.join(idle)} "
                f"{'has' if len(idle) == 1 else 'have'} no effect.",
                "max_concurrent_runs",
                *idle,
            )
        if rss > 0:
            warn(
                "memory-only-gate",
                f"with no ceiling there is no queue to wait in: above the soft threshold "
                f"({show_number(s.soft_rss_mb)} MiB) turns still start at once, and only the hard limit "
                f"({show_number(rss)} MiB) sheds. Set max_concurrent_runs for backpressure.",
                "max_rss_mb",
                "max_concurrent_runs",
            )

    # This machine.
    if rss > 0:
        limit = s.memory.limit_mb
        if limit is not None and rss >= limit:
            warn(
                "rss-above-memory",
                f"max_rss_mb {show_number(rss)} is not below this machine's memory ({s.memory.describe()})"
                ": the OOM killer fires before the gate sheds anything. Use about 80% of "
                f"the limit ({0.8 * limit:.0f}).",
                "max_rss_mb",
            )
        current = RssSampler().read().rss_mb
        if current is not None and rss <= current:
            warn(
                "rss-below-process",
                f"max_rss_mb {show_number(rss)} is below the {current:.0f} MiB this checker process "
                "already uses; a gateway process is larger, so every turn would be rejected.",
                "max_rss_mb",
            )
    return out
