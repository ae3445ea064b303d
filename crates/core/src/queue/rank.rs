//! How many waiters are ahead of one: order statistics over the wait queue in O(log n).
//!
//! `on_queued` and `Admission.position` ask where a waiter stands. Walking the queue to find
//! out cost O(n) under the gate's lock, so n arrivals that each asked cost O(n^2) (40,000
//! queued arrivals held the lock for 6.7 s). Instead every waiter on the queue gets a *rank
//! slot*, handed out in arrival order, and a Fenwick tree over the slots counts the live
//! ones: a waiter's position is the number of live slots below its own, a prefix sum.
//!
//! Slots are never reused, so the tree fills up; when it does, the live waiters are renumbered
//! 0..n in queue order and the tree is rebuilt with room for as many again (at least
//! `MIN_CAPACITY`). A rebuild costs O(n) and is followed by at least n + 1 pushes before
//! the next one, so a push costs amortised O(1) plus the O(log n) update, and the tree's
//! memory stays within about twice the longest queue since the last rebuild.

/// The smallest tree built, so a short queue does not rebuild every few pushes.
const MIN_CAPACITY: usize = 64;

/// A Fenwick tree counting live rank slots.
#[derive(Debug, Default)]
pub struct RankIndex {
    /// `tree[i - 1]` counts the live slots in `(i - lowbit(i), i]` (1-based positions).
    tree: Vec<u64>,
    /// The next slot to hand out; `tree.len()` when the tree is full.
    next: usize,
}

/// The lowest set bit of `i`.
fn lowbit(i: usize) -> usize {
    i & i.wrapping_neg()
}

impl RankIndex {
    /// Hands out the next slot, marking it live; `None` when the tree is full (the caller
    /// then renumbers its waiters with [`RankIndex::rebuild`] and asks again).
    pub fn push(&mut self) -> Option<usize> {
        let slot = self.next;
        if slot >= self.tree.len() {
            return None;
        }
        self.next = slot.saturating_add(1);
        self.add(slot, true);
        Some(slot)
    }

    /// Marks `slot` no longer live (its waiter left the queue).
    pub fn remove(&mut self, slot: usize) {
        self.add(slot, false);
    }

    /// How many live slots are below `slot`: the waiters ahead of the one holding it.
    pub fn before(&self, slot: usize) -> u64 {
        let mut sum: u64 = 0;
        // 1-based position `slot` covers slots 0..slot.
        let mut i = slot.min(self.tree.len());
        while i > 0 {
            sum = sum.saturating_add(self.tree.get(i.wrapping_sub(1)).copied().unwrap_or(0));
            i &= i.wrapping_sub(1);
        }
        sum
    }

    /// Forgets every slot and makes room for `live` waiters, renumbered `0..live` (the
    /// caller assigns those slots in queue order), plus as many again.
    pub fn rebuild(&mut self, live: usize) {
        let capacity = live.saturating_mul(2).saturating_add(1).max(MIN_CAPACITY);
        // Positions 1..=live hold one live slot each: position i covers
        // (i - lowbit(i), i], of which min(i, live) - (i - lowbit(i)) are live.
        self.tree = (1..=capacity)
            .map(|i| {
                let start = i.wrapping_sub(lowbit(i));
                i.min(live).saturating_sub(start) as u64
            })
            .collect();
        self.next = live.min(capacity);
    }

    /// Forgets every slot (the queue was emptied).
    pub fn clear(&mut self) {
        self.rebuild(0);
    }

    fn add(&mut self, slot: usize, live: bool) {
        let len = self.tree.len();
        let mut i = slot.saturating_add(1);
        while i <= len {
            if let Some(count) = self.tree.get_mut(i.wrapping_sub(1)) {
                *count = if live {
                    count.saturating_add(1)
                } else {
                    debug_assert!(*count > 0, "rank slot {slot} removed twice");
                    count.saturating_sub(1)
                };
            }
            i = i.wrapping_add(lowbit(i));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_live_slots_below_and_rebuilds_when_full() {
        let mut rank = RankIndex::default();
        assert_eq!(rank.push(), None, "an empty index has no room until built");
        rank.rebuild(0);
        let slots: Vec<usize> = (0..10).map(|_| rank.push().unwrap()).collect();
        assert_eq!(slots, (0..10).collect::<Vec<_>>());
        assert_eq!(rank.before(9), 9);
        rank.remove(3);
        rank.remove(0);
        assert_eq!(rank.before(9), 7);
        assert_eq!(rank.before(3), 2);
        assert_eq!(rank.before(4), 2);
        // Rebuilt for 8 live waiters: they hold 0..8 and the next push gets 8.
        rank.rebuild(8);
        assert_eq!(rank.before(7), 7);
        assert_eq!(rank.push(), Some(8));
        assert_eq!(rank.before(8), 8);
        assert_eq!(rank.tree.len(), MIN_CAPACITY);
    }

    #[test]
    fn matches_a_naive_count_under_random_pushes_and_removals() {
        let mut rank = RankIndex::default();
        let mut live: Vec<usize> = Vec::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            if next() % 3 == 0 && !live.is_empty() {
                let victim = live.remove((next() % live.len() as u64) as usize);
                rank.remove(victim);
            } else {
                let slot = match rank.push() {
                    Some(slot) => slot,
                    None => {
                        rank.rebuild(live.len());
                        live = (0..live.len()).collect();
                        rank.push().unwrap()
                    }
                };
                live.push(slot);
            }
            if let Some(&probe) = live.get((next() % (live.len() as u64 + 1)) as usize) {
                let naive = live.iter().filter(|&&s| s < probe).count() as u64;
                assert_eq!(rank.before(probe), naive);
            }
        }
    }
}
