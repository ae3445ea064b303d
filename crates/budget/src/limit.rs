//! One limit of a budget (what it counts, its rate, its algorithm) and one key's state under it.

use crate::error::BudgetError;
use crate::gcra::{Cell, Gcra};
use crate::log::SlidingLog;
use crate::rate::Rate;
use crate::verdict::Verdict;

/// What a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Meter {
    /// Each admission counts 1.
    Requests,
    /// Each admission counts its token estimate, settled later to what it used.
    Tokens,
}

impl Meter {
    /// `requests` or `tokens`, as the argument is named.
    pub fn name(self) -> &'static str {
        match self {
            Meter::Requests => "requests",
            Meter::Tokens => "tokens",
        }
    }
}

/// How a limit decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Exact: at most `amount` in any half-open interval of length `window` (a sliding log).
    SlidingWindow,
    /// GCRA with this burst (≥ 1): `burst` at once, then one per `window / amount`; at most
    /// `amount + burst - 1` in any window. One 16-byte cell per key.
    Gcra {
        /// How many may pass at once.
        burst: u64,
    },
}

/// One limit: what it counts, how many per window, and how it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// What it counts.
    pub meter: Meter,
    /// How many per window.
    pub rate: Rate,
    /// How it decides.
    pub algorithm: Algorithm,
}

impl Limit {
    /// An exact sliding-window limit.
    pub fn sliding(meter: Meter, rate: Rate) -> Self {
        Limit {
            meter,
            rate,
            algorithm: Algorithm::SlidingWindow,
        }
    }

    /// A GCRA limit with `burst` (1 ..= the rate's amount... or more; at least 1).
    pub fn gcra(meter: Meter, rate: Rate, burst: u64) -> Result<Self, BudgetError> {
        if burst == 0 || burst > crate::rate::MAX_AMOUNT {
            return Err(BudgetError::new(
                "burst",
                burst.to_string(),
                format!("must be 1 to {}", crate::rate::MAX_AMOUNT),
            ));
        }
        Ok(Limit {
            meter,
            rate,
            algorithm: Algorithm::Gcra { burst },
        })
    }

    /// The largest token estimate an admission may ever reserve under this limit (a sliding
    /// window's amount, a GCRA limit's burst): more is refused with no retry time. `None` for
    /// a request limit, which counts no tokens.
    pub fn max_tokens(&self) -> Option<u64> {
        match (self.meter, self.algorithm) {
            (Meter::Requests, _) => None,
            (Meter::Tokens, Algorithm::SlidingWindow) => Some(self.rate.amount()),
            (Meter::Tokens, Algorithm::Gcra { burst }) => Some(burst),
        }
    }

    /// What one admission costs under this limit: 1 request, or its tokens.
    pub(crate) fn cost(&self, tokens: u64) -> u64 {
        match self.meter {
            Meter::Requests => 1,
            Meter::Tokens => tokens,
        }
    }

    fn gcra_params(&self, burst: u64) -> Gcra {
        Gcra {
            window: self.rate.window_ns(),
            amount: self.rate.amount(),
            burst,
        }
    }

    /// A key's fresh state under this limit.
    pub(crate) fn fresh(&self) -> LimitState {
        match self.algorithm {
            Algorithm::SlidingWindow => LimitState::Log(SlidingLog::default()),
            Algorithm::Gcra { .. } => LimitState::Cell(Cell::default()),
        }
    }

    /// Forgets what left the window by `now`; frees an emptied log.
    pub(crate) fn prune(&self, state: &mut LimitState, now: u64) {
        if let LimitState::Log(log) = state {
            log.prune(now, self.rate.window_ns());
            if log.is_empty() {
                // Give the buffer back: an idle key holds no heap.
                *log = SlidingLog::default();
            }
        }
    }

    /// Whether `cost` fits now (the state pruned to `now` first), and if not, from when.
    pub(crate) fn verdict(&self, state: &LimitState, now: u64, cost: u64) -> Verdict {
        match (state, self.algorithm) {
            (LimitState::Log(log), _) => {
                log.verdict(self.rate.window_ns(), self.rate.amount(), cost)
            }
            (LimitState::Cell(cell), Algorithm::Gcra { burst }) => {
                cell.verdict(self.gcra_params(burst), now, cost)
            }
            (LimitState::Cell(_), Algorithm::SlidingWindow) => Verdict::Never,
        }
    }

    /// Records `cost` at `now`.
    pub(crate) fn add(&self, state: &mut LimitState, now: u64, cost: u64) {
        match (state, self.algorithm) {
            (LimitState::Log(log), _) => log.add(now, cost),
            (LimitState::Cell(cell), Algorithm::Gcra { burst }) => {
                cell.add(self.gcra_params(burst), now, cost)
            }
            (LimitState::Cell(_), Algorithm::SlidingWindow) => {}
        }
    }

    /// Takes back `cost` recorded at `at`.
    pub(crate) fn take_back(&self, state: &mut LimitState, at: u64, cost: u64) {
        match (state, self.algorithm) {
            (LimitState::Log(log), _) => {
                log.take_back(at, cost);
                if log.is_empty() {
                    *log = SlidingLog::default();
                }
            }
            (LimitState::Cell(cell), Algorithm::Gcra { burst }) => {
                cell.take_back(self.gcra_params(burst), cost)
            }
            (LimitState::Cell(_), Algorithm::SlidingWindow) => {}
        }
    }

    /// When the state is as if new again (ns); `0` if it is now.
    pub(crate) fn idle_at(&self, state: &LimitState) -> u64 {
        match (state, self.algorithm) {
            (LimitState::Log(log), _) => log.empty_at(self.rate.window_ns()).unwrap_or(0),
            (LimitState::Cell(cell), Algorithm::Gcra { burst }) => {
                cell.idle_at(self.gcra_params(burst))
            }
            (LimitState::Cell(_), Algorithm::SlidingWindow) => 0,
        }
    }
}

/// One key's state under one limit: 40 bytes inline, plus a sliding log's buffer while it
/// holds entries (no allocation otherwise).
#[derive(Debug, Clone)]
pub(crate) enum LimitState {
    Log(SlidingLog),
    Cell(Cell),
}

impl LimitState {
    /// The newest time recorded, if the state keeps times (a log).
    pub(crate) fn newest(&self) -> Option<u64> {
        match self {
            LimitState::Log(log) => log.newest(),
            LimitState::Cell(_) => None,
        }
    }

    /// Heap bytes held beyond the inline state.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            LimitState::Log(log) => log.heap_bytes(),
            LimitState::Cell(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_is_the_largest_cost_that_ever_fits() {
        let rate = Rate::parse("tokens", "1000/min").unwrap();
        for limit in [
            Limit::sliding(Meter::Tokens, rate),
            Limit::gcra(Meter::Tokens, rate, 300).unwrap(),
        ] {
            let max = limit.max_tokens().unwrap();
            let state = limit.fresh();
            assert_ne!(limit.verdict(&state, 0, max), Verdict::Never, "{limit:?}");
            assert_eq!(
                limit.verdict(&state, 0, max + 1),
                Verdict::Never,
                "{limit:?}"
            );
        }
        assert_eq!(Limit::sliding(Meter::Requests, rate).max_tokens(), None);
    }

    #[test]
    fn a_key_state_is_40_bytes_inline() {
        assert_eq!(std::mem::size_of::<super::LimitState>(), 40);
    }
}
