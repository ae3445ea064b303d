//! [`FleetLimit`], the handle a replica uses, and the state its tasks share.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::backend::{Backend, Failure};
use crate::classes::FleetClasses;
use crate::config::{ConfigError, FleetConfig, OnBackendError};
use crate::error::FleetError;
use crate::events::{log_events, EventHandler, FleetEvent};
use crate::lease::Lease;
use crate::registry::{Grant, Registry, Removed};
use crate::scripts::{Caps, ClaimRequest, Claimed, FleetStatus, Keys, Learned, Proposal, Scripts};
use crate::stats::{Counters, FleetStats};
use crate::{heartbeat, subscriber};

/// One fleet-wide limit, shared by every replica configured with the same `key` on the same
/// Redis. Cheap to clone (all clones are the same limit); every method may be called from any
/// thread, and the futures are `Send + 'static`-friendly (clone the limit into them).
///
/// Background work (the heartbeat and the pub/sub listener) starts on the given runtime with the
/// first acquisition (or [`connect`](FleetLimit::connect)), and stops when the last clone and
/// the last lease are dropped, or at [`shutdown`](FleetLimit::shutdown).
#[derive(Clone)]
pub struct FleetLimit {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Default)]
struct Tasks {
    started: bool,
    heartbeat: Option<AbortHandle>,
    subscriber: Option<AbortHandle>,
}

pub(crate) struct Inner {
    pub(crate) config: FleetConfig,
    pub(crate) backend: Backend,
    pub(crate) scripts: Scripts,
    registry: Mutex<Registry>,
    pub(crate) counters: Counters,
    pub(crate) handle: Handle,
    events: RwLock<EventHandler>,
    id_prefix: String,
    next_id: AtomicU64,
    tasks: Mutex<Tasks>,
    /// Beat (or probe) at once.
    pub(crate) beat_now: Arc<Notify>,
    /// The heartbeat's period may have changed (a turn started waiting): re-plan without beating.
    pub(crate) replan: Arc<Notify>,
    closed: AtomicBool,
    /// The fleet refused this replica's class configuration (logged once).
    conflict_logged: AtomicBool,
}

/// How long a grant waits for its replica to claim it before the room goes back to the fleet:
/// one `command_timeout` (the claim is one call, which a live replica makes as soon as the
/// grant's pub/sub message arrives, or its next re-check finds the grant).
pub(crate) fn claim_window(config: &FleetConfig) -> Duration {
    config.command_timeout
}

/// How long after its last call a replica's tickets may still get room: two of its re-checks
/// while it waits, and a call's bound, at most `lease_ttl`. A dead or paused replica's tickets
/// stop getting room after this, or as soon as one grant to it goes unclaimed.
pub(crate) fn presence(config: &FleetConfig) -> Duration {
    let beat = config
        .effective_heartbeat_interval()
        .min(config.recheck_interval);
    beat.saturating_mul(2)
        .saturating_add(config.command_timeout)
        .min(config.lease_ttl)
}

impl FleetLimit {
    /// Validates `config` and prepares the limit; touches no network and starts no task yet.
    /// `runtime` is where its tasks will run (admitgate's own runtime in the Python binding); it
    /// needs its time and I/O drivers (`enable_all`), without which tokio panics on first use.
    pub fn new(config: FleetConfig, runtime: Handle) -> Result<Self, ConfigError> {
        config.validate()?;
        let backend = Backend::new(&config, runtime.clone())?;
        // All validated (at most an hour); saturating rather than truncating all the same.
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let caps = Caps {
            cap: config.max_in_flight,
            slice: config.max_in_flight_per_scope,
            ttl_ms: ms(config.lease_ttl),
            claim_ms: ms(claim_window(&config)),
            presence_ms: ms(presence(&config)),
        };
        // Lease ids: replica id, a random per-instance nonce (pods restart with the same host
        // name and pid 1), and a counter.
        let nonce = RandomState::new().build_hasher().finish();
        let instance = format!("{}#{:016x}", config.replica_id, nonce);
        let id_prefix = format!("{instance}#");
        let scripts = Scripts::new(Keys::new(&config.key), caps, instance);
        Ok(FleetLimit {
            inner: Arc::new(Inner {
                config,
                backend,
                scripts,
                registry: Mutex::new(Registry::default()),
                counters: Counters::default(),
                handle: runtime,
                events: RwLock::new(log_events()),
                id_prefix,
                next_id: AtomicU64::new(0),
                tasks: Mutex::new(Tasks::default()),
                beat_now: Arc::new(Notify::new()),
                replan: Arc::new(Notify::new()),
                closed: AtomicBool::new(false),
                conflict_logged: AtomicBool::new(false),
            }),
        })
    }

    /// Routes [`FleetEvent`]s (outages, recoveries, lost leases) to `handler` instead of the
    /// `log` crate.
    pub fn set_event_handler(&self, handler: EventHandler) {
        *self.inner.events.write().unwrap_or_else(|e| e.into_inner()) = handler;
    }

    /// The validated configuration.
    pub fn config(&self) -> &FleetConfig {
        &self.inner.config
    }

    /// Starts the background tasks and checks that Redis answers (one bounded round trip).
    /// Optional: acquisitions connect by themselves, and an unreachable Redis at start-up is
    /// just an outage.
    pub async fn connect(&self) -> Result<(), FleetError> {
        self.inner.ensure_started();
        let reply = self
            .inner
            .backend
            .call(|mut con| async move { redis::cmd("PING").query_async::<String>(&mut con).await })
            .await;
        match reply {
            Ok(_) => Ok(()),
            Err(failure) => {
                let message = failure.0.clone();
                self.inner.backend_failed(failure);
                Err(FleetError::Backend(message))
            }
        }
    }

    /// Waits for a lease for a turn of `scope`, in fleet-wide FIFO order. `scope` is the tenant
    /// (admitgate's `session_id`); "" counts against the fleet cap only, never a slice.
    ///
    /// One round trip when there is room. Otherwise the turn holds a ticket until a release
    /// anywhere in the fleet hands it a lease (pushed over pub/sub, re-checked every
    /// `recheck_interval`). Dropping the future withdraws the ticket, and gives back a lease
    /// granted at that moment. While Redis is down it decides without a round trip: a local
    /// lease (`on_backend_error = local`) or [`FleetError::Unavailable`] (`reject`).
    pub async fn acquire(&self, scope: &str) -> Result<Lease, FleetError> {
        self.acquire_in(scope, None).await
    }

    /// [`acquire`](Self::acquire) for a turn of priority class `class` (a position in the
    /// classes given to [`set_classes`](Self::set_classes), most important first; `None` or
    /// one past the last: the default class). With fair queuing, `scope` is the tenant.
    pub async fn acquire_in(&self, scope: &str, class: Option<usize>) -> Result<Lease, FleetError> {
        // A waiting take never comes back empty (a closed limit is an error).
        self.inner
            .take(scope, class, true)
            .await?
            .ok_or(FleetError::Closed)
    }

    /// A lease for `scope` if one is free now (one round trip), else `None`; never queues.
    pub async fn try_acquire(&self, scope: &str) -> Result<Option<Lease>, FleetError> {
        self.inner.take(scope, None, false).await
    }

    /// [`try_acquire`](Self::try_acquire) for a turn of priority class `class`.
    pub async fn try_acquire_in(
        &self,
        scope: &str,
        class: Option<usize>,
    ) -> Result<Option<Lease>, FleetError> {
        self.inner.take(scope, class, false).await
    }

    /// Orders this replica's tickets by `classes` (see the `classes` module: every replica of
    /// the fleet must configure the same, or it is refused). Set once, before the first turn:
    /// a limit that has classes, or holds or waits for leases, keeps what it has, and another
    /// configuration is refused (setting the same again is fine).
    pub fn set_classes(&self, classes: FleetClasses) -> Result<(), ConfigError> {
        let inner = &self.inner;
        let current = inner.scripts.classes();
        if *current == classes {
            return Ok(());
        }
        let registry = inner.registry();
        if current.is_classed() || registry.held() > 0 || registry.waiting() > 0 {
            return Err(ConfigError {
                field: "priorities",
                value: classes.identity().to_owned(),
                reason: format!(
                    "this fleet limit orders its leases by other classes already ({}); give \
                     each gate with other classes its own FleetLimit",
                    current.identity()
                ),
            });
        }
        inner.scripts.set_classes(classes);
        Ok(())
    }

    /// The classes this replica's tickets are ordered by.
    pub fn classes(&self) -> Arc<FleetClasses> {
        self.inner.scripts.classes()
    }

    /// A snapshot of the counters, without a round trip.
    pub fn stats(&self) -> FleetStats {
        let inner = &self.inner;
        let mut stats = FleetStats {
            max_in_flight: inner.config.max_in_flight,
            max_in_flight_per_scope: inner.config.max_in_flight_per_scope,
            backend_up: inner.backend.is_up(),
            outages: inner.backend.outages(),
            failovers: inner.backend.failovers(),
            unconfirmed: inner.backend.unconfirmed(),
            topology: inner.backend.kind().as_str(),
            ..FleetStats::default()
        };
        inner.counters.fill(&mut stats);
        let registry = inner.registry();
        stats.held = u64::try_from(registry.held()).unwrap_or(u64::MAX);
        stats.waiting = u64::try_from(registry.waiting()).unwrap_or(u64::MAX);
        stats
    }

    /// Whether Redis answered the last call.
    pub fn backend_up(&self) -> bool {
        self.inner.backend.is_up()
    }

    /// The newest fleet-wide reading, without a round trip: leases held and tickets waiting
    /// across the fleet, and the learned limit (see [`FleetLearner`](crate::FleetLearner)).
    pub fn fleet_reading(&self) -> (u64, u64, Option<Learned>) {
        match self.inner.counters.newest() {
            Some(s) => (s.in_flight, s.waiting, s.learned),
            None => (0, 0, None),
        }
    }

    /// Applies `proposal` to the fleet's learned limit (one round trip; see `lua/learn.lua`)
    /// and returns it as it is now. While Redis is down: [`FleetError::Unavailable`], nothing
    /// sent (the learned limit waits for Redis like every other change).
    pub async fn learn(&self, proposal: Proposal) -> Result<Option<Learned>, FleetError> {
        let inner = &self.inner;
        if inner.is_closed() {
            return Err(FleetError::Closed);
        }
        if !inner.backend.is_up() {
            return Err(FleetError::Unavailable);
        }
        let reply = inner
            .backend
            .call(|mut con| async move { inner.scripts.learn(&mut con, &proposal).await })
            .await;
        match reply {
            Ok(status) => {
                inner.observe(status);
                Ok(status.learned)
            }
            Err(failure) => {
                let message = failure.0.clone();
                inner.backend_failed(failure);
                Err(FleetError::Backend(message))
            }
        }
    }

    /// Tells this protocol object from another (a forked child's rebuilt one) while both live.
    pub fn identity(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// The runtime the limit's calls run on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.inner.handle
    }

    /// Gives back every lease and withdraws every ticket of this replica (bounded round trips),
    /// ends all waits with [`FleetError::Closed`] and stops the background tasks. Leases still
    /// held by callers become inert.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        inner.closed.store(true, Ordering::Release);
        let owed = inner.registry().close();
        inner.stop_tasks();
        if inner.backend.is_up() && !owed.is_empty() {
            let releases = owed.iter().map(|(id, scope)| {
                inner.backend.call_unconfirmed(move |mut con| async move {
                    inner.scripts.release(&mut con, id, scope).await
                })
            });
            let replies = futures_util::future::join_all(releases).await;
            for (status, _) in replies.into_iter().flatten() {
                inner.observe(status);
            }
        }
    }
}

impl std::fmt::Debug for FleetLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetLimit")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Inner {
    pub(crate) fn registry(&self) -> MutexGuard<'_, Registry> {
        // The registry's invariants hold between statements, so a panic elsewhere leaves it usable.
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// A fresh lease or ticket id, carrying its class (the scripts read it after the last ':').
    pub(crate) fn next_id(&self, class: Option<usize>) -> Arc<str> {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        match class {
            None => Arc::from(format!("{}{n}", self.id_prefix)),
            Some(c) => Arc::from(format!("{}{n}:{c}", self.id_prefix)),
        }
    }

    /// The fleet refused this replica's classes: logged once, and the error to return.
    pub(crate) fn class_conflict(&self) -> FleetError {
        let ours = self.scripts.classes().identity().to_owned();
        if !self.conflict_logged.swap(true, Ordering::AcqRel) {
            self.emit(FleetEvent::ClassConflict {
                key: self.config.key.clone(),
                classes: ours.clone(),
            });
        }
        FleetError::Conflict(ours)
    }

    pub(crate) fn observe(&self, status: FleetStatus) {
        self.counters.observe(status);
    }

    /// Calls the event handler, with no lock held. A handler that panics loses that one event
    /// (the panic hook has reported it) instead of ending the task that called it: the
    /// heartbeat, whose end would let every lease of this replica expire.
    pub(crate) fn emit(&self, event: FleetEvent) {
        let handler = self
            .events
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(&event)));
    }

    /// Starts the heartbeat and the pub/sub listener, once.
    pub(crate) fn ensure_started(self: &Arc<Self>) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if tasks.started || self.is_closed() {
            return;
        }
        tasks.started = true;
        let weak = Arc::downgrade(self);
        tasks.heartbeat = Some(
            self.handle
                .spawn(heartbeat::run(
                    weak,
                    self.beat_now.clone(),
                    self.replan.clone(),
                ))
                .abort_handle(),
        );
        tasks.subscriber = Some(self.spawn_subscriber());
    }

    fn spawn_subscriber(self: &Arc<Self>) -> AbortHandle {
        self.handle
            .spawn(subscriber::run(Arc::downgrade(self)))
            .abort_handle()
    }

    /// A fresh pub/sub listener (after an outage the old connection may be a dead socket).
    pub(crate) fn restart_subscriber(self: &Arc<Self>) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if !tasks.started || self.is_closed() {
            return;
        }
        if let Some(old) = tasks.subscriber.take() {
            old.abort();
        }
        tasks.subscriber = Some(self.spawn_subscriber());
    }

    fn stop_tasks(&self) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        for task in [tasks.heartbeat.take(), tasks.subscriber.take()]
            .into_iter()
            .flatten()
        {
            task.abort();
        }
    }

    /// A call failed: the first failure of an outage warns once, ends every wait as
    /// `on_backend_error` says, and starts the recovery probe.
    pub(crate) fn backend_failed(&self, failure: Failure) {
        if self.backend.mark_down() {
            self.emit(FleetEvent::BackendDown {
                url: self.config.redacted_url(),
                error: failure.0,
                on_backend_error: self.config.on_backend_error,
            });
            self.registry()
                .end_waits_offline(self.config.on_backend_error, None);
            self.beat_now.notify_one();
        }
    }

    /// The decision without Redis: a local lease (`local`) or `Unavailable` (`reject`).
    pub(crate) fn offline_lease(
        self: &Arc<Self>,
        scope: Arc<str>,
        position: Option<usize>,
    ) -> Result<Lease, FleetError> {
        match self.config.on_backend_error {
            OnBackendError::Local => Ok(self.local_lease(scope, position)),
            OnBackendError::Reject => Err(FleetError::Unavailable),
        }
    }

    /// A lease that exists only here until Redis returns and the heartbeat registers it.
    /// `position`: its class, when the fleet has classes.
    pub(crate) fn local_lease(self: &Arc<Self>, scope: Arc<str>, position: Option<usize>) -> Lease {
        let id = self.next_id(position);
        self.registry().insert_held(id.clone(), scope.clone());
        Lease::new(self.clone(), id, scope)
    }

    /// Stops tracking `id` and gives it back to Redis (lease or ticket, whichever it is); while
    /// Redis is down the release is owed and sent when it returns.
    pub(crate) async fn give_back(&self, id: Arc<str>, scope: Arc<str>) {
        if self.registry().remove(&id) == Removed::Nothing {
            return;
        }
        self.send_release(id, scope).await;
    }

    /// Sends a release for an id this replica no longer tracks.
    pub(crate) async fn send_release(&self, id: Arc<str>, scope: Arc<str>) {
        if self.is_closed() && !self.backend.is_up() {
            return;
        }
        if !self.backend.is_up() {
            self.registry().owe(id, scope);
            return;
        }
        let reply = self
            .backend
            .call_unconfirmed(|mut con| {
                let (id, scope) = (&id, &scope);
                async move { self.scripts.release(&mut con, id, scope).await }
            })
            .await;
        match reply {
            Ok((status, _)) => self.observe(status),
            Err(failure) => {
                self.registry().owe(id, scope);
                self.backend_failed(failure);
            }
        }
    }

    /// Claims grants published for this replica's waiting turns; a turn starts only on a claimed
    /// grant. A grant that expired first (this replica was paused past its claim window) is
    /// counted in `lease_lost` and its turn waits again with its place in line.
    pub(crate) async fn claim_grants(self: &Arc<Self>, claims: Vec<ClaimRequest>) {
        if !self.backend.is_up() {
            // The outage ended these waits already, or the recovery heartbeat settles them.
            return;
        }
        let reply = self
            .backend
            .call(|con| {
                let calls = claims.chunks(crate::scripts::HEARTBEAT_CHUNK).map(|chunk| {
                    let mut con = con.clone();
                    async move { self.scripts.claim(&mut con, chunk).await }
                });
                futures_util::future::try_join_all(calls)
            })
            .await;
        let replies = match reply {
            Ok(replies) => replies,
            Err(failure) => {
                self.backend_failed(failure);
                return;
            }
        };
        let mut owed = Vec::new();
        {
            let mut registry = self.registry();
            if let Some((status, _)) = replies.last() {
                self.observe(*status);
            }
            let results = replies.iter().flat_map(|(_, results)| results.iter());
            for (claim, result) in claims.iter().zip(results) {
                let lost = matches!(result, Claimed::Expired | Claimed::ExpiredRegranted);
                if lost && registry.contains(&claim.id) {
                    self.counters.lease_lost.fetch_add(1, Ordering::Relaxed);
                }
                let tracked = match result {
                    Claimed::Lease | Claimed::ExpiredRegranted => {
                        registry.grant(&claim.id, Grant::Fleet)
                    }
                    Claimed::Waiting | Claimed::Expired => {
                        registry.unannounce(&claim.id);
                        registry.contains(&claim.id)
                    }
                };
                if !tracked {
                    // The wait was withdrawn meanwhile and its withdrawal reached Redis first:
                    // this claim (or re-queue) put it back. Give it back again.
                    owed.push(claim.clone());
                }
            }
        }
        for claim in owed {
            self.send_release(claim.id, claim.scope).await;
        }
    }

    /// [`give_back`](Self::give_back) from a destructor: runs on the limit's runtime.
    pub(crate) fn spawn_give_back(self: &Arc<Self>, id: Arc<str>, scope: Arc<str>) {
        let inner = self.clone();
        // A runtime that was shut down drops the task: the lease then expires after its TTL.
        self.handle
            .spawn(async move { inner.give_back(id, scope).await });
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop_tasks();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_static<T: Send + 'static>(_: &T) {}

    /// The binding hands these futures to pyo3-async-runtimes, which needs `Send + 'static`.
    #[test]
    fn futures_are_send_and_static_with_a_cloned_limit() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let limit = FleetLimit::new(
            FleetConfig::new("redis://127.0.0.1:1/0", "send-check", 1),
            runtime.handle().clone(),
        )
        .unwrap();
        let l = limit.clone();
        let acquire = async move { l.acquire("t").await };
        assert_send_static(&acquire);
        let l = limit.clone();
        let try_acquire = async move { l.try_acquire("t").await };
        assert_send_static(&try_acquire);
        let l = limit.clone();
        let reclaim = async move { l.reclaim("t").await };
        assert_send_static(&reclaim);
        let l = limit.clone();
        let lend = async move {
            let lease = l.acquire("t").await.unwrap();
            l.lend(lease).await;
            l.shutdown().await;
        };
        assert_send_static(&lend);
        let l = limit.clone();
        let connect = async move { l.connect().await };
        assert_send_static(&connect);
        // Nothing was started: building a limit touches no network and spawns nothing.
        assert!(!limit.inner.tasks.lock().unwrap().started);
        assert!(
            limit.backend_up(),
            "unknown counts as up until a call fails"
        );
    }
}
