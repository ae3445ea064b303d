//! `admitgate._admitgate.WindowLockout`: the BotOS drop-ins' rate limiter (a window anchored at
//! a key's first request, then a lockout), decided in Rust: locally
//! ([`admitgate_budget::WindowLockout`]) or fleet-wide ([`admitgate_fleet::FleetWindowLockout`]).
//!
//! One object serves both of praisonai's shapes: `check(*, identity, scope, now)` (praisonai-
//! agents' `RateLimitPolicyProtocol`, answering its `RateLimitDecision`) and `allow(endpoint,
//! identity)` / `time_until_allowed` / `reset` / `prune` (praisonai-bot's `AuthRateLimiter`).
//! No Python runs per decision beyond building the decision object.
//!
//! # A fleet decision never blocks a running event loop for long
//!
//! Both shapes are synchronous, and BotOS calls them from its `async` handlers. A fleet decision
//! is one Lua call sent on admitgate's runtime thread; the caller waits for it with the GIL
//! released, for at most `max_block` when an event loop runs on the calling thread (the full
//! call bound otherwise). A reply later than that is still applied (a refusal it brings is
//! remembered), but this decision is made by the fallback (`on_backend_error`) and counted in
//! `late_decisions`.
//!
//! **A late call makes Redis suspect.** From the moment a call goes late until it answers or
//! fails, decisions on a loop do not wait for Redis at all: the fallback answers at once
//! (`suspect_decisions`). Without this, a frozen Redis made every decision wait its full
//! `max_block` until the connection was marked down (a call fails only after about
//! `2 × (connect_timeout + command_timeout)`, 6 s by default): thousands of 3 ms timer waits,
//! and on a VM the timer's wake-up jitter takes some of them past 5 ms. Now one decision per
//! outage waits. When Redis was only slow, the late call's answer ends the suspicion and the
//! next decision waits for Redis again. The suspicion is the connection's: every limiter on
//! one `FleetLimit` shares it. See [`LateCalls`] for how a reply that comes exactly as its
//! waiter gives up is counted once, never leaving the limiter suspecting for good.
//!
//! A thread with no running loop is not held to `max_block`: it is allowed to block, and it
//! waits for Redis even while Redis is suspect (the documented way to get the fleet's exact
//! answer from async code is `asyncio.to_thread`). A call it gives up on (past the whole call
//! bound) does make Redis suspect for the loops.
//!
//! Two things make most decisions need no round trip at all:
//!
//! - **A known refusal** is answered locally until the retry time Redis gave (measured from when
//!   the call was sent, so never later than the server's): nothing another replica does makes a
//!   refused key allowed earlier, except a reset (a reset on this replica forgets it; one on
//!   another replica is seen after the known time: early refusals, never over the limit).
//! - **A backend known to be down** is not called: decisions take the fallback until the
//!   connection's probe sees Redis again.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use admitgate_budget::{WindowLockout, WindowLockoutRule, WindowVerdict};
use admitgate_fleet::{FleetWindowLockout, FleetWindowVerdict};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::guard;
use super::fleet::{runtime_start, PyFleetLimit};
use super::runtime::running_loop;

/// What a fleet decision does when Redis cannot answer in time.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fallback {
    Local,
    Reject,
    Allow,
}

impl Fallback {
    fn name(self) -> &'static str {
        match self {
            Fallback::Local => "local",
            Fallback::Reject => "reject",
            Fallback::Allow => "allow",
        }
    }
}

/// Who made a decision (the fourth item of `decide()`'s answer).
#[derive(Clone, Copy)]
enum Decider {
    Local,
    Fleet,
    KnownRefusal,
    Fallback,
}

impl Decider {
    fn name(self) -> &'static str {
        match self {
            Decider::Local => "local",
            Decider::Fleet => "fleet",
            Decider::KnownRefusal => "known_refusal",
            Decider::Fallback => "fallback",
        }
    }
}

/// Refusals whose retry time is known, per local key hash.
#[derive(Default)]
struct Known {
    until: HashMap<u64, (Instant, f64)>,
    sweep_at: usize,
}

const MIN_KNOWN_SWEEP: usize = 1024;

/// The least time a known refusal must have left to be answered locally (see [`Known::get`]).
const KNOWN_MIN_LEFT: Duration = Duration::from_micros(2);

impl Known {
    /// `(seconds left, the server time it stands for)`, if a refusal is known for `key`.
    ///
    /// A refusal with less than [`KNOWN_MIN_LEFT`] to go is not answered here: the server
    /// time it stands for, in `f64` seconds since the epoch (a resolution of about 0.24 µs
    /// today), would round to the refusal's own end, a time at which the rule allows; Redis
    /// answers such a call exactly.
    fn get(&self, key: u64, now: Instant) -> Option<(f64, f64)> {
        let &(until, server_until) = self.until.get(&key)?;
        let left = until.saturating_duration_since(now);
        (left >= KNOWN_MIN_LEFT).then(|| {
            let left = left.as_secs_f64();
            (left, server_until - left)
        })
    }

    fn insert(&mut self, key: u64, until: Instant, server_until: f64, now: Instant) {
        if self.until.len() >= self.sweep_at.max(MIN_KNOWN_SWEEP) {
            self.until.retain(|_, (u, _)| *u > now);
            self.sweep_at = self.until.len().saturating_mul(2);
        }
        self.until.insert(key, (until, server_until));
    }
}

#[derive(Default)]
struct Counters {
    allowed: AtomicU64,
    limited: AtomicU64,
    fleet_decisions: AtomicU64,
    known_refusals: AtomicU64,
    offline_decisions: AtomicU64,
    late_decisions: AtomicU64,
    suspect_decisions: AtomicU64,
}

/// The calls on one connection that went late (their waiter gave up) and have not answered
/// or failed yet. While there is one, Redis is suspect: decisions on a loop do not wait.
///
/// Each call and its waiter share a state ([`CallState`]: waiting, late, settled) and settle
/// who counts it with one atomic step each, so that a reply that comes exactly as its waiter
/// times out is counted once or not at all, never left counted: a count stuck above 0 would
/// silently turn the limiter local for good.
///
/// - The waiter, timed out, counts the call late *first*, then moves it from waiting to late
///   (compare-exchange). If that fails, the call has settled meanwhile: the waiter takes its
///   count back and reads the reply that is there now.
/// - The call, when it answers or fails (or is dropped unfinished: a runtime shut down),
///   marks itself settled (swap); only if it was late does it take the count back.
///
/// Every increment is thus matched by exactly one decrement, and the count never goes below
/// 0 (the waiter's increment comes before the late state the call's decrement needs). In the
/// instant between the waiter's increment and its failed exchange, a decision elsewhere may
/// see the count at 1 and take the fallback: harmless, and as rare as the race itself.
#[derive(Default)]
struct LateCalls {
    outstanding: AtomicUsize,
}

impl LateCalls {
    fn suspect(&self) -> bool {
        self.outstanding.load(Ordering::Acquire) > 0
    }
}

/// Each connection's late calls, by its `FleetLimit`'s identity: every limiter on one
/// connection shares them (the gateway builds three on its `push.redis`). Their calls queue on
/// one multiplexed connection to one Redis, so one limiter's late call says the others' would
/// be late too, and a frozen Redis costs one wait per outage, not one per limiter.
///
/// An identity is an address, and is never reused while an entry is alive: a limiter holding
/// the `LateCalls` holds the connection too. Dead entries are dropped as new ones come.
static LATE_BY_CONNECTION: Mutex<Vec<(usize, Weak<LateCalls>)>> = Mutex::new(Vec::new());

fn late_calls_of(connection: usize) -> Arc<LateCalls> {
    let mut all = LATE_BY_CONNECTION.lock();
    all.retain(|(_, late)| late.strong_count() > 0);
    if let Some(late) = all
        .iter()
        .find(|(id, _)| *id == connection)
        .and_then(|(_, late)| late.upgrade())
    {
        return late;
    }
    let late = Arc::<LateCalls>::default();
    all.push((connection, Arc::downgrade(&late)));
    late
}

/// Where one call stands (see [`LateCalls`]).
struct CallState(AtomicU8);

const WAITING: u8 = 0;
const LATE: u8 = 1;
const SETTLED: u8 = 2;

/// Held by a call's task: marks the call settled when the task ends, or when it is dropped
/// unfinished, so that no path leaves a late call counted.
struct Settles {
    call: Arc<CallState>,
    late: Arc<LateCalls>,
}

impl Drop for Settles {
    fn drop(&mut self) {
        if self.call.0.swap(SETTLED, Ordering::AcqRel) == LATE {
            self.late.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What a bounded wait for one fleet call came to.
enum Asked<T> {
    Answered(T),
    /// Redis answered with an error, or the call could not be made.
    Failed,
    /// No answer within the bound: the call goes on, counted in [`LateCalls`].
    Late,
}

/// How long a caller may wait for Redis.
#[derive(Clone, Copy)]
struct WaitBound {
    wait: Duration,
    /// An event loop runs on the calling thread: the wait is `max_block`, and a suspect Redis
    /// is not waited for at all.
    on_loop: bool,
}

/// Sends `call` on admitgate's runtime and waits for its answer with the GIL released, at
/// most `wait`; a call not answered by then is counted in `late` until it settles.
fn ask<T: Send + 'static>(
    py: Python<'_>,
    late: &Arc<LateCalls>,
    wait: Duration,
    call: impl Future<Output = Option<T>> + Send + 'static,
) -> PyResult<Asked<T>> {
    let handle = runtime_start()?;
    let (tx, rx) = mpsc::sync_channel::<Option<T>>(1);
    let state = Arc::new(CallState(AtomicU8::new(WAITING)));
    let settles = Settles {
        call: state.clone(),
        late: late.clone(),
    };
    handle.spawn(async move {
        let reply = call.await;
        // Sent before the call is marked settled: a waiter that finds it settled finds the
        // reply in the channel.
        let _ = tx.send(reply);
        drop(settles);
    });
    let answered = |reply: Option<T>| match reply {
        Some(value) => Asked::Answered(value),
        None => Asked::Failed,
    };
    // The receiver is not `Sync`: moved into the detached wait and handed back.
    let (waited, rx) = py.detach(move || (rx.recv_timeout(wait), rx));
    match waited {
        Ok(reply) => Ok(answered(reply)),
        Err(mpsc::RecvTimeoutError::Disconnected) => Ok(Asked::Failed),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            late.outstanding.fetch_add(1, Ordering::AcqRel);
            if state
                .0
                .compare_exchange(WAITING, LATE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok(Asked::Late);
            }
            // It settled just as the wait ended: not late after all.
            late.outstanding.fetch_sub(1, Ordering::AcqRel);
            Ok(rx.try_recv().map_or(Asked::Failed, answered))
        }
    }
}

/// The rule on one `FleetLimit` connection, and that connection's late calls (shared with
/// every limiter on it: [`LATE_BY_CONNECTION`]).
struct Built {
    identity: usize,
    protocol: FleetWindowLockout,
    late: Arc<LateCalls>,
}

/// The fleet side: the rule on a `FleetLimit`'s connection, rebuilt when that limit is (a
/// forked child's, which starts with no late call: the parent's are not its own).
struct Fleet {
    limit: Py<PyFleetLimit>,
    name: String,
    built: Mutex<Option<Built>>,
    fallback: Fallback,
    max_block: Duration,
    known: Arc<Mutex<Known>>,
    counters: Counters,
}

impl Fleet {
    fn protocol(&self, rule: WindowLockoutRule) -> PyResult<(FleetWindowLockout, Arc<LateCalls>)> {
        let limit = self.limit.get().limit()?;
        let mut built = self.built.lock();
        match &*built {
            Some(b) if b.identity == limit.identity() => Ok((b.protocol.clone(), b.late.clone())),
            _ => {
                let protocol = FleetWindowLockout::new(&limit, &self.name, rule)
                    .map_err(|e| PyValueError::new_err(e.to_string()))?;
                let late = late_calls_of(limit.identity());
                *built = Some(Built {
                    identity: limit.identity(),
                    protocol: protocol.clone(),
                    late: late.clone(),
                });
                Ok((protocol, late))
            }
        }
    }

    /// How long to wait for Redis: `max_block` with an event loop running on this thread, the
    /// whole call bound otherwise.
    fn bound(&self, py: Python<'_>, fleet: &FleetWindowLockout) -> WaitBound {
        if running_loop(py).ok().flatten().is_some() {
            return WaitBound {
                wait: self.max_block,
                on_loop: true,
            };
        }
        let config = fleet.fleet().config();
        WaitBound {
            wait: config
                .connect_timeout
                .saturating_add(config.command_timeout)
                .saturating_add(Duration::from_millis(100)),
            on_loop: false,
        }
    }

    /// How many calls on this limiter's connection went late and are still unanswered (0
    /// before the first fleet call).
    fn late_outstanding(&self) -> usize {
        self.built
            .lock()
            .as_ref()
            .map_or(0, |b| b.late.outstanding.load(Ordering::Acquire))
    }
}

/// The rule over many keys, locally or fleet-wide (see the module docs).
#[pyclass(frozen, module = "admitgate._admitgate", name = "WindowLockout")]
pub struct PyWindowLockout {
    local: WindowLockout,
    fleet: Option<Fleet>,
    decision: Option<Py<PyAny>>,
    allowed: Option<Py<PyAny>>,
}

fn wall_clock() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn finite_now(now: Option<f64>) -> PyResult<f64> {
    match now {
        None => Ok(wall_clock()),
        Some(t) if t.is_finite() => Ok(t),
        Some(t) => {
            // As Python shows it.
            let shown = if t.is_nan() {
                "nan"
            } else if t > 0.0 {
                "inf"
            } else {
                "-inf"
            };
            Err(PyValueError::new_err(format!(
                "now must be a finite number of seconds, got {shown}"
            )))
        }
    }
}

/// A decision: allowed or the retry hint, the time it was made at, and who made it.
type Decided = (WindowVerdict, f64, Decider);

impl PyWindowLockout {
    fn fallback(&self, fleet: &Fleet, key: u64, now: f64) -> Decided {
        fleet.counters.offline_decisions.fetch_add(1, Relaxed);
        let verdict = match fleet.fallback {
            Fallback::Local => self.local.check(key, now),
            Fallback::Allow => WindowVerdict::Allowed,
            Fallback::Reject => WindowVerdict::Limited {
                retry_after: self.fleet_probe_interval(fleet).unwrap_or(1.0),
            },
        };
        (verdict, now, Decider::Fallback)
    }

    fn fleet_probe_interval(&self, fleet: &Fleet) -> Option<f64> {
        let built = fleet.built.lock();
        built
            .as_ref()
            .map(|b| b.protocol.fleet().config().probe_interval.as_secs_f64())
    }

    fn decide_inner(
        &self,
        py: Python<'_>,
        scope: &str,
        identity: &str,
        now: f64,
    ) -> PyResult<Decided> {
        let decided = self.decide_uncounted(py, scope, identity, now)?;
        if let Some(fleet) = &self.fleet {
            match decided.0 {
                WindowVerdict::Allowed => fleet.counters.allowed.fetch_add(1, Relaxed),
                WindowVerdict::Limited { .. } => fleet.counters.limited.fetch_add(1, Relaxed),
            };
        }
        Ok(decided)
    }

    fn decide_uncounted(
        &self,
        py: Python<'_>,
        scope: &str,
        identity: &str,
        now: f64,
    ) -> PyResult<Decided> {
        let key = self.local.key(scope, identity);
        let Some(fleet) = &self.fleet else {
            return Ok((self.local.check(key, now), now, Decider::Local));
        };
        if self.local.rule().max_requests() == 0 {
            return Ok((WindowVerdict::Allowed, now, Decider::Local));
        }
        let sent = Instant::now();
        if let Some((left, server_now)) = fleet.known.lock().get(key, sent) {
            fleet.counters.known_refusals.fetch_add(1, Relaxed);
            let verdict = WindowVerdict::Limited { retry_after: left };
            return Ok((verdict, server_now, Decider::KnownRefusal));
        }
        // A lockout earned here while Redis was away outlives its recovery, as the reference's.
        let local_wait = self.local.wait(key, now);
        if local_wait > 0.0 {
            fleet.counters.offline_decisions.fetch_add(1, Relaxed);
            let verdict = WindowVerdict::Limited {
                retry_after: local_wait,
            };
            return Ok((verdict, now, Decider::Fallback));
        }
        let (protocol, late) = fleet.protocol(*self.local.rule())?;
        if !protocol.is_up() {
            return Ok(self.fallback(fleet, key, now));
        }
        let bound = fleet.bound(py, &protocol);
        if bound.on_loop && late.suspect() {
            // An earlier call has not answered within its bound yet: this one would not
            // either (or only just), so the loop is not held at all.
            fleet.counters.suspect_decisions.fetch_add(1, Relaxed);
            return Ok(self.fallback(fleet, key, now));
        }
        let redis_key = protocol.key(scope, identity);
        let known = fleet.known.clone();
        let call = async move {
            let reply = protocol.check(&redis_key).await.ok();
            if let Some(FleetWindowVerdict {
                verdict: WindowVerdict::Limited { retry_after },
                decided_at,
            }) = reply
            {
                // Measured from when the call was sent: never later than the server's time.
                if let Some(until) = Duration::try_from_secs_f64(retry_after)
                    .ok()
                    .and_then(|d| sent.checked_add(d))
                {
                    known
                        .lock()
                        .insert(key, until, decided_at + retry_after, Instant::now());
                }
            }
            reply
        };
        match ask(py, &late, bound.wait, call)? {
            Asked::Answered(reply) => {
                fleet.counters.fleet_decisions.fetch_add(1, Relaxed);
                Ok((reply.verdict, reply.decided_at, Decider::Fleet))
            }
            Asked::Failed => Ok(self.fallback(fleet, key, now)),
            Asked::Late => {
                fleet.counters.late_decisions.fetch_add(1, Relaxed);
                Ok(self.fallback(fleet, key, now))
            }
        }
    }

    /// Runs `call` on the fleet for `scope`/`identity` within the bound; `None` if Redis did
    /// not answer in time (or is down).
    ///
    /// These calls (`time_until_allowed`'s wait, `reset`) share the decisions' suspect state:
    /// it is one connection to one Redis, and a loop must not wait 3 ms per call on a frozen
    /// Redis any more than per decision. While Redis is suspect, on a loop, a call that only
    /// reads (`sends_unwaited = false`) is not sent; one that writes (a reset) is sent but not
    /// waited for, so that it still reaches Redis if Redis was only slow.
    fn fleet_call<T: Send + 'static>(
        &self,
        py: Python<'_>,
        fleet: &Fleet,
        scope: &str,
        identity: &str,
        sends_unwaited: bool,
        call: impl FnOnce(
            FleetWindowLockout,
            String,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<T>> + Send>>,
    ) -> PyResult<Option<T>> {
        let (protocol, late) = fleet.protocol(*self.local.rule())?;
        if !protocol.is_up() {
            return Ok(None);
        }
        let bound = fleet.bound(py, &protocol);
        let mut wait = bound.wait;
        if bound.on_loop && late.suspect() {
            if !sends_unwaited {
                return Ok(None);
            }
            wait = Duration::ZERO;
        }
        let redis_key = protocol.key(scope, identity);
        Ok(match ask(py, &late, wait, call(protocol, redis_key))? {
            Asked::Answered(value) => Some(value),
            Asked::Failed | Asked::Late => None,
        })
    }

    fn decision_object(&self, py: Python<'_>, verdict: WindowVerdict) -> PyResult<Py<PyAny>> {
        let (Some(decision), Some(allowed)) = (&self.decision, &self.allowed) else {
            return Err(PyValueError::new_err(
                "check() needs the decision class: build this limiter with decision=RateLimitDecision",
            ));
        };
        match verdict {
            WindowVerdict::Allowed => Ok(allowed.clone_ref(py)),
            WindowVerdict::Limited { retry_after } => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("allowed", false)?;
                kwargs.set_item("retry_after_seconds", retry_after)?;
                Ok(decision.bind(py).call((), Some(&kwargs))?.unbind())
            }
        }
    }
}

#[pymethods]
impl PyWindowLockout {
    #[new]
    #[pyo3(signature = (
        max_requests, window_seconds, lockout_seconds, *, max_keys, decision=None, fleet=None,
        name="botos", on_backend_error="local", max_block_s=0.003
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_requests: u64,
        window_seconds: f64,
        lockout_seconds: f64,
        max_keys: usize,
        decision: Option<Py<PyAny>>,
        fleet: Option<Py<PyFleetLimit>>,
        name: &str,
        on_backend_error: &str,
        max_block_s: f64,
    ) -> PyResult<Self> {
        guard(|| {
            let err = |e: admitgate_budget::BudgetError| {
                PyValueError::new_err(format!(
                    "{} must be {}, got {}",
                    e.argument(),
                    e.reason().trim_start_matches("must be "),
                    e.value()
                ))
            };
            let rule = WindowLockoutRule::new(max_requests, window_seconds, lockout_seconds)
                .map_err(err)?;
            let local = WindowLockout::new(rule, max_keys).map_err(err)?;
            let fallback = match on_backend_error {
                "local" => Fallback::Local,
                "reject" => Fallback::Reject,
                "allow" => Fallback::Allow,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "on_backend_error must be 'local', 'reject' or 'allow', got {other:?}"
                    )))
                }
            };
            if !(max_block_s.is_finite() && (0.0..=1.0).contains(&max_block_s)) {
                return Err(PyValueError::new_err(format!(
                    "max_block_s must be a number of seconds from 0 to 1, got {max_block_s:?}"
                )));
            }
            let fleet = match fleet {
                None => None,
                Some(limit) => {
                    let fleet = Fleet {
                        limit,
                        name: name.to_owned(),
                        built: Mutex::new(None),
                        fallback,
                        max_block: Duration::from_secs_f64(max_block_s),
                        known: Arc::default(),
                        counters: Counters::default(),
                    };
                    if max_requests > 0 {
                        // Checks the name now, and builds on the limit's connection.
                        fleet.protocol(rule)?;
                    }
                    Some(fleet)
                }
            };
            let allowed = match &decision {
                None => None,
                Some(class) => {
                    let kwargs = PyDict::new(py);
                    kwargs.set_item("allowed", true)?;
                    Some(class.bind(py).call((), Some(&kwargs))?.unbind())
                }
            };
            Ok(PyWindowLockout {
                local,
                fleet,
                decision,
                allowed,
            })
        })
    }

    /// `RateLimitPolicyProtocol.check`: one request of `identity` in `scope` at `now`.
    #[pyo3(signature = (*, identity, scope, now))]
    fn check(&self, py: Python<'_>, identity: &str, scope: &str, now: f64) -> PyResult<Py<PyAny>> {
        guard(|| {
            let now = finite_now(Some(now))?;
            let (verdict, _, _) = self.decide_inner(py, scope, identity, now)?;
            self.decision_object(py, verdict)
        })
    }

    /// One request, counted: `(allowed, retry_after_seconds or None, decided_at, decider)`.
    #[pyo3(signature = (scope, identity, now=None))]
    fn decide(
        &self,
        py: Python<'_>,
        scope: &str,
        identity: &str,
        now: Option<f64>,
    ) -> PyResult<(bool, Option<f64>, f64, &'static str)> {
        guard(|| {
            let now = finite_now(now)?;
            let (verdict, at, decider) = self.decide_inner(py, scope, identity, now)?;
            Ok(match verdict {
                WindowVerdict::Allowed => (true, None, at, decider.name()),
                WindowVerdict::Limited { retry_after } => {
                    (false, Some(retry_after), at, decider.name())
                }
            })
        })
    }

    /// `AuthRateLimiter.allow`: whether a request of `identity` to `endpoint` may proceed
    /// (and count it).
    #[pyo3(signature = (endpoint, identity, now=None))]
    fn allow(
        &self,
        py: Python<'_>,
        endpoint: &str,
        identity: &str,
        now: Option<f64>,
    ) -> PyResult<bool> {
        guard(|| {
            let now = finite_now(now)?;
            let (verdict, _, _) = self.decide_inner(py, endpoint, identity, now)?;
            Ok(verdict == WindowVerdict::Allowed)
        })
    }

    /// `AuthRateLimiter.time_until_allowed`: seconds until the key is allowed (0.0 if now).
    #[pyo3(signature = (endpoint, identity, now=None))]
    fn time_until_allowed(
        &self,
        py: Python<'_>,
        endpoint: &str,
        identity: &str,
        now: Option<f64>,
    ) -> PyResult<f64> {
        guard(|| {
            let now = finite_now(now)?;
            let key = self.local.key(endpoint, identity);
            let local = self.local.wait(key, now);
            let Some(fleet) = &self.fleet else {
                return Ok(local);
            };
            if let Some((left, _)) = fleet.known.lock().get(key, Instant::now()) {
                return Ok(left.max(local));
            }
            if self.local.rule().max_requests() == 0 {
                return Ok(0.0);
            }
            let remote = self.fleet_call(py, fleet, endpoint, identity, false, |p, k| {
                Box::pin(async move { p.wait(&k).await.ok().map(|(wait, _)| wait) })
            })?;
            Ok(remote.unwrap_or(0.0).max(local))
        })
    }

    /// `AuthRateLimiter.reset`: forgets the key (here and, with a fleet, fleet-wide).
    fn reset(&self, py: Python<'_>, endpoint: &str, identity: &str) -> PyResult<()> {
        guard(|| {
            let key = self.local.key(endpoint, identity);
            self.local.reset(key);
            if let Some(fleet) = &self.fleet {
                fleet.known.lock().until.remove(&key);
                if self.local.rule().max_requests() > 0 {
                    self.fleet_call(py, fleet, endpoint, identity, true, |p, k| {
                        Box::pin(async move { p.reset(&k).await.ok() })
                    })?;
                }
            }
            Ok(())
        })
    }

    /// `AuthRateLimiter.prune`: forgets every idle key held here now; how many.
    #[pyo3(signature = (now=None))]
    fn prune(&self, now: Option<f64>) -> PyResult<u64> {
        guard(|| Ok(self.local.reclaim(finite_now(now)?)))
    }

    /// Requests allowed per window (0: limiting is off).
    #[getter]
    fn max_requests(&self) -> u64 {
        self.local.rule().max_requests()
    }

    /// The window, in seconds.
    #[getter]
    fn window_seconds(&self) -> f64 {
        self.local.rule().window_seconds()
    }

    /// The lockout, in seconds.
    #[getter]
    fn lockout_seconds(&self) -> f64 {
        self.local.rule().lockout_seconds()
    }

    /// Whether limiting is on (`max_requests > 0`).
    #[getter]
    fn enabled(&self) -> bool {
        self.local.rule().max_requests() > 0
    }

    /// Whether decisions are made fleet-wide.
    #[getter]
    fn fleet_wide(&self) -> bool {
        self.fleet.is_some()
    }

    /// The counters (no per-key numbers).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let s = self.local.stats();
            let d = PyDict::new(py);
            d.set_item("allowed", s.allowed)?;
            d.set_item("limited", s.limited)?;
            d.set_item("refused_at_capacity", s.refused_at_capacity)?;
            d.set_item("keys", s.keys)?;
            d.set_item("reclaimed", s.reclaimed)?;
            if let Some(fleet) = &self.fleet {
                let c = &fleet.counters;
                // Every decision, wherever it was made (the local counters above hold only
                // the fallback's).
                d.set_item("allowed", c.allowed.load(Relaxed))?;
                d.set_item("limited", c.limited.load(Relaxed))?;
                d.set_item("fleet_decisions", c.fleet_decisions.load(Relaxed))?;
                d.set_item("known_refusals", c.known_refusals.load(Relaxed))?;
                d.set_item("offline_decisions", c.offline_decisions.load(Relaxed))?;
                d.set_item("late_decisions", c.late_decisions.load(Relaxed))?;
                d.set_item("suspect_decisions", c.suspect_decisions.load(Relaxed))?;
                d.set_item("late_outstanding", fleet.late_outstanding())?;
                d.set_item("on_backend_error", fleet.fallback.name())?;
            }
            Ok(d)
        })
    }

    fn __repr__(&self) -> String {
        let rule = self.local.rule();
        format!(
            "WindowLockout(max_requests={}, window_seconds={:?}, lockout_seconds={:?}, fleet_wide={})",
            rule.max_requests(),
            rule.window_seconds(),
            rule.lockout_seconds(),
            if self.fleet.is_some() { "True" } else { "False" }
        )
    }
}
