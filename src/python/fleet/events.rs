//! Routing a fleet limit's events (outages, recoveries, lost leases) to the `admitgate` logger.
//!
//! The lease protocol reports events from its tokio tasks, which must never wait for the GIL
//! (a thread holding it may be waiting for them). So the handler only queues the event (one
//! short lock, no Python) and, if no drain is pending, schedules one on the runtime's blocking
//! pool. The drain attaches to the interpreter and logs the queued events in order, taking each
//! batch out of the queue before it calls Python: no Rust lock is held while Python runs, and
//! no thread waits for one while holding the GIL. Logging right away (rather than on the next
//! call from Python) matters for an outage: a replica that admits nothing meanwhile still says
//! so.
//!
//! The protocol reports an outage once (then its end once); lost leases found by one heartbeat
//! (after a Redis restart, for instance) are logged as one line.

use std::sync::{Arc, Mutex};

use admitgate_fleet::{EventHandler, FleetEvent};
use pyo3::prelude::*;

use super::runtime::{attach_guard, spawn_blocking};
use crate::python::runtime::log;

/// Lost leases named in one log line; the rest are counted.
const NAMED_LEASES: usize = 5;

#[derive(Default)]
struct Queue {
    events: Vec<FleetEvent>,
    /// A drain is scheduled and has not yet found the queue empty.
    draining: bool,
}

/// One fleet limit's queue of events not yet logged.
#[derive(Default)]
pub struct EventSink {
    queue: Mutex<Queue>,
}

impl EventSink {
    /// The handler to give the lease protocol.
    pub fn handler(self: &Arc<Self>) -> EventHandler {
        let sink = self.clone();
        Arc::new(move |event: &FleetEvent| sink.push(event.clone()))
    }

    fn push(self: &Arc<Self>, event: FleetEvent) {
        let schedule = {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue.events.push(event);
            !std::mem::replace(&mut queue.draining, true)
        };
        if schedule {
            let sink = self.clone();
            spawn_blocking(move || sink.drain());
        }
    }

    /// Logs everything queued, batch by batch, until the queue is empty.
    fn drain(&self) {
        let entered = attach_guard();
        let logged = entered.as_ref().and_then(|_| {
            Python::try_attach(|py| loop {
                let Some(batch) = self.take() else { return };
                for (level, message) in lines(batch) {
                    log(py, level, message);
                }
            })
        });
        if logged.is_none() {
            // The interpreter is shutting down: nobody is left to tell.
            while self.take().is_some() {}
        }
    }

    /// The queued events, or `None` (and the drain is over) when there are none.
    fn take(&self) -> Option<Vec<FleetEvent>> {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if queue.events.is_empty() {
            queue.draining = false;
            None
        } else {
            Some(std::mem::take(&mut queue.events))
        }
    }
}

/// The log lines for a batch of events: one per event, except that consecutive lost leases
/// make one line.
fn lines(batch: Vec<FleetEvent>) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let mut lost: Vec<FleetEvent> = Vec::new();
    for event in batch {
        if matches!(event, FleetEvent::LeaseLost { .. }) {
            lost.push(event);
            continue;
        }
        flush_lost(&mut lost, &mut out);
        let level = if event.is_warning() {
            "warning"
        } else {
            "info"
        };
        out.push((level, event.to_string()));
    }
    flush_lost(&mut lost, &mut out);
    out
}

fn flush_lost(lost: &mut Vec<FleetEvent>, out: &mut Vec<(&'static str, String)>) {
    match lost.as_slice() {
        [] => {}
        [one] => out.push(("warning", one.to_string())),
        many => {
            let mut named: Vec<String> = many
                .iter()
                .take(NAMED_LEASES)
                .filter_map(|event| match event {
                    FleetEvent::LeaseLost { lease, scope } => {
                        Some(format!("{lease} (scope {scope:?})"))
                    }
                    _ => None,
                })
                .collect();
            if let Some(more) = many.len().checked_sub(NAMED_LEASES).filter(|&n| n > 0) {
                named.push(format!("and {more} more"));
            }
            out.push((
                "warning",
                format!(
                    "fleet limit: {} leases expired under their turns and their room was taken \
                     ({}); those turns run over the fleet cap",
                    many.len(),
                    named.join(", ")
                ),
            ));
        }
    }
    lost.clear();
}
