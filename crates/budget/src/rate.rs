//! A limit as an operator writes it: `"60/min"`, `"100000/min"`, `(1000, 86_400 s)`.

use std::fmt;
use std::time::Duration;

use crate::error::BudgetError;

/// The longest window a limit may have: a year. Longer windows only make mistakes (a typo in
/// the unit) look like limits.
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

/// The largest amount a limit may allow per window (requests or tokens).
pub const MAX_AMOUNT: u64 = 1 << 48;

/// At most `amount` per `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    amount: u64,
    window: Duration,
}

impl Rate {
    /// A rate of `amount` per `window`; `what` names the argument in the error.
    ///
    /// `amount` is 1 ..= 2⁴⁸ and `window` 1 ms ..= a year, a whole number of nanoseconds.
    pub fn new(what: &str, amount: u64, window: Duration) -> Result<Self, BudgetError> {
        let shown = || format!("({amount}, {window:?})");
        if amount == 0 || amount > MAX_AMOUNT {
            return Err(BudgetError::new(
                what,
                shown(),
                format!("the amount must be 1 to {MAX_AMOUNT}"),
            ));
        }
        if window < Duration::from_millis(1) || window > MAX_WINDOW {
            return Err(BudgetError::new(
                what,
                shown(),
                "the window must be 1 ms to 366 days",
            ));
        }
        Ok(Rate { amount, window })
    }

    /// Parses `"N/s"`, `"N/min"`, `"N/h"` or `"N/day"` (spaces around the parts allowed; `N`
    /// a whole number, `_` separators allowed as in `"100_000/min"`).
    pub fn parse(what: &str, text: &str) -> Result<Self, BudgetError> {
        let bad = |why: &str| BudgetError::new(what, format!("{text:?}"), why);
        let (amount, unit) = text
            .split_once('/')
            .ok_or_else(|| bad("expected \"N/s\", \"N/min\", \"N/h\" or \"N/day\""))?;
        let digits: String = amount.trim().chars().filter(|c| *c != '_').collect();
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("the amount before '/' must be a whole number"));
        }
        let amount: u64 = digits
            .parse()
            .map_err(|_| bad("the amount before '/' is too large"))?;
        let window = match unit.trim() {
            "s" | "sec" | "second" => Duration::from_secs(1),
            "min" | "minute" => Duration::from_secs(60),
            "h" | "hour" => Duration::from_secs(3600),
            "day" | "d" => Duration::from_secs(86_400),
            _ => {
                return Err(bad(
                    "the unit after '/' must be s, min, h or day (or give (N, seconds))",
                ))
            }
        };
        Rate::new(what, amount, window).map_err(|e| bad(e.reason()))
    }

    /// How many per window.
    pub fn amount(&self) -> u64 {
        self.amount
    }

    /// The window's length.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The window in nanoseconds (at most a year, so it fits).
    pub(crate) fn window_ns(&self) -> u64 {
        u64::try_from(self.window.as_nanos()).unwrap_or(u64::MAX)
    }
}

impl fmt::Display for Rate {
    /// `60/min`, `1000/day`, or `5/90s` for a window with no unit of its own.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.window.as_secs();
        let whole = self.window.subsec_nanos() == 0;
        match (whole, secs) {
            (true, 1) => write!(f, "{}/s", self.amount),
            (true, 60) => write!(f, "{}/min", self.amount),
            (true, 3600) => write!(f, "{}/h", self.amount),
            (true, 86_400) => write!(f, "{}/day", self.amount),
            _ => write!(f, "{}/{}s", self.amount, self.window.as_secs_f64()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_four_units() {
        let min = Rate::parse("requests", "60/min").unwrap();
        assert_eq!((min.amount(), min.window()), (60, Duration::from_secs(60)));
        assert_eq!(
            Rate::parse("r", "5/s").unwrap().window(),
            Duration::from_secs(1)
        );
        assert_eq!(
            Rate::parse("r", "5 / h").unwrap().window(),
            Duration::from_secs(3600)
        );
        let day = Rate::parse("tokens", "100_000/day").unwrap();
        assert_eq!(
            (day.amount(), day.window()),
            (100_000, Duration::from_secs(86_400))
        );
        assert_eq!(day.to_string(), "100000/day");
        assert_eq!(
            Rate::new("r", 5, Duration::from_secs(90))
                .unwrap()
                .to_string(),
            "5/90s"
        );
    }

    #[test]
    fn bad_text_names_the_argument_and_the_value() {
        for bad in [
            "60",
            "x/min",
            "60/fortnight",
            "0/min",
            "-1/min",
            "/min",
            "1e3/min",
        ] {
            let e = Rate::parse("requests", bad).unwrap_err();
            let shown = e.to_string();
            assert!(shown.starts_with("requests="), "{shown}");
            assert!(shown.contains(&format!("{bad:?}")), "{shown}");
        }
        let e = Rate::new("tokens", 5, Duration::from_micros(10)).unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        assert!(Rate::parse("r", "99999999999999999999999/min").is_err());
    }
}
