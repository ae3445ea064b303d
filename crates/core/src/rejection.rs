//! Why a turn was refused: one reason per refusal, shared by the gate, its wait queue and
//! every front door (the gate's own module and the queue's both name it, so it lives apart
//! from both).

/// Why a turn was refused. One table maps each reason to its HTTP and gRPC status
/// (`admitgate.REJECTION_REASONS` in Python, and the README).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// The queue it would join was full and the overflow policy rejects (or `shed_oldest`
    /// found nobody to evict).
    QueueFull,
    /// Evicted from the queue by a newer turn under `shed_oldest` (counted in `shed`).
    Shed,
    /// A user-supplied policy said reject.
    Policy,
    /// Resident memory is at or above the hard threshold.
    MemoryPressure,
    /// The gate is closing (drained).
    Closing,
    /// It waited longer than the queue timeout.
    Timeout,
    /// The fleet-wide limit's backend is unreachable and the gate refuses rather than admit
    /// against its local ceiling alone.
    FleetUnavailable,
    /// Its caller's deadline passed while it waited, or less of it was left than a turn
    /// typically takes: its caller would have left before it finished.
    Deadline,
    /// A budget (`rate_limit=`) has no room for the turn's identity: requests or tokens per
    /// window used up. Decided before the slot, so the turn never took one; the retry time is
    /// exact (when the same turn fits).
    RateLimited,
}

impl Rejection {
    /// Every reason, in the order per-reason counters are kept.
    pub const ALL: [Rejection; 9] = [
        Rejection::QueueFull,
        Rejection::Shed,
        Rejection::Policy,
        Rejection::MemoryPressure,
        Rejection::Closing,
        Rejection::Timeout,
        Rejection::FleetUnavailable,
        Rejection::Deadline,
        Rejection::RateLimited,
    ];

    /// A stable name for logs, metrics and `AdmissionRejected.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::QueueFull => "queue_full",
            Rejection::Shed => "shed",
            Rejection::Policy => "policy",
            Rejection::MemoryPressure => "memory_pressure",
            Rejection::Closing => "closing",
            Rejection::Timeout => "timeout",
            Rejection::FleetUnavailable => "fleet_unavailable",
            Rejection::Deadline => "deadline",
            Rejection::RateLimited => "rate_limited",
        }
    }

    /// This reason's position in [`Rejection::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}
