"""Type stub for admitgate's native module (the Rust core's PyO3 binding).

Hand-written; checked against the built module by ``python -m mypy.stubtest``.
"""

import os
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Literal, final

from typing_extensions import disjoint_base

from ._drain import DrainReport
from ._priorities import PriorityClass
from ._types import ResourceSample

__all__ = [
    "DURATION_BUCKETS",
    "MAX_TRANSPORTS",
    "A2ARules",
    "InternalError",
    "_broker_main",
    "_fleet_runtime_running",
    "_invalidate_samplers",
    "_jsonrpc_request",
    "_panic_in_next_broker",
    "_panic_in_next_wakes",
    "_panic_inside_gate",
    "_quiesce_at_exit",
    "_rejection_class",
    "_reset_after_fork",
    "_reset_fleet_after_fork",
    "_resolve_waiter",
    "_set_rejection_class",
    "_simulate",
    "_standard_scenarios",
    "AdaptiveLimit",
    "Admission",
    "Entered",
    "HumanWait",
    "HumanWaitFactory",
    "LoopInbox",
    "LoopMailbox",
    "QueueTimer",
    "AdmissionGate",
    "RssSampler",
    "Ready",
    "Wait",
    "ConcurrencyLimitPolicy",
    "MemoryPressurePolicy",
    "FleetLimit",
    "FleetLease",
    "LeaseWait",
    "RateLimit",
    "RecentUsage",
    "BudgetAnswer",
    "serve_broker",
    "WindowLockout",
    "__version__",
]

__version__: Final[str]
DURATION_BUCKETS: Final[list[float]]
"""Upper bounds (seconds) of the request-duration and queue-wait histogram buckets."""
MAX_TRANSPORTS: Final[int]
"""The most distinct transports one gate tracks (each is a metric label)."""

class InternalError(RuntimeError):
    """A bug inside admitgate's Rust core (a Rust panic), raised as an ordinary exception.

    The gate stays usable afterwards. Set ``RUST_BACKTRACE=1`` to see where it happened.
    """

@disjoint_base
class ConcurrencyLimitPolicy:
    """Config-driven concurrency policy: a ceiling, a bounded wait queue, an overflow rule
    and an optional per-scope (per-tenant) sub-limit. Decides exactly as PraisonAI's
    ``ConcurrencyLimitPolicy`` does for the same facts.

    Counts accept ints, integral floats and integer strings in ``0..2**31-1``; anything else
    raises ``ValueError`` naming the argument. ``overflow_policy`` is ``"reject"``,
    ``"queue"`` or ``"shed_oldest"`` (case and surrounding spaces ignored).

    Immutable; may be subclassed (a gate then calls the subclass's ``decide``), pickled and
    copied.
    """

    def __new__(
        cls,
        max_concurrent_runs: int | float | str = 0,
        queue_depth: int | float | str = 0,
        overflow_policy: str | None = "reject",
        max_concurrent_runs_per_scope: int | float | str = 0,
        queue_timeout_s: float | None = None,
    ) -> ConcurrencyLimitPolicy: ...
    @property
    def queue_timeout_s(self) -> float | None:
        """Seconds a turn may wait before it is refused with ``timeout``; ``None``: no
        bound (the reference has none)."""
    @property
    def max_concurrent_runs(self) -> int:
        """Ceiling on concurrent runs; 0 disables admission control."""
    @property
    def queue_depth(self) -> int:
        """Turns that may wait before the overflow policy applies."""
    @property
    def overflow_policy(self) -> Literal["reject", "queue", "shed_oldest"]:
        """What a turn that finds the queue full meets."""
    @property
    def max_concurrent_runs_per_scope(self) -> int:
        """Per-scope sub-limit within the ceiling; 0 disables it."""
    @property
    def enabled(self) -> bool:
        """Whether a ceiling is set."""
    def __reduce__(self) -> tuple[Any, ...]: ...
    def decide(
        self,
        *,
        in_flight: int,
        queued: int,
        session_id: str = "",
        scope: str = "",
        scope_in_flight: int = 0,
        scope_queued: int = 0,
    ) -> Any:
        """Decide for one turn from the live facts; returns an ``AdmissionDecision``."""

@disjoint_base
class MemoryPressurePolicy:
    """The soft/hard RSS ladder: below ``soft_rss_mb`` admit, from soft to ``hard_rss_mb``
    queue, at or over hard reject; an unknown reading admits.

    Thresholds must be finite and ``>= 0``; ``hard_rss_mb=0`` means no hard threshold, and
    with both set soft must not exceed hard. Otherwise ``ValueError``.
    """

    def __new__(
        cls,
        soft_rss_mb: float | int | str | None = 0.0,
        hard_rss_mb: float | int | str | None = 0.0,
    ) -> MemoryPressurePolicy: ...
    @staticmethod
    def from_max_rss_mb(max_rss_mb: Any, soft_ratio: Any) -> MemoryPressurePolicy | None:
        """The ladder for one hard ceiling ``max_rss_mb`` (MiB), soft at ``soft_ratio``
        (clamped to ``[0, 1]``) of it; ``None`` when the ceiling is 0 or ``None``."""
    @property
    def soft_rss_mb(self) -> float:
        """Soft (queue) threshold in MiB; 0.0 when unset."""
    @property
    def hard_rss_mb(self) -> float:
        """Hard (reject) threshold in MiB; 0.0 when unset."""
    @property
    def enabled(self) -> bool:
        """Whether any threshold is set."""
    def __reduce__(self) -> tuple[Any, ...]: ...
    def evaluate(self, sample: Any) -> Any:
        """Decide for one sample (anything with ``rss_mb``); returns an ``AdmissionDecision``."""

@final
class RssSampler:
    """The built-in sampler: the process's live RSS (peak RSS where live is unavailable),
    refreshed at most every ``interval_seconds`` (5 ms); disables itself with one warning
    where neither can be read."""

    def __new__(cls) -> RssSampler: ...
    def read(self) -> ResourceSample:
        """A ``ResourceSample`` of the current RSS (``rss_mb=None`` when unavailable)."""
    @property
    def interval_seconds(self) -> float:
        """How stale a reading may be, in seconds."""
    @property
    def source(self) -> Literal["live", "peak", "unavailable"]:
        """Which reading the sampler takes."""

@disjoint_base
class AdmissionGate:
    """Gateway-wide admission gate: a concurrency ceiling, a bounded FIFO wait queue with
    per-scope lanes, overflow policies and memory-aware admission.

    ``policy`` is an admitgate ``ConcurrencyLimitPolicy`` (decided in Rust), any object with
    PraisonAI's ``decide(**facts)`` and limit attributes, or ``None`` for a resource-only
    gate. ``resource_policy`` is a ``MemoryPressurePolicy`` or any object with
    ``evaluate(sample)``; ``resource_sampler`` any object with ``read()`` (default: the
    built-in :class:`RssSampler`). Thread-safe: one gate may serve several event loops.

    ``adaptive`` (an :class:`AdaptiveLimit`) moves the effective ceiling between its
    ``min_limit`` and ``max_concurrent_runs`` from provider throttles and latency (with
    ``fleet=`` too: one learned limit for the whole fleet, between ``min_limit`` and the
    fleet's ``max_in_flight``, kept in Redis and honoured by every lease);
    ``queue_discipline="adaptive"`` serves a standing queue newest first with waits capped
    at the measured service time (``"fifo"``: today's order). Both need a ceiling.

    ``priorities`` (a list of :class:`admitgate.PriorityClass`, most important first) gives
    turns classes: a class below its guaranteed share (``min_share`` of the limit) is served
    first, then classes in priority order; ``max_share`` caps a class even while slots are
    free; a full queue sheds the least important class's oldest waiter rather than refuse a
    more important newcomer. ``default_priority`` names the class of a turn that names none
    (default: the last class). ``fairness="tenant"`` shares turns fairly across tenants
    (``session_id``) within each class, FIFO within a tenant; it is on by default with
    classes (``"none"`` turns it off) and off without. ``tenant_weights`` (``{tenant:
    weight}``, 1 to 1,000,000) weighs tenants' shares under fair queuing. See
    ``docs/priorities.md``.

    ``rate_limit`` (a :class:`RateLimit` or a list of them, names unique) is passed by every
    turn, in order, before its slot and lease: a turn a budget refuses never takes either.
    ``AdmissionGate(rate_limit=...)`` alone enforces only the budget. See ``docs/budgets.md``.

    ``estimator`` gives each turn that passes no ``cost=`` its token estimate: a
    :class:`RecentUsage` (learned from what turns report, in Rust) or a callable
    ``estimator(session_id, identity) -> int`` (0 to 2**48), called with the identity the
    first budget that counts tokens keys the turn on (``identity=``, else its ``key``'s
    answer, else the ``session_id``). An explicit ``cost=`` wins. A callable that raises
    refuses the turn with its exception; one that answers anything but such an int refuses
    it with ``TypeError`` / ``ValueError`` naming the estimator and the value; either way the
    turn reserves nothing. It needs a ``rate_limit`` with ``tokens=``.
    """

    def __new__(
        cls,
        policy: Any | None = None,
        *,
        resource_policy: Any | None = None,
        resource_sampler: Any | None = None,
        fleet: FleetLimit | None = None,
        adaptive: AdaptiveLimit | None = None,
        queue_discipline: str | None = None,
        priorities: Sequence[PriorityClass] | None = None,
        default_priority: str | None = None,
        fairness: Literal["tenant", "none"] | None = None,
        tenant_weights: Mapping[str, int] | None = None,
        rate_limit: RateLimit | Sequence[RateLimit] | None = None,
        estimator: RecentUsage | Callable[[str, str | bytes], int] | None = None,
    ) -> AdmissionGate: ...
    @property
    def rate_limits(self) -> list[RateLimit]:
        """``rate_limit=``, in the order turns pass them (empty: none)."""
    @property
    def estimator(self) -> RecentUsage | Callable[[str, str | bytes], int] | None:
        """``estimator=``: what a turn given no ``cost=`` reserves, or ``None``."""
    @property
    def adaptive(self) -> AdaptiveLimit | None:
        """The adaptive ceiling's settings (``adaptive=``), or ``None``."""
    @property
    def queue_discipline(self) -> str:
        """``"fifo"`` or ``"adaptive"``."""
    @property
    def limit(self) -> int:
        """The effective ceiling now: ``max_concurrent_runs``, or below it what ``adaptive=``
        has learned (0: no ceiling); with ``fleet=`` too, the fleet's learned limit once read
        (one value for every replica, kept in Redis)."""
    @property
    def fleet(self) -> FleetLimit | None:
        """The fleet-wide limit: a turn runs once it has its local slot and a lease."""
    def admit(
        self,
        *,
        session_id: object = "",
        transport: str = "direct",
        on_queued: Callable[[int, float | None], object] | None = None,
        deadline_s: float | None = None,
        priority: str | None = None,
        cost: int | None = None,
        identity: str | bytes | None = None,
    ) -> Admission:
        """One turn's passage: ``async with gate.admit(session_id=user) as turn:`` (the
        turn is this admission, on every gate). Raises ``AdmissionRejected`` on entry if the
        turn is rejected, or evicted while waiting.

        With ``rate_limit=``: ``cost`` is the turn's token estimate (an int >= 0), reserved
        in every token limit before the turn's slot and settled by
        :meth:`Admission.report_usage` (``None``: the gate's ``estimator=``'s estimate, or 0
        without one); ``identity`` (a str or bytes) keys the turn in every
        budget instead of ``key(session_id)`` or the ``session_id`` (the front doors pass the
        ``--rate-key`` value through it). A budget that refuses raises ``rate_limited`` with
        the exact ``retry_after`` (``on_limit="reject"``), or the turn waits for it within its
        queue timeout and ``deadline_s`` (``on_limit="wait"``).

        ``deadline_s`` is how many seconds the caller will wait for the whole turn: a turn
        that would wait is refused at once (reason ``deadline``) when less is left than the
        gate's expected service time, and while it waits once that becomes true; a turn that
        runs at once always runs. On a gate with ``adaptive=`` or ``queue_discipline=`` (or
        once any of its turns passed ``deadline_s``: the gate then times its turns),
        ``async with ... as turn`` gives this admission (to call :meth:`Admission.report_throttled`).

        ``session_id`` is the tenant key (a str as is, ``None`` as ``""``, anything else by
        its ``str()``, as the reference accepts). ``transport`` names the front door the turn
        came through, for :meth:`transport_stats` and the metrics: 1 to 32 characters of
        ``[a-z0-9_]``, not ``"passthrough"``; a gate keeps at most :data:`MAX_TRANSPORTS`.
        ``on_queued(position, estimated_wait_s)`` is called once if the turn has to wait
        (see :attr:`Admission.position`); an exception from it withdraws the turn and
        propagates. ``priority`` names the turn's class on a gate built with
        ``priorities=[...]`` (``None``: its default class); an unknown name, or any name on a
        gate without classes, raises ``ValueError`` naming it (and the known classes)."""
    def admit_sync(
        self,
        *,
        session_id: object = "",
        transport: str = "direct",
        timeout: float | None = None,
        on_queued: Callable[[int, float | None], object] | None = None,
        deadline_s: float | None = None,
        priority: str | None = None,
        cost: int | None = None,
        identity: str | bytes | None = None,
    ) -> Admission:
        """One turn from a worker thread: ``with gate.admit_sync(session_id=user) as turn:``
        (``cost`` and ``identity`` as for :meth:`admit`; a budget's wait is on this thread,
        without the GIL). Shares
        the slots, queues and FIFO order of async turns; waits without holding the GIL, at
        most ``timeout`` seconds and at most ``queue_timeout_s`` (the smaller wins; refused
        with reason ``timeout``). Raises ``RuntimeError`` at once on a thread running an
        event loop (waiting there would block that loop)."""
    def reconfigure(
        self,
        *,
        max_concurrent_runs: int | float | str = ...,
        queue_depth: int | float | str = ...,
        overflow_policy: str | None = ...,
        max_concurrent_runs_per_scope: int | float | str = ...,
        max_rss_mb: float | None = ...,
        queue_timeout_s: float | None = ...,
        priorities: Sequence[PriorityClass] | None = None,
        default_priority: str | None = None,
        fairness: Literal["tenant", "none"] | None = None,
        tenant_weights: Mapping[str, int] | None = None,
    ) -> int:
        """Change any subset of the limits while the gate runs, validated as at
        construction (a bad value changes nothing). Lowering the ceiling never cancels a
        running turn; raising it starts waiting turns at once; shrinking the queue refuses
        the newest waiters of each lane past the new depth (``queue_full``) except under the
        ``queue`` policy. Turns let through while the gate enforced nothing count against a
        ceiling set now. Memory pressure is sampled afresh: if it eased (or ``max_rss_mb=0``
        turned memory-aware admission off), the waiters it held back start at once. Classes'
        guarantees and caps follow the new ceiling. ``priorities`` may change the classes'
        shares, not their names or order (``ValueError``); ``default_priority``,
        ``fairness`` and ``tenant_weights`` may change (``None``: unchanged). Returns how
        many waiters were refused."""
    def scope_stats(self) -> dict[str, dict[str, int]]:
        """``{tenant: {"in_flight": n, "queued": n}}`` for tenants with turns running or
        waiting; empty when neither per-tenant limits nor fair queuing are on."""
    def close(self, drain_timeout: float | None = None) -> Coroutine[Any, Any, DrainReport]:
        """Drain: stop admitting (``closing``), refuse every queued turn at once (and, with
        a fleet limit, every turn still waiting for its lease), never cancel a running one,
        wait up to ``drain_timeout`` seconds for running turns to end. Returns a
        :class:`DrainReport`; a closed gate stays closed."""
    def close_sync(self, drain_timeout: float | None = None) -> DrainReport:
        """:meth:`close` for threaded code: blocks without the GIL."""
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` (or :meth:`close_sync`) was called."""
    @property
    def queue_timeout_s(self) -> float | None:
        """Seconds a turn may wait before it is refused with ``timeout``; ``None``: no
        bound."""
    def _begin_close(self) -> tuple[int, int]: ...
    def _running(self) -> int: ...
    def _drained_future(self) -> Any | None: ...
    def _wait_drained(self, timeout: float | None = None) -> bool: ...
    @property
    def max_concurrent_runs(self) -> int:
        """The ceiling on concurrent runs (0: none)."""
    @property
    def saturated(self) -> bool:
        """Whether in flight is at the cap that bounds the agent: the fleet cap (leases held
        across the fleet, last known) with a fleet limit, else the ceiling (never without
        one)."""
    def transport_stats(self) -> dict[str, dict[str, Any]]:
        """Per transport: ``in_flight``, ``queued``, ``admitted`` and ``rejected`` (a dict of
        every rejection reason to its count), for each transport that reached ``admit()``."""
    def record_request(self, transport: str, seconds: float) -> None:
        """Record one front-door request (``"passthrough"`` for ungated traffic) that took
        ``seconds``; called once per request by the ASGI middleware and gRPC interceptor."""
    def request_stats(self) -> dict[str, dict[str, Any]]:
        """Per request label: ``count``, ``sum`` (seconds) and cumulative ``buckets``
        (``[(upper_bound, count), ...]`` ending with ``inf``)."""
    def queue_wait_stats(self) -> dict[str, Any]:
        """How long turns that queued waited before being admitted: ``count``, ``sum``,
        ``buckets`` as in :meth:`request_stats`."""
    @property
    def enabled(self) -> bool:
        """Whether the gate is active (a ceiling, or a memory threshold, is set)."""
    @property
    def in_flight(self) -> int:
        """Turns holding a run slot."""
    @property
    def queued(self) -> int:
        """Turns waiting for a slot."""
    @property
    def admitted(self) -> int:
        """Turns that started running."""
    @property
    def rejected(self) -> int:
        """Turns refused on arrival."""
    @property
    def shed(self) -> int:
        """Waiters evicted by ``shed_oldest``."""
    @property
    def cancelled(self) -> int:
        """Turns withdrawn while queued, or cancelled between being granted a slot and
        starting."""
    @property
    def awaiting_human(self) -> int:
        """Admitted turns parked on a human approval, not holding a slot."""
    @property
    def peak_in_flight(self) -> int:
        """The most turns that were ever in flight at once."""
    @property
    def oldest_wait_seconds(self) -> float | None:
        """How long the oldest waiter has waited, or ``None`` when nobody waits."""
    @property
    def policy(self) -> Any | None:
        """The concurrency policy the gate was built with."""
    def stats(self) -> dict[str, int | float | dict[str, dict[str, int]]]:
        """A snapshot: ``max_concurrent_runs``, ``max_concurrent_runs_per_scope``,
        ``queue_depth``, ``in_flight``, ``queued``, ``awaiting_human``, ``admitted``,
        ``rejected``, ``shed``, ``max_rss_mb`` (float), ``cancelled`` and ``limit`` (the
        effective ceiling now, see :attr:`limit`); with a fleet limit
        also ``fleet_in_flight``, ``fleet_max_in_flight``, ``fleet_backend_up`` (1/0),
        ``fleet_lease_lost``, ``fleet_borrowed`` and ``fleet_outages``; with a fleet limit and
        ``adaptive=``, ``fleet_limit`` (the fleet's learned limit, 0 until one is read), which
        ``limit`` then shows. With ``priorities=``, ``classes``: ``{name: {"in_flight",
        "queued", "admitted", "rejected", "shed", "cancelled"}}``, read with the totals under
        one lock, so each counter summed over the classes equals the total."""
    @property
    def _resource_policy(self) -> Any | None: ...
    @property
    def _resource_sampler(self) -> Any | None: ...
    @_resource_sampler.setter
    def _resource_sampler(self, sampler: Any | None) -> None: ...
    def _shed_oldest_waiter(self) -> bool:
        """Evict the oldest live waiter; ``False`` when nobody waits."""

@final
class Admission:
    """The async context manager ``AdmissionGate.admit`` returns; enter it once."""

    @property
    def waited(self) -> bool:
        """Whether the turn had to wait for a slot (it was not granted one on arrival)."""
    @property
    def active(self) -> bool:
        """Whether the turn is inside the gate (holding, or lending, its slot)."""
    @property
    def position(self) -> int | None:
        """While the turn waits: how many turns would start before it (0: next); ``None``
        otherwise. Computed on request."""
    @property
    def estimated_wait_s(self) -> float | None:
        """While the turn waits: seconds until it may start at the recent release rate
        (the estimator behind ``AdmissionRejected.retry_after``, unclamped); ``None``
        otherwise or until some turn of the gate has ended."""
    def report_throttled(self, retry_after_s: float | None = None) -> None:
        """Reports that the provider throttled this turn's call (429), with its
        ``Retry-After`` in seconds if sent (a number >= 0; 0 holds nothing). With ``adaptive=`` the ceiling moves when the
        turn ends (an exception of ``AdaptiveLimit.throttle_on`` leaving the block reports
        the same); elsewhere it is ignored."""
    def report_remaining(self, requests: int) -> None:
        """Reports the provider's ``x-ratelimit-remaining-requests``: at 0 the adaptive
        ceiling does not grow."""
    def report_usage(self, *, tokens: int) -> None:
        """Reports the tokens this turn really used: each budget (``rate_limit=``) refunds
        what its estimate (``cost=``) held beyond that, or records the excess as a debt that
        delays the identity's next turns. Only the first report counts; without a budget it
        is ignored. An unreported turn keeps its estimate."""
    @property
    def cost(self) -> int | None:
        """The tokens this turn reserves in its budgets: ``cost=``, or without it the
        gate's ``estimator=``'s estimate (0 without one), known once the turn has passed its
        budgets; ``None`` before that when no ``cost=`` was given."""
    def _budget_step(self, answer: BudgetAnswer | None = None) -> Any: ...
    def _budget_abandon(self, step: Any = None) -> None: ...
    @property
    def _budget_server_time(self) -> float | None: ...
    def _enter_gate(self) -> Entered | Wait | LeaseWait: ...
    def __aenter__(self) -> Entered | Wait | LeaseWait | Coroutine[Any, Any, Admission]: ...
    def __enter__(self) -> Admission: ...
    def __exit__(
        self,
        _exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        _tb: TracebackType | None = None,
    ) -> bool: ...
    def __aexit__(
        self,
        _exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        _tb: TracebackType | None = None,
    ) -> Ready: ...

@final
class BudgetAnswer:
    """A fleet-wide budget's answer for one turn (opaque; see ``admitgate._budget``)."""

@final
class RateLimit:
    """A budget: at most ``requests`` turns and ``tokens`` tokens per identity per window.

    A limit is ``"N/s"``, ``"N/min"``, ``"N/h"`` or ``"N/day"``, or a tuple ``(N, seconds)``;
    ``requests`` and ``tokens`` may each be a list (``["60/min", "1000/day"]``); at least one
    is needed. ``"N/T"`` means at most N in any half-open interval of length T, per identity
    (an exact sliding log); ``burst`` (an int >= 1, local only) trades that for GCRA: ``burst``
    at once, then one every ``T/N``, at most ``N + burst - 1`` in any window.

    ``key`` is a callable of the turn's ``session_id`` returning its identity (str or bytes);
    ``None``: the ``session_id``. ``admit(identity=...)`` overrides both. Identities are hashed
    before they are stored; no stat or metric is per identity.

    ``fleet`` is ``None`` (decided in this process, in Rust), a Redis URL or a
    :class:`FleetLimit` whose connection it then shares: one Lua call per decision, by
    Redis's clock, exact across replicas. ``on_backend_error`` is what a fleet-wide limit
    does while Redis is down: ``"local"`` (this replica's own budget: at most R x N per
    identity per window across R replicas), ``"reject"`` (``fleet_unavailable``) or
    ``"allow"`` (no limit). ``name`` namespaces its Redis keys and labels its stats and
    metrics. ``on_limit``: ``"reject"`` (``rate_limited``, with the exact retry time) or
    ``"wait"`` (until the budget allows, within the turn's queue timeout and deadline).
    """

    def __new__(
        cls,
        requests: str | tuple[int, float] | Sequence[str | tuple[int, float]] | None = None,
        tokens: str | tuple[int, float] | Sequence[str | tuple[int, float]] | None = None,
        key: Callable[[str], str | bytes] | None = None,
        fleet: str | FleetLimit | None = None,
        on_limit: Literal["reject", "wait"] = "reject",
        name: str = "default",
        on_backend_error: Literal["local", "reject", "allow"] = "local",
        burst: int | None = None,
    ) -> RateLimit: ...
    @property
    def requests(self) -> list[str]:
        """The request limits, as given."""
    @property
    def tokens(self) -> list[str]:
        """The token limits, as given."""
    @property
    def key(self) -> Callable[[str], str | bytes] | None:
        """The key callable, or ``None`` (the session id)."""
    @property
    def fleet(self) -> str | FleetLimit | None:
        """``None`` (local), the shared :class:`FleetLimit`, or the Redis URL with its
        password redacted."""
    @property
    def on_limit(self) -> str:
        """``"reject"`` or ``"wait"``."""
    @property
    def name(self) -> str:
        """The name: its keys' namespace, its label in stats and metrics."""
    @property
    def on_backend_error(self) -> str:
        """``"local"``, ``"reject"`` or ``"allow"``."""
    @property
    def burst(self) -> int | None:
        """The GCRA burst, or ``None`` (exact sliding windows)."""
    def stats(self) -> dict[str, int]:
        """This process's counters: ``allowed``, ``limited``, ``waited``, ``unavailable``,
        ``tokens_reserved``, ``settled``, ``tokens_settled``, ``returned``,
        ``tokens_returned``, ``keys`` (plus ``fleet_decisions``, ``known_refusals``,
        ``offline_decisions``, ``settles_lost`` for a fleet-wide limit). No per-identity
        numbers."""

@final
class RecentUsage:
    """A token estimate learned from what turns report, for ``AdmissionGate(estimator=)``.

    Per identity, the larger of its last report and a decayed average of its reports: it
    rises at once to a larger usage and falls back gradually after smaller ones, the gap
    halving every ``half_life`` reports (an int, 1 to 1,000,000). An identity with no report
    is estimated from the decayed average of every identity's reports, and before any report
    at all as ``initial`` tokens (an int, 0 to 2**48). On a gate, a learned estimate is
    capped at the largest cost the gate's token limits can ever admit, so one huge report
    cannot lock an identity out.

    Identities are hashed with a per-estimator random key before anything is stored. At most
    ``max_identities`` (2 to 16,777,216) are held, in two generations of half that: an
    identity is remembered at least until ``max_identities / 2`` others have reported for the
    first time since it last did; then it is estimated from the global average again. Its
    tables hold at most about 58 bytes per identity of the cap. A gate teaches it at
    ``turn.report_usage(tokens=...)`` (the first report of a turn its budgets admitted,
    whatever its cost). It may serve several gates; a forked child keeps what it learned.
    """

    def __new__(
        cls, initial: int, *, half_life: int = 8, max_identities: int = 65536
    ) -> RecentUsage: ...
    @property
    def initial(self) -> int:
        """The estimate before any report (tokens)."""
    @property
    def half_life(self) -> int:
        """How many reports halve the gap between the average and a smaller usage."""
    @property
    def max_identities(self) -> int:
        """The most identities held at once."""
    def __call__(self, session_id: object, identity: str | bytes) -> int:
        """The estimate for a turn of ``identity``, as a gate asks it (the session id is
        not used)."""
    def report(self, identity: str | bytes, *, tokens: int) -> None:
        """Learns that a turn of ``identity`` used ``tokens`` (what a gate does at
        ``turn.report_usage``; for usage seen outside a gate using this estimator)."""
    def stats(self) -> dict[str, int]:
        """``identities`` (held now), ``reports``, ``forgotten`` (to stay within
        ``max_identities``), ``bytes`` (its tables). No per-identity numbers."""

@final
class Entered:
    """An already finished awaitable whose result is the admission (a turn that runs at
    once)."""

    def __await__(self) -> Generator[Any, Any, Admission]: ...
    def __next__(self) -> Any: ...
    def send(self, _value: Any) -> Any: ...
    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> None: ...
    def close(self) -> None: ...

@final
class AdaptiveLimit:
    """Learn the provider's real ceiling below ``max_concurrent_runs``.

    A 429 from the provider is read as a measurement: the refused call started while
    ``in_flight - 1`` others ran, so the ceiling is set there at once. Until the first 429
    the ceiling doubles each round trip in which it was reached; after it, it probes one
    higher every 16 to 64 calls, doubling the step while probes succeed. Latency above
    twice its long-run mean takes a tenth off. ``throttle_on``: exception types that report
    a throttle when they leave a turn's block (``turn.report_throttled()`` does the same).
    """

    def __new__(
        cls,
        *,
        min_limit: int | None = None,
        initial_limit: int | None = None,
        throttle_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
    ) -> AdaptiveLimit: ...
    @property
    def min_limit(self) -> int:
        """The lowest ceiling it sets (default 1)."""
    @property
    def initial_limit(self) -> int | None:
        """The ceiling before anything is learned (``None``: 4, or the maximum if lower)."""
    @property
    def throttle_on(self) -> tuple[type[BaseException], ...]:
        """The exception types that report a provider throttle."""

@final
class Ready:
    """An already finished awaitable (the fast path)."""

    def __await__(self) -> Generator[Any, Any]: ...
    def __next__(self) -> Any: ...
    def send(self, _value: Any) -> Any: ...
    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> None: ...
    def close(self) -> None: ...

@final
class Wait:
    """A queued turn's awaitable: resolves when a slot is granted; withdraws from the queue
    when cancelled, closed or dropped."""

    def __await__(self) -> Generator[Any, Any]: ...
    def __next__(self) -> Any: ...
    def send(self, _value: Any) -> Any: ...
    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> None: ...
    def close(self) -> None: ...

@final
class HumanWaitFactory:
    """Bound to praisonaiagents' ``HUMAN_WAIT_SCOPE`` while a turn runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> HumanWait:
        """A new :class:`HumanWait` for the running turn (arguments are ignored)."""

@final
class HumanWait:
    """Sync and async context manager around one human-approval wait: lends the turn's slot
    and takes it back (borrowing if none is free) without blocking."""

    def __enter__(self) -> HumanWait: ...
    def __exit__(self, *_exc: Any) -> bool: ...
    def __aenter__(self) -> Ready: ...
    def __aexit__(self, *_exc: Any) -> Ready: ...

@final
class QueueTimer:
    """Refuses one waiting turn whose queue timeout ran out (scheduled on its loop)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None: ...

@final
class LoopMailbox:
    """Wake-ups posted to one event loop from other threads, delivered in one callback."""

    def __call__(self, *args: Any, **kwargs: Any) -> None: ...

@final
class LoopInbox:
    """The fleet runtime's finished results for one event loop (``loop._admitgate_inbox``):
    posted without the GIL, delivered when the loop sees its socket readable."""

    def __call__(self, *args: Any, **kwargs: Any) -> None: ...
    def __len__(self) -> int:
        """The futures still waiting for a result (for tests)."""

@final
class FleetLimit:
    """A fleet-wide in-flight cap shared by every replica configured with the same ``key`` on
    the same Redis (``redis://`` or ``rediss://``, credentials in the URL allowed; a Sentinel
    deployment as ``redis+sentinel://host:port[,host:port...]/service_name[/db]``, a Redis
    Cluster as ``redis+cluster://host:port[,host:port...]``, each also ``rediss+...``).

    Each admitted turn holds a lease in Redis, taken and released atomically with the Redis
    server's time; a replica that dies loses its leases after ``lease_ttl_s``. Turns that find
    no room wait in a fleet-wide FIFO and are woken over pub/sub when a lease frees anywhere.
    ``on_backend_error`` says what admissions do while Redis is down: ``"local"`` admits (the
    cap is not enforced meanwhile), ``"reject"`` refuses with reason ``fleet_unavailable``.
    ``command_timeout_s`` defaults to 1 s, or half of ``lease_ttl_s`` when that is shorter.
    ``durability="replicated"`` counts a grant only once ``WAIT 1`` confirms a replica holds
    it (one more round trip; the cap stays exact through a failover); a call no replica
    confirms is handled as an outage (``on_backend_error``). ``tls_cert_file`` and
    ``tls_key_file`` present a client certificate (mutual TLS). Every argument is validated (``ValueError`` naming it); the password never appears in a
    repr, an error or a log line. Building one starts no thread: admitgate's runtime starts
    with the first call that talks to Redis.
    """

    def __new__(
        cls,
        url: str,
        key: str,
        max_in_flight: int,
        *,
        max_in_flight_per_scope: int | None = 0,
        lease_ttl_s: float | None = 10.0,
        on_backend_error: Literal["local", "reject"] | None = "local",
        connect_timeout_s: float | None = 2.0,
        command_timeout_s: float | None = 1.0,
        replica_id: str | None = None,
        tls_ca_file: str | os.PathLike[str] | None = None,
        durability: Literal["primary", "replicated"] | None = "primary",
        tls_cert_file: str | os.PathLike[str] | None = None,
        tls_key_file: str | os.PathLike[str] | None = None,
    ) -> FleetLimit: ...
    @property
    def url(self) -> str:
        """The Redis URL with its password replaced by ``***``."""
    @property
    def key(self) -> str:
        """The limit's name; its Redis keys carry the hash tag ``{key}``."""
    @property
    def max_in_flight(self) -> int:
        """The cap for the whole fleet, as this replica enforces it."""
    @property
    def max_in_flight_per_scope(self) -> int:
        """A tenant's slice of the fleet cap (0: off)."""
    @property
    def lease_ttl_s(self) -> float:
        """How long a lease outlives its last renewal, in seconds."""
    @property
    def on_backend_error(self) -> Literal["local", "reject"]:
        """What admissions do while Redis cannot be reached."""
    @property
    def connect_timeout_s(self) -> float:
        """The bound on establishing a connection, in seconds."""
    @property
    def command_timeout_s(self) -> float:
        """The bound on one command's round trip, in seconds."""
    @property
    def replica_id(self) -> str:
        """This replica's name in lease ids (``<hostname>-<pid>`` unless given)."""
    @property
    def tls_ca_file(self) -> str | None:
        """The CA file for a ``rediss://`` server with a private CA."""
    @property
    def tls_cert_file(self) -> str | None:
        """The client certificate presented to servers that require one (mutual TLS)."""
    @property
    def tls_key_file(self) -> str | None:
        """The client certificate's private key file."""
    @property
    def durability(self) -> Literal["primary", "replicated"]:
        """When a grant counts: once the primary holds it, or once a replica confirms it."""
    @property
    def backend_up(self) -> bool:
        """Whether Redis answered the last call."""
    def stats(self) -> dict[str, int]:
        """Counters without a round trip: ``fleet_in_flight``, ``fleet_max_in_flight``,
        ``fleet_backend_up`` (1/0), ``fleet_lease_lost``, ``fleet_borrowed``,
        ``fleet_outages``, ``fleet_max_in_flight_per_scope``, ``fleet_waiting``,
        ``fleet_lease_retaken``, ``fleet_replica_held``, ``fleet_replica_waiting``,
        ``fleet_limit`` (the fleet's learned limit, set by gates with ``adaptive=``, last
        known; 0: none, the cap alone counts), ``fleet_failovers`` (new primaries named by
        the sentinels and followed), ``fleet_unconfirmed`` (calls no replica confirmed, with
        ``durability="replicated"``)."""
    def acquire(self, scope: object = "") -> Awaitable[FleetLease]:
        """Waits for a lease in fleet-wide FIFO order (call inside a running event loop).
        Cancelling the wait withdraws it. While Redis is down: a local lease, or
        ``AdmissionRejected(reason="fleet_unavailable")`` with ``on_backend_error="reject"``."""
    def try_acquire(self, scope: object = "") -> Awaitable[FleetLease | None]:
        """A lease if one is free now (one round trip), else ``None``."""
    def lend(self, lease: FleetLease) -> Awaitable[None]:
        """Gives ``lease`` back while its turn waits for a person; resume with ``reclaim``."""
    def reclaim(self, scope: object = "") -> Awaitable[FleetLease]:
        """A lease for a resuming turn: taken if there is room, else borrowed over the cap
        (``fleet_borrowed``, repaid by the next release in the fleet); never waits in line."""
    def connect(self) -> Awaitable[None]:
        """Checks that Redis answers; raises ``ConnectionError`` (without the password)."""
    def shutdown(self) -> Awaitable[None]:
        """Gives back every lease of this replica and stops its background tasks."""

@final
class LeaseWait:
    """What ``Admission.__aenter__`` returns with a fleet limit: the local queue wait (if the
    turn queued), then the wait for the fleet lease; cancelling it hands the slot on."""

    def __await__(self) -> Generator[Any, Any]: ...
    def __next__(self) -> Any: ...
    def send(self, _value: Any) -> Any: ...
    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> None: ...
    def close(self) -> None: ...

@final
class FleetLease:
    """One turn's share of a fleet-wide cap. Given back by ``await lease.release()``, or when
    the object is garbage; a lease inherited across ``os.fork()`` is never given back by the
    child."""

    @property
    def id(self) -> str:
        """The lease id in Redis: ``<replica_id>#<instance nonce>#<n>``."""
    @property
    def scope(self) -> str:
        """The scope (tenant) it counts against; ``""`` when none."""
    @property
    def reclaimed(self) -> Literal["taken", "borrowed", "borrowed_scope", "local"] | None:
        """How ``reclaim`` got it; ``None`` for ``acquire``."""
    @property
    def released(self) -> bool:
        """Whether this object no longer holds the lease."""
    @property
    def lost(self) -> bool:
        """Whether the lease expired under its turn with no room to take it again."""
    def release(self) -> Awaitable[None]:
        """Gives the lease back; under way once called, idempotent."""

@final
class WindowLockout:
    """BotOS's rate-limit rule (a window anchored at a key's first request, then a lockout),
    decided in admitgate's Rust core: what :func:`admitgate.praisonai.rate_limit_policy` and
    the ``build_auth_rate_limiter`` that :func:`admitgate.praisonai.install` wires return.

    Per ``(scope, identity)`` (hashed before it is stored): a key with no window, or whose
    window began ``window_seconds`` ago or more, starts one and is allowed; inside it, requests
    are counted and the one that makes ``max_requests + 1`` is refused, then the key is locked
    out for ``lockout_seconds`` (or, with none, refused until its window ends).
    ``max_requests=0`` turns limiting off. Decisions and retry hints equal praisonaiagents'
    ``SlidingWindowRateLimitPolicy`` and praisonai-bot's ``AuthRateLimiter`` (same float
    operations), except the documented fixes. At most ``max_keys`` live keys are held (idle
    ones are reclaimed); a new key past them is refused.

    With ``fleet`` (a :class:`FleetLimit` whose connection it shares) decisions are fleet-wide,
    one Lua call each, by Redis ``TIME``; a refusal is then answered locally until its known
    retry time. A fleet decision holds an event loop running on the calling thread at most
    ``max_block_s``; past it, or while Redis is down, ``on_backend_error`` decides
    (``"local"``: this process's own limiter; ``"reject"``; ``"allow"``). Once a call has gone
    past ``max_block_s``, and until it answers or fails, decisions on a loop do not wait for
    Redis at all (Redis is suspect: a frozen one costs one wait per outage, not one per
    decision; every limiter on the same connection shares this); a thread with no running
    loop always waits, for the whole call bound.
    """

    def __new__(
        cls,
        max_requests: int,
        window_seconds: float,
        lockout_seconds: float,
        *,
        max_keys: int,
        decision: Callable[..., Any] | None = None,
        fleet: FleetLimit | None = None,
        name: str = "botos",
        on_backend_error: Literal["local", "reject", "allow"] = "local",
        max_block_s: float = 0.003,
    ) -> WindowLockout: ...
    def check(self, *, identity: str, scope: str, now: float) -> Any:
        """``RateLimitPolicyProtocol.check``: one request of ``identity`` in ``scope`` at
        ``now`` (seconds; fleet-wide, only the ``"local"`` fallback reads it), answered as a
        ``decision(allowed=..., retry_after_seconds=...)``."""
    def decide(
        self, scope: str, identity: str, now: float | None = None
    ) -> tuple[bool, float | None, float, str]:
        """One request, counted: ``(allowed, retry_after_seconds or None, the time it was
        decided at, who decided: "local", "fleet", "known_refusal" or "fallback")``. Fleet-wide,
        the time is Redis ``TIME`` (for a known refusal, the server time it stands for)."""
    def allow(self, endpoint: str, identity: str, now: float | None = None) -> bool:
        """``AuthRateLimiter.allow``: whether the request may proceed (and count it); ``now``
        defaults to the wall clock (``time.time()``)."""
    def time_until_allowed(self, endpoint: str, identity: str, now: float | None = None) -> float:
        """Seconds until the key is allowed again (0.0 if it is now), counting nothing."""
    def reset(self, endpoint: str, identity: str) -> None:
        """Forgets the key (a successful login, say), here and fleet-wide."""
    def prune(self, now: float | None = None) -> int:
        """Forgets every idle key held in this process now; how many."""
    @property
    def max_requests(self) -> int:
        """Requests allowed per window (0: limiting is off)."""
    @property
    def window_seconds(self) -> float:
        """The window, in seconds."""
    @property
    def lockout_seconds(self) -> float:
        """The lockout, in seconds (0: none)."""
    @property
    def enabled(self) -> bool:
        """Whether limiting is on (``max_requests > 0``)."""
    @property
    def fleet_wide(self) -> bool:
        """Whether decisions are made fleet-wide."""
    def stats(self) -> dict[str, Any]:
        """``allowed``, ``limited``, ``refused_at_capacity``, ``keys`` and ``reclaimed``; fleet-
        wide also ``fleet_decisions``, ``known_refusals``, ``offline_decisions`` (every one the
        fallback made), ``late_decisions`` (of those, Redis slower than ``max_block_s``),
        ``suspect_decisions`` (of those, made at once on a loop while an earlier call was still
        late), ``late_outstanding`` (late calls on this limiter's connection not answered yet:
        while above 0, decisions on a loop do not wait) and ``on_backend_error``. No per-key numbers."""

@final
class A2ARules:
    """The A2A classification rules of one HTTP front door (``crates/classify``; the broker
    runs the same code): the SDK's routes for one ``path_prefix`` and JSON-RPC endpoint,
    matched as Starlette matches them, the JSON-RPC body read as ``json.loads`` reads it, and
    the method rule (``gate_all``: ``gate_methods="all"``)."""

    def __new__(
        cls, path_prefix: str, jsonrpc_path: str | None, *, gate_all: bool, max_peek_bytes: int
    ) -> A2ARules: ...
    def kind(self, method: str, path: str, root_path: str) -> int:
        """0 passthrough, 1 read, 2 work, 3 the JSON-RPC endpoint: the strongest verdict of
        every layout the SDK builds."""
    def jsonrpc(self, body: bytes | bytearray, complete: bool) -> tuple[bool, str | int | None]:
        """``(gated, id)`` of a JSON-RPC request whose body starts with ``body``
        (``complete``: it ends there). A body that does not end within ``max_peek_bytes`` is
        gated, its ``id`` read from the prefix; ``id`` is what a refusal echoes: a str, an
        int of any size, or ``None``."""
    def tenant(self, method: str, path: str, root_path: str) -> str | None:
        """The tenant the SDK's router takes from the path (its ``Mount("/{tenant}", ...)``)
        in the layout that gives :meth:`kind`'s verdict; ``None`` off the tenant routes. The
        broker's ``--tenant-from path``."""

def _jsonrpc_request(body: bytes | bytearray) -> tuple[str | None, str | int | None] | None: ...
def _rejection_class() -> type[Exception]: ...
def _set_rejection_class(cls: type[Exception] | None) -> None: ...
def _reset_after_fork() -> None: ...
def _reset_fleet_after_fork() -> None: ...
def _fleet_runtime_running() -> bool: ...
def _invalidate_samplers() -> None: ...
def _quiesce_at_exit() -> None: ...
def _resolve_waiter(fut: Any) -> None: ...
def _panic_inside_gate(gate: AdmissionGate) -> None: ...
def _panic_in_next_wakes(count: int) -> None: ...
def _panic_in_next_broker() -> None:
    """Makes the next broker to start panic inside its own task (for admitgate's tests)."""

def _broker_main(argv: list[str]) -> int:
    """``python -m admitgate broker``: ``argv`` (the program name first) parsed as the
    ``admitgate-broker`` binary parses its own, then the broker run as :func:`serve_broker`
    runs it; returns the exit code (0 after the drain or ``--help``, 2 for a bad flag)."""

def serve_broker(
    *,
    upstream: str | None = None,
    listen: str | None = None,
    grpc_upstream: str | None = None,
    upstream_protocol: Literal["http1", "h2", "auto"] | None = None,
    max_in_flight: int | None = None,
    queue_depth: int | None = None,
    overflow_policy: Literal["reject", "queue", "shed_oldest"] | None = None,
    queue_timeout: float | None = None,
    max_in_flight_per_tenant: int | None = None,
    tenant_from: str | None = None,
    rate_limit: str | None = None,
    rate_key: str | None = None,
    gate_methods: Literal["work", "all"] | None = None,
    path_prefix: str | None = None,
    jsonrpc_path: str | None = None,
    max_peek_bytes: int | None = None,
    fleet: str | None = None,
    fleet_key: str | None = None,
    fleet_on_error: Literal["local", "reject"] | None = None,
    fleet_tls_ca_file: str | os.PathLike[str] | None = None,
    fleet_tls_cert_file: str | os.PathLike[str] | None = None,
    fleet_tls_key_file: str | os.PathLike[str] | None = None,
    fleet_durability: Literal["primary", "replicated"] | None = None,
    metrics_listen: str | None = None,
    drain_timeout: float | None = None,
    first_bytes_timeout: float | None = None,
    upstream_idle_timeout: float | None = None,
    upstream_max_idle: int | None = None,
    memory_soft_ratio: float | None = None,
    memory_hard_ratio: float | None = None,
    memory_cgroup: str | os.PathLike[str] | None = None,
    request_body_timeout: float | None = None,
    max_buffered_body: int | None = None,
    abandoned_response_timeout: float | None = None,
    send_timeout: float | None = None,
    threads: int | None = None,
    readiness_path: str | None = None,
    priority: Sequence[str] | None = None,
    default_priority: str | None = None,
    priority_from: str | None = None,
    fairness: Literal["tenant", "none"] | None = None,
    config: str | os.PathLike[str] | None = None,
) -> None:
    """Runs the broker in this process, in front of ``upstream``, until SIGTERM or SIGINT and
    its drain; blocks the calling thread with the GIL released (``admitgate.broker.serve``).

    Each keyword is the broker flag of that name with ``_`` for ``-`` (``--max-in-flight``
    is ``max_in_flight``; ``admitgate-broker --help`` describes them all); ``None`` leaves a
    setting to the YAML file named by ``config``, then to the default. Addresses are
    ``"IP:port"`` strings; port 0 picks a free port (the ``listening`` log line on stderr
    says which). ``priority`` is a list, one ``"NAME[:min=F][,max=F]"`` per ``--priority``
    (most important first).

    Returns ``None`` after a drain started by SIGTERM (when its handler was the default).
    A signal handler that raises (SIGINT's default raises ``KeyboardInterrupt``) starts the
    same drain, and its exception is raised once the drain is over; a second one during the
    drain cuts it short and is raised at once. Handlers are as they were when this returns.

    Raises ``TypeError``/``ValueError`` naming a bad argument and its value (the binary's
    messages; a ``fleet`` URL is never shown), ``OSError`` (with its errno) naming the
    address that cannot be bound, ``RuntimeError`` when called from a thread other than the
    main thread or while a broker already serves in this process, and
    :class:`InternalError` if the broker panics.
    """

def _simulate(scenario: dict[str, Any], candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs each candidate gate in the scenario in the overload simulator (virtual time)."""

def _standard_scenarios(phase_s: float, seed: int) -> list[dict[str, Any]]:
    """Issue 17's scenarios, as the dicts :func:`_simulate` takes."""
