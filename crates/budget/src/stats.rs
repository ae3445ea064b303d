//! A budget's counters: lock-free, read at scrape time. No per-identity numbers.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a budget has done since it was built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BudgetStats {
    /// Admissions allowed.
    pub allowed: u64,
    /// Admissions refused.
    pub limited: u64,
    /// Refusals per limit (the limit with the longest wait is charged).
    pub limited_by: Vec<u64>,
    /// Token estimates reserved by allowed admissions.
    pub tokens_reserved: u64,
    /// Reservations settled.
    pub settled: u64,
    /// Tokens refunded at settling (estimate above use).
    pub tokens_refunded: u64,
    /// Tokens added as debt at settling (use above estimate).
    pub tokens_debt: u64,
    /// Reservations given back whole (the turn never ran).
    pub returned: u64,
    /// Tokens those reservations held.
    pub tokens_returned: u64,
    /// Identities held now.
    pub keys: u64,
    /// Idle identities forgotten (no effect on any decision).
    pub reclaimed: u64,
    /// Identities forgotten at the key cap while their state still mattered.
    pub evicted: u64,
}

pub(crate) struct Counters {
    allowed: AtomicU64,
    limited: AtomicU64,
    limited_by: Box<[AtomicU64]>,
    tokens_reserved: AtomicU64,
    settled: AtomicU64,
    tokens_refunded: AtomicU64,
    tokens_debt: AtomicU64,
    returned: AtomicU64,
    tokens_returned: AtomicU64,
}

fn add(cell: &AtomicU64, by: u64) {
    cell.fetch_add(by, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn new(limits: usize) -> Self {
        Counters {
            allowed: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            limited_by: (0..limits).map(|_| AtomicU64::new(0)).collect(),
            tokens_reserved: AtomicU64::new(0),
            settled: AtomicU64::new(0),
            tokens_refunded: AtomicU64::new(0),
            tokens_debt: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            tokens_returned: AtomicU64::new(0),
        }
    }

    pub(crate) fn allowed(&self, tokens: u64) {
        add(&self.allowed, 1);
        add(&self.tokens_reserved, tokens);
    }

    pub(crate) fn limited(&self, limit: usize) {
        add(&self.limited, 1);
        if let Some(cell) = self.limited_by.get(limit) {
            add(cell, 1);
        }
    }

    /// A reservation settled: `refunded` tokens given back, `debt` tokens charged.
    pub(crate) fn settled(&self, refunded: u64, debt: u64) {
        add(&self.settled, 1);
        add(&self.tokens_refunded, refunded);
        add(&self.tokens_debt, debt);
    }

    pub(crate) fn returned(&self, tokens: u64) {
        add(&self.returned, 1);
        add(&self.tokens_returned, tokens);
    }

    pub(crate) fn read(&self) -> BudgetStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BudgetStats {
            allowed: get(&self.allowed),
            limited: get(&self.limited),
            limited_by: self.limited_by.iter().map(get).collect(),
            tokens_reserved: get(&self.tokens_reserved),
            settled: get(&self.settled),
            tokens_refunded: get(&self.tokens_refunded),
            tokens_debt: get(&self.tokens_debt),
            returned: get(&self.returned),
            tokens_returned: get(&self.tokens_returned),
            ..BudgetStats::default()
        }
    }
}
