//! Pure admission decisions: no state, no clock, no locks.
//!
//! [`ConcurrencyLimit::decide`] answers exactly as PraisonAI's `ConcurrencyLimitPolicy.decide`
//! does for the same facts (the parity tests check every combination over small ranges), and
//! [`MemoryPressure::evaluate`] is the documented soft/hard RSS ladder. The gate in
//! [`crate::gate`] is what turns a decision into a running, waiting or rejected turn.

use std::fmt;

/// The largest count any limit accepts: the range of a signed 32-bit integer, as configuration
/// files and CLIs produce them. Larger values are almost certainly typos.
pub const MAX_COUNT: i64 = (1 << 31) - 1;

/// Outcome of one admission evaluation, ordered from least to most restrictive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Decision {
    /// Capacity is available: run now.
    Admit,
    /// Wait in the bounded queue for a slot.
    Queue,
    /// Shed the turn with a busy reply.
    Reject,
}

impl Decision {
    /// The wire value PraisonAI's `AdmissionDecision` enum uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Admit => "admit",
            Decision::Queue => "queue",
            Decision::Reject => "reject",
        }
    }

    /// Parses a wire value; `None` for anything else.
    pub fn from_value(value: &str) -> Option<Self> {
        match value {
            "admit" => Some(Decision::Admit),
            "queue" => Some(Decision::Queue),
            "reject" => Some(Decision::Reject),
            _ => None,
        }
    }

    /// The more restrictive of two decisions (REJECT > QUEUE > ADMIT).
    pub fn escalate(self, other: Decision) -> Decision {
        self.max(other)
    }
}

/// What happens to a turn that finds the wait queue full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// Reject the newcomer.
    Reject,
    /// Let the newcomer wait beyond the declared depth.
    Queue,
    /// Evict the oldest waiter of the queue the newcomer would join, then queue the newcomer.
    ShedOldest,
}

impl Overflow {
    /// The accepted spellings, in the order error messages list them.
    pub const NAMES: [&'static str; 3] = ["reject", "queue", "shed_oldest"];

    /// Parses a policy name; case and surrounding white space are ignored, and an empty name
    /// means `reject` (the default). A name of only spaces is refused: it is a typo.
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        if name.is_empty() {
            return Ok(Overflow::Reject);
        }
        let normalized = name.trim().to_ascii_lowercase();
        match normalized.as_str() {
            "reject" => Ok(Overflow::Reject),
            "queue" => Ok(Overflow::Queue),
            "shed_oldest" => Ok(Overflow::ShedOldest),
            _ => Err(ConfigError::UnknownOverflow {
                value: name.to_owned(),
            }),
        }
    }

    /// The canonical name.
    pub fn as_str(self) -> &'static str {
        match self {
            Overflow::Reject => "reject",
            Overflow::Queue => "queue",
            Overflow::ShedOldest => "shed_oldest",
        }
    }
}

/// A configuration value the core refuses, naming the argument and the bad value.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigError {
    /// A count below zero.
    Negative { arg: &'static str, value: i64 },
    /// A count above [`MAX_COUNT`].
    TooLarge { arg: &'static str, value: i64 },
    /// A threshold below zero.
    NegativeThreshold { arg: &'static str, value: f64 },
    /// A NaN or infinite threshold.
    NotFinite { arg: &'static str, value: f64 },
    /// A soft threshold above the hard one (both set).
    Inverted { soft: f64, hard: f64 },
    /// An overflow policy name that is not one of [`Overflow::NAMES`].
    UnknownOverflow { value: String },
}

impl ConfigError {
    /// The name of the argument at fault.
    pub fn arg(&self) -> &'static str {
        match self {
            ConfigError::Negative { arg, .. }
            | ConfigError::TooLarge { arg, .. }
            | ConfigError::NegativeThreshold { arg, .. }
            | ConfigError::NotFinite { arg, .. } => arg,
            ConfigError::Inverted { .. } => "soft_rss_mb",
            ConfigError::UnknownOverflow { .. } => "overflow_policy",
        }
    }
}

impl ConfigError {
    /// The message, with the bad value shown as `shown` (the binding passes the caller's
    /// own spelling of it, such as a Python `repr`; `Display` passes Rust's).
    pub fn describe(&self, shown: &str) -> String {
        let arg = self.arg();
        match self {
            ConfigError::Negative { .. } | ConfigError::NegativeThreshold { .. } => {
                format!("{arg} must be >= 0, got {shown}")
            }
            ConfigError::TooLarge { .. } => format!("{arg} must be <= {MAX_COUNT}, got {shown}"),
            ConfigError::NotFinite { .. } => format!("{arg} must be a finite number, got {shown}"),
            ConfigError::UnknownOverflow { .. } => format!(
                "overflow_policy must be one of ('reject', 'queue', 'shed_oldest'), got {shown}"
            ),
            ConfigError::Inverted { soft, hard } => {
                format!("soft_rss_mb ({soft:?}) must be <= hard_rss_mb ({hard:?})")
            }
        }
    }

    /// The bad value as Rust spells it.
    fn value_text(&self) -> String {
        match self {
            ConfigError::Negative { value, .. } | ConfigError::TooLarge { value, .. } => {
                value.to_string()
            }
            ConfigError::NegativeThreshold { value, .. } | ConfigError::NotFinite { value, .. } => {
                format!("{value:?}")
            }
            ConfigError::UnknownOverflow { value } => format!("{value:?}"),
            ConfigError::Inverted { soft, .. } => format!("{soft:?}"),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(&self.value_text()))
    }
}

impl std::error::Error for ConfigError {}

/// Checks a count argument: `0..=MAX_COUNT`.
pub fn check_count(arg: &'static str, value: i64) -> Result<u32, ConfigError> {
    if value < 0 {
        return Err(ConfigError::Negative { arg, value });
    }
    match u32::try_from(value) {
        Ok(count) if value <= MAX_COUNT => Ok(count),
        _ => Err(ConfigError::TooLarge { arg, value }),
    }
}

/// Checks a threshold argument: finite and `>= 0`.
pub fn check_threshold(arg: &'static str, value: f64) -> Result<f64, ConfigError> {
    if !value.is_finite() {
        return Err(ConfigError::NotFinite { arg, value });
    }
    if value < 0.0 {
        return Err(ConfigError::NegativeThreshold { arg, value });
    }
    Ok(value)
}

/// The live counts a concurrency decision is made from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// Turns holding a run slot.
    pub in_flight: u64,
    /// Turns waiting for a slot, across all scopes.
    pub queued: u64,
    /// Turns of this scope holding a run slot.
    pub scope_in_flight: u64,
    /// Turns of this scope waiting.
    pub scope_queued: u64,
}

/// The concurrency policy: a ceiling, a bounded queue, an overflow rule and a per-scope limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    /// Ceiling on concurrent runs; 0 disables the policy (everything is admitted).
    pub max_concurrent_runs: u32,
    /// How many turns may wait before the overflow rule applies.
    pub queue_depth: u32,
    /// What a turn that finds the queue full meets.
    pub overflow: Overflow,
    /// Per-scope (per-tenant) ceiling within the global one; 0 disables it.
    pub max_per_scope: u32,
}

impl ConcurrencyLimit {
    /// Validates and builds a policy.
    pub fn new(
        max_concurrent_runs: i64,
        queue_depth: i64,
        overflow: &str,
        max_per_scope: i64,
    ) -> Result<Self, ConfigError> {
        Ok(Self {
            max_concurrent_runs: check_count("max_concurrent_runs", max_concurrent_runs)?,
            queue_depth: check_count("queue_depth", queue_depth)?,
            overflow: Overflow::parse(overflow)?,
            max_per_scope: check_count("max_concurrent_runs_per_scope", max_per_scope)?,
        })
    }

    /// Whether a ceiling is set.
    pub fn enabled(&self) -> bool {
        self.max_concurrent_runs > 0
    }

    /// Whether a turn of a (non-empty) scope with these facts is held by its scope's limit.
    pub fn scope_blocked(&self, scoped: bool, facts: &Facts) -> bool {
        self.max_per_scope > 0 && scoped && facts.scope_in_flight >= u64::from(self.max_per_scope)
    }

    /// Decides for one turn. `scoped` says whether the turn carries a non-empty scope.
    ///
    /// The per-scope limit is checked first, because it is the tighter one: a tenant at its
    /// sub-limit is queued or shed against its own queue even while global slots are free.
    pub fn decide(&self, facts: &Facts, scoped: bool) -> Decision {
        if self.max_concurrent_runs == 0 {
            return Decision::Admit;
        }
        if self.scope_blocked(scoped, facts) {
            return self.overflow_decision(facts.scope_queued);
        }
        if facts.in_flight < u64::from(self.max_concurrent_runs) {
            return Decision::Admit;
        }
        self.overflow_decision(facts.queued)
    }

    fn overflow_decision(&self, queued: u64) -> Decision {
        if queued < u64::from(self.queue_depth) {
            return Decision::Queue;
        }
        match self.overflow {
            // `shed_oldest` queues too: the gate evicts the oldest waiter to make room.
            Overflow::Queue | Overflow::ShedOldest => Decision::Queue,
            Overflow::Reject => Decision::Reject,
        }
    }
}

/// The memory-pressure ladder: below `soft` admit, `soft..hard` queue, at or over `hard` reject.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryPressure {
    /// Soft (queue) threshold in MiB; 0 means none.
    pub soft_rss_mb: f64,
    /// Hard (reject) threshold in MiB; 0 means none.
    pub hard_rss_mb: f64,
}

impl MemoryPressure {
    /// Validates and builds a ladder. `hard_rss_mb == 0` means no hard threshold, so a
    /// soft-only ladder is valid; with both set, soft must not exceed hard.
    pub fn new(soft_rss_mb: f64, hard_rss_mb: f64) -> Result<Self, ConfigError> {
        let soft = check_threshold("soft_rss_mb", soft_rss_mb)?;
        let hard = check_threshold("hard_rss_mb", hard_rss_mb)?;
        if soft > 0.0 && hard > 0.0 && soft > hard {
            return Err(ConfigError::Inverted { soft, hard });
        }
        Ok(Self {
            soft_rss_mb: soft,
            hard_rss_mb: hard,
        })
    }

    /// Derives the ladder from one hard ceiling: soft is `soft_ratio` (clamped to `[0, 1]`)
    /// of it. `None` when the ceiling is 0 (memory-aware admission off).
    pub fn from_ceiling(max_rss_mb: f64, soft_ratio: f64) -> Result<Option<Self>, ConfigError> {
        let hard = check_threshold("max_rss_mb", max_rss_mb)?;
        if !soft_ratio.is_finite() {
            return Err(ConfigError::NotFinite {
                arg: "soft_ratio",
                value: soft_ratio,
            });
        }
        if hard == 0.0 {
            return Ok(None);
        }
        let soft = soft_ratio.clamp(0.0, 1.0) * hard;
        Self::new(soft, hard).map(Some)
    }

    /// Whether any threshold is set.
    pub fn enabled(&self) -> bool {
        self.soft_rss_mb > 0.0 || self.hard_rss_mb > 0.0
    }

    /// Decides for one sample; an unknown reading (`None`) admits, so a missing signal never
    /// blocks a turn.
    pub fn evaluate(&self, rss_mb: Option<f64>) -> Decision {
        let Some(rss) = rss_mb else {
            return Decision::Admit;
        };
        if self.hard_rss_mb > 0.0 && rss >= self.hard_rss_mb {
            return Decision::Reject;
        }
        if self.soft_rss_mb > 0.0 && rss >= self.soft_rss_mb {
            return Decision::Queue;
        }
        Decision::Admit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(in_flight: u64, queued: u64, scope_in_flight: u64, scope_queued: u64) -> Facts {
        Facts {
            in_flight,
            queued,
            scope_in_flight,
            scope_queued,
        }
    }

    #[test]
    fn disabled_policy_admits_everything() {
        let p = ConcurrencyLimit::new(0, 0, "reject", 0).unwrap();
        assert_eq!(p.decide(&facts(1000, 1000, 0, 0), false), Decision::Admit);
    }

    #[test]
    fn ceiling_then_queue_then_overflow() {
        let p = ConcurrencyLimit::new(2, 1, "reject", 0).unwrap();
        assert_eq!(p.decide(&facts(1, 0, 0, 0), false), Decision::Admit);
        assert_eq!(p.decide(&facts(2, 0, 0, 0), false), Decision::Queue);
        assert_eq!(p.decide(&facts(2, 1, 0, 0), false), Decision::Reject);
        let q = ConcurrencyLimit::new(2, 1, " Queue ", 0).unwrap();
        assert_eq!(q.overflow, Overflow::Queue);
        assert_eq!(q.decide(&facts(2, 5, 0, 0), false), Decision::Queue);
        let s = ConcurrencyLimit::new(2, 1, "SHED_OLDEST", 0).unwrap();
        assert_eq!(s.decide(&facts(2, 5, 0, 0), false), Decision::Queue);
    }

    #[test]
    fn scope_limit_applies_first_and_only_to_scoped_turns() {
        let p = ConcurrencyLimit::new(32, 2, "reject", 4).unwrap();
        assert_eq!(p.decide(&facts(4, 0, 4, 0), true), Decision::Queue);
        assert_eq!(p.decide(&facts(4, 0, 4, 2), true), Decision::Reject);
        assert_eq!(p.decide(&facts(4, 0, 4, 2), false), Decision::Admit);
        assert_eq!(p.decide(&facts(4, 9, 3, 0), true), Decision::Admit);
    }

    #[test]
    fn counts_are_validated() {
        assert_eq!(
            ConcurrencyLimit::new(-1, 0, "reject", 0)
                .unwrap_err()
                .to_string(),
            "max_concurrent_runs must be >= 0, got -1"
        );
        assert_eq!(
            ConcurrencyLimit::new(1, MAX_COUNT + 1, "reject", 0)
                .unwrap_err()
                .arg(),
            "queue_depth"
        );
        assert!(matches!(
            ConcurrencyLimit::new(1, 0, "drop", 0),
            Err(ConfigError::UnknownOverflow { .. })
        ));
        assert_eq!(
            ConcurrencyLimit::new(1, 0, "reject", -3).unwrap_err().arg(),
            "max_concurrent_runs_per_scope"
        );
    }

    #[test]
    fn memory_ladder() {
        let m = MemoryPressure::new(800.0, 1024.0).unwrap();
        assert_eq!(m.evaluate(None), Decision::Admit);
        assert_eq!(m.evaluate(Some(799.9)), Decision::Admit);
        assert_eq!(m.evaluate(Some(800.0)), Decision::Queue);
        assert_eq!(m.evaluate(Some(1023.9)), Decision::Queue);
        assert_eq!(m.evaluate(Some(1024.0)), Decision::Reject);
        let soft_only = MemoryPressure::new(100.0, 0.0).unwrap();
        assert_eq!(soft_only.evaluate(Some(1e9)), Decision::Queue);
        assert!(!MemoryPressure::new(0.0, 0.0).unwrap().enabled());
    }

    #[test]
    fn memory_ladder_is_validated() {
        assert!(matches!(
            MemoryPressure::new(2.0, 1.0),
            Err(ConfigError::Inverted { .. })
        ));
        assert!(matches!(
            MemoryPressure::new(f64::NAN, 1.0),
            Err(ConfigError::NotFinite { .. })
        ));
        assert!(matches!(
            MemoryPressure::new(0.0, f64::INFINITY),
            Err(ConfigError::NotFinite { .. })
        ));
        assert_eq!(
            MemoryPressure::new(-1.0, 0.0).unwrap_err().arg(),
            "soft_rss_mb"
        );
    }

    #[test]
    fn single_knob_derives_soft() {
        let m = MemoryPressure::from_ceiling(1000.0, 0.9).unwrap().unwrap();
        assert_eq!(m.soft_rss_mb, 900.0);
        assert_eq!(m.hard_rss_mb, 1000.0);
        assert_eq!(MemoryPressure::from_ceiling(0.0, 0.9).unwrap(), None);
        let clamped = MemoryPressure::from_ceiling(100.0, 7.0).unwrap().unwrap();
        assert_eq!(clamped.soft_rss_mb, 100.0);
        assert!(MemoryPressure::from_ceiling(-5.0, 0.9).is_err());
    }

    #[test]
    fn escalation_takes_the_stricter() {
        assert_eq!(Decision::Admit.escalate(Decision::Queue), Decision::Queue);
        assert_eq!(Decision::Reject.escalate(Decision::Queue), Decision::Reject);
        assert_eq!(Decision::Admit.escalate(Decision::Admit), Decision::Admit);
    }
}
