//! What a simulation runs: a provider, its clients, and the gate configurations compared.

use std::time::Duration;

use crate::overload::Discipline;
use crate::queue::Order;
use crate::Overflow;

/// The LLM provider: a concurrency capacity that may change over time, a service time, and
/// an immediate refusal (429) for any call beyond the capacity.
#[derive(Clone, Debug, PartialEq)]
pub struct Provider {
    /// `(from, capacity)`, in time order, the first from zero.
    pub capacity: Vec<(Duration, u64)>,
    /// The mean service time of an accepted call.
    pub service_mean: Duration,
    /// The log-space deviation of the service time (0: every call takes the mean).
    pub service_sigma: f64,
    /// How long a refused call takes to come back.
    pub refusal_latency: Duration,
}

impl Provider {
    /// The capacity at `now`.
    pub fn capacity_at(&self, now: Duration) -> u64 {
        self.capacity
            .iter()
            .take_while(|(from, _)| *from <= now)
            .last()
            .map_or(0, |&(_, capacity)| capacity)
    }

    /// The most calls per second it can serve over `[0, until)`, averaged.
    pub fn physical_rate(&self, until: Duration) -> f64 {
        let mut served = 0.0;
        for (i, &(from, capacity)) in self.capacity.iter().enumerate() {
            let to = self
                .capacity
                .get(i.saturating_add(1))
                .map_or(until, |&(next, _)| next.min(until));
            served += capacity as f64 * to.saturating_sub(from).as_secs_f64();
        }
        served / self.service_mean.as_secs_f64() / until.as_secs_f64().max(1e-9)
    }
}

/// The clients: Poisson arrivals, each willing to wait `patience` for its whole turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Clients {
    /// How long a client waits for its turn (queued and running) before it leaves.
    pub patience: Duration,
    /// Offered turns as a multiple of the provider's first capacity (10.0: ten times what
    /// it can serve).
    pub load: f64,
    /// Whether clients tell the gate their deadline (`admit(deadline_s=patience)`).
    pub send_deadline: bool,
}

/// One kind of traffic among the clients' arrivals: its priority class's name, its part of
/// the arrivals and its clients' patience.
#[derive(Clone, Debug, PartialEq)]
pub struct Traffic {
    /// The class its turns name (`admit(priority=...)`); a gate without that class puts
    /// them in its default class.
    pub class: String,
    /// Its fraction of the arrivals (the fractions of a scenario's traffic are normalised).
    pub share: f64,
    /// How long its clients wait for a turn; `None`: the clients' patience.
    pub patience: Option<Duration>,
}

/// One simulated situation.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// A short name for the table.
    pub name: String,
    /// The provider.
    pub provider: Provider,
    /// The clients.
    pub clients: Clients,
    /// How long it runs, in virtual time.
    pub duration: Duration,
    /// The seed of its arrivals and service times.
    pub seed: u64,
    /// The kinds of traffic, most important first (empty: one kind, no class, as before).
    pub traffic: Vec<Traffic>,
    /// How many tenants the arrivals are spread over, uniformly (0 or 1: none).
    pub tenants: u32,
}

impl Scenario {
    /// The offered arrival rate, turns per second.
    pub fn arrival_rate(&self) -> f64 {
        let first = self.provider.capacity.first().map_or(0, |&(_, c)| c);
        self.clients.load * first as f64 / self.provider.service_mean.as_secs_f64()
    }
}

/// The ceiling a candidate gate applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ceiling {
    /// No gate at all: every turn calls the provider at once.
    NoGate,
    /// A fixed `max_concurrent_runs`.
    Fixed(u32),
    /// An adaptive ceiling below `max`.
    Adaptive(Algorithm, u32),
}

/// An adaptive-ceiling algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// admitgate's [`CapacitySearch`](crate::overload::CapacitySearch).
    Admitgate,
    /// The Vector-ARC-style [`Aimd`](crate::overload::Aimd).
    Aimd,
    /// The Netflix-style [`Gradient2`](crate::overload::Gradient2).
    Gradient2,
}

/// One gate configuration to compare.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// A short name for the table.
    pub name: String,
    /// Its ceiling.
    pub ceiling: Ceiling,
    /// `queue_depth`.
    pub queue_depth: u32,
    /// `overflow_policy`.
    pub overflow: Overflow,
    /// `queue_timeout_s`.
    pub queue_timeout: Option<Duration>,
    /// `queue_discipline`.
    pub discipline: Discipline,
    /// The queue's order (priority classes, fair queuing across tenants); `None`: FIFO.
    pub order: Option<Order>,
}

impl Candidate {
    /// The gate of the measurements: a fixed ceiling, queue 32, reject, FIFO.
    pub fn fixed(ceiling: u32) -> Self {
        Self {
            name: format!("fixed {ceiling}, fifo"),
            ceiling: Ceiling::Fixed(ceiling),
            queue_depth: 32,
            overflow: Overflow::Reject,
            queue_timeout: None,
            discipline: Discipline::Fifo,
            order: None,
        }
    }

    /// admitgate's adaptive configuration: not told the capacity (upper bound `max`), the
    /// adaptive ceiling and the adaptive queue.
    pub fn adaptive(max: u32) -> Self {
        Self {
            name: format!("admitgate adaptive (<= {max})"),
            ceiling: Ceiling::Adaptive(Algorithm::Admitgate, max),
            queue_depth: 128,
            overflow: Overflow::Reject,
            queue_timeout: None,
            discipline: Discipline::AdaptiveLifo,
            order: None,
        }
    }

    /// No gate.
    pub fn no_gate() -> Self {
        Self {
            name: "no gate".to_owned(),
            ceiling: Ceiling::NoGate,
            queue_depth: 0,
            overflow: Overflow::Reject,
            queue_timeout: None,
            discipline: Discipline::Fifo,
            order: None,
        }
    }

    /// The anchors of the issue, each with the discipline it comes with: Vector's ARC (AIMD,
    /// FIFO), Netflix's Gradient2 (FIFO), and folly's CoDel (FIFO) under a fixed ceiling
    /// it is told; the adaptive ceilings get the upper bound `max`.
    pub fn baselines(max: u32, told: u32) -> Vec<Self> {
        let adaptive = |name: &str, algorithm| Self {
            name: name.to_owned(),
            ceiling: Ceiling::Adaptive(algorithm, max),
            queue_depth: 128,
            overflow: Overflow::Reject,
            queue_timeout: None,
            discipline: Discipline::Fifo,
            order: None,
        };
        vec![
            adaptive("aimd (vector arc), fifo", Algorithm::Aimd),
            adaptive("gradient2 (netflix), fifo", Algorithm::Gradient2),
            Self {
                name: format!("fixed {told}, codel (folly)"),
                discipline: Discipline::Codel,
                queue_depth: 128,
                ..Self::fixed(told)
            },
        ]
    }
}

/// The scenarios of issue 17: a provider of 8 concurrent calls of about 50 ms, turns
/// offered at 10× capacity, clients of 0.2 s, 0.5 s and 2 s patience with and without
/// deadlines, and the capacity moving 8 → 4 → 16. `phase` is how long each run (or each
/// capacity) lasts.
pub fn standard(phase: Duration, seed: u64) -> Vec<Scenario> {
    let provider = |capacity: Vec<(Duration, u64)>| Provider {
        capacity,
        service_mean: Duration::from_millis(50),
        service_sigma: 0.25,
        refusal_latency: Duration::from_millis(1),
    };
    let mut scenarios = Vec::new();
    for (patience_ms, send_deadline) in [
        (200, false),
        (500, false),
        (2000, false),
        (200, true),
        (500, true),
        (2000, true),
    ] {
        let with = if send_deadline { ", deadlines" } else { "" };
        scenarios.push(Scenario {
            name: format!("patience {:.1}s{with}", patience_ms as f64 / 1000.0),
            provider: provider(vec![(Duration::ZERO, 8)]),
            clients: Clients {
                patience: Duration::from_millis(patience_ms),
                load: 10.0,
                send_deadline,
            },
            duration: phase.saturating_mul(3),
            seed,
            traffic: Vec::new(),
            tenants: 0,
        });
    }
    for send_deadline in [false, true] {
        let with = if send_deadline { ", deadlines" } else { "" };
        scenarios.push(Scenario {
            name: format!("capacity 8>4>16, patience 0.5s{with}"),
            provider: provider(vec![
                (Duration::ZERO, 8),
                (phase, 4),
                (phase.saturating_mul(2), 16),
            ]),
            clients: Clients {
                patience: Duration::from_millis(500),
                load: 10.0,
                send_deadline,
            },
            duration: phase.saturating_mul(3),
            seed,
            traffic: Vec::new(),
            tenants: 0,
        });
    }
    scenarios
}
