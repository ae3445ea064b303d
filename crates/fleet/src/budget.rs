//! Budgets across the fleet: requests and tokens per identity per window, exact on Redis.
//!
//! A [`FleetBudget`] decides each admission with **one Lua call** (`lua/budget.lua`): it
//! prunes the identity's sliding logs, checks every limit and records the admission in all of
//! them atomically, by the server's clock (`TIME`). So the fleet admits at most `N` requests
//! per identity in any half-open interval of length `T`, however many replicas ask at once,
//! and a refusal carries the exact time at which the same admission fits. The keys of one
//! identity share the hash tag `{<name>:<identity hash>}` (one cluster slot) and expire a
//! window and a second (up to 1.5 s) after their newest entry, by the identity's clock. The identity is hashed (SHA-1, 128 bits shown) before it
//! leaves the process; note that a hash of a guessable identity (a user name) can be guessed
//! by whoever reads Redis.
//!
//! **Refusals answered locally.** A refusal's retry time is exact, and nothing admitted
//! elsewhere can make it earlier (only a refund can), so this replica answers the same
//! identity's next admissions (of at least the same cost) locally until then, without a round
//! trip: that is what makes a burst far above the limit cheap. A refund or cancel on this
//! replica clears the identity's cached refusal; one on another replica is seen here after the
//! cached retry time (the answer is then early-refusing, never over the limit).
//!
//! **The connection** is a [`FleetLimit`]'s: a budget built with one shares its connection and
//! its view of outages (a failure marks the backend down for both; the limit's probe detects
//! the recovery). A budget with its own URL builds a limit that only holds the connection.
//!
//! A fleet budget's limits are exact sliding windows; `burst=` (GCRA) is refused for one
//! (a local budget has it).
//!
//! **Outages** (`on_backend_error`), never blocking: a call is bounded as every fleet call is
//! (`connect_timeout + command_timeout`, at most `lease_ttl` for a slow but alive Redis), and
//! while the backend is down decisions make no round trip at all:
//! - `local` (the default): decide with this replica's local budget, which also holds every
//!   admission this replica made through the fleet (within the window). **Bound:** per identity
//!   per window, at most `R × N` across `R` replicas (each replica admits at most `N` counting
//!   its own fleet admissions; others' fleet admissions before the outage are not seen).
//! - `reject`: refuse ([`FleetError::Unavailable`], reason `fleet_unavailable`): never over.
//! - `allow`: admit without counting: no bound while Redis is down.
//!
//! A settle or cancel that finds Redis down applies to the local budget only; the fleet keeps
//! the estimate (and misses a debt) for that reservation.

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use admitgate_budget::{Budget, Decision, KeyHash, Limit, Meter, Reservation};
use redis::Script;

use crate::backend::Connection;
use crate::config::{validate_name, ConfigError};
use crate::error::FleetError;
use crate::limit::FleetLimit;

/// What a budget's decisions do while Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BudgetFallback {
    /// Decide with the replica's local budget: at most `R × N` per identity per window.
    Local,
    /// Refuse (`fleet_unavailable`): never over the limit.
    Reject,
    /// Admit without counting: no limit while Redis is down.
    Allow,
}

impl BudgetFallback {
    /// The name used in configuration and by the Python binding.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetFallback::Local => "local",
            BudgetFallback::Reject => "reject",
            BudgetFallback::Allow => "allow",
        }
    }
}

impl std::str::FromStr for BudgetFallback {
    type Err = ConfigError;

    fn from_str(value: &str) -> Result<Self, ConfigError> {
        match value {
            "local" => Ok(BudgetFallback::Local),
            "reject" => Ok(BudgetFallback::Reject),
            "allow" => Ok(BudgetFallback::Allow),
            _ => Err(ConfigError::new(
                "on_backend_error",
                format!("{value:?}"),
                "must be \"local\", \"reject\" or \"allow\"",
            )),
        }
    }
}

/// Where a decision was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decider {
    /// The fleet's Redis, in one call.
    Fleet,
    /// This replica: a refusal it already knew the retry time of.
    KnownRefusal,
    /// This replica's local budget (Redis down, `local`).
    Local,
    /// Nobody: Redis down, `allow`.
    Unchecked,
}

/// An admission's hold on the fleet budget: settle it with [`FleetBudget::settle`], give it
/// back with [`FleetBudget::cancel`]; dropped, it keeps its estimate.
#[derive(Debug)]
pub struct FleetReservation {
    key: KeyHash,
    tag: Arc<str>,
    id: Arc<str>,
    tokens: u64,
    mirror: Option<Reservation>,
    in_fleet: bool,
    decider: Decider,
    server_time: Option<Duration>,
}

impl FleetReservation {
    /// When Redis recorded it (the server's clock, since the Unix epoch); `None` if it was
    /// decided without Redis.
    pub fn server_time(&self) -> Option<Duration> {
        self.server_time
    }

    /// The token estimate it holds.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Who decided it.
    pub fn decider(&self) -> Decider {
        self.decider
    }
}

/// A refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// How long until the same admission fits (`None`: never, its cost is more than a whole
    /// window holds).
    pub retry_after: Option<Duration>,
    /// The index of the limit that refused (the one with the longest wait).
    pub limit: usize,
    /// Who decided it.
    pub decider: Decider,
    /// When Redis decided it (the server's clock); `None` if it was decided without Redis.
    pub server_time: Option<Duration>,
}

/// A fleet budget's decision.
#[derive(Debug)]
pub enum FleetDecision {
    /// Admitted.
    Allowed(FleetReservation),
    /// Refused.
    Limited(BudgetRefusal),
}

/// What a fleet budget has done (this replica's view; no per-identity numbers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetBudgetStats {
    /// Decisions made by Redis.
    pub fleet_decisions: u64,
    /// Refusals answered from a known retry time, without a round trip.
    pub known_refusals: u64,
    /// Decisions made while Redis was down (local budget, or refused/allowed unchecked).
    pub offline_decisions: u64,
    /// Settles and cancels that could not reach Redis.
    pub settles_lost: u64,
}

#[derive(Default)]
struct Counters {
    fleet_decisions: AtomicU64,
    known_refusals: AtomicU64,
    offline_decisions: AtomicU64,
    settles_lost: AtomicU64,
}

/// A refusal whose retry time is known: until when, the cost refused, and the limit.
#[derive(Clone, Copy)]
struct Known {
    until: Instant,
    cost: u64,
    limit: usize,
}

/// Refusals with a known retry time, per identity.
struct KnownRefusals {
    until: HashMap<KeyHash, Known>,
    sweep_at: usize,
}

/// Known refusals are swept of stale entries when they double past this.
const MIN_SWEEP: usize = 1024;

impl KnownRefusals {
    /// The wait left and the limit, if a refusal of at most `cost` is known for `key`.
    fn get(&self, key: KeyHash, cost: u64, now: Instant) -> Option<(Duration, usize)> {
        let known = self.until.get(&key)?;
        (now < known.until && cost >= known.cost)
            .then(|| (known.until.saturating_duration_since(now), known.limit))
    }

    fn insert(&mut self, key: KeyHash, known: Known, now: Instant) {
        if self.until.len() >= self.sweep_at {
            self.until.retain(|_, k| k.until > now);
            self.sweep_at = self.until.len().saturating_mul(2).max(MIN_SWEEP);
        }
        self.until.insert(key, known);
    }
}

/// Requests and tokens per identity per window, exact across the fleet (see the module docs).
#[derive(Clone)]
pub struct FleetBudget {
    inner: Arc<Inner>,
}

struct Inner {
    fleet: FleetLimit,
    name: String,
    limits: Vec<Limit>,
    local: Budget,
    fallback: BudgetFallback,
    script: Script,
    epoch: Instant,
    id_prefix: String,
    next_id: AtomicU64,
    known: Mutex<KnownRefusals>,
    counters: Counters,
}

impl fmt::Debug for FleetBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetBudget")
            .field("name", &self.inner.name)
            .field("limits", &self.inner.limits)
            .field("on_backend_error", &self.inner.fallback)
            .finish_non_exhaustive()
    }
}

/// The identity as Redis sees it: 128 bits of SHA-1, hex (the same on every replica).
fn identity_hash(identity: &[u8]) -> String {
    let digest = sha1_smol::Sha1::from(identity).digest().bytes();
    let mut hex = String::with_capacity(32);
    for byte in &digest[..16] {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

/// The hash tag of `identity`'s keys in the budget `name`: `{name:hash}`, so that every key
/// of one identity is in one cluster slot.
fn key_tag(name: &str, identity: &[u8]) -> Arc<str> {
    let mut tag = String::with_capacity(name.len().saturating_add(35));
    tag.push('{');
    tag.push_str(name);
    tag.push(':');
    tag.push_str(&identity_hash(identity));
    tag.push('}');
    Arc::from(tag)
}

/// One limit's key of an identity: `{tag}:{index}` (its log), with `:t` for its token log.
/// Written straight into a command (see [`FleetBudget::command`]).
struct LimitKey<'a> {
    tag: &'a str,
    index: usize,
    tokens: bool,
}

impl fmt::Display for LimitKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.tag, self.index)?;
        if self.tokens {
            f.write_str(":t")?;
        }
        Ok(())
    }
}

impl redis::ToRedisArgs for LimitKey<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        out.write_arg_fmt(self);
    }
}

impl FleetBudget {
    /// A budget of `limits` named `name` (its keys' namespace, so two services can share one
    /// Redis), on `fleet`'s connection. `local` is the replica's budget for outages (and its
    /// record of what it admitted); give it the same limits.
    pub fn new(
        fleet: &FleetLimit,
        name: &str,
        local: Budget,
        fallback: BudgetFallback,
    ) -> Result<Self, ConfigError> {
        validate_name(name)?;
        if let Some(limit) = local
            .limits()
            .iter()
            .find(|l| matches!(l.algorithm, admitgate_budget::Algorithm::Gcra { .. }))
        {
            return Err(ConfigError::new(
                "burst",
                format!("{:?} ({})", limit.algorithm, limit.rate),
                "a fleet budget decides exact sliding windows only; burst= (GCRA) is for a local budget",
            ));
        }
        let nonce = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), name);
        Ok(FleetBudget {
            inner: Arc::new(Inner {
                fleet: fleet.clone(),
                name: name.to_owned(),
                limits: local.limits().to_vec(),
                local,
                fallback,
                script: Script::new(include_str!("lua/budget.lua")),
                epoch: Instant::now(),
                id_prefix: format!("{}#{nonce:016x}#", fleet.config().replica_id),
                next_id: AtomicU64::new(0),
                known: Mutex::new(KnownRefusals {
                    until: HashMap::new(),
                    sweep_at: MIN_SWEEP,
                }),
                counters: Counters::default(),
            }),
        })
    }

    /// A budget with a connection of its own to `url` (see [`FleetBudget::new`]): a
    /// [`FleetLimit`] that holds only the connection and its outage probe.
    pub fn with_url(
        url: &str,
        name: &str,
        local: Budget,
        fallback: BudgetFallback,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, ConfigError> {
        validate_name(name)?;
        let config = crate::config::FleetConfig::new(url, format!("admitgate:budget:{name}"), 1);
        let fleet = FleetLimit::new(config, runtime)?;
        FleetBudget::new(&fleet, name, local, fallback)
    }

    /// The local budget (outages, and this replica's record).
    pub fn local(&self) -> &Budget {
        &self.inner.local
    }

    /// The limits, in order.
    pub fn limits(&self) -> &[Limit] {
        &self.inner.limits
    }

    /// The budget's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// What it does while Redis is down.
    pub fn on_backend_error(&self) -> BudgetFallback {
        self.inner.fallback
    }

    /// The connection's limit.
    pub fn fleet(&self) -> &FleetLimit {
        &self.inner.fleet
    }

    /// This replica's counters.
    pub fn stats(&self) -> FleetBudgetStats {
        let c = &self.inner.counters;
        FleetBudgetStats {
            fleet_decisions: c.fleet_decisions.load(Relaxed),
            known_refusals: c.known_refusals.load(Relaxed),
            offline_decisions: c.offline_decisions.load(Relaxed),
            settles_lost: c.settles_lost.load(Relaxed),
        }
    }

    fn now(&self) -> Duration {
        self.inner.epoch.elapsed()
    }

    /// The budget script's `EVALSHA`, built in one buffer: numbers and key names are written
    /// straight into the command (a decision is made at tens of thousands a second, and every
    /// separate allocation showed in the runtime thread's profile).
    fn command(&self, tag: &str, op: &str, id: &str, tokens: u64, debt: u64) -> redis::Cmd {
        let limits = self.inner.limits.len();
        let keys = limits.saturating_mul(2);
        // The sizes are hints (saturating: a capacity too small only means a reallocation).
        let args = limits.saturating_mul(3).saturating_add(5);
        let bytes = keys
            .saturating_mul(tag.len().saturating_add(8))
            .saturating_add(args.saturating_mul(12))
            .saturating_add(op.len())
            .saturating_add(id.len())
            .saturating_add(64);
        let mut cmd = redis::Cmd::with_capacity(keys.saturating_add(args).saturating_add(3), bytes);
        cmd.arg("EVALSHA")
            .arg(self.inner.script.get_hash())
            .arg(keys);
        for index in 0..limits {
            cmd.arg(LimitKey {
                tag,
                index,
                tokens: false,
            })
            .arg(LimitKey {
                tag,
                index,
                tokens: true,
            });
        }
        cmd.arg(op).arg(id).arg(tokens).arg(debt).arg(limits);
        for limit in &self.inner.limits {
            let window_us = u64::try_from(limit.rate.window().as_micros()).unwrap_or(u64::MAX);
            cmd.arg(match limit.meter {
                Meter::Requests => "r",
                Meter::Tokens => "t",
            })
            .arg(limit.rate.amount())
            .arg(window_us);
        }
        cmd
    }

    /// Sends `cmd` (the script's `EVALSHA`), loading the script first if this server has not
    /// seen it (`NOSCRIPT`: a restart, a failover, a new cluster node), as `redis::Script` does.
    async fn evalsha(&self, cmd: redis::Cmd, con: &mut Connection) -> redis::RedisResult<Vec<i64>> {
        match cmd.query_async(con).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.inner.script.load_async(con).await?;
                cmd.query_async(con).await
            }
            answer => answer,
        }
    }

    /// Decides one admission of `identity` costing `tokens`: one round trip to Redis, or none
    /// (a known refusal, or Redis down). `Err` only for `reject` while Redis is down.
    pub async fn reserve(&self, identity: &[u8], tokens: u64) -> Result<FleetDecision, FleetError> {
        if let Some(decided) = self.decide_now(identity, tokens) {
            return decided;
        }
        let inner = &self.inner;
        let key = inner.local.key(identity);
        let started = Instant::now();
        let backend = &inner.fleet.inner.backend;
        inner.fleet.inner.ensure_started();
        let tag = key_tag(&inner.name, identity);
        let n = inner.next_id.fetch_add(1, Relaxed);
        let id: Arc<str> = format!("{}{n}", inner.id_prefix).into();
        let reply = backend
            .call(|mut con| {
                let cmd = self.command(&tag, "reserve", &id, tokens, 0);
                async move { self.evalsha(cmd, &mut con).await }
            })
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(failure) => {
                inner.fleet.inner.backend_failed(failure);
                return self.offline(key, tokens);
            }
        };
        inner.counters.fleet_decisions.fetch_add(1, Relaxed);
        let us = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
        match reply.as_slice() {
            [1, now_us] => {
                let mirror = inner.local.record(key, tokens, self.now());
                Ok(FleetDecision::Allowed(FleetReservation {
                    key,
                    tag,
                    id,
                    tokens,
                    mirror: Some(mirror),
                    in_fleet: true,
                    decider: Decider::Fleet,
                    server_time: Some(us(*now_us)),
                }))
            }
            [0, retry_at_us, limit, now_us] => {
                let limit = usize::try_from(*limit).unwrap_or(0);
                let retry_after = u64::try_from(*retry_at_us).ok().map(|at| {
                    let us = at.saturating_sub(u64::try_from(*now_us).unwrap_or(0));
                    Duration::from_micros(us)
                });
                if let Some(wait) = retry_after {
                    // Measured from when the call was sent: the server decided after that, so
                    // the local deadline is never later than the server's.
                    if let Some(until) = started.checked_add(wait) {
                        inner
                            .known
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(
                                key,
                                Known {
                                    until,
                                    cost: tokens,
                                    limit,
                                },
                                started,
                            );
                    }
                }
                Ok(FleetDecision::Limited(BudgetRefusal {
                    retry_after,
                    limit,
                    decider: Decider::Fleet,
                    server_time: Some(us(*now_us)),
                }))
            }
            _ => {
                // A reply this version cannot read: treated as an outage of this call.
                Ok(self.offline(key, tokens)?)
            }
        }
    }

    /// The decision of [`FleetBudget::reserve`] when it needs no round trip (a refusal whose
    /// retry time is known, or Redis down), made here without awaiting anything; `None` when
    /// Redis must be asked. A caller on another runtime (an event loop) answers most of a
    /// burst far above the limit this way, without handing the call to the fleet's runtime.
    pub fn decide_now(
        &self,
        identity: &[u8],
        tokens: u64,
    ) -> Option<Result<FleetDecision, FleetError>> {
        let inner = &self.inner;
        let key = inner.local.key(identity);
        let known =
            inner
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(key, tokens, Instant::now());
        if let Some((wait, limit)) = known {
            inner.counters.known_refusals.fetch_add(1, Relaxed);
            return Some(Ok(FleetDecision::Limited(BudgetRefusal {
                retry_after: Some(wait),
                limit,
                decider: Decider::KnownRefusal,
                server_time: None,
            })));
        }
        if !inner.fleet.inner.backend.is_up() {
            return Some(self.offline(key, tokens));
        }
        None
    }

    fn offline(&self, key: KeyHash, tokens: u64) -> Result<FleetDecision, FleetError> {
        let inner = &self.inner;
        inner.counters.offline_decisions.fetch_add(1, Relaxed);
        let reservation = |mirror, decider| FleetReservation {
            key,
            tag: Arc::from(""),
            id: Arc::from(""),
            tokens,
            mirror,
            in_fleet: false,
            decider,
            server_time: None,
        };
        match inner.fallback {
            BudgetFallback::Reject => Err(FleetError::Unavailable),
            BudgetFallback::Allow => Ok(FleetDecision::Allowed(reservation(
                None,
                Decider::Unchecked,
            ))),
            BudgetFallback::Local => match inner.local.reserve(key, tokens, self.now()) {
                Decision::Allowed(r) => {
                    Ok(FleetDecision::Allowed(reservation(Some(r), Decider::Local)))
                }
                Decision::Limited(l) => Ok(FleetDecision::Limited(BudgetRefusal {
                    retry_after: l.retry_after(self.now()),
                    limit: l.limit,
                    decider: Decider::Local,
                    server_time: None,
                })),
            },
        }
    }

    fn forget_refusal(&self, key: KeyHash) {
        self.inner
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .until
            .remove(&key);
    }

    /// Settles a reservation to the tokens its turn used: a refund where the estimate was
    /// recorded, or a debt recorded now (by the server's clock) that delays the identity's
    /// next turns. One round trip when the reservation is in Redis and anything changes; the
    /// server's time of it, if it was sent and answered.
    pub async fn settle(&self, reservation: FleetReservation, used: u64) -> Option<Duration> {
        let inner = &self.inner;
        if let Some(mirror) = reservation.mirror {
            inner.local.settle(mirror, used, self.now());
        }
        let refund = reservation.tokens.saturating_sub(used);
        let debt = used.saturating_sub(reservation.tokens);
        if refund > 0 {
            self.forget_refusal(reservation.key);
        }
        if !reservation.in_fleet || (refund == 0 && debt == 0) || !inner.local.counts_tokens() {
            return None;
        }
        let keep = reservation.tokens.min(used);
        self.send(&reservation.tag, "settle", &reservation.id, keep, debt)
            .await
    }

    /// Gives a reservation back whole (its turn was refused or cancelled before it ran); the
    /// server's time of it, if it was sent and answered.
    pub async fn cancel(&self, reservation: FleetReservation) -> Option<Duration> {
        if let Some(mirror) = reservation.mirror {
            self.inner.local.cancel(mirror);
        }
        self.forget_refusal(reservation.key);
        if !reservation.in_fleet {
            return None;
        }
        self.send(&reservation.tag, "cancel", &reservation.id, 0, 0)
            .await
    }

    async fn send(
        &self,
        tag: &str,
        op: &str,
        id: &str,
        tokens: u64,
        debt: u64,
    ) -> Option<Duration> {
        let inner = &self.inner;
        let backend = &inner.fleet.inner.backend;
        if !backend.is_up() {
            inner.counters.settles_lost.fetch_add(1, Relaxed);
            return None;
        }
        let reply = backend
            .call(|mut con| {
                let cmd = self.command(tag, op, id, tokens, debt);
                async move { self.evalsha(cmd, &mut con).await }
            })
            .await;
        match reply {
            Ok(reply) => reply
                .first()
                .and_then(|us| u64::try_from(*us).ok())
                .map(Duration::from_micros),
            Err(failure) => {
                inner.counters.settles_lost.fetch_add(1, Relaxed);
                inner.fleet.inner.backend_failed(failure);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_fallbacks_are_checked() {
        assert!(validate_name("chat-api").is_ok());
        for bad in ["", "a{b", "a b", "x}"] {
            let e = validate_name(bad).unwrap_err();
            assert_eq!(e.field, "name");
        }
        let e = "later".parse::<BudgetFallback>().unwrap_err();
        assert!(e.to_string().contains("\"later\""), "{e}");
        assert_eq!("allow".parse::<BudgetFallback>(), Ok(BudgetFallback::Allow));
    }

    #[test]
    fn the_identity_hash_is_stable_and_hides_the_identity() {
        let h = identity_hash(b"sk-secret-key");
        assert_eq!(h.len(), 32);
        // The key names replicas of every version share: the first 32 hex digits of SHA-1.
        let full = sha1_smol::Sha1::from(b"sk-secret-key").digest().to_string();
        assert_eq!(h, full[..32]);
        assert_eq!(
            &*key_tag("chat", b"sk-secret-key"),
            format!("{{chat:{}}}", &full[..32])
        );
        let key = |index, tokens| {
            LimitKey {
                tag: "{chat:ab}",
                index,
                tokens,
            }
            .to_string()
        };
        assert_eq!(
            (key(0, false), key(1, true)),
            ("{chat:ab}:0".into(), "{chat:ab}:1:t".into())
        );
        assert_eq!(h, identity_hash(b"sk-secret-key"));
        assert!(!h.contains("secret"));
    }
}
