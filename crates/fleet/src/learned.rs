//! One learned limit for a whole fleet: admitgate's adaptive ceiling ([`CapacitySearch`]) with
//! its value kept in Redis, moved by every replica's signals and honoured by every lease.
//!
//! # Why one limit
//!
//! With a fleet and `adaptive=` each replica could learn its own ceiling, the fleet cap
//! bounding their sum. Then N replicas each probe the provider (N times the probing 429s),
//! each finds only its own share by trial and error, and a 429 seen by one tells the others
//! nothing, so a provider whose capacity halves is overrun by N − 1 replicas that did not
//! hear. The provider's capacity is one number; the fleet learns one number.
//!
//! # The design
//!
//! **The value lives in Redis**, in `{key}:learned` (limit, generation, time of the last change
//! by the server's clock), beside the lease keys and in their slot. Every lease script reads it
//! and grants at most `min(max_in_flight, learned)` leases; absent, only the caps count, exactly
//! as before. So the limit is enforced where the fleet cap is, atomically with it, whatever the
//! replicas believe.
//!
//! **The controller runs in Rust, in every replica**, on fleet-wide inputs: the turns in flight
//! across the fleet (the holder count every script reply carries; the reading taken when the
//! turn started, its own lease included) and the fleet's waiting tickets. It is the same
//! [`CapacitySearch`] a single gate runs, not a second implementation: a 429 is a measurement
//! (the refused call started with `fleet in-flight − 1` others running, so the limit drops at
//! once to that), latency inflation takes a tenth, growth needs the limit to have been reached.
//!
//! **Redis only composes proposals** (`lua/learn.lua`, a dozen lines). A replica whose
//! controller moved proposes the new value: a **lower** one is taken at once, whatever anyone
//! else did meanwhile (two measurements compose as their minimum, in any order, so a throttle
//! anywhere lowers the fleet within one round trip); a **higher** one is a compare-and-set on
//! the generation the replica last saw, and needs a round trip (the proposer's smoothed one)
//! to have passed since the last change by the server's clock. So the fleet grows at most one
//! step per round trip however many replicas see room, and a raise based on a stale value
//! (someone throttled meanwhile) is refused. Every reply carries the value and generation, and
//! every replica's controller [follows](CapacitySearch::follow) the newest one it reads: a
//! value lowered elsewhere is taken as its own throttle (no slow start again, hold this
//! window), a raise elsewhere or a refused proposal simply replaces its own.
//!
//! Why not run the transition on state read from Redis (read, step, compare-and-set): a
//! controller sees every turn start and end, so that would be a round trip per turn, and its
//! window state (round trips, medians) would have to round-trip as well. Proposals happen only
//! when the limit moves: a few per second at most, none in a steady state between probes.
//!
//! # Cost
//!
//! No round trip is added to a turn: the value arrives with the replies a turn gets anyway
//! (its acquire and release). A change costs one call, sent from the runtime, not the turn.
//! One raise is in flight at a time per replica; lowers are sent at once (a lower below one
//! still in flight waits for it).
//!
//! # Outages, restarts, fork
//!
//! * **Redis down:** the fleet's `on_backend_error` applies as it does to every lease. No
//!   proposal is sent; the replica's controller goes on learning from its own turns, and its
//!   local ceiling (the gate's) follows it, but never grows: with `local`, a replica admits at
//!   most its last learned value (the fleet's, the last it read), lowered further by its own
//!   429s, never more than `max_concurrent_runs`: the fleet admits at most N times the last
//!   learned limit, not N times the configured ceiling. With `reject` nothing runs without a
//!   lease.
//! * **`Retry-After`:** a hold is the provider's, so it holds fleet-wide: the replica that saw
//!   it sends it with its next proposal (a lower, which may change nothing else), and Redis
//!   keeps its end beside the value (`hold_us`, the server's clock); no raise is taken from any
//!   replica until it has passed.
//! * **A replica that has read no value** (started while Redis was down, or before its first
//!   call) uses `initial_limit` as its local ceiling.
//! * **Redis restarted without persistence:** the value is gone, so the caps alone count until
//!   the next turn of any adaptive replica seeds it again with that replica's current value (one
//!   call); its generation starts from the server's clock, above every one before. The lease
//!   scripts never let the fleet exceed `max_in_flight` meanwhile.
//! * **Never above `max_in_flight`:** the script bounds every proposal to `[min_limit,
//!   max_in_flight]` (the proposer's), and the lease scripts take the smaller of the caller's
//!   cap and the learned value.
//! * **Fork:** the controller reaches the limit only through `source`, which yields the current
//!   process's protocol object (the binding returns none in a forked child until it rebuilt
//!   its own), so a child never sends on its parent's runtime. The controller's state is locked
//!   only by the gate's calls (threads attached to the interpreter, as `os.fork()`'s caller is,
//!   so never held across a fork); a reply, handled on a runtime thread, only bumps an atomic.
//!   Proposals the parent had in flight are forgotten by the child: it sees another protocol
//!   object.
//! * **Close:** once the limit is shut down, proposals fail as `Closed` and are dropped.
//! * **Idle:** the value expires an hour after the last heartbeat or change of any replica.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use admitgate_core::overload::{
    CapacitySearch, CapacitySearchConfig, LimitController, Outcome, Sample,
};

use crate::limit::FleetLimit;
use crate::scripts::{Change, Learned, Proposal};

/// A proposal unanswered for this long is taken as lost (a call is bounded well below it:
/// at most `lease_ttl`, a minute at most), so a lost reply cannot stop the learning.
const ANSWER_WITHIN: Duration = Duration::from_secs(60);

/// Yields this process's fleet limit, if it has one it may use now.
pub type LimitSource = Arc<dyn Fn() -> Option<FleetLimit> + Send + Sync>;

/// The fleet-wide adaptive ceiling: a [`LimitController`] for a replica's gate whose value is
/// the fleet's (see the module documentation). Clones share one controller.
#[derive(Clone)]
pub struct FleetLearner {
    shared: Arc<Shared>,
}

struct Shared {
    /// Locked only by the gate's calls, never by a runtime thread (see "Fork" above).
    state: Mutex<State>,
    source: LimitSource,
    config: CapacitySearchConfig,
    /// Proposals answered (or failed), of each kind: a reply only bumps these.
    grows_answered: AtomicU64,
    lowers_answered: AtomicU64,
}

/// One kind of proposal in flight (seed/raise, or lower): at most one of each at a time.
#[derive(Clone, Copy, Debug, Default)]
struct InFlight {
    sent: u64,
    /// When the last was sent (the gate's clock), and its value.
    at: Duration,
    limit: u64,
}

impl InFlight {
    fn pending(&self, answered: &AtomicU64, now: Duration) -> bool {
        self.sent != answered.load(Ordering::Acquire) && now.saturating_sub(self.at) < ANSWER_WITHIN
    }
}

struct State {
    search: CapacitySearch,
    /// The fleet's value as last read (`None`: none read, or Redis forgot it).
    seen: Option<Learned>,
    grow: InFlight,
    lower: InFlight,
    /// The controller came down on its own input (a throttle, inflation) and has not
    /// proposed it yet: no reading of a higher value undoes that.
    measured: bool,
    /// The protocol object the proposals in flight went to (its address): another one (a
    /// forked child's) has none of them.
    sent_via: usize,
    /// The in-flight figure the turn that just started reported to the controller (the
    /// fleet's): the gate hands it to that turn ([`LimitController::start_figure`]), which
    /// gives it back in its sample. Nothing is kept per turn.
    start_figure: u64,
    /// During a Redis outage: the most this replica's ceiling may be (the last fleet value it
    /// read, or `initial_limit`, lowered by its own throttles since). `None` while Redis answers.
    outage_cap: Option<u64>,
    /// A provider's `Retry-After` seen here and not yet proposed to the fleet.
    hold: Duration,
}

/// What a replica read from the fleet when a turn started or ended.
#[derive(Clone, Copy)]
struct Reading {
    up: bool,
    in_flight: u64,
    waiting: u64,
    /// `Some(None)`: Redis reported no learned value.
    learned: Option<Option<Learned>>,
}

impl FleetLearner {
    /// A learner with `config`'s bounds (its `max_limit` the fleet's `max_in_flight`), that
    /// reaches its fleet limit through `source`.
    pub fn new(config: CapacitySearchConfig, source: LimitSource) -> Self {
        let search = CapacitySearch::new(config);
        let config = search.config();
        FleetLearner {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    search,
                    seen: None,
                    grow: InFlight::default(),
                    lower: InFlight::default(),
                    measured: false,
                    sent_via: 0,
                    start_figure: 0,
                    outage_cap: None,
                    hold: Duration::ZERO,
                }),
                source,
                config,
                grows_answered: AtomicU64::new(0),
                lowers_answered: AtomicU64::new(0),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The state's invariants hold between statements: a panic elsewhere leaves it usable.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> (Option<FleetLimit>, Reading) {
        let limit = (self.shared.source)();
        let reading = match &limit {
            Some(limit) if limit.backend_up() => {
                let (in_flight, waiting, learned) = limit.fleet_reading();
                Reading {
                    up: true,
                    in_flight,
                    waiting,
                    learned: Some(learned),
                }
            }
            _ => Reading {
                up: false,
                in_flight: 0,
                waiting: 0,
                learned: None,
            },
        };
        (limit, reading)
    }

    /// What to propose now that the controller took its input, if anything, marking it in
    /// flight (with the state locked).
    fn propose(
        &self,
        state: &mut State,
        limit: Option<&FleetLimit>,
        reading: Reading,
        now: Duration,
    ) -> Option<Proposal> {
        let limit = limit.filter(|_| reading.up)?;
        let via = limit.identity();
        if state.sent_via != via {
            // Another protocol object (a forked child's): nothing of ours is in flight on it.
            state.sent_via = via;
            state.grow = InFlight::default();
            state.lower = InFlight::default();
            self.shared.grows_answered.store(0, Ordering::Release);
            self.shared.lowers_answered.store(0, Ordering::Release);
        }
        let wanted = state.search.limit();
        let growing = state.grow.pending(&self.shared.grows_answered, now);
        let lowering = state
            .lower
            .pending(&self.shared.lowers_answered, now)
            .then_some(state.lower.limit);
        let (change, generation) = match state.seen {
            // A measurement before any value was read (a seed may be on its way): a lower is
            // safe whatever Redis holds (it seeds, or takes the minimum).
            None if state.measured && lowering.is_none_or(|l| wanted < l) => (Change::Lower, 0),
            None if !growing => (Change::Seed, 0),
            Some(seen) if wanted < seen.limit && lowering.is_none_or(|l| wanted < l) => {
                (Change::Lower, seen.generation)
            }
            Some(seen) if wanted > seen.limit && !growing && lowering.is_none() => {
                (Change::Raise, seen.generation)
            }
            // A Retry-After to pass on with no change of the value: a lower that lowers
            // nothing carries it (at most one lower in flight, as ever).
            seen if !state.hold.is_zero() && lowering.is_none() => {
                (Change::Lower, seen.map_or(0, |seen| seen.generation))
            }
            _ => return None,
        };
        let hold = match change {
            Change::Lower => std::mem::take(&mut state.hold),
            Change::Seed | Change::Raise => Duration::ZERO,
        };
        let flight = match change {
            Change::Lower => {
                // In flight now: the lower's own guard keeps it from here.
                state.measured = false;
                &mut state.lower
            }
            Change::Seed | Change::Raise => &mut state.grow,
        };
        flight.sent = flight.sent.wrapping_add(1);
        flight.at = now;
        flight.limit = wanted;
        Some(Proposal {
            change,
            limit: wanted,
            generation,
            min_limit: self.shared.config.min_limit,
            max_limit: self.shared.config.max_limit,
            spacing: state.search.round_trip().unwrap_or_default(),
            hold,
        })
    }

    /// Sends `proposal` on the limit's runtime. The reply refreshes the limit's reading (which
    /// the next turn adopts) and marks the proposal answered; nothing is locked.
    fn send(&self, limit: Option<FleetLimit>, proposal: Option<Proposal>) {
        let (Some(limit), Some(proposal)) = (limit, proposal) else {
            return;
        };
        let shared = self.shared.clone();
        let runtime = limit.runtime().clone();
        runtime.spawn(async move {
            // Success or failure alike: a failure is an outage, which the reading says.
            let _ = limit.learn(proposal).await;
            let answered = match proposal.change {
                Change::Lower => &shared.lowers_answered,
                Change::Seed | Change::Raise => &shared.grows_answered,
            };
            answered.fetch_add(1, Ordering::AcqRel);
        });
    }
}

impl State {
    /// Keeps the ceiling where an outage allows: while Redis does not answer (`up` false), at
    /// most the last fleet value read (`initial` if none), lowered by this replica's own
    /// throttles since, never growing: the fleet then runs at most N times the last learned
    /// limit. Once Redis answers, the fleet's value is followed again.
    fn bound_by_outage(&mut self, up: bool, initial: u64) {
        if up {
            self.outage_cap = None;
            return;
        }
        let cap = self
            .outage_cap
            .unwrap_or_else(|| self.seen.map_or(initial, |seen| seen.limit));
        let cap = cap.min(self.search.limit());
        self.outage_cap = Some(cap);
        if self.search.limit() > cap {
            self.search.follow(cap, false);
        }
    }

    /// Takes a reading of the fleet's value if it is newer than the one seen.
    fn adopt(&mut self, fresh: Option<Learned>, lowers_answered: &AtomicU64, now: Duration) {
        let Some(fresh) = fresh else {
            // Redis has none (restarted, or it expired): the next proposal seeds it.
            self.seen = None;
            return;
        };
        if self
            .seen
            .is_some_and(|seen| fresh.generation <= seen.generation)
        {
            return;
        }
        let lowered = match self.seen {
            Some(seen) => fresh.limit < seen.limit,
            None => fresh.limit < self.search.limit(),
        };
        self.seen = Some(fresh);
        if self.search.limit() >= fresh.limit {
            self.measured = false;
        } else if self.measured {
            // Measured here, not proposed yet (a seed was in flight): proposed next.
            return;
        }
        let mine = self.lower.limit;
        if self.lower.pending(lowers_answered, now)
            && mine < fresh.limit
            && self.search.limit() <= mine
        {
            // This replica's own lower is on its way and will land below this reading.
            return;
        }
        if self.search.limit() != fresh.limit {
            self.search.follow(fresh.limit, lowered);
        }
    }
}

impl LimitController for FleetLearner {
    fn name(&self) -> &'static str {
        "admitgate-fleet"
    }

    fn limit(&self) -> u64 {
        self.state().search.limit()
    }

    fn start_figure(&self, in_flight: u64) -> u64 {
        let figure = self.state().start_figure;
        if figure == 0 {
            in_flight
        } else {
            figure
        }
    }

    fn on_start(&mut self, now: Duration, in_flight: u64, queued: u64) {
        let (limit, reading) = self.read();
        let proposal = {
            let mut state = self.state();
            if let Some(learned) = reading.learned {
                state.adopt(learned, &self.shared.lowers_answered, now);
            }
            // The fleet's figures while Redis answers (this turn's own lease included: its
            // acquire's reply is the reading), the gate's own during an outage.
            let (running, queued) = if reading.up {
                (
                    reading.in_flight.max(in_flight),
                    queued.max(reading.waiting),
                )
            } else {
                (in_flight, queued)
            };
            let before = state.search.limit();
            state.search.on_start(now, running, queued);
            state.measured |= state.search.limit() < before;
            state.bound_by_outage(reading.up, self.shared.config.initial_limit);
            state.start_figure = running;
            self.propose(&mut state, limit.as_ref(), reading, now)
        };
        self.send(limit, proposal);
    }

    fn on_sample(&mut self, sample: Sample) {
        let (limit, reading) = self.read();
        let proposal = {
            let mut state = self.state();
            // `sample.in_flight` is the figure `start_figure` gave the turn: the fleet's.
            // The fleet's value first, then the measurement: a throttle seen here is never
            // undone by a reading taken before it was proposed (once proposed, a reading above
            // it waits for its answer).
            if let Some(learned) = reading.learned {
                state.adopt(learned, &self.shared.lowers_answered, sample.ended_at);
            }
            let before = state.search.limit();
            state.search.on_sample(sample);
            state.measured |= state.search.limit() < before;
            state.bound_by_outage(reading.up, self.shared.config.initial_limit);
            if let Outcome::Throttled {
                retry_after: Some(pause),
            } = sample.outcome
            {
                // Passed on to the fleet with the next proposal (kept by the server's clock).
                state.hold = state.hold.max(pause);
            }
            self.propose(&mut state, limit.as_ref(), reading, sample.ended_at)
        };
        self.send(limit, proposal);
    }
}

impl fmt::Debug for FleetLearner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("FleetLearner")
            .field("limit", &state.search.limit())
            .field("fleet", &state.seen)
            .finish()
    }
}
