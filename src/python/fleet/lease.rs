//! `admitgate.FleetLease`: one turn's share of a fleet-wide cap, as Python holds it.

use std::time::Duration;

use admitgate_fleet::{FleetError, Lease, Reclaim};
use parking_lot::Mutex;
use pyo3::exceptions::{PyConnectionError, PyRuntimeError};
use pyo3::prelude::*;

use super::runtime;
use crate::python::awaitable::ready;
use crate::python::errors::guard;
use crate::python::rejection::rejection;
use admitgate_core::Rejection;

/// A lease on one slot of a fleet-wide cap, held while a turn runs.
///
/// Given back by `await lease.release()`, or, failing that, as soon as the object is garbage
/// (on admitgate's runtime, without blocking). In a child of `os.fork()` a lease inherited
/// from the parent is the parent's: the child never gives it back.
#[pyclass(frozen, module = "admitgate", name = "FleetLease")]
pub struct PyFleetLease {
    lease: Mutex<Option<Lease>>,
    id: String,
    scope: String,
    /// How a `reclaim` got it; `None` for `acquire`.
    reclaimed: Option<&'static str>,
    /// The runtime epoch it was taken in (see [`runtime::epoch`]).
    epoch: u64,
}

impl PyFleetLease {
    /// Wraps a lease taken in runtime epoch `epoch`.
    pub fn new(lease: Lease, epoch: u64, reclaimed: Option<Reclaim>) -> Self {
        Self {
            id: lease.id().to_owned(),
            scope: lease.scope().to_owned(),
            lease: Mutex::new(Some(lease)),
            reclaimed: reclaimed.map(reclaim_name),
            epoch,
        }
    }

    /// Takes the lease out (to release or lend it); `None` when it is gone already or belongs
    /// to the parent of a fork (then it is forgotten, never given back).
    pub fn take(&self) -> Option<Lease> {
        let lease = self.lease.lock().take()?;
        if self.epoch == runtime::epoch() {
            Some(lease)
        } else {
            std::mem::forget(lease);
            None
        }
    }
}

/// The name `FleetLease.reclaimed` reports.
fn reclaim_name(how: Reclaim) -> &'static str {
    match how {
        Reclaim::Taken => "taken",
        Reclaim::Borrowed => "borrowed",
        Reclaim::BorrowedScope => "borrowed_scope",
        Reclaim::Local => "local",
    }
}

#[pymethods]
impl PyFleetLease {
    /// The lease id as stored in Redis: `<replica_id>#<instance nonce>#<n>`.
    #[getter]
    fn id(&self) -> &str {
        &self.id
    }

    /// The scope (tenant) the lease counts against; `""` when none.
    #[getter]
    fn scope(&self) -> &str {
        &self.scope
    }

    /// `None` for a lease from `acquire`; for one from `reclaim`: `"taken"` (there was room),
    /// `"borrowed"` (over the fleet cap, repaid by the next release in the fleet),
    /// `"borrowed_scope"` (over the tenant's slice) or `"local"` (Redis was down).
    #[getter]
    fn reclaimed(&self) -> Option<&'static str> {
        self.reclaimed
    }

    /// Whether this object no longer holds the lease (released, lent, or inherited from the
    /// parent of a fork).
    #[getter]
    fn released(&self) -> bool {
        self.lease.lock().is_none() || self.epoch != runtime::epoch()
    }

    /// Whether a heartbeat found the lease expired with no room to take it again: the turn
    /// runs over the fleet cap (counted in `fleet_lease_lost`).
    #[getter]
    fn lost(&self) -> PyResult<bool> {
        guard(|| {
            if self.epoch != runtime::epoch() {
                return Ok(false);
            }
            // Takes the protocol's registry lock for a moment; its holders never wait for the
            // GIL, so waiting for it here cannot deadlock.
            Ok(self.lease.lock().as_ref().is_some_and(Lease::is_lost))
        })
    }

    /// Gives the lease back (one bounded round trip; owed and sent when Redis returns during an
    /// outage). Awaiting is optional: the release is under way once this returns. Calling it
    /// again does nothing.
    fn release<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        guard(|| match self.take() {
            None => Ok(ready(py)?.into_bound(py)),
            Some(lease) => runtime::future_into_py(py, async move {
                lease.release().await;
                Ok(())
            }),
        })
    }

    fn __repr__(&self) -> String {
        let state = if self.released() { "released" } else { "held" };
        format!(
            "<FleetLease id={:?} scope={:?} {state}>",
            self.id, self.scope
        )
    }
}

impl Drop for PyFleetLease {
    fn drop(&mut self) {
        // Given back on the runtime by the lease's own destructor (never blocking); a lease of
        // the parent of a fork is forgotten.
        drop(self.take());
    }
}

/// What a fleet future resolves to, turned into a Python value once it is back on the
/// interpreter: a lease, `None`, or the exception for a failure.
pub enum Outcome {
    /// A lease.
    Lease(PyFleetLease),
    /// No lease and no error (`try_acquire` found no room; `lend`, `connect` and the like).
    Nothing,
    /// The protocol's failure, with the retry hint of a `fleet_unavailable` refusal.
    Failed(FleetError, Duration),
}

impl<'py> IntoPyObject<'py> for Outcome {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        match self {
            Outcome::Lease(lease) => Ok(Bound::new(py, lease)?.into_any()),
            Outcome::Nothing => Ok(py.None().into_bound(py)),
            Outcome::Failed(FleetError::Unavailable, retry_after) => Err(rejection(
                py,
                Rejection::FleetUnavailable,
                Some(retry_after),
            )),
            Outcome::Failed(FleetError::Closed, _) => {
                Err(PyRuntimeError::new_err("this fleet limit was shut down"))
            }
            Outcome::Failed(FleetError::Backend(message), _) => Err(PyConnectionError::new_err(
                format!("fleet limit: {message}"),
            )),
            // Another replica's classes hold the fleet: refused like an unreachable fleet
            // (the conflict is logged once, naming both sides' cause).
            Outcome::Failed(FleetError::Conflict(_), retry_after) => Err(rejection(
                py,
                Rejection::FleetUnavailable,
                Some(retry_after),
            )),
        }
    }
}
