//! Why a fleet admission did not get a lease.

use std::fmt;

/// An admission the fleet limit could not serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FleetError {
    /// Redis cannot be reached and `on_backend_error` is `reject` (reason `fleet_unavailable`).
    Unavailable,
    /// The limit was shut down ([`FleetLimit::shutdown`](crate::FleetLimit::shutdown)).
    Closed,
    /// [`FleetLimit::connect`](crate::FleetLimit::connect) failed; the message never contains
    /// the URL's password.
    Backend(String),
    /// The fleet orders its leases by other priority classes than this replica's (named by
    /// its identity): refused, nothing queued (reason `fleet_unavailable`; see
    /// [`FleetClasses`](crate::FleetClasses)).
    Conflict(String),
}

impl FleetError {
    /// A short machine-readable reason, as admitgate's `AdmissionRejected.reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            FleetError::Unavailable | FleetError::Backend(_) | FleetError::Conflict(_) => {
                "fleet_unavailable"
            }
            FleetError::Closed => "fleet_closed",
        }
    }
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FleetError::Unavailable => {
                f.write_str("the fleet limit's Redis cannot be reached (on_backend_error=reject)")
            }
            FleetError::Closed => f.write_str("the fleet limit was shut down"),
            FleetError::Backend(message) => write!(f, "the fleet limit's Redis: {message}"),
            FleetError::Conflict(classes) => write!(
                f,
                "the fleet orders its leases by other priority classes than this replica's \
                 ({classes}); every replica of a fleet must configure the same classes"
            ),
        }
    }
}

impl std::error::Error for FleetError {}
