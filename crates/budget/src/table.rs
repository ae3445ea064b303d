//! The keys of one shard: their states, found by hash, with idle keys reclaimed and the count
//! held at a cap.
//!
//! Slots live in two parallel vectors (the key hashes, and `stride` limit states per key),
//! found through a `hashbrown::HashTable` of 4-byte slot numbers; a removed slot is filled by
//! the last one (`swap_remove`), so the vectors stay dense. There is no per-key allocation
//! except a sliding log's buffer while it holds entries.
//!
//! **Reclaiming.** A key whose every limit is idle (as if new: its log empty, its GCRA cell's
//! time past) is forgotten with no effect on any decision. A full sweep runs when the shard has
//! doubled since the last one (amortised O(1) per new key), so the shard holds at most twice
//! its live keys.
//!
//! **The cap.** At `capacity` live keys, a new key evicts one: five slots are sampled and the
//! one that would be idle soonest goes (Redis' approximated-LRU idea, on "expires soonest",
//! which is the state that matters least). Evicting a key that is not yet idle forgets
//! admissions still in its window: the only way a local limit can let more through than it
//! says. It is counted (`evicted`), and it needs more distinct identities within one window
//! than the cap.

use hashbrown::HashTable;

use crate::limit::{Limit, LimitState};

/// A sweep runs no sooner than at this many keys.
const MIN_SWEEP: usize = 64;

/// How many slots an eviction samples.
const EVICTION_SAMPLES: usize = 5;

pub(crate) struct Table {
    index: HashTable<u32>,
    hashes: Vec<u64>,
    states: Vec<LimitState>,
    stride: usize,
    capacity: usize,
    sweep_at: usize,
    inserts_since_sweep: usize,
    rng: u64,
    /// Keys forgotten while their state still mattered (at the cap).
    pub(crate) evicted: u64,
    /// Idle keys forgotten.
    pub(crate) reclaimed: u64,
}

impl Table {
    pub(crate) fn new(stride: usize, capacity: usize, seed: u64) -> Self {
        Table {
            index: HashTable::new(),
            hashes: Vec::new(),
            states: Vec::new(),
            stride: stride.max(1),
            capacity: capacity.clamp(1, u32::MAX as usize),
            sweep_at: MIN_SWEEP,
            inserts_since_sweep: 0,
            rng: seed | 1,
            evicted: 0,
            reclaimed: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.hashes.len()
    }

    pub(crate) fn find(&self, hash: u64) -> Option<usize> {
        let hashes = &self.hashes;
        self.index
            .find(hash, |&slot| hashes.get(slot as usize) == Some(&hash))
            .map(|&slot| slot as usize)
    }

    /// The limit states of the key in `slot`.
    pub(crate) fn states(&mut self, slot: usize) -> &mut [LimitState] {
        let start = slot.saturating_mul(self.stride);
        let end = start.saturating_add(self.stride).min(self.states.len());
        self.states.get_mut(start..end).unwrap_or_default()
    }

    /// Adds a key with fresh states (reclaiming or evicting first if the shard is full).
    pub(crate) fn insert(&mut self, hash: u64, limits: &[Limit], now: u64) -> usize {
        let len = self.len();
        if len >= self.sweep_at && self.inserts_since_sweep >= len / 2 {
            self.sweep(limits, now);
        }
        while self.len() >= self.capacity {
            self.evict_one(limits, now);
        }
        let slot = self.len();
        self.hashes.push(hash);
        self.states.extend(limits.iter().map(Limit::fresh));
        let hashes = &self.hashes;
        self.index.insert_unique(hash, slot as u32, |&s| {
            hashes.get(s as usize).copied().unwrap_or_default()
        });
        self.inserts_since_sweep = self.inserts_since_sweep.saturating_add(1);
        slot
    }

    /// When the key in `slot` is as if new again.
    fn idle_at(&self, slot: usize, limits: &[Limit]) -> u64 {
        let start = slot.saturating_mul(self.stride);
        limits
            .iter()
            .zip(self.states.iter().skip(start))
            .map(|(limit, state)| limit.idle_at(state))
            .max()
            .unwrap_or(0)
    }

    /// Forgets every idle key.
    pub(crate) fn sweep(&mut self, limits: &[Limit], now: u64) {
        for slot in (0..self.len()).rev() {
            if self.idle_at(slot, limits) <= now {
                self.remove(slot);
                self.reclaimed = self.reclaimed.saturating_add(1);
            }
        }
        self.sweep_at = self.len().saturating_mul(2).clamp(MIN_SWEEP, self.capacity);
        self.inserts_since_sweep = 0;
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64: cheap, and only picks eviction candidates.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn evict_one(&mut self, limits: &[Limit], now: u64) {
        let len = self.len() as u64;
        if len == 0 {
            return;
        }
        let mut victim = (u64::MAX, 0usize);
        for _ in 0..EVICTION_SAMPLES {
            let slot = self.next_random().checked_rem(len).unwrap_or(0) as usize;
            let idle_at = self.idle_at(slot, limits);
            if idle_at < victim.0 {
                victim = (idle_at, slot);
            }
        }
        if victim.0 > now {
            self.evicted = self.evicted.saturating_add(1);
        } else {
            self.reclaimed = self.reclaimed.saturating_add(1);
        }
        self.remove(victim.1);
    }

    /// Removes `slot`, moving the last slot into its place.
    pub(crate) fn remove(&mut self, slot: usize) {
        let Some(last) = self.len().checked_sub(1) else {
            return;
        };
        let Some(&hash) = self.hashes.get(slot) else {
            return;
        };
        if let Ok(entry) = self.index.find_entry(hash, |&s| s as usize == slot) {
            entry.remove();
        }
        if slot != last {
            if let Some(&moved) = self.hashes.get(last) {
                if let Some(s) = self.index.find_mut(moved, |&s| s as usize == last) {
                    *s = slot as u32;
                }
            }
            let (to, from) = (
                slot.saturating_mul(self.stride),
                last.saturating_mul(self.stride),
            );
            for i in 0..self.stride {
                let (a, b) = (to.saturating_add(i), from.saturating_add(i));
                if a < self.states.len() && b < self.states.len() {
                    self.states.swap(a, b);
                }
            }
        }
        self.hashes.swap_remove(slot);
        self.states.truncate(last.saturating_mul(self.stride));
    }

    /// Bytes held: the vectors' and the index's allocations, and the logs' buffers.
    pub(crate) fn bytes(&self) -> usize {
        let heap: usize = self.states.iter().map(LimitState::heap_bytes).sum();
        self.hashes
            .capacity()
            .saturating_mul(std::mem::size_of::<u64>())
            .saturating_add(
                self.states
                    .capacity()
                    .saturating_mul(std::mem::size_of::<LimitState>()),
            )
            .saturating_add(self.index.allocation_size())
            .saturating_add(heap)
    }
}
