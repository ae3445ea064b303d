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
//!   local ceiling (the gate's) follows it. So with `local`, a replica admits at most its last
//!   learned value (the fleet's, the last it read), lowered further by its own 429s, never more
//!   than `max_concurrent_runs`: the fleet admits at most N times the last learned limit, not N
//!   times the configured ceiling. With `reject` nothing runs without a lease.
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
//!   its own), so a child never sends on its parent's runtime.
//! * **Close:** once the limit is shut down, proposals fail as `Closed` and are dropped.
//! * **Idle:** the value expires an hour after the last heartbeat or change of any replica.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use admitgate_core::overload::{CapacitySearch, CapacitySearchConfig, LimitController, Sample};

use crate::limit::FleetLimit;
use crate::scripts::{Change, Learned, Proposal};

/// Turns whose start is remembered until they end (for the fleet-wide in-flight figure of
/// their sample); past this the memory is cleared, and those turns fall back to the gate's.
const STARTS_KEPT: usize = 4096;

/// Yields this process's fleet limit, if it has one it may use now.
pub type LimitSource = Arc<dyn Fn() -> Option<FleetLimit> + Send + Sync>;

/// The fleet-wide adaptive ceiling: a [`LimitController`] for a replica's gate whose value is
/// the fleet's (see the module documentation). Clones share one controller.
#[derive(Clone)]
pub struct FleetLearner {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    source: LimitSource,
    config: CapacitySearchConfig,
}

struct State {
    search: CapacitySearch,
    /// The fleet's value as last read (`None`: none read, or Redis forgot it).
    seen: Option<Learned>,
    /// A seed or raise is in flight.
    growing: bool,
    /// The lowest lower in flight.
    lowering: Option<u64>,
    /// Fleet-wide in-flight figure at each running turn's start, by its start time.
    starts: HashMap<Duration, u64>,
}

/// What a replica read from the fleet when a turn started.
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
                    growing: false,
                    lowering: None,
                    starts: HashMap::new(),
                }),
                source,
                config,
            }),
        }
    }

    /// The fleet's learned value as last read, if any.
    pub fn fleet_value(&self) -> Option<u64> {
        self.state().seen.map(|l| l.limit)
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

    /// Sends `proposal` on the limit's runtime; each reply is read, and the next proposal (if
    /// the controller moved meanwhile) sent after it.
    fn send(&self, limit: Option<FleetLimit>, proposal: Option<Proposal>) {
        let (Some(limit), Some(proposal)) = (limit, proposal) else {
            return;
        };
        let learner = self.clone();
        let runtime = limit.runtime().clone();
        runtime.spawn(async move {
            let mut next = Some(proposal);
            while let Some(proposal) = next.take() {
                let reply = limit.learn(proposal).await;
                let up = limit.backend_up();
                let mut state = learner.state();
                state.settle(&proposal);
                if let Ok(learned) = reply {
                    state.adopt(learned);
                    next = state.proposal(up, learner.shared.config);
                }
            }
        });
    }
}

impl State {
    /// A proposal answered (or failed): its flag goes.
    fn settle(&mut self, proposal: &Proposal) {
        match proposal.change {
            Change::Lower => {
                if self.lowering == Some(proposal.limit) {
                    self.lowering = None;
                }
            }
            Change::Seed | Change::Raise => self.growing = false,
        }
    }

    /// Takes a reading of the fleet's value if it is newer than the one seen.
    fn adopt(&mut self, fresh: Option<Learned>) {
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
        if self
            .lowering
            .is_some_and(|mine| mine < fresh.limit && self.search.limit() <= mine)
        {
            // This replica's own lower is on its way and will land below this reading.
            return;
        }
        if self.search.limit() != fresh.limit {
            self.search.follow(fresh.limit, lowered);
        }
    }

    /// What to propose now that the controller may have moved, marking it in flight.
    fn proposal(&mut self, up: bool, config: CapacitySearchConfig) -> Option<Proposal> {
        if !up {
            return None;
        }
        let wanted = self.search.limit();
        let proposal = |change, generation| Proposal {
            change,
            limit: wanted,
            generation,
            min_limit: config.min_limit,
            max_limit: config.max_limit,
            spacing: self.search.round_trip().unwrap_or_default(),
        };
        match self.seen {
            None if !self.growing => {
                self.growing = true;
                Some(proposal(Change::Seed, 0))
            }
            Some(seen) if wanted < seen.limit && self.lowering.is_none_or(|l| wanted < l) => {
                self.lowering = Some(wanted);
                Some(proposal(Change::Lower, seen.generation))
            }
            Some(seen) if wanted > seen.limit && !self.growing && self.lowering.is_none() => {
                self.growing = true;
                Some(proposal(Change::Raise, seen.generation))
            }
            _ => None,
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

    fn on_start(&mut self, now: Duration, in_flight: u64, queued: u64) {
        let (limit, reading) = self.read();
        let proposal = {
            let mut state = self.state();
            if let Some(learned) = reading.learned {
                state.adopt(learned);
            }
            // The fleet's figures while Redis answers (this turn's own lease included: its
            // acquire's reply is the reading), the gate's own during an outage.
            let running = if reading.up {
                reading.in_flight.max(in_flight)
            } else {
                in_flight
            };
            let queued = if reading.up {
                queued.max(reading.waiting)
            } else {
                queued
            };
            state.search.on_start(now, running, queued);
            if state.starts.len() >= STARTS_KEPT {
                state.starts.clear();
            }
            state.starts.insert(now, running);
            state.proposal(reading.up, self.shared.config)
        };
        self.send(limit, proposal);
    }

    fn on_sample(&mut self, sample: Sample) {
        let (limit, reading) = self.read();
        let proposal = {
            let mut state = self.state();
            if let Some(learned) = reading.learned {
                state.adopt(learned);
            }
            let in_flight = state
                .starts
                .remove(&sample.started_at)
                .unwrap_or(sample.in_flight);
            state.search.on_sample(Sample {
                in_flight,
                ..sample
            });
            state.proposal(reading.up, self.shared.config)
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
