//! Turns let through while the gate has nothing to enforce, counted without its lock.
//!
//! A gate with no ceiling, no memory-aware admission and no fleet limit lets every turn
//! straight through, as the reference does, at the cost of two atomic operations per turn.
//! Those turns still run when a ceiling is set later (`reconfigure(max_concurrent_runs=2)`),
//! and a ceiling that did not know them would be exceeded by all of them. So they are counted
//! here, and the gate *adopts* the count under its lock whenever it enforces something
//! (every `reconfigure`, and an enforced arrival that finds any running): adopted turns hold
//! slots in the gate's count like admitted ones, and give them back there when they end.
//!
//! # Implementation details
//!
//! One `u64`: the low 32 bits count the turns running uncounted by the gate, the high 32 bits
//! are the *era*, bumped by each adoption. A turn's [`PassTicket`] remembers the era it
//! entered in; when it ends, it takes itself off the count if the era is unchanged, and
//! otherwise it was adopted and must give its slot back to the gate. Both steps are single
//! atomic read-modify-writes, so a turn ending races an adoption safely: exactly one of the two
//! counts it. (2^32 turns passing at once, which would carry into the era, cannot happen: each
//! is a live Python coroutine.)

use std::sync::atomic::Ordering;

use super::sync::AtomicU64;

const COUNT_MASK: u64 = u32::MAX as u64;

/// The era and count of turns running uncounted by the gate (see the module documentation).
#[derive(Debug, Default)]
pub struct PassThroughTurns(AtomicU64);

/// What a turn let through remembers: the era it entered in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a turn let through must be ended with `PassThroughTurns::leave`"]
pub struct PassTicket {
    era: u32,
}

/// How a turn let through ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassEnd {
    /// It was still uncounted by the gate: nothing else to do.
    Uncounted,
    /// The gate adopted it: it holds a slot there, to be returned.
    Adopted,
}

fn era(value: u64) -> u32 {
    (value >> 32) as u32
}

impl PassThroughTurns {
    /// A turn is let through.
    pub fn enter(&self) -> PassTicket {
        // AcqRel: an enter ordered after an adoption sees what preceded it (the caller
        // re-checks whether the gate now enforces something).
        let before = self.0.fetch_add(1, Ordering::AcqRel);
        PassTicket { era: era(before) }
    }

    /// A turn let through ends.
    pub fn leave(&self, ticket: PassTicket) -> PassEnd {
        let uncounted = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
                (era(value) == ticket.era && value & COUNT_MASK > 0).then(|| value.wrapping_sub(1))
            })
            .is_ok();
        if uncounted {
            PassEnd::Uncounted
        } else {
            PassEnd::Adopted
        }
    }

    /// Whether any turn runs uncounted (a relaxed load: a hint for the enforced path).
    pub fn any(&self) -> bool {
        self.0.load(Ordering::Relaxed) & COUNT_MASK > 0
    }

    /// Hands every running turn to the gate, which counts them from now on; returns how many.
    /// Their tickets now read as adopted.
    pub fn adopt(&self) -> u64 {
        let before = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
                Some(u64::from(era(value).wrapping_add(1)) << 32)
            })
            .unwrap_or_else(|value| value);
        before & COUNT_MASK
    }

    /// Forgets every turn (a forked child: the parent's turns are not its own). The era moves
    /// on, so the parent's tickets never take anything off the child's count.
    pub fn reset(&self) {
        let _ = self.adopt();
    }
}

#[cfg(all(test, not(admitgate_loom)))]
mod tests {
    use super::*;

    #[test]
    fn adoption_moves_running_turns_to_the_gate_exactly_once() {
        let turns = PassThroughTurns::default();
        let a = turns.enter();
        let b = turns.enter();
        assert!(turns.any());
        assert_eq!(turns.leave(a), PassEnd::Uncounted);
        assert_eq!(turns.adopt(), 1, "b runs");
        assert!(!turns.any());
        let c = turns.enter();
        assert_eq!(
            turns.leave(b),
            PassEnd::Adopted,
            "b's slot is the gate's now"
        );
        assert_eq!(turns.adopt(), 1, "c runs");
        assert_eq!(turns.adopt(), 0);
        assert_eq!(turns.leave(c), PassEnd::Adopted);
        turns.reset();
        let d = turns.enter();
        assert_eq!(turns.leave(d), PassEnd::Uncounted);
    }

    #[test]
    fn racing_leaves_and_adoptions_count_each_turn_once() {
        let turns = std::sync::Arc::new(PassThroughTurns::default());
        let adopted = std::sync::Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let turns = turns.clone();
                std::thread::spawn(move || {
                    let mut adopted_ends = 0u64;
                    for _ in 0..20_000 {
                        let ticket = turns.enter();
                        if turns.leave(ticket) == PassEnd::Adopted {
                            adopted_ends += 1;
                        }
                    }
                    adopted_ends
                })
            })
            .collect();
        let adopter = {
            let (turns, adopted) = (turns.clone(), adopted.clone());
            std::thread::spawn(move || {
                for _ in 0..2_000 {
                    adopted.fetch_add(turns.adopt(), Ordering::Relaxed);
                    std::thread::yield_now();
                }
            })
        };
        let ended_adopted: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        adopter.join().unwrap();
        assert_eq!(turns.adopt(), 0, "every turn ended");
        assert_eq!(adopted.load(Ordering::Relaxed), ended_adopted);
    }
}
