//! One turn's budget step: the rate limits (`rate_limit=`, `--rate-limit`) a turn passes
//! **before** its local slot and its fleet lease, so a turn the budget refuses never takes
//! either.
//!
//! # Design
//!
//! A [`RateLimiter`] is one named budget (requests and tokens per identity per window) decided
//! locally ([`admitgate_budget::Budget`], no I/O) or across the fleet
//! ([`admitgate_fleet::FleetBudget`], one Lua call), with what a refused turn does
//! ([`OnLimit`]). A turn passes every limiter of its gate ([`RateLimits`]) in order; an
//! identity is given per limiter (each may key turns its own way).
//!
//! [`BudgetTurn`] is the step, as a state machine that never waits and never reads a clock
//! (as [`Turn`](crate::Turn) is): [`BudgetTurn::step`] decides every local limiter at once and
//! hands back what the driver must do next ([`BudgetNext`]): nothing more (admitted, holding a
//! [`BudgetHolds`]), ask a fleet budget ([`FleetAsk`], one round trip, answered with
//! [`BudgetTurn::answered`]), sleep until a time and step again (`on_limit = "wait"`), or
//! answer the refusal ([`Refused`]). Every driver (the broker's tokio [`reserve`], the Python
//! binding's asyncio coroutine and its blocking `admit_sync`) only sleeps and awaits; the rules
//! are here, once:
//!
//! * A limiter that refuses gives back what the turn reserved in the limiters before it
//!   (cancelled), so a refused turn counts in no budget.
//! * `on_limit = "reject"` refuses with reason `rate_limited` and the **exact** retry time
//!   (when the same turn fits, if nothing else is admitted for that identity first); a cost
//!   that can never fit (more than a whole window of a token limit) is refused with no retry
//!   time.
//! * `on_limit = "wait"` sleeps until that time and decides again from the first limiter, as
//!   long as the time is within the turn's wait bound (its queue timeout, its deadline,
//!   whichever ends first); a retry time past it is refused at once (`rate_limited`, with the
//!   exact retry time), never waited out for nothing.
//! * A fleet budget whose Redis is down decides as its `on_backend_error` says; `reject`
//!   refuses with `fleet_unavailable`.
//! * A [`BudgetTurn`] dropped before it was admitted (its caller left) gives back what it
//!   holds; [`BudgetHolds`] given to a turn that was then refused or cancelled before it ran
//!   are given back with [`BudgetHolds::cancel`]; a turn that ran keeps its estimate unless it
//!   reports its usage ([`BudgetHolds::settle`]).
//!
//! A fleet budget's settle and cancel are round trips: they run as tasks on the fleet limit's
//! runtime, never blocking their caller.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_budget::{Budget, BudgetStats, Decision, Limit, Reservation};
use admitgate_fleet::{FleetBudget, FleetBudgetStats, FleetDecision, FleetError, FleetReservation};

use crate::core_api::Rejection;
use crate::Refused;

/// What a turn the budget refuses does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OnLimit {
    /// Refused at once (`rate_limited`), with the exact retry time.
    Reject,
    /// Waits until the budget allows it, within its queue timeout or deadline.
    Wait,
}

impl OnLimit {
    /// The name used in configuration (`"reject"`, `"wait"`).
    pub fn as_str(self) -> &'static str {
        match self {
            OnLimit::Reject => "reject",
            OnLimit::Wait => "wait",
        }
    }
}

impl std::str::FromStr for OnLimit {
    type Err = String;

    /// `"reject"` or `"wait"`; the error says what was given.
    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "reject" => Ok(OnLimit::Reject),
            "wait" => Ok(OnLimit::Wait),
            _ => Err(format!(
                "on_limit={value:?}: must be \"reject\" or \"wait\""
            )),
        }
    }
}

/// Where a limiter's decisions are made.
pub enum BudgetBackend {
    /// In this process, no I/O.
    Local(Box<Budget>),
    /// Across the fleet, on Redis (its local budget decides during outages, as configured).
    Fleet(FleetBudget),
}

/// What a limiter has done since it was built, as its front ends show it (no per-identity
/// numbers).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RateLimitStats {
    /// Turns it allowed.
    pub allowed: u64,
    /// Turns it refused (`rate_limited`), after any wait.
    pub limited: u64,
    /// Turns that waited for it (`on_limit = "wait"`), whatever came of the wait.
    pub waited: u64,
    /// Turns refused because its Redis was down and `on_backend_error` is `reject`.
    pub unavailable: u64,
    /// Token estimates reserved by the turns it allowed.
    pub tokens_reserved: u64,
    /// Reservations settled to a reported usage.
    pub settled: u64,
    /// Tokens those settlements reported as used.
    pub tokens_settled: u64,
    /// Reservations given back whole (the turn was refused by a later limiter or the gate, or
    /// cancelled, before it ran).
    pub returned: u64,
    /// Tokens those reservations held.
    pub tokens_returned: u64,
    /// Identities held in memory now (the local budget's; for a fleet budget, the replica's
    /// record of what it admitted).
    pub keys: u64,
    /// The fleet budget's own counters (`None` for a local budget).
    pub fleet: Option<FleetBudgetStats>,
}

#[derive(Default)]
struct Counters {
    allowed: AtomicU64,
    limited: AtomicU64,
    waited: AtomicU64,
    unavailable: AtomicU64,
    tokens_reserved: AtomicU64,
    settled: AtomicU64,
    tokens_settled: AtomicU64,
    returned: AtomicU64,
    tokens_returned: AtomicU64,
}

fn bump(cell: &AtomicU64, by: u64) {
    cell.fetch_add(by, Relaxed);
}

/// One named budget and what a turn it refuses does.
pub struct RateLimiter {
    name: Arc<str>,
    backend: BudgetBackend,
    on_limit: OnLimit,
    /// The local budget's clock origin.
    epoch: Instant,
    counters: Counters,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("name", &self.name)
            .field("limits", &self.limits())
            .field("fleet", &matches!(self.backend, BudgetBackend::Fleet(_)))
            .field("on_limit", &self.on_limit)
            .finish_non_exhaustive()
    }
}

impl RateLimiter {
    /// A limiter named `name` deciding with `backend`.
    pub fn new(name: &str, backend: BudgetBackend, on_limit: OnLimit) -> Self {
        RateLimiter {
            name: Arc::from(name),
            backend,
            on_limit,
            epoch: Instant::now(),
            counters: Counters::default(),
        }
    }

    /// Its name (the namespace of its keys; the label of its metrics).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What a refused turn does.
    pub fn on_limit(&self) -> OnLimit {
        self.on_limit
    }

    /// Where it decides.
    pub fn backend(&self) -> &BudgetBackend {
        &self.backend
    }

    /// Its limits, in order.
    pub fn limits(&self) -> &[Limit] {
        match &self.backend {
            BudgetBackend::Local(budget) => budget.limits(),
            BudgetBackend::Fleet(budget) => budget.limits(),
        }
    }

    /// Whether any of its limits counts tokens.
    pub fn counts_tokens(&self) -> bool {
        self.limits()
            .iter()
            .any(|l| l.meter == admitgate_budget::Meter::Tokens)
    }

    fn local_budget(&self) -> &Budget {
        match &self.backend {
            BudgetBackend::Local(budget) => budget,
            BudgetBackend::Fleet(budget) => budget.local(),
        }
    }

    /// Its counters.
    pub fn stats(&self) -> RateLimitStats {
        let c = &self.counters;
        let local: BudgetStats = self.local_budget().stats();
        RateLimitStats {
            allowed: c.allowed.load(Relaxed),
            limited: c.limited.load(Relaxed),
            waited: c.waited.load(Relaxed),
            unavailable: c.unavailable.load(Relaxed),
            tokens_reserved: c.tokens_reserved.load(Relaxed),
            settled: c.settled.load(Relaxed),
            tokens_settled: c.tokens_settled.load(Relaxed),
            returned: c.returned.load(Relaxed),
            tokens_returned: c.tokens_returned.load(Relaxed),
            keys: local.keys,
            fleet: match &self.backend {
                BudgetBackend::Local(_) => None,
                BudgetBackend::Fleet(budget) => Some(budget.stats()),
            },
        }
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn allowed(&self, tokens: u64) {
        bump(&self.counters.allowed, 1);
        bump(&self.counters.tokens_reserved, tokens);
    }

    fn give_back(&self, hold: Hold) {
        bump(&self.counters.returned, 1);
        bump(&self.counters.tokens_returned, hold.tokens());
        match hold {
            Hold::Local(reservation) => self.local_budget().cancel(reservation),
            Hold::Fleet(reservation) => {
                if let BudgetBackend::Fleet(budget) = &self.backend {
                    let budget = budget.clone();
                    spawn_on(&budget.clone(), async move {
                        budget.cancel(reservation).await;
                    });
                }
            }
        }
    }

    fn settle(&self, hold: Hold, used: u64) {
        bump(&self.counters.settled, 1);
        bump(&self.counters.tokens_settled, used);
        match hold {
            Hold::Local(reservation) => {
                self.local_budget().settle(reservation, used, self.now());
            }
            Hold::Fleet(reservation) => {
                if let BudgetBackend::Fleet(budget) = &self.backend {
                    let budget = budget.clone();
                    spawn_on(&budget.clone(), async move {
                        budget.settle(reservation, used).await;
                    });
                }
            }
        }
    }
}

/// Runs a fleet budget's settle or cancel on its limit's runtime (a runtime shut down drops
/// it: the fleet then keeps the estimate, never more).
fn spawn_on(budget: &FleetBudget, task: impl std::future::Future<Output = ()> + Send + 'static) {
    drop(budget.fleet().runtime().spawn(task));
}

/// A gate's rate limits, passed in order by every turn.
#[derive(Clone, Debug, Default)]
pub struct RateLimits(Arc<[Arc<RateLimiter>]>);

impl RateLimits {
    /// The limiters, passed in this order.
    pub fn new(limiters: Vec<Arc<RateLimiter>>) -> Self {
        RateLimits(limiters.into())
    }

    /// The limiters.
    pub fn limiters(&self) -> &[Arc<RateLimiter>] {
        &self.0
    }

    /// Whether there are none (turns skip the step).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One limiter's hold on its budget for one turn.
#[derive(Debug)]
enum Hold {
    Local(Reservation),
    Fleet(FleetReservation),
}

impl Hold {
    fn tokens(&self) -> u64 {
        match self {
            Hold::Local(r) => r.tokens(),
            Hold::Fleet(r) => r.tokens(),
        }
    }
}

/// What a turn admitted by its budgets holds in them: settle it when the turn reports its
/// usage, cancel it if the turn never ran. Dropped, every estimate stays spent.
#[must_use = "cancel the holds of a turn that did not run; drop them to keep the estimates"]
#[derive(Debug, Default)]
pub struct BudgetHolds {
    holds: Vec<(Arc<RateLimiter>, Hold)>,
}

impl BudgetHolds {
    /// Whether it holds nothing (no limiter, or it was settled or cancelled).
    pub fn is_empty(&self) -> bool {
        self.holds.is_empty()
    }

    /// When Redis recorded the turn in the first fleet-wide budget that did (its clock, since
    /// the Unix epoch): the one clock every replica's admissions share, for checking a
    /// fleet's exactness. `None` when no fleet budget decided it on Redis.
    pub fn server_time(&self) -> Option<Duration> {
        self.holds.iter().find_map(|(_, hold)| match hold {
            Hold::Fleet(r) => r.server_time(),
            Hold::Local(_) => None,
        })
    }

    /// The turn used `tokens`: each limiter refunds the difference from its estimate, or
    /// records the excess as a debt that delays the identity's next turns.
    pub fn settle(self, tokens: u64) {
        for (limiter, hold) in self.holds {
            limiter.settle(hold, tokens);
        }
    }

    /// The turn never ran (refused by the gate, cancelled while it waited): everything is
    /// given back, its request and its tokens.
    pub fn cancel(self) {
        for (limiter, hold) in self.holds {
            limiter.give_back(hold);
        }
    }
}

/// One fleet budget's decision to make: a round trip the driver awaits ([`FleetAsk::run`]),
/// then hands to [`BudgetTurn::answered`].
pub struct FleetAsk {
    budget: FleetBudget,
    identity: Arc<[u8]>,
    tokens: u64,
}

/// A fleet budget's answer, to hand to [`BudgetTurn::answered`]. An admission in it that is
/// dropped unanswered (its driver was cancelled) is given back.
pub struct FleetAnswer {
    budget: FleetBudget,
    result: Option<Result<FleetDecision, FleetError>>,
}

impl Drop for FleetAnswer {
    fn drop(&mut self) {
        if let Some(Ok(FleetDecision::Allowed(reservation))) = self.result.take() {
            let budget = self.budget.clone();
            spawn_on(&self.budget, async move {
                budget.cancel(reservation).await;
            });
        }
    }
}

impl FleetAsk {
    /// The round trip (or none: a refusal already known, Redis down). Runs on the fleet
    /// limit's runtime.
    pub async fn run(self) -> FleetAnswer {
        let result = self.budget.reserve(&self.identity, self.tokens).await;
        FleetAnswer {
            budget: self.budget,
            result: Some(result),
        }
    }

    /// The runtime the round trip must run on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.budget.fleet().runtime()
    }
}

/// What the driver of a [`BudgetTurn`] does next.
pub enum BudgetNext {
    /// Every limiter allowed the turn: take its holds ([`BudgetTurn::admitted`]) and go on
    /// to the slot.
    Admitted,
    /// Ask a fleet budget, then [`BudgetTurn::answered`].
    Ask(FleetAsk),
    /// Sleep until this time, then [`BudgetTurn::step`] again (`on_limit = "wait"`).
    WaitUntil(Instant),
    /// The turn is refused: `rate_limited` (exact retry time) or `fleet_unavailable`.
    Refused(Refused),
}

/// One turn's way through its rate limits (see the module docs).
pub struct BudgetTurn {
    limits: RateLimits,
    /// One identity per limiter.
    identities: Vec<Arc<[u8]>>,
    tokens: u64,
    /// The holds of the limiters passed so far, in order.
    held: Vec<(Arc<RateLimiter>, Hold)>,
    /// When the turn's wait ends (queue timeout or deadline), if it does.
    wait_until: Option<Instant>,
    /// Limiters the turn has waited for (counted once each).
    waited: Vec<bool>,
    done: bool,
}

impl BudgetTurn {
    /// The step of a turn costing `tokens`, keyed `identities[i]` under `limits[i]` (the
    /// last identity serves any limiter past the list), whose wait ends at `wait_until`.
    pub fn new(
        limits: RateLimits,
        identities: Vec<Arc<[u8]>>,
        tokens: u64,
        wait_until: Option<Instant>,
    ) -> Self {
        let n = limits.0.len();
        BudgetTurn {
            limits,
            identities,
            tokens,
            held: Vec::with_capacity(n),
            wait_until,
            waited: vec![false; n],
            done: false,
        }
    }

    /// [`BudgetTurn::new`] with one identity for every limiter.
    pub fn with_identity(
        limits: RateLimits,
        identity: &[u8],
        tokens: u64,
        wait_until: Option<Instant>,
    ) -> Self {
        Self::new(limits, vec![Arc::from(identity)], tokens, wait_until)
    }

    fn identity(&self, i: usize) -> Arc<[u8]> {
        self.identities
            .get(i)
            .or_else(|| self.identities.last())
            .cloned()
            .unwrap_or_else(|| Arc::from(&b""[..]))
    }

    /// Decides the limiters not yet passed, from the next one on, at `now`: every local one
    /// at once; a fleet one is handed to the driver.
    pub fn step(&mut self, now: Instant) -> BudgetNext {
        if self.done {
            return BudgetNext::Admitted;
        }
        loop {
            let i = self.held.len();
            let Some(limiter) = self.limits.0.get(i).cloned() else {
                self.done = true;
                return BudgetNext::Admitted;
            };
            let identity = self.identity(i);
            match &limiter.backend {
                BudgetBackend::Fleet(budget) => {
                    // A known refusal, or Redis down: decided here, with no round trip.
                    if let Some(result) = budget.decide_now(&identity, self.tokens) {
                        let answer = FleetAnswer {
                            budget: budget.clone(),
                            result: Some(result),
                        };
                        match self.fleet_answer(answer, now) {
                            Some(next) => return next,
                            None => continue,
                        }
                    }
                    return BudgetNext::Ask(FleetAsk {
                        budget: budget.clone(),
                        identity,
                        tokens: self.tokens,
                    });
                }
                BudgetBackend::Local(budget) => {
                    let key = budget.key(&identity);
                    match budget.reserve(key, self.tokens, limiter.now()) {
                        Decision::Allowed(reservation) => {
                            limiter.allowed(self.tokens);
                            self.held.push((limiter, Hold::Local(reservation)));
                        }
                        Decision::Limited(limited) => {
                            let retry = limited.retry_after(limiter.now());
                            if let Some(next) = self.limited(i, limited.limit, retry, now) {
                                return next;
                            }
                        }
                    }
                }
            }
        }
    }

    /// The fleet budget asked last answered (at `now`): goes on from there.
    pub fn answered(&mut self, answer: FleetAnswer, now: Instant) -> BudgetNext {
        match self.fleet_answer(answer, now) {
            Some(next) => next,
            None => self.step(now),
        }
    }

    /// Takes the fleet's answer for the next limiter: what next, or `None` to go on stepping.
    fn fleet_answer(&mut self, mut answer: FleetAnswer, now: Instant) -> Option<BudgetNext> {
        let i = self.held.len();
        let limiter = self.limits.0.get(i).cloned()?;
        match answer.result.take() {
            Some(Ok(FleetDecision::Allowed(reservation))) => {
                limiter.allowed(self.tokens);
                self.held.push((limiter, Hold::Fleet(reservation)));
                None
            }
            Some(Ok(FleetDecision::Limited(refusal))) => {
                self.limited(i, refusal.limit, refusal.retry_after, now)
            }
            Some(Err(_)) | None => {
                bump(&limiter.counters.unavailable, 1);
                self.give_back_all();
                self.done = true;
                let retry = match &limiter.backend {
                    BudgetBackend::Fleet(budget) => Some(budget.fleet().config().probe_interval),
                    BudgetBackend::Local(_) => None,
                };
                Some(BudgetNext::Refused(Refused {
                    reason: Rejection::FleetUnavailable,
                    retry_after: retry,
                    by: None,
                }))
            }
        }
    }

    /// Limiter `i` refused (its limit `limit`), with the wait until the same turn fits
    /// (`None`: never): what next (`None`: decide again at once, from the first limiter).
    fn limited(
        &mut self,
        i: usize,
        limit: usize,
        retry: Option<Duration>,
        now: Instant,
    ) -> Option<BudgetNext> {
        self.give_back_all();
        let limiter = self.limits.0.get(i).cloned()?;
        let refuse = |this: &mut Self| {
            bump(&limiter.counters.limited, 1);
            this.done = true;
            Some(BudgetNext::Refused(Refused {
                reason: Rejection::RateLimited,
                retry_after: retry,
                by: Some(crate::RefusedBy { limiter: i, limit }),
            }))
        };
        if limiter.on_limit == OnLimit::Reject {
            return refuse(self);
        }
        let Some(at) = retry.and_then(|wait| now.checked_add(wait)) else {
            return refuse(self);
        };
        if self.wait_until.is_some_and(|until| at > until) {
            return refuse(self);
        }
        if let Some(waited) = self.waited.get_mut(i) {
            if !*waited {
                *waited = true;
                bump(&limiter.counters.waited, 1);
            }
        }
        if at <= now {
            return None;
        }
        Some(BudgetNext::WaitUntil(at))
    }

    fn give_back_all(&mut self) {
        for (limiter, hold) in self.held.drain(..) {
            limiter.give_back(hold);
        }
    }

    /// The holds of an admitted turn (empty before [`BudgetNext::Admitted`]).
    pub fn admitted(mut self) -> BudgetHolds {
        if !self.done {
            return BudgetHolds::default();
        }
        BudgetHolds {
            holds: std::mem::take(&mut self.held),
        }
    }
}

impl Drop for BudgetTurn {
    fn drop(&mut self) {
        // Dropped before it was admitted (its caller left): nothing counts.
        self.give_back_all();
    }
}

/// The tokio driver of a [`BudgetTurn`] (the broker's): the holds, or the refusal. Dropping
/// the future gives back what it holds.
pub async fn reserve(mut turn: BudgetTurn) -> Result<BudgetHolds, Refused> {
    let mut next = turn.step(Instant::now());
    loop {
        next = match next {
            BudgetNext::Admitted => return Ok(turn.admitted()),
            BudgetNext::Refused(refused) => return Err(refused),
            BudgetNext::Ask(ask) => {
                let answer = ask.run().await;
                turn.answered(answer, Instant::now())
            }
            BudgetNext::WaitUntil(at) => {
                tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
                turn.step(Instant::now())
            }
        };
    }
}

#[cfg(test)]
mod tests;
