//! Waiting for a slot on a worker thread: the body of `with gate.admit_sync(...)`.
//!
//! A blocked turn shares the same slots, queues and FIFO order as async turns: it is an
//! ordinary waiter whose waker signals a condition variable instead of resolving a future.
//! The thread waits with the GIL released, in slices, so `KeyboardInterrupt` and other
//! signals are seen; its deadline (the smaller of the caller's `timeout` and the gate's
//! `queue_timeout_s`) refuses it with `timeout` through the same core operation as an async
//! queue timeout, so a grant and a timeout never both happen.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::exit::detach_counted;
use super::gate::PyAdmissionGate;
use super::pressure_watch::{self, WATCH_INTERVAL};
use super::rejection::rejection;
use super::runtime::now;
use super::wake::{Core, PyWaker, ThreadSignal};
use admitgate_core::transport::TransportId;
use admitgate_core::{Claim, Rejection, WaiterKey};

/// How long one wait lasts before the thread looks at signals again.
const SLICE: Duration = Duration::from_millis(100);

/// A queued turn waited for by a blocked thread. Dropped unfinished, it withdraws.
pub struct BlockingWait {
    core: Arc<Core>,
    /// For re-sampling memory pressure while it holds the turn back.
    gate: Py<PyAdmissionGate>,
    key: WaiterKey,
    transport: TransportId,
    signal: Arc<ThreadSignal>,
    /// A fleet lease follows the slot: the turn stays queued for its transport until then.
    lease_follows: bool,
    /// The gate's epoch when the turn queued (threads do not survive a fork, but the wait's
    /// owner might be dropped in the child: it leaves the child's counters alone).
    epoch: u64,
    done: bool,
}

impl BlockingWait {
    /// The wait of the turn queued under `key`.
    pub fn new(
        core: Arc<Core>,
        gate: Py<PyAdmissionGate>,
        key: WaiterKey,
        transport: TransportId,
        lease_follows: bool,
    ) -> Self {
        Self {
            epoch: core.epoch(),
            core,
            gate,
            key,
            transport,
            signal: Arc::new(ThreadSignal::default()),
            lease_follows,
            done: false,
        }
    }

    fn finish(&mut self, admitted: bool) {
        self.done = true;
        if !(admitted && self.lease_follows) && self.epoch == self.core.epoch() {
            self.core.transports.dequeued(self.transport, admitted);
        }
    }

    /// Blocks until the turn is granted a slot (its scope is returned) or refused (the
    /// rejection is raised), timing out at `deadline` on [`now`]'s clock.
    pub fn wait(
        &mut self,
        py: Python<'_>,
        deadline: Option<Duration>,
        reason: Rejection,
    ) -> PyResult<Option<Arc<str>>> {
        // Settled before registering: the claim below finds it.
        let _ = self
            .core
            .register(self.key, PyWaker::Thread(self.signal.clone()));
        loop {
            let (claim, wakes) = self.core.claim(self.key, now);
            wakes.run();
            match claim {
                Claim::Waiting => {}
                Claim::Admitted(scope) => {
                    self.finish(true);
                    return Ok(scope);
                }
                Claim::Refused(reason, retry_after) => {
                    self.finish(false);
                    self.core.transports.rejected(self.transport, reason);
                    return Err(rejection(py, reason, retry_after));
                }
                Claim::Unknown => {
                    self.finish(false);
                    return Err(PyRuntimeError::new_err("this turn's wait was withdrawn"));
                }
            }
            // Held back by memory pressure with slots free: nobody else may re-sample it (no
            // event loop need exist), so this thread does, every watch interval.
            let held_back = self.core.held_back();
            let longest = if held_back { WATCH_INTERVAL } else { SLICE };
            let slice = match deadline {
                Some(deadline) => deadline.saturating_sub(now()).min(longest),
                None => longest,
            };
            if slice.is_zero() {
                // Refuses the turn with `timeout` unless a slot was granted first; the claim
                // at the top of the loop tells which.
                let (_, wakes) = self.core.expire_for(self.key, reason);
                wakes.run();
                continue;
            }
            let signal = self.signal.clone();
            let woken = detach_counted(py, move || signal.wait(slice));
            if let Err(err) = py.check_signals() {
                self.withdraw(py);
                return Err(err);
            }
            if !woken && self.core.held_back() {
                pressure_watch::recheck(py, self.gate.get());
            }
        }
    }

    /// Leaves the queue (or hands on a slot granted in the meantime). Idempotent.
    pub fn withdraw(&mut self, py: Python<'_>) {
        if self.done {
            return;
        }
        self.finish(false);
        let (_, wakes) = self.core.cancel(self.key);
        wakes.run();
        self.core.after_release(py);
    }
}

impl Drop for BlockingWait {
    fn drop(&mut self) {
        if !self.done {
            Python::attach(|py| self.withdraw(py));
        }
    }
}
