"""Prometheus metrics for admitgate gates: a collector that reads the gate at scrape time.

    import admitgate.metrics
    admitgate.metrics.register(gate)                      # on prometheus_client.REGISTRY
    admitgate.metrics.register(gate, prefix="broker")     # the mesh broker's metric names

Nothing is counted on the request path by this module: every figure is the gate's own, read
from the Rust core when Prometheus scrapes (``gate.stats()``, ``transport_stats()``,
``request_stats()``, ``queue_wait_stats()``). With ``prefix="broker"`` the two series a mesh
broker documents are exactly ``broker_inflight_requests{transport}`` and
``broker_rejected_total{transport}`` (with an extra ``reason`` label).

| metric | type | labels | value |
|---|---|---|---|
| ``<prefix>_inflight_requests`` | gauge | ``transport`` | turns holding a slot |
| ``<prefix>_rejected_total`` | counter | ``transport``, ``reason`` | refusals (``shed`` counts evicted waiters) |
| ``<prefix>_admitted_total`` | counter | ``transport`` | turns that started running |
| ``<prefix>_requests_total`` | counter | ``transport`` | requests through a front door, ``passthrough`` included |
| ``<prefix>_request_duration_seconds`` | histogram | ``transport`` | their durations |
| ``<prefix>_queued_requests`` | gauge | | turns waiting for a slot |
| ``<prefix>_queue_wait_seconds`` | histogram | | how long admitted turns waited |
| ``<prefix>_limit`` | gauge | | the cap that bounds the agent (0: none) |
| ``<prefix>_saturated`` | gauge | | 1 while in flight is at that cap |
| ``<prefix>_fleet_*`` | gauge / counter | | fleet figures, when the gate has a fleet limit |
| ``<prefix>_class_inflight_requests`` | gauge | ``class`` | turns holding a slot, per priority class |
| ``<prefix>_class_queued_requests`` | gauge | ``class`` | turns waiting, per class |
| ``<prefix>_class_admitted_total`` | counter | ``class`` | turns started, per class |
| ``<prefix>_class_rejected_total`` | counter | ``class`` | turns refused (shed ones apart), per class |
| ``<prefix>_class_shed_total`` | counter | ``class`` | waiters evicted, per class |
| ``<prefix>_class_cancelled_total`` | counter | ``class`` | turns withdrawn while waiting, per class |
| ``<prefix>_priority_defaulted_total`` | counter | ``cause`` | requests a front door put in the default class: ``missing`` or ``unknown`` class |
| ``<prefix>_rate_limit_*`` | counter / gauge | ``limit`` | budget figures per ``RateLimit`` (``RATE_LIMIT_METRICS``), when the gate has ``rate_limit=`` |

The ``class_*`` and ``priority_defaulted`` families appear only for a gate built with
``priorities=[...]`` (a gate without classes exports what it always did). They are families
of their own rather than a ``class`` label on ``<prefix>_inflight_requests``, so a sum over
that name still counts each turn once. No metric carries a tenant.

A turn a budget refuses counts in ``<prefix>_rejected_total{reason="rate_limited"}`` too. No
series is per identity.

With ``name=`` every series also carries ``gate="<name>"``; several gates may then share one
registry and prefix (one collector serves them all, so each metric family appears once).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from ._frontdoor import check_gate
from ._priority_door import defaulted

__all__ = [
    "CLASS_METRICS",
    "FLEET_METRICS",
    "RATE_LIMIT_METRICS",
    "GateCollector",
    "register",
    "unregister",
]

_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_MAX_PREFIX = 64
_MAX_NAME = 128

#: ``stats()`` keys a fleet limit adds, exported as ``<prefix>_<key>`` when present:
#: key -> (``"gauge"`` or ``"counter"``, help text). Counters get the ``_total`` suffix.
FLEET_METRICS: Mapping[str, tuple[str, str]] = {
    "fleet_in_flight": ("gauge", "Turns holding a fleet lease across every replica (last known)."),
    "fleet_max_in_flight": ("gauge", "The fleet-wide in-flight cap (0: none)."),
    "fleet_backend_up": ("gauge", "1 while the fleet backend (Redis) answers, 0 during an outage."),
    "fleet_lease_lost": (
        "counter",
        "Fleet leases lost: running turns whose lease expired under them, and grants that "
        "expired before their replica claimed them.",
    ),
    "fleet_borrowed": ("gauge", "Fleet leases borrowed by turns resuming from a human wait."),
    "fleet_outages": ("counter", "Fleet backend outages seen by this replica."),
    "fleet_failovers": (
        "counter",
        "Fleet backend failovers followed by this replica (a new primary named by Sentinel).",
    ),
}


#: ``stats()["rate_limits"][name]`` keys, exported as ``<prefix>_rate_limit_<key>`` with the
#: label ``limit="<name>"``: key -> (``"gauge"`` or ``"counter"``, help text).
RATE_LIMIT_METRICS: Mapping[str, tuple[str, str]] = {
    "allowed": ("counter", "Turns a budget (rate_limit=) allowed."),
    "limited": ("counter", "Turns a budget refused (rate_limited), after any wait."),
    "waited": ("counter", "Turns that waited for a budget (on_limit='wait')."),
    "unavailable": (
        "counter",
        "Turns refused because a fleet-wide budget's Redis was down (on_backend_error='reject').",
    ),
    "tokens_reserved": ("counter", "Token estimates (cost=) reserved by allowed turns."),
    "settled": ("counter", "Reservations settled to a reported usage (report_usage)."),
    "tokens_settled": ("counter", "Tokens reported used by settled turns."),
    "returned": (
        "counter",
        "Reservations given back whole: the turn was refused or cancelled before it ran.",
    ),
    "tokens_returned": ("counter", "Tokens those reservations held."),
    "keys": ("gauge", "Identities this process's budget holds in memory now."),
}

#: ``stats()["classes"][name]`` keys exported per priority class: key -> (``"gauge"`` or
#: ``"counter"``, the metric's name after ``<prefix>_``, help text). The broker exports the
#: same names with ``prefix="broker"``.
CLASS_METRICS: Mapping[str, tuple[str, str, str]] = {
    "in_flight": ("gauge", "class_inflight_requests", "Turns holding a slot, by priority class."),
    "queued": ("gauge", "class_queued_requests", "Turns waiting for a slot, by priority class."),
    "admitted": (
        "counter",
        "class_admitted_total",
        "Turns admitted (started running), by priority class.",
    ),
    "rejected": (
        "counter",
        "class_rejected_total",
        "Turns refused on arrival or while waiting (shed ones are counted apart), by class.",
    ),
    "shed": ("counter", "class_shed_total", "Waiters evicted to make room, by priority class."),
    "cancelled": (
        "counter",
        "class_cancelled_total",
        "Turns withdrawn while waiting, by priority class.",
    ),
}


class GateCollector:
    """A ``prometheus_client`` collector exporting one or more gates under one prefix.

    Built and registered by :func:`register`; ``registry.unregister(collector)`` removes it
    with every gate it serves, :func:`unregister` (or :meth:`remove`) one gate. Gates are
    read only at scrape time, from the scraping thread (the gate is thread-safe).
    """

    def __init__(self, prefix: str = "admitgate") -> None:
        _check_prefix(prefix)
        self._prefix = prefix
        self._lock = threading.Lock()
        self._members: dict[str | None, Any] = {}

    @property
    def prefix(self) -> str:
        """The metric-name prefix."""
        return self._prefix

    @property
    def gates(self) -> dict[str | None, Any]:
        """The gates exported, by ``name`` (``None`` for an unnamed gate)."""
        with self._lock:
            return dict(self._members)

    def add(self, gate: Any, name: str | None = None) -> None:
        """Export ``gate`` too, with ``gate="<name>"`` on its series.

        Every gate of a collector needs a distinct name, except a collector's only gate,
        which may have none. ``ValueError`` otherwise.
        """
        check_gate(gate)
        _check_name(name)
        with self._lock:
            if any(member is gate for member in self._members.values()):
                raise ValueError(f"gate {gate!r} is already exported with prefix {self._prefix!r}")
            if name in self._members:
                raise ValueError(
                    f"a gate named {name!r} is already exported with prefix {self._prefix!r}"
                )
            if self._members and (name is None or None in self._members):
                raise ValueError(
                    f"several gates share prefix {self._prefix!r} on this registry: give each "
                    f"a distinct name= (got name={name!r}), or use another prefix"
                )
            self._members[name] = gate

    def remove(self, gate: Any) -> None:
        """Stop exporting ``gate``; ``ValueError`` if it is not exported here."""
        with self._lock:
            for key, member in self._members.items():
                if member is gate:
                    del self._members[key]
                    return
        raise ValueError(f"gate {gate!r} is not exported with prefix {self._prefix!r}")

    def describe(self) -> list[Metric]:
        """The metric families this collector owns (without samples), so that a registry
        refuses another collector that would export the same names."""
        return list(_Families(self._prefix, ()).all())

    def collect(self) -> Iterator[Metric]:
        """Read every gate now and yield its metric families."""
        with self._lock:
            members = list(self._members.items())
        named = bool(members) and members[0][0] is not None
        families = _Families(self._prefix, ("gate",) if named else ())
        for name, gate in members:
            families.add_gate(gate, () if name is None else (name,))
        yield from families.present()


class _Families:
    """The metric families of one scrape, filled gate by gate."""

    def __init__(self, prefix: str, base: tuple[str, ...]) -> None:
        self._base = base
        p = prefix
        by_transport = [*base, "transport"]
        self.inflight = GaugeMetricFamily(
            f"{p}_inflight_requests",
            "A2A and other gated requests holding a slot, by transport.",
            labels=by_transport,
        )
        self.rejected = CounterMetricFamily(
            f"{p}_rejected_total",
            "Requests refused at admission, by transport and reason (shed: evicted while queued).",
            labels=[*by_transport, "reason"],
        )
        self.admitted = CounterMetricFamily(
            f"{p}_admitted_total",
            "Requests admitted (started running), by transport.",
            labels=by_transport,
        )
        self.requests = CounterMetricFamily(
            f"{p}_requests_total",
            "Requests through a front door (middleware or interceptor), gated or passthrough.",
            labels=by_transport,
        )
        self.duration = HistogramMetricFamily(
            f"{p}_request_duration_seconds",
            "Duration of requests through a front door, queueing included.",
            labels=by_transport,
        )
        self.queued = GaugeMetricFamily(
            f"{p}_queued_requests", "Requests waiting for a slot.", labels=list(base)
        )
        self.queue_wait = HistogramMetricFamily(
            f"{p}_queue_wait_seconds",
            "How long requests that queued waited before being admitted.",
            labels=list(base),
        )
        self.limit = GaugeMetricFamily(
            f"{p}_limit",
            "The in-flight cap that bounds the agent: the fleet cap when one is set, the "
            "local ceiling otherwise (with adaptive=, the ceiling learned below it; 0: none).",
            labels=list(base),
        )
        self.saturated = GaugeMetricFamily(
            f"{p}_saturated",
            "1 while in flight is at the cap that bounds the agent, else 0.",
            labels=list(base),
        )
        by_class = [*base, "class"]
        self.classes: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for key, (kind, suffix, text) in CLASS_METRICS.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            self.classes[key] = family(f"{p}_{suffix}", text, labels=by_class)
        self.defaulted = CounterMetricFamily(
            f"{p}_priority_defaulted_total",
            "Requests a front door put in the default priority class: they named none "
            "(missing) or one the gate does not have (unknown).",
            labels=[*base, "cause"],
        )
        self.fleet: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for key, (kind, text) in FLEET_METRICS.items():
            if kind == "counter":
                self.fleet[key] = CounterMetricFamily(f"{p}_{key}_total", text, labels=list(base))
            else:
                self.fleet[key] = GaugeMetricFamily(f"{p}_{key}", text, labels=list(base))
        self.rate_limit: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        by_limit = [*base, "limit"]
        for key, (kind, text) in RATE_LIMIT_METRICS.items():
            name = f"{p}_rate_limit_{key}"
            if kind == "counter":
                self.rate_limit[key] = CounterMetricFamily(f"{name}_total", text, labels=by_limit)
            else:
                self.rate_limit[key] = GaugeMetricFamily(name, text, labels=by_limit)

    def all(self) -> Iterator[Metric]:
        yield from (
            self.inflight,
            self.rejected,
            self.admitted,
            self.requests,
            self.duration,
            self.queued,
            self.queue_wait,
            self.limit,
            self.saturated,
        )
        yield from self.fleet.values()
        yield from self.rate_limit.values()
        yield from self.classes.values()
        yield self.defaulted

    def present(self) -> Iterator[Metric]:
        """Every family, except fleet, budget and class families no gate reported."""
        optional = {id(family) for family in self.fleet.values()}
        optional |= {id(family) for family in self.rate_limit.values()}
        optional |= {id(family) for family in self.classes.values()}
        optional.add(id(self.defaulted))
        for family in self.all():
            if id(family) not in optional or family.samples:
                yield family

    def add_gate(self, gate: Any, gate_label: tuple[str, ...]) -> None:
        stats = gate.stats()
        transports = gate.transport_stats()
        requests = gate.request_stats()
        waits = gate.queue_wait_stats()
        base = list(gate_label)
        for transport in sorted(transports):
            figures = transports[transport]
            labels = [*base, transport]
            self.inflight.add_metric(labels, figures["in_flight"])
            self.admitted.add_metric(labels, figures["admitted"])
            for reason in sorted(figures["rejected"]):
                self.rejected.add_metric([*labels, reason], figures["rejected"][reason])
        for transport in sorted(requests):
            figures = requests[transport]
            labels = [*base, transport]
            self.requests.add_metric(labels, figures["count"])
            self.duration.add_metric(labels, _buckets(figures["buckets"]), figures["sum"])
        self.queued.add_metric(base, stats["queued"])
        self.queue_wait.add_metric(base, _buckets(waits["buckets"]), waits["sum"])
        fleet_cap = stats.get("fleet_max_in_flight") or 0
        # A fleet's learned limit (adaptive= with fleet=) is the ceiling in force.
        learned = stats.get("fleet_limit") or 0
        self.limit.add_metric(base, learned or fleet_cap or stats["limit"])
        # gate.saturated already compares with the fleet cap once one is configured.
        self.saturated.add_metric(base, 1.0 if gate.saturated else 0.0)
        for key, family in self.fleet.items():
            if key in stats:
                family.add_metric(base, float(stats[key]))
        for limit, figures in sorted(stats.get("rate_limits", {}).items()):
            for key, family in self.rate_limit.items():
                family.add_metric([*base, limit], float(figures[key]))
        classes = stats.get("classes")
        if classes:
            for class_name, figures in classes.items():
                for key, family in self.classes.items():
                    family.add_metric([*base, class_name], figures[key])
            for cause, count in defaulted(gate).items():
                self.defaulted.add_metric([*base, cause], count)


def _buckets(cumulative: Any) -> list[tuple[str, float]]:
    return [(floatToGoString(bound), count) for bound, count in cumulative]


def _check_prefix(prefix: object) -> None:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"prefix must be a Prometheus metric-name prefix ([a-zA-Z_][a-zA-Z0-9_]*), got {prefix!r}"
        )
    if prefix.startswith("__") or prefix.endswith("_") or len(prefix) > _MAX_PREFIX:
        raise ValueError(
            f"prefix must not start with '__' (reserved), end with '_' (it is joined with '_') "
            f"or exceed {_MAX_PREFIX} characters, got {prefix!r}"
        )


def _check_name(name: object) -> None:
    if name is None:
        return
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME or not name.isprintable():
        raise ValueError(
            f"name must be None or a non-empty printable str of at most {_MAX_NAME} "
            f"characters (the value of the gate label), got {name!r}"
        )


def _check_registry(registry: object) -> CollectorRegistry:
    if registry is None:
        return REGISTRY
    if not isinstance(registry, CollectorRegistry):
        raise TypeError(
            f"registry must be a prometheus_client.CollectorRegistry or None, got {registry!r}"
        )
    return registry


def _registered(registry: CollectorRegistry, prefix: str) -> GateCollector | None:
    """The :class:`GateCollector` registered on ``registry`` for ``prefix``, if any.

    Looked up from the registry itself (so ``registry.unregister(collector)`` is honoured);
    ``ValueError`` when another collector owns the names."""
    owners = getattr(registry, "_names_to_collectors", {})
    owner = owners.get(f"{prefix}_limit")
    if owner is None or isinstance(owner, GateCollector):
        return owner
    raise ValueError(
        f"the metric {prefix}_limit is already registered by {owner!r}; choose another prefix"
    )


def register(
    gate: Any,
    registry: CollectorRegistry | None = None,
    prefix: str = "admitgate",
    name: str | None = None,
) -> GateCollector:
    """Export ``gate`` on ``registry`` (default ``prometheus_client.REGISTRY``) and return the
    collector that serves it.

    ``prefix`` starts every metric name (``prefix="broker"`` gives the mesh broker's names);
    ``name`` adds the label ``gate="<name>"`` to every series. A second gate registered with
    the same registry and prefix joins the same collector (both need distinct names);
    ``ValueError`` on a duplicate gate or name, or when another collector owns the names.
    Undo with :func:`unregister`, or ``registry.unregister(collector)`` for every gate of
    that prefix.
    """
    check_gate(gate)
    _check_prefix(prefix)
    _check_name(name)
    target = _check_registry(registry)
    existing = _registered(target, prefix)
    if existing is not None:
        existing.add(gate, name)
        return existing
    collector = GateCollector(prefix)
    collector.add(gate, name)
    target.register(collector)
    return collector


def unregister(
    gate: Any, registry: CollectorRegistry | None = None, prefix: str = "admitgate"
) -> None:
    """Stop exporting ``gate`` from ``registry`` under ``prefix``; the collector leaves the
    registry with its last gate. ``ValueError`` if the gate is not exported there."""
    _check_prefix(prefix)
    target = _check_registry(registry)
    collector = _registered(target, prefix)
    if collector is None:
        raise ValueError(f"no admitgate metrics with prefix {prefix!r} on this registry")
    collector.remove(gate)
    if not collector.gates:
        target.unregister(collector)
