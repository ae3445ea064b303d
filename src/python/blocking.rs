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

use admitgate_passage::turn::{Claimed, WaitEnd};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::admission::Admission;
use super::exit::detach_counted;
use super::pressure_check::{self, WATCH_INTERVAL};
use super::runtime::now;
use super::wake::{PyWaker, ThreadSignal};

/// How long one wait lasts before the thread looks at signals again.
const SLICE: Duration = Duration::from_millis(100);

/// A queued turn waited for by a blocked thread. Dropped unfinished, it withdraws.
pub struct BlockingWait<'a> {
    admission: &'a Admission,
    signal: Arc<ThreadSignal>,
    done: bool,
}

impl<'a> BlockingWait<'a> {
    /// The wait of the queued turn of `admission`.
    pub fn new(admission: &'a Admission) -> Self {
        Self {
            admission,
            signal: Arc::new(ThreadSignal::default()),
            done: false,
        }
    }

    /// Blocks until the turn is granted a slot or refused (the rejection is raised), looked at
    /// (refused if due, for its reason) at each of its wait's ends on [`now`]'s clock.
    pub fn wait(&mut self, py: Python<'_>, mut until: Option<WaitEnd>) -> PyResult<()> {
        let core = self.admission.gate().get().core.clone();
        // Settled before registering: the claim below finds it.
        let _ = self
            .admission
            .register(PyWaker::Thread(self.signal.clone()));
        loop {
            match self.admission.claim() {
                Claimed::Waiting => {}
                Claimed::Granted => {
                    self.done = true;
                    return Ok(());
                }
                Claimed::Refused(refused) => {
                    self.done = true;
                    return Err(self
                        .admission
                        .refusal(py, refused.reason, refused.retry_after));
                }
                Claimed::Withdrawn => {
                    self.done = true;
                    return Err(PyRuntimeError::new_err("this turn's wait was withdrawn"));
                }
            }
            // Held back by memory pressure with slots free: nobody else may re-sample it (no
            // event loop need exist), so this thread does, every watch interval.
            let held_back = core.held_back();
            let longest = if held_back { WATCH_INTERVAL } else { SLICE };
            let slice = match until {
                Some(end) => end.at.saturating_sub(now()).min(longest),
                None => longest,
            };
            if let (true, Some(end)) = (slice.is_zero(), until) {
                // Refuses the turn for its reason if due, unless a slot was granted first; the
                // claim at the top of the loop tells which. Otherwise it waits for the next.
                until = self.admission.expire(&end);
                continue;
            }
            let signal = self.signal.clone();
            let woken = detach_counted(py, move || signal.wait(slice));
            if let Err(err) = py.check_signals() {
                self.withdraw(py);
                return Err(err);
            }
            if !woken && core.held_back() {
                pressure_check::recheck(py, self.admission.gate().get());
            }
        }
    }

    /// Leaves the queue (or hands on a slot granted in the meantime). Idempotent.
    pub fn withdraw(&mut self, py: Python<'_>) {
        if self.done {
            return;
        }
        self.done = true;
        self.admission.withdraw(py);
    }
}

impl Drop for BlockingWait<'_> {
    fn drop(&mut self) {
        if !self.done {
            Python::attach(|py| self.withdraw(py));
        }
    }
}
