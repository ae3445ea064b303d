"""Config-to-gate builders with PraisonAI's signatures and stricter validation."""

from __future__ import annotations

from typing import Any

from ._admitgate import AdmissionGate, ConcurrencyLimitPolicy, MemoryPressurePolicy


def _unset(value: Any) -> bool:
    """``None`` means "not configured" for the builders, as in PraisonAI's config layer."""
    return value is None


def build_memory_pressure_policy(
    max_rss_mb: Any = 0.0, soft_ratio: Any = 0.9
) -> MemoryPressurePolicy | None:
    """Build the soft/hard RSS ladder from one knob, the hard ceiling ``max_rss_mb`` (MiB).

    The soft (queue) threshold is ``soft_ratio`` of the ceiling, clamped to ``[0, 1]``.
    Returns ``None`` when ``max_rss_mb`` is 0 or ``None`` (memory-aware admission off).
    A negative, non-numeric, NaN or infinite ``max_rss_mb`` or ``soft_ratio`` raises
    ``ValueError``: a typo must not silently turn memory protection off.
    """
    return MemoryPressurePolicy.from_max_rss_mb(max_rss_mb, soft_ratio)


def build_admission_gate(
    max_concurrent_runs: Any = 0,
    queue_depth: Any = 0,
    overflow_policy: Any = "reject",
    policy: Any = None,
    resource_policy: Any = None,
    max_concurrent_runs_per_scope: Any = 0,
    queue_timeout_s: Any = None,
    fleet: Any = None,
    adaptive: Any = None,
    queue_discipline: Any = "fifo",
    priorities: Any = None,
    default_priority: Any = None,
    fairness: Any = None,
    tenant_weights: Any = None,
    rate_limit: Any = None,
    estimator: Any = None,
    *,
    _gate_class: type[AdmissionGate] = AdmissionGate,
) -> AdmissionGate | None:
    """Build an :class:`AdmissionGate` from configuration, or return ``None``.

    ``None`` (no gate, every turn runs at once) when no ``policy`` is given, the ceiling is
    0 and no ``resource_policy`` is given; a resource-only gate when only a
    ``resource_policy`` is. Every argument is validated even when the ceiling is 0, so a
    misconfiguration fails at start-up instead of silently removing protection.
    ``queue_timeout_s`` (seconds, or ``None``) refuses a turn that has waited that long
    with reason ``timeout``. ``fleet`` (an :class:`admitgate.FleetLimit`) adds a cap shared
    by every replica: a turn runs once it has a local slot and a fleet lease; with a fleet
    the gate is built even without a local ceiling. ``adaptive`` (an
    :class:`admitgate.AdaptiveLimit`) learns the provider's real ceiling below
    ``max_concurrent_runs``; ``queue_discipline="adaptive"`` serves a standing queue newest
    first with waits capped at the measured service time (``"fifo"``, the default, is
    today's order). ``priorities`` (a list of :class:`admitgate.PriorityClass`, most
    important first) gives turns classes with guaranteed and capped shares of the limit,
    ``default_priority`` names the class of a turn that names none (the last class when
    ``None``), ``fairness="tenant"`` shares each class's turns fairly across tenants (on by
    default with classes; ``"none"`` turns it off) and ``tenant_weights`` weighs tenants'
    shares (see ``docs/priorities.md``); with ``priorities`` the gate is built even without
    a ceiling, so its classes are counted. ``rate_limit`` (an :class:`admitgate.RateLimit`
    or a list of them) is checked before a turn's slot: with nothing else it returns a gate
    that enforces only the budget (see ``docs/budgets.md``). ``estimator`` (an
    :class:`admitgate.RecentUsage` or a callable ``estimator(session_id, identity) -> int``)
    gives a turn that passes no ``cost=`` its token estimate; it needs a ``rate_limit`` with
    ``tokens=``.
    """
    if policy is None:
        candidate = ConcurrencyLimitPolicy(
            max_concurrent_runs=0 if _unset(max_concurrent_runs) else max_concurrent_runs,
            queue_depth=0 if _unset(queue_depth) else queue_depth,
            overflow_policy=overflow_policy,
            max_concurrent_runs_per_scope=(
                0 if _unset(max_concurrent_runs_per_scope) else max_concurrent_runs_per_scope
            ),
            queue_timeout_s=queue_timeout_s,
        )
        ordered = any(
            arg is not None for arg in (priorities, default_priority, fairness, tenant_weights)
        )
        if (
            candidate.max_concurrent_runs == 0
            and fleet is None
            and adaptive is None
            and not ordered
        ):
            if resource_policy is not None or rate_limit is not None or estimator is not None:
                # An estimator without a budget is refused by the gate, not dropped here.
                return _gate_class(
                    None,
                    resource_policy=resource_policy,
                    rate_limit=rate_limit,
                    estimator=estimator,
                )
            return None
        policy = candidate
    # `_gate_class`: a subclass (admitgate.praisonai's, which picks a turn's class from its
    # session), built with the same checks.
    return _gate_class(
        policy,
        resource_policy=resource_policy,
        fleet=fleet,
        adaptive=adaptive,
        queue_discipline=queue_discipline,
        priorities=priorities,
        default_priority=default_priority,
        fairness=fairness,
        tenant_weights=tenant_weights,
        rate_limit=rate_limit,
        estimator=estimator,
    )
