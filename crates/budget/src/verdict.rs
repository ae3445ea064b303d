//! What one limit says about one more admission now.

/// One limit's answer for an admission of some cost at some time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// It fits now.
    Allowed,
    /// It fits from this time on (ns, the caller's clock), if nothing else is admitted first.
    RetryAt(u64),
    /// It can never fit: the cost is more than the limit holds.
    Never,
}

impl Verdict {
    /// Two limits' answers together: the admission needs both, and each limit's "allowed from"
    /// only moves later as time passes with nothing admitted, so the later time is exact.
    pub(crate) fn and(self, other: Verdict) -> Verdict {
        match (self, other) {
            (Verdict::Never, _) | (_, Verdict::Never) => Verdict::Never,
            (Verdict::Allowed, v) | (v, Verdict::Allowed) => v,
            (Verdict::RetryAt(a), Verdict::RetryAt(b)) => Verdict::RetryAt(a.max(b)),
        }
    }
}
