//! After `os.fork()`: the child's gates start empty, its samplers forget cached readings, and
//! a broker its parent was serving leaves the child's signal handlers as they were.
//!
//! admitgate keeps a weak registry of every live gate core and sampler; the package's
//! `os.register_at_fork(after_in_child=...)` hook calls the two functions here.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use pyo3::prelude::*;

use super::wake::Core;
use admitgate_core::rss::RssSampler;

static GATES: Mutex<Vec<Weak<Core>>> = Mutex::new(Vec::new());
static SAMPLERS: Mutex<Vec<Weak<RssSampler>>> = Mutex::new(Vec::new());

fn register<T>(registry: &Mutex<Vec<Weak<T>>>, item: &Arc<T>) {
    let mut all = registry.lock();
    all.retain(|w| w.strong_count() > 0);
    all.push(Arc::downgrade(item));
}

fn live<T>(registry: &Mutex<Vec<Weak<T>>>) -> Vec<Arc<T>> {
    registry.lock().iter().filter_map(Weak::upgrade).collect()
}

/// Remembers a gate core so a forked child can empty it.
pub fn register_gate(core: &Arc<Core>) {
    register(&GATES, core);
}

/// Remembers a sampler so a forked child forgets its cached reading.
pub fn register_sampler(sampler: &Arc<RssSampler>) {
    register(&SAMPLERS, sampler);
}

/// Empties every gate in a freshly forked child: the parent's turns are not the child's.
///
/// Safe to take the cores' locks here: every core operation runs while its thread is
/// attached to the interpreter, and `os.fork()` is called by an attached thread, so no other
/// thread was inside a core operation when the process forked.
#[pyfunction]
pub fn _reset_after_fork(py: Python<'_>) -> PyResult<()> {
    super::exit::reset_after_fork();
    for core in live(&GATES) {
        core.reset_after_fork();
    }
    super::broker::reset_after_fork(py)
}

/// Forgets cached readings in a forked child.
#[pyfunction]
pub fn _invalidate_samplers() {
    for sampler in live(&SAMPLERS) {
        sampler.invalidate();
    }
}
