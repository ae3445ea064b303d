//! The one error of this crate: a bad argument, named as the caller typed it.

use std::fmt;

/// A bad argument: its name, the value as given, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetError {
    argument: String,
    value: String,
    reason: String,
}

impl BudgetError {
    pub(crate) fn new(argument: &str, value: String, reason: impl Into<String>) -> Self {
        BudgetError {
            argument: argument.to_owned(),
            value,
            reason: reason.into(),
        }
    }

    /// The argument's name, e.g. `requests`.
    pub fn argument(&self) -> &str {
        &self.argument
    }

    /// The bad value as the caller gave it.
    pub fn value(&self) -> &str {
        &self.value
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for BudgetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}: {}", self.argument, self.value, self.reason)
    }
}

impl std::error::Error for BudgetError {}
