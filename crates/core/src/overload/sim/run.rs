//! The event loop: virtual time, the real core [`Gate`], a provider and its clients.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::rng::Rng;
use super::scenario::{Algorithm, Candidate, Ceiling, Scenario};
use crate::gate::{Entrant, TurnEnd};
use crate::overload::{
    Aimd, CapacitySearch, CapacitySearchConfig, Discipline, Gradient2, LimitController, Outcome,
};
use crate::queue::ClassId;
use crate::{
    Arrival, Claim, ConcurrencyLimit, Decision, Gate, Rejection, TurnSlot, WaiterKey, Waker, Wakes,
};

/// The width of one point of the timeline.
pub const TIMELINE_STEP: Duration = Duration::from_millis(250);

/// One point of a run's timeline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// The end of the step, seconds.
    pub at_s: f64,
    /// Turns served in the step, per second.
    pub goodput: f64,
    /// The ceiling at the end of the step (0: none).
    pub limit: u64,
    /// The provider's capacity at the end of the step.
    pub capacity: u64,
    /// The share of the provider's answers in the step that were 429s (0 with none).
    pub throttled_share: f64,
}

/// One kind of traffic's figures over one step of the timeline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClassPoint {
    /// Its turns served in the step, per second.
    pub goodput: f64,
    /// The mean queue wait of its turns that started in the step, seconds (0 with none).
    pub mean_wait_s: f64,
}

/// What one kind of traffic (a priority class) got.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassReport {
    /// Its class's name.
    pub name: String,
    /// Its turns offered.
    pub offered: u64,
    /// Its turns served to a client still waiting.
    pub served: u64,
    /// Its served turns per second over the most the provider could serve (the kinds'
    /// goodputs add up to the candidate's).
    pub goodput: f64,
    /// The 99th percentile of its turns' queue wait (arrival to start), of those that ran.
    pub p99_wait: Duration,
    /// Its figures over time, one point per point of the report's timeline.
    pub timeline: Vec<ClassPoint>,
}

/// A kind of traffic's running counts.
#[derive(Default)]
struct ClassAcc {
    offered: u64,
    served: u64,
    waits: Vec<Duration>,
    served_in_step: u64,
    started_in_step: u64,
    wait_in_step: Duration,
    timeline: Vec<ClassPoint>,
}

/// What one candidate achieved in one scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The candidate's name.
    pub candidate: String,
    /// The scenario's name.
    pub scenario: String,
    /// Turns offered.
    pub offered: u64,
    /// Turns served to a client still waiting.
    pub served: u64,
    /// Served turns per second over the most the provider could serve.
    pub goodput: f64,
    /// The 99th percentile of a served turn's latency (arrival to answer).
    pub p99: Duration,
    /// Calls made to the provider.
    pub provider_calls: u64,
    /// Calls the provider refused (429).
    pub throttled: u64,
    /// Turns the gate refused (busy acknowledgements), any reason.
    pub refused: u64,
    /// Clients that left while queued.
    pub left_queued: u64,
    /// Clients that left while their turn ran (its slot wasted).
    pub left_running: u64,
    /// `(capacity, ceiling)` at the end of each capacity phase (ceiling 0: none).
    pub phase_limits: Vec<(u64, u64)>,
    /// Goodput and ceiling over time.
    pub timeline: Vec<Point>,
    /// Each kind of traffic's figures (empty for a scenario of one kind).
    pub classes: Vec<ClassReport>,
}

impl Report {
    /// Provider refusals as a fraction of provider calls.
    pub fn throttled_fraction(&self) -> f64 {
        self.throttled as f64 / (self.provider_calls as f64).max(1.0)
    }

    /// Gate refusals as a fraction of turns offered.
    pub fn refused_fraction(&self) -> f64 {
        self.refused as f64 / (self.offered as f64).max(1.0)
    }
}

/// Wakes a simulated waiter: notes its client for the loop to claim.
struct SimWaker {
    client: usize,
    woken: Arc<Mutex<Vec<usize>>>,
}

impl Waker for SimWaker {
    fn wake(self) -> Wakes<Self> {
        self.woken.lock().push(self.client);
        Wakes::default()
    }
}

enum Turn {
    Queued(WaiterKey),
    Running {
        slot: TurnSlot,
        started: Duration,
        in_flight: u64,
        accepted: bool,
    },
    Done,
}

struct Client {
    arrived: Duration,
    turn: Turn,
    /// Its kind of traffic (an index into the scenario's), its class and tenant.
    kind: usize,
    class: ClassId,
    scope: Option<Arc<str>>,
    /// The deadline it sent, if it sends one.
    deadline: Option<Duration>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive,
    CallEnds(usize),
    GiveUp(usize),
    Expire(usize),
    /// A waiter's next look ([`Gate::next_check`]): its deadline, the adaptive queue's cap.
    Check(usize),
    Sample,
}

struct Sim<'a> {
    scenario: &'a Scenario,
    candidate: &'a Candidate,
    rng: Rng,
    now: Duration,
    seq: u64,
    events: BinaryHeap<Reverse<(Duration, u64, Event)>>,
    gate: Gate<SimWaker>,
    /// The gate reports turns' starts and ends (overload control is on).
    timed: bool,
    woken: Arc<Mutex<Vec<usize>>>,
    clients: Vec<Client>,
    provider_active: u64,
    latencies: Vec<Duration>,
    served_in_step: u64,
    answers_in_step: u64,
    throttled_in_step: u64,
    report: Report,
    /// Per kind of traffic: its class in this candidate's gate, and its counts.
    kind_class: Vec<ClassId>,
    classes: Vec<ClassAcc>,
    /// The tenants' names (empty: none).
    tenants: Vec<Arc<str>>,
}

fn controller(ceiling: Ceiling) -> Option<Box<dyn LimitController>> {
    let Ceiling::Adaptive(algorithm, max) = ceiling else {
        return None;
    };
    let max = u64::from(max);
    Some(match algorithm {
        Algorithm::Admitgate => Box::new(CapacitySearch::new(CapacitySearchConfig::new(max))),
        // Vector starts at 1; Netflix's Gradient2 at 20 (its floor too, lowered here to 1
        // so it is not handicapped on a small provider).
        Algorithm::Aimd => Box::new(Aimd::new(1, max, 1)),
        Algorithm::Gradient2 => Box::new(Gradient2::new(1, max, 20)),
    })
}

impl<'a> Sim<'a> {
    fn new(scenario: &'a Scenario, candidate: &'a Candidate) -> Self {
        let ceiling = match candidate.ceiling {
            Ceiling::NoGate => 0,
            Ceiling::Fixed(n) | Ceiling::Adaptive(_, n) => n,
        };
        let limits = ConcurrencyLimit {
            max_concurrent_runs: ceiling,
            queue_depth: candidate.queue_depth,
            overflow: candidate.overflow,
            max_per_scope: 0,
        };
        let gate = Gate::new(limits);
        let controller = controller(candidate.ceiling);
        // Deadlines are a gate feature every configuration gets once clients send them.
        let timed = candidate.ceiling != Ceiling::NoGate
            && (controller.is_some()
                || candidate.discipline != Discipline::Fifo
                || scenario.clients.send_deadline);
        if timed {
            gate.enable_overload(controller, candidate.discipline);
        }
        if let Some(order) = &candidate.order {
            // Checked where the candidate was built; an order the gate refuses leaves it FIFO.
            if let Ok(wakes) = gate.set_order(order.clone()) {
                wakes.run();
            }
        }
        let kind_class = scenario
            .traffic
            .iter()
            .map(|t| {
                candidate.order.as_ref().map_or(ClassId::DEFAULT, |order| {
                    order
                        .priorities
                        .find(&t.class)
                        .unwrap_or(order.priorities.default_class())
                })
            })
            .collect();
        let tenants = (0..scenario.tenants)
            .filter(|_| scenario.tenants > 1)
            .map(|i| Arc::from(format!("tenant-{i}")))
            .collect();
        Self {
            scenario,
            candidate,
            rng: Rng::new(scenario.seed),
            now: Duration::ZERO,
            seq: 0,
            events: BinaryHeap::new(),
            gate,
            timed,
            woken: Arc::default(),
            clients: Vec::new(),
            provider_active: 0,
            latencies: Vec::new(),
            served_in_step: 0,
            answers_in_step: 0,
            throttled_in_step: 0,
            report: Report {
                candidate: candidate.name.clone(),
                scenario: scenario.name.clone(),
                offered: 0,
                served: 0,
                goodput: 0.0,
                p99: Duration::ZERO,
                provider_calls: 0,
                throttled: 0,
                refused: 0,
                left_queued: 0,
                left_running: 0,
                phase_limits: Vec::new(),
                timeline: Vec::new(),
                classes: Vec::new(),
            },
            kind_class,
            classes: scenario
                .traffic
                .iter()
                .map(|_| ClassAcc::default())
                .collect(),
            tenants,
        }
    }

    /// The kind of traffic of the next arrival (0 for a scenario of one kind: no draw, so
    /// its arrivals are those of a simulator without kinds).
    fn pick_kind(&mut self) -> usize {
        let traffic = &self.scenario.traffic;
        if traffic.len() <= 1 {
            return 0;
        }
        let total: f64 = traffic.iter().map(|t| t.share.max(0.0)).sum();
        let mut point = self.rng.unit() * total;
        for (i, t) in traffic.iter().enumerate() {
            point -= t.share.max(0.0);
            if point < 0.0 {
                return i;
            }
        }
        traffic.len().saturating_sub(1)
    }

    /// The tenant of the next arrival (none without tenants: no draw).
    fn pick_tenant(&mut self) -> Option<Arc<str>> {
        if self.tenants.is_empty() {
            return None;
        }
        let n = self.tenants.len() as u64;
        let i = usize::try_from(self.rng.next_u64().checked_rem(n).unwrap_or(0)).unwrap_or(0);
        self.tenants.get(i).cloned()
    }

    fn schedule(&mut self, after: Duration, event: Event) {
        self.seq = self.seq.saturating_add(1);
        self.events
            .push(Reverse((self.now.saturating_add(after), self.seq, event)));
    }

    fn seconds(value: f64) -> Duration {
        Duration::try_from_secs_f64(value).unwrap_or(Duration::MAX)
    }

    fn ceiling(&self) -> u64 {
        self.gate.stats(|| Duration::ZERO).limit
    }

    fn run(mut self) -> Report {
        self.schedule(Duration::ZERO, Event::Arrive);
        self.schedule(TIMELINE_STEP, Event::Sample);
        while let Some(Reverse((at, _, event))) = self.events.pop() {
            if at > self.scenario.duration {
                break;
            }
            self.now = at;
            match event {
                Event::Arrive => self.arrive(),
                Event::CallEnds(client) => self.call_ends(client),
                Event::GiveUp(client) => self.give_up(client),
                Event::Expire(client) => self.expire(client, Rejection::Timeout),
                Event::Check(client) => self.check(client),
                Event::Sample => self.sample(),
            }
            self.settle();
        }
        self.finish()
    }

    /// Runs wakes, claims what they woke, and moves the ceiling, until nothing changes.
    fn settle(&mut self) {
        loop {
            let woken = std::mem::take(&mut *self.woken.lock());
            if woken.is_empty() {
                break;
            }
            for client in woken {
                self.claim(client);
            }
        }
    }

    fn arrive(&mut self) {
        let gap = self.rng.exponential(1.0 / self.scenario.arrival_rate());
        self.schedule(Self::seconds(gap), Event::Arrive);
        self.report.offered = self.report.offered.saturating_add(1);
        let kind = self.pick_kind();
        let scope = self.pick_tenant();
        let class = self
            .kind_class
            .get(kind)
            .copied()
            .unwrap_or(ClassId::DEFAULT);
        let patience = self
            .scenario
            .traffic
            .get(kind)
            .and_then(|t| t.patience)
            .unwrap_or(self.scenario.clients.patience);
        if let Some(acc) = self.classes.get_mut(kind) {
            acc.offered = acc.offered.saturating_add(1);
        }
        let client = self.clients.len();
        self.clients.push(Client {
            arrived: self.now,
            turn: Turn::Done,
            deadline: None,
            kind,
            class,
            scope: scope.clone(),
        });
        self.schedule(patience, Event::GiveUp(client));
        let now = self.now;
        let deadline = self
            .scenario
            .clients
            .send_deadline
            .then(|| now.saturating_add(patience));
        if let Some(c) = self.clients.get_mut(client) {
            c.deadline = deadline;
        }
        let entrant = Entrant {
            scope: scope.as_deref(),
            class,
            deadline,
        };
        let (arrival, wakes) = self.gate.arrive_as(entrant, None, Decision::Admit, || now);
        wakes.run();
        match arrival {
            Arrival::Admitted(_) => self.start(client),
            Arrival::Queued(key) => {
                if let Some(c) = self.clients.get_mut(client) {
                    c.turn = Turn::Queued(key);
                }
                let waker = SimWaker {
                    client,
                    woken: self.woken.clone(),
                };
                let (_, returned) = self.gate.register(key, waker);
                if let Some(waker) = returned {
                    // Settled before it registered: claim now.
                    self.woken.lock().push(waker.client);
                }
                if let Some(timeout) = self.candidate.queue_timeout {
                    self.schedule(timeout, Event::Expire(client));
                }
                self.schedule_check(client, key, deadline);
            }
            Arrival::Rejected(..) => {
                self.report.refused = self.report.refused.saturating_add(1);
            }
        }
    }

    fn claim(&mut self, client: usize) {
        let Some(Turn::Queued(key)) = self.clients.get(client).map(|c| &c.turn) else {
            return;
        };
        let key = *key;
        let now = self.now;
        let (claim, wakes) = self.gate.claim(key, || now);
        wakes.run();
        match claim {
            Claim::Admitted(_) => self.start(client),
            Claim::Refused(..) => {
                self.report.refused = self.report.refused.saturating_add(1);
                if let Some(c) = self.clients.get_mut(client) {
                    c.turn = Turn::Done;
                }
            }
            Claim::Waiting | Claim::Unknown => {}
        }
    }

    fn start(&mut self, client: usize) {
        let in_flight = if self.timed {
            let (in_flight, wakes) = self.gate.turn_started(self.now);
            wakes.run();
            in_flight
        } else {
            0
        };
        self.report.provider_calls = self.report.provider_calls.saturating_add(1);
        let accepted = self.provider_active < self.scenario.provider.capacity_at(self.now);
        let duration = if accepted {
            self.provider_active = self.provider_active.saturating_add(1);
            let provider = &self.scenario.provider;
            Self::seconds(
                self.rng
                    .log_normal(provider.service_mean.as_secs_f64(), provider.service_sigma),
            )
        } else {
            self.scenario.provider.refusal_latency
        };
        let now = self.now;
        if let Some(c) = self.clients.get_mut(client) {
            let wait = now.saturating_sub(c.arrived);
            if let Some(acc) = self.classes.get_mut(c.kind) {
                acc.waits.push(wait);
                acc.started_in_step = acc.started_in_step.saturating_add(1);
                acc.wait_in_step = acc.wait_in_step.saturating_add(wait);
            }
            c.turn = Turn::Running {
                slot: TurnSlot::in_class(c.scope.clone(), c.class),
                started: self.now,
                in_flight,
                accepted,
            };
        }
        self.schedule(duration, Event::CallEnds(client));
    }

    /// Ends a running turn: its slot back to the gate, its outcome to the controller.
    fn end_turn(&mut self, client: usize, outcome: Outcome) {
        let Some(c) = self.clients.get_mut(client) else {
            return;
        };
        let Turn::Running {
            slot,
            started,
            in_flight,
            accepted,
        } = std::mem::replace(&mut c.turn, Turn::Done)
        else {
            return;
        };
        if accepted {
            self.provider_active = self.provider_active.saturating_sub(1);
        }
        let wakes = if self.timed {
            let end = TurnEnd {
                started_at: started,
                ended_at: self.now,
                in_flight,
                outcome,
                remaining: None,
            };
            slot.finish(&self.gate, None, end)
        } else {
            slot.close(&self.gate, None)
        };
        wakes.run();
    }

    fn call_ends(&mut self, client: usize) {
        let Some(c) = self.clients.get(client) else {
            return;
        };
        let Turn::Running { accepted, .. } = c.turn else {
            return;
        };
        self.answers_in_step = self.answers_in_step.saturating_add(1);
        if accepted {
            self.report.served = self.report.served.saturating_add(1);
            self.served_in_step = self.served_in_step.saturating_add(1);
            self.latencies.push(self.now.saturating_sub(c.arrived));
            if let Some(acc) = self.classes.get_mut(c.kind) {
                acc.served = acc.served.saturating_add(1);
                acc.served_in_step = acc.served_in_step.saturating_add(1);
            }
            self.end_turn(client, Outcome::Success);
        } else {
            self.report.throttled = self.report.throttled.saturating_add(1);
            self.throttled_in_step = self.throttled_in_step.saturating_add(1);
            self.end_turn(client, Outcome::Throttled { retry_after: None });
        }
    }

    fn give_up(&mut self, client: usize) {
        match self.clients.get(client).map(|c| &c.turn) {
            Some(Turn::Queued(key)) => {
                let key = *key;
                let (_, wakes) = self.gate.cancel(key);
                wakes.run();
                self.report.left_queued = self.report.left_queued.saturating_add(1);
                if let Some(c) = self.clients.get_mut(client) {
                    c.turn = Turn::Done;
                }
            }
            Some(Turn::Running { .. }) => {
                self.report.left_running = self.report.left_running.saturating_add(1);
                self.end_turn(client, Outcome::Ignored);
            }
            _ => {}
        }
    }

    /// Schedules the waiter's next look, if the gate wants one.
    fn schedule_check(&mut self, client: usize, key: WaiterKey, deadline: Option<Duration>) {
        if let Some((at, _)) = self.gate.next_check(key, deadline) {
            let wait = at.saturating_sub(self.now);
            self.schedule(wait, Event::Check(client));
        }
    }

    fn check(&mut self, client: usize) {
        let Some((Turn::Queued(key), deadline)) =
            self.clients.get(client).map(|c| (&c.turn, c.deadline))
        else {
            return;
        };
        let key = *key;
        let (refused, wakes) = self.gate.recheck(key, deadline, self.now);
        wakes.run();
        if !refused {
            self.schedule_check(client, key, deadline);
        }
    }

    fn expire(&mut self, client: usize, reason: Rejection) {
        if let Some(Turn::Queued(key)) = self.clients.get(client).map(|c| &c.turn) {
            let (_, wakes) = self.gate.expire_for(*key, reason);
            wakes.run();
        }
    }

    fn sample(&mut self) {
        self.schedule(TIMELINE_STEP, Event::Sample);
        let capacity = self.scenario.provider.capacity_at(self.now);
        let next = self
            .scenario
            .provider
            .capacity_at(self.now.saturating_add(TIMELINE_STEP));
        let end = self.now.saturating_add(TIMELINE_STEP) > self.scenario.duration;
        if next != capacity || end {
            self.report.phase_limits.push((capacity, self.ceiling()));
        }
        self.report.timeline.push(Point {
            at_s: self.now.as_secs_f64(),
            goodput: self.served_in_step as f64 / TIMELINE_STEP.as_secs_f64(),
            limit: self.ceiling(),
            capacity,
            throttled_share: self.throttled_in_step as f64 / self.answers_in_step.max(1) as f64,
        });
        self.served_in_step = 0;
        self.answers_in_step = 0;
        self.throttled_in_step = 0;
        for acc in &mut self.classes {
            let mean_wait_s = if acc.started_in_step == 0 {
                0.0
            } else {
                acc.wait_in_step.as_secs_f64() / acc.started_in_step as f64
            };
            acc.timeline.push(ClassPoint {
                goodput: acc.served_in_step as f64 / TIMELINE_STEP.as_secs_f64(),
                mean_wait_s,
            });
            acc.served_in_step = 0;
            acc.started_in_step = 0;
            acc.wait_in_step = Duration::ZERO;
        }
    }

    fn finish(mut self) -> Report {
        let duration = self.scenario.duration;
        let physical = self.scenario.provider.physical_rate(duration);
        self.report.goodput =
            self.report.served as f64 / duration.as_secs_f64().max(1e-9) / physical.max(1e-9);
        self.latencies.sort_unstable();
        let rank = (self.latencies.len() as f64 * 0.99) as usize;
        self.report.p99 = self
            .latencies
            .get(rank.min(self.latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default();
        let rate = duration.as_secs_f64().max(1e-9) * physical.max(1e-9);
        for (acc, traffic) in std::mem::take(&mut self.classes)
            .into_iter()
            .zip(&self.scenario.traffic)
        {
            let mut waits = acc.waits;
            waits.sort_unstable();
            let rank = (waits.len() as f64 * 0.99) as usize;
            self.report.classes.push(ClassReport {
                name: traffic.class.clone(),
                offered: acc.offered,
                served: acc.served,
                goodput: acc.served as f64 / rate,
                p99_wait: waits
                    .get(rank.min(waits.len().saturating_sub(1)))
                    .copied()
                    .unwrap_or_default(),
                timeline: acc.timeline,
            });
        }
        self.report
    }
}

/// Runs `candidate` in `scenario`.
pub fn run(scenario: &Scenario, candidate: &Candidate) -> Report {
    Sim::new(scenario, candidate).run()
}
