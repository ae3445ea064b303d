//! Which waiter runs next, and how long anyone may wait, once a queue stands.
//!
//! A queue that drains now and then absorbs bursts: first come, first served. A queue that
//! has not drained for a while is a standing queue, and FIFO then serves the oldest waiter,
//! the one whose caller is likeliest to have given up. Two answers:
//!
//! * [`Discipline::AdaptiveLifo`] (admitgate's, after Facebook's "Fail at Scale"): a queue
//!   that has not been empty for [`INTERVAL_SERVICE_TIMES`] service times is standing; while
//!   it stands, waits are capped at [`TARGET_SERVICE_TIMES`] service time (older waiters are
//!   refused with `timeout`) and the newest waiter runs first. Both are multiples of the
//!   measured service time, so a gate in front of 30 s LLM calls and one in front of 50 ms
//!   calls need no different settings.
//! * [`Discipline::Codel`], a baseline: folly's `Codel` with its constants (target 5 ms,
//!   interval 100 ms): overloaded when the smallest wait seen in an interval exceeded the
//!   target; then waits above twice the target are refused. Oldest first throughout.
//!
//! Time is an input; nothing here reads a clock.

use std::time::Duration;

/// A queue not empty for this many service times is standing.
pub const INTERVAL_SERVICE_TIMES: u32 = 2;
/// While it stands, the longest wait, in service times.
pub const TARGET_SERVICE_TIMES: u32 = 1;
/// folly's `codel_target_delay` default.
pub const CODEL_TARGET: Duration = Duration::from_millis(5);
/// folly's `codel_interval` default.
pub const CODEL_INTERVAL: Duration = Duration::from_millis(100);

/// A queue discipline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discipline {
    /// First come, first served; waits bounded only by the queue timeout.
    Fifo,
    /// Controlled delay, oldest first (folly's constants).
    Codel,
    /// Controlled delay and newest first while a queue stands; FIFO otherwise.
    AdaptiveLifo,
}

impl Discipline {
    /// The names `queue_discipline=` accepts (CoDel alone is a benchmark baseline).
    pub const NAMES: [&'static str; 2] = ["fifo", "adaptive"];

    /// Parses a `queue_discipline` value; `None` for anything else.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "fifo" => Some(Discipline::Fifo),
            "adaptive" => Some(Discipline::AdaptiveLifo),
            _ => None,
        }
    }

    /// The canonical name.
    pub fn as_str(self) -> &'static str {
        match self {
            Discipline::Fifo => "fifo",
            Discipline::Codel => "codel",
            Discipline::AdaptiveLifo => "adaptive",
        }
    }
}

/// How the queue is served right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMode {
    /// Oldest first, no cap beyond the queue timeout.
    Fifo,
    /// Waiters older than `max_wait` are refused; the next to run is the newest if
    /// `newest_first`, else the oldest.
    Controlled {
        /// Serve the newest waiter first.
        newest_first: bool,
        /// The longest a waiter may wait.
        max_wait: Duration,
    },
}

/// The state of a queue discipline (see the module documentation).
#[derive(Clone, Copy, Debug)]
pub struct QueueDiscipline {
    kind: Discipline,
    /// When the queue was last seen empty.
    last_empty: Duration,
    /// CoDel: the end of the current interval, the smallest wait seen in it, overloaded.
    interval_end: Duration,
    min_delay: Option<Duration>,
    overloaded: bool,
}

impl QueueDiscipline {
    /// A discipline of `kind`, with an empty queue.
    pub fn new(kind: Discipline) -> Self {
        Self {
            kind,
            last_empty: Duration::ZERO,
            interval_end: Duration::ZERO,
            min_delay: None,
            overloaded: false,
        }
    }

    /// Which discipline.
    pub fn kind(&self) -> Discipline {
        self.kind
    }

    /// A turn joins the queue at `now`, which held `queued` waiters before it.
    pub fn on_enqueue(&mut self, now: Duration, queued: u64) {
        if queued == 0 {
            self.last_empty = now;
        }
    }

    /// A waiter that waited `delay` was handed a slot at `now` (CoDel's input).
    pub fn on_dequeue(&mut self, now: Duration, delay: Duration) {
        if self.kind != Discipline::Codel {
            return;
        }
        if now > self.interval_end {
            self.interval_end = now.saturating_add(CODEL_INTERVAL);
            self.overloaded = self.min_delay.is_some_and(|min| min > CODEL_TARGET);
            // The first waiter of an interval starts its minimum.
            self.min_delay = Some(delay);
            return;
        }
        self.min_delay = Some(self.min_delay.map_or(delay, |min| min.min(delay)));
    }

    /// When a waiter enqueued at `enqueued_at` will have waited past the cap of a standing
    /// queue, at the current `service` estimate, if the queue keeps standing: the later of its
    /// own cap and the time the queue becomes a standing one. `None` without a cap (FIFO, or
    /// no estimate yet; CoDel caps only when it sees a queue served).
    pub fn cap_due(&self, enqueued_at: Duration, service: Option<Duration>) -> Option<Duration> {
        if self.kind != Discipline::AdaptiveLifo {
            return None;
        }
        let service = service?;
        let own = enqueued_at.saturating_add(service.saturating_mul(TARGET_SERVICE_TIMES));
        let standing = self
            .last_empty
            .saturating_add(service.saturating_mul(INTERVAL_SERVICE_TIMES));
        Some(own.max(standing))
    }

    /// How to serve a queue of `queued` waiters at `now`, given the expected service time
    /// (`None` before any turn has ended: FIFO, since a standing queue cannot be told from a
    /// burst without knowing how fast the queue drains).
    pub fn mode(&mut self, now: Duration, queued: u64, service: Option<Duration>) -> QueueMode {
        if queued == 0 {
            self.last_empty = now;
            return QueueMode::Fifo;
        }
        match self.kind {
            Discipline::Fifo => QueueMode::Fifo,
            Discipline::Codel if self.overloaded => QueueMode::Controlled {
                newest_first: false,
                max_wait: CODEL_TARGET.saturating_mul(2),
            },
            Discipline::Codel => QueueMode::Fifo,
            Discipline::AdaptiveLifo => {
                let Some(service) = service else {
                    return QueueMode::Fifo;
                };
                let interval = service.saturating_mul(INTERVAL_SERVICE_TIMES);
                if now.saturating_sub(self.last_empty) > interval {
                    QueueMode::Controlled {
                        newest_first: true,
                        max_wait: service.saturating_mul(TARGET_SERVICE_TIMES),
                    }
                } else {
                    QueueMode::Fifo
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn fifo_is_always_fifo() {
        let mut queue = QueueDiscipline::new(Discipline::Fifo);
        queue.on_enqueue(ms(0), 0);
        assert_eq!(queue.mode(ms(10_000), 50, Some(ms(50))), QueueMode::Fifo);
    }

    #[test]
    fn adaptive_serves_newest_first_once_the_queue_has_stood_for_two_service_times() {
        let mut queue = QueueDiscipline::new(Discipline::AdaptiveLifo);
        queue.on_enqueue(ms(1000), 0);
        assert_eq!(queue.mode(ms(1050), 5, Some(ms(50))), QueueMode::Fifo);
        assert_eq!(queue.mode(ms(1100), 5, Some(ms(50))), QueueMode::Fifo);
        assert_eq!(
            queue.mode(ms(1101), 5, Some(ms(50))),
            QueueMode::Controlled {
                newest_first: true,
                max_wait: ms(50)
            }
        );
        // Unknown service time: nothing to scale by, FIFO.
        assert_eq!(queue.mode(ms(5000), 5, None), QueueMode::Fifo);
        // Drained: FIFO again until it stands anew.
        assert_eq!(queue.mode(ms(1200), 0, Some(ms(50))), QueueMode::Fifo);
        queue.on_enqueue(ms(1210), 0);
        assert_eq!(queue.mode(ms(1250), 3, Some(ms(50))), QueueMode::Fifo);
    }

    #[test]
    fn the_interval_scales_with_the_service_time() {
        let mut queue = QueueDiscipline::new(Discipline::AdaptiveLifo);
        queue.on_enqueue(ms(0), 0);
        let slow = Some(Duration::from_secs(20));
        assert_eq!(queue.mode(ms(30_000), 5, slow), QueueMode::Fifo);
        assert!(matches!(
            queue.mode(ms(40_001), 5, slow),
            QueueMode::Controlled { max_wait, .. } if max_wait == Duration::from_secs(20)
        ));
    }

    #[test]
    fn codel_sloughs_after_an_interval_whose_smallest_wait_beat_the_target() {
        let mut queue = QueueDiscipline::new(Discipline::Codel);
        queue.on_dequeue(ms(1), ms(20));
        queue.on_dequeue(ms(50), ms(8));
        assert_eq!(queue.mode(ms(60), 3, Some(ms(50))), QueueMode::Fifo);
        queue.on_dequeue(ms(102), ms(30));
        assert_eq!(
            queue.mode(ms(103), 3, None),
            QueueMode::Controlled {
                newest_first: false,
                max_wait: ms(10)
            }
        );
        // An interval with a short wait ends the overload.
        queue.on_dequeue(ms(150), ms(1));
        queue.on_dequeue(ms(210), ms(1));
        assert_eq!(queue.mode(ms(211), 3, None), QueueMode::Fifo);
    }
}
