//! What a fleet limit tells its owner: outages, recoveries and lost leases. The default handler
//! writes them to the `log` crate (target `admitgate.fleet`); the Python binding installs one
//! that routes them to the `admitgate` logger.

use std::sync::Arc;
use std::time::Duration;

use crate::config::OnBackendError;

/// Something an operator should hear about. No event ever carries the URL's password.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FleetEvent {
    /// Redis could not be reached (once per outage). `error` is the first failure.
    BackendDown {
        /// The redacted URL.
        url: String,
        /// What failed.
        error: String,
        /// What admissions do until it returns.
        on_backend_error: OnBackendError,
    },
    /// Redis answers again; leases taken during the outage were registered.
    BackendUp {
        /// The redacted URL.
        url: String,
        /// How long the outage lasted.
        down_for: Duration,
    },
    /// A heartbeat found a lease of this replica gone with no room to take it again (the holder
    /// paused past `lease_ttl`, or Redis restarted and the room was taken): the turn keeps
    /// running, possibly alongside a newer one.
    LeaseLost {
        /// The lease id.
        lease: String,
        /// Its scope ("" when none).
        scope: String,
    },
    /// The fleet orders its leases by other priority classes than this replica's: its turns
    /// are refused (`fleet_unavailable`) until the configurations agree. Once per limit.
    ClassConflict {
        /// The limit's key.
        key: String,
        /// This replica's class configuration (its identity).
        classes: String,
    },
}

impl FleetEvent {
    /// Whether the event deserves a warning (rather than information).
    pub fn is_warning(&self) -> bool {
        !matches!(self, FleetEvent::BackendUp { .. })
    }
}

impl std::fmt::Display for FleetEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FleetEvent::BackendDown {
                url,
                error,
                on_backend_error,
            } => {
                let meanwhile = match on_backend_error {
                    OnBackendError::Local => {
                        "admitting against each replica's local ceiling (the fleet cap is not \
                         enforced)"
                    }
                    OnBackendError::Reject => "refusing admissions (fleet_unavailable)",
                };
                write!(
                    f,
                    "fleet limit: Redis at {url} is unreachable ({error}); {meanwhile} until it \
                     returns"
                )
            }
            FleetEvent::BackendUp { url, down_for } => {
                write!(
                    f,
                    "fleet limit: Redis at {url} is back after {down_for:.1?}"
                )
            }
            FleetEvent::LeaseLost { lease, scope } => write!(
                f,
                "fleet limit: lease {lease} (scope {scope:?}) expired under its turn and the room \
                 was taken; the turn runs over the fleet cap"
            ),
            FleetEvent::ClassConflict { key, classes } => write!(
                f,
                "fleet limit {key:?}: the fleet orders its leases by other priority classes than \
                 this replica's ({classes}); its turns are refused (fleet_unavailable) until \
                 every replica configures the same classes (or this one uses another key)"
            ),
        }
    }
}

/// Receives every [`FleetEvent`]; called from the limit's tokio tasks, so it must not block.
pub type EventHandler = Arc<dyn Fn(&FleetEvent) + Send + Sync>;

/// The default handler: `log::warn!` / `log::info!` with target `admitgate.fleet`.
pub fn log_events() -> EventHandler {
    Arc::new(|event: &FleetEvent| {
        if event.is_warning() {
            log::warn!(target: "admitgate.fleet", "{event}");
        } else {
            log::info!(target: "admitgate.fleet", "{event}");
        }
    })
}
