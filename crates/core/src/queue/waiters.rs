//! The wait queue: a slab of waiter records threaded on intrusive doubly-linked lists.
//!
//! Every waiting turn is on three lists: the queue of all waiters in arrival order (whose
//! head is the oldest waiter of all), the list of its priority class in arrival order (whose
//! head is the `shed_oldest` victim when the queue is full) and its lane, the waiters of one
//! tenant in one class (whose head is that tenant's next turn in that class, and the victim
//! when the tenant's own queue is full). Unlinking any record is O(1), so cancellation and
//! eviction do not scan. A record outlives its place in the lists: once granted a slot or shed it stays in
//! the slab, off every list, until its owner claims the outcome (or cancels), so a grant and a
//! cancellation that race are always settled under the gate's lock and never lose a slot.
//!
//! Keys carry a generation, so a stale key (a record already freed and reused) finds nothing.
//!
//! A waiter's place in line (how many wait before it) comes from a [`RankIndex`] over the
//! queue of all waiters, in O(log n), not from a walk.

use std::sync::Arc;
use std::time::Duration;

use super::rank::RankIndex;
use crate::count::{decrement, increment};
use crate::rejection::Rejection;

const NIL: u32 = u32::MAX;

/// Names one waiter record; stale keys are detected by their generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WaiterKey {
    index: u32,
    generation: u32,
}

/// Where a waiter record stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaiterState {
    /// On the lists, waiting for a slot.
    Waiting,
    /// Handed a run slot (counted in flight); the owner has not claimed it yet.
    Granted,
    /// Refused while it waited (evicted by `shed_oldest`, timed out, or the gate closed);
    /// the owner has not seen it yet.
    Refused(Rejection),
}

#[derive(Clone, Copy, Debug, Default)]
struct Links {
    prev: u32,
    next: u32,
}

/// Which of a record's three lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum List {
    All,
    Class,
    Lane,
}

/// A FIFO list of waiters threaded through the slab (one per lane, one per class, and the
/// list of all).
#[derive(Debug)]
pub struct Lane {
    head: u32,
    tail: u32,
    len: u64,
}

impl Default for Lane {
    fn default() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl Lane {
    /// How many waiters the lane holds.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the lane is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One waiting (or granted-but-unclaimed, or shed-but-unseen) turn.
#[derive(Debug)]
pub struct Waiter<W> {
    generation: u32,
    occupied: bool,
    /// Where the record stands.
    pub state: WaiterState,
    /// How to wake the owner; `None` until the owner registers one (it may be granted first).
    pub waker: Option<W>,
    /// The tracked scope, or `None` for an unscoped turn.
    pub scope: Option<Arc<str>>,
    /// Arrival order: smaller is older.
    pub seq: u64,
    /// When it joined the queue, on the caller's clock.
    pub enqueued_at: Duration,
    /// It waits only because of soft memory pressure, outside `queue_depth`.
    pub outside_depth: bool,
    /// Its priority class's position.
    pub class: u8,
    /// Its slot in the rank index while it is on the queue.
    rank: usize,
    all: Links,
    class_links: Links,
    lane: Links,
    next_free: u32,
}

/// The slab of waiter records and the list of all waiters in arrival order.
#[derive(Debug)]
pub struct WaitQueue<W> {
    nodes: Vec<Waiter<W>>,
    free_head: u32,
    all: Lane,
    /// Each class's waiters in arrival order, by position (grown as classes are used).
    classes: Vec<Lane>,
    next_seq: u64,
    /// Counts the waiters ahead of each one (see [`WaitQueue::ahead`]).
    rank: RankIndex,
}

impl<W> Default for WaitQueue<W> {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            free_head: NIL,
            all: Lane::default(),
            classes: Vec::new(),
            next_seq: 0,
            rank: RankIndex::default(),
        }
    }
}

impl<W> WaitQueue<W> {
    /// Waiters on the lists (waiting, not granted or shed).
    pub fn len(&self) -> u64 {
        self.all.len
    }

    /// Whether nobody is waiting.
    pub fn is_empty(&self) -> bool {
        self.all.len == 0
    }

    /// Records held in the slab, including granted and shed ones not yet claimed.
    pub fn records(&self) -> usize {
        self.nodes.iter().filter(|node| node.occupied).count()
    }

    /// Adds a waiter of `class` at the back of the queue, of its class and of `lane`;
    /// `outside_depth` marks a turn held back only by soft memory pressure. `None` when the slab is full: its indices are
    /// `u32`, so it holds at most 2^32 - 1 records (hundreds of GiB of them).
    pub fn push(
        &mut self,
        lane: &mut Lane,
        scope: Option<Arc<str>>,
        class: u8,
        now: Duration,
        outside_depth: bool,
    ) -> Option<WaiterKey> {
        let wanted = usize::from(class).saturating_add(1);
        if self.classes.len() < wanted {
            self.classes.resize_with(wanted, Lane::default);
        }
        let seq = self.next_seq;
        let rank = self.rank_slot();
        let free = (self.free_head != NIL).then_some(self.free_head);
        let reused = free.and_then(|index| Some((index, self.nodes.get_mut(index as usize)?)));
        let (index, generation) = match reused {
            Some((index, node)) => {
                self.free_head = node.next_free;
                node.occupied = true;
                node.state = WaiterState::Waiting;
                node.waker = None;
                node.scope = scope;
                node.seq = seq;
                node.enqueued_at = now;
                node.outside_depth = outside_depth;
                node.class = class;
                node.rank = rank;
                (index, node.generation)
            }
            None => {
                let Some(index) = u32::try_from(self.nodes.len())
                    .ok()
                    .filter(|&index| index != NIL)
                else {
                    self.rank.remove(rank);
                    return None;
                };
                self.nodes.push(Waiter {
                    generation: 0,
                    occupied: true,
                    state: WaiterState::Waiting,
                    waker: None,
                    scope,
                    seq,
                    enqueued_at: now,
                    outside_depth,
                    class,
                    rank,
                    all: Links::default(),
                    class_links: Links::default(),
                    lane: Links::default(),
                    next_free: NIL,
                });
                (index, 0)
            }
        };
        increment(&mut self.next_seq);
        for list in [List::All, List::Class, List::Lane] {
            self.link_back(index, list, lane);
        }
        Some(WaiterKey { index, generation })
    }

    /// A rank slot for a waiter joining the back of the queue. When the index is full, the
    /// waiters on the queue are renumbered in order first (amortised O(1), see `rank`).
    fn rank_slot(&mut self) -> usize {
        if let Some(slot) = self.rank.push() {
            return slot;
        }
        let live = usize::try_from(self.all.len).unwrap_or(usize::MAX);
        self.rank.rebuild(live);
        let mut i = self.all.head;
        let mut slot: usize = 0;
        while let Some(node) = self.nodes.get_mut(i as usize) {
            node.rank = slot;
            slot = slot.saturating_add(1);
            i = node.all.next;
        }
        // The rebuilt index has room for as many again: this cannot come back empty.
        self.rank.push().unwrap_or(slot)
    }

    /// How many waiters are ahead of the waiting record at `index` in arrival order;
    /// `None` when it is not waiting. O(log n).
    pub fn ahead(&self, index: u32) -> Option<u64> {
        let node = self
            .get(index)
            .filter(|node| node.state == WaiterState::Waiting)?;
        Some(self.rank.before(node.rank))
    }

    /// The slot at `index`, held or free.
    fn node(&self, index: u32) -> Option<&Waiter<W>> {
        self.nodes.get(index as usize)
    }

    fn links(&mut self, index: u32, list: List) -> Option<&mut Links> {
        let node = self.nodes.get_mut(index as usize)?;
        Some(match list {
            List::All => &mut node.all,
            List::Class => &mut node.class_links,
            List::Lane => &mut node.lane,
        })
    }

    /// The list `list` of the record at `index` (`lane` is its lane).
    fn list<'a>(&'a mut self, index: u32, list: List, lane: &'a mut Lane) -> Option<&'a mut Lane> {
        match list {
            List::All => Some(&mut self.all),
            List::Lane => Some(lane),
            List::Class => {
                let class = self.nodes.get(index as usize)?.class;
                self.classes.get_mut(usize::from(class))
            }
        }
    }

    fn link_back(&mut self, index: u32, list: List, lane: &mut Lane) {
        let Some(tail) = self.list(index, list, lane).map(|l| l.tail) else {
            return;
        };
        let Some(links) = self.links(index, list) else {
            return;
        };
        *links = Links {
            prev: tail,
            next: NIL,
        };
        if tail != NIL {
            if let Some(links) = self.links(tail, list) {
                links.next = index;
            }
        }
        if let Some(l) = self.list(index, list, lane) {
            l.tail = index;
            if l.head == NIL {
                l.head = index;
            }
            increment(&mut l.len);
        }
    }

    fn unlink_from(&mut self, index: u32, list: List, lane: &mut Lane) {
        let Some(&mut Links { prev, next }) = self.links(index, list) else {
            return;
        };
        if let Some(l) = self.list(index, list, lane) {
            if prev == NIL {
                l.head = next;
            }
            if next == NIL {
                l.tail = prev;
            }
            decrement(&mut l.len, "a wait list's length");
        }
        if prev != NIL {
            if let Some(links) = self.links(prev, list) {
                links.next = next;
            }
        }
        if next != NIL {
            if let Some(links) = self.links(next, list) {
                links.prev = prev;
            }
        }
    }

    /// Takes a waiting record off the queue and its lane, leaving it in the slab in `state`,
    /// and returns it. `None`, changing nothing, when `index` holds no waiting record:
    /// unlinking one that is off the lists would corrupt them.
    pub fn unlink(
        &mut self,
        index: u32,
        lane: &mut Lane,
        state: WaiterState,
    ) -> Option<&mut Waiter<W>> {
        let waiting = self
            .get(index)
            .is_some_and(|node| node.state == WaiterState::Waiting);
        debug_assert!(waiting, "unlinking record {index}, which is not waiting");
        if !waiting {
            return None;
        }
        for list in [List::All, List::Class, List::Lane] {
            self.unlink_from(index, list, lane);
        }
        let node = self.nodes.get_mut(index as usize)?;
        node.state = state;
        self.rank.remove(node.rank);
        Some(node)
    }

    /// Frees a record that is off the lists, returning its waker (to be dropped by the
    /// caller outside the gate's lock). Nothing happens when `index` holds no record, or one
    /// still on the lists (freeing it would leave the lists pointing at a free slot).
    pub fn free(&mut self, index: u32) -> Option<W> {
        let node = self
            .nodes
            .get_mut(index as usize)
            .filter(|node| node.occupied && node.state != WaiterState::Waiting);
        debug_assert!(
            node.is_some(),
            "freeing record {index}: free or still waiting"
        );
        let node = node?;
        node.occupied = false;
        node.generation = node.generation.wrapping_add(1);
        node.scope = None;
        node.next_free = self.free_head;
        self.free_head = index;
        node.waker.take()
    }

    /// The record a key names, if it is still the same record.
    pub fn resolve(&self, key: WaiterKey) -> Option<u32> {
        self.lookup(key).map(|(index, _)| index)
    }

    /// The record a key names and its index, if it is still the same record.
    pub fn lookup(&self, key: WaiterKey) -> Option<(u32, &Waiter<W>)> {
        let node = self
            .get(key.index)
            .filter(|node| node.generation == key.generation)?;
        Some((key.index, node))
    }

    /// [`WaitQueue::lookup`], mutably.
    pub fn lookup_mut(&mut self, key: WaiterKey) -> Option<(u32, &mut Waiter<W>)> {
        let node = self
            .get_mut(key.index)
            .filter(|node| node.generation == key.generation)?;
        Some((key.index, node))
    }

    /// The record at `index`; `None` when the slot is free (or out of range).
    pub fn get(&self, index: u32) -> Option<&Waiter<W>> {
        self.node(index).filter(|node| node.occupied)
    }

    /// The record at `index`, mutably; `None` when the slot is free (or out of range).
    pub fn get_mut(&mut self, index: u32) -> Option<&mut Waiter<W>> {
        self.nodes
            .get_mut(index as usize)
            .filter(|node| node.occupied)
    }

    /// The oldest waiter of all, if any.
    pub fn oldest(&self) -> Option<u32> {
        (self.all.head != NIL).then_some(self.all.head)
    }

    /// The oldest waiter of the class at `class`, if any.
    pub fn class_head(&self, class: usize) -> Option<u32> {
        self.classes
            .get(class)
            .and_then(|list| (list.head != NIL).then_some(list.head))
    }

    /// How many waiters the class at `class` holds.
    pub fn class_len(&self, class: usize) -> u64 {
        self.classes.get(class).map_or(0, Lane::len)
    }

    /// Walks the class at `class` in arrival order.
    pub fn iter_class(&self, class: usize) -> impl Iterator<Item = u32> + '_ {
        let mut i = self.class_head(class).unwrap_or(NIL);
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let current = i;
            i = self.node(current).map_or(NIL, |node| node.class_links.next);
            Some(current)
        })
    }

    /// The newest waiter of the class at `class` that counts against the queue's depth (not
    /// held back by soft memory pressure alone), if any. Walks back past those that do not
    /// count, of which there are at most as many as free slots.
    pub fn class_newest_in_depth(&self, class: usize) -> Option<u32> {
        let mut i = self.classes.get(class).map_or(NIL, |list| list.tail);
        while let Some(node) = self.get(i) {
            if !node.outside_depth {
                return Some(i);
            }
            i = node.class_links.prev;
        }
        None
    }

    /// The newest waiter of all, if any.
    pub fn newest(&self) -> Option<u32> {
        (self.all.tail != NIL).then_some(self.all.tail)
    }

    /// The waiter that arrived just before `index` (of all waiters).
    pub fn prev(&self, index: u32) -> Option<u32> {
        let prev = self.get(index)?.all.prev;
        (prev != NIL).then_some(prev)
    }

    /// The oldest waiter of a lane, if any.
    pub fn lane_head(&self, lane: &Lane) -> Option<u32> {
        (lane.head != NIL).then_some(lane.head)
    }

    /// The key of the record at `index`, if the slot holds one.
    pub fn key(&self, index: u32) -> Option<WaiterKey> {
        let node = self.get(index)?;
        Some(WaiterKey {
            index,
            generation: node.generation,
        })
    }

    /// Frees every record, returning all wakers (to be dropped outside the lock). The
    /// generations move on, so no key handed out before stays valid (after `fork()`, the
    /// parent's waiters must not name the child's).
    pub fn clear(&mut self) -> Vec<W> {
        let mut wakers = Vec::new();
        self.free_head = NIL;
        self.all = Lane::default();
        self.classes.clear();
        self.rank.clear();
        for (index, node) in self.nodes.iter_mut().enumerate().rev() {
            if node.occupied {
                node.occupied = false;
                node.generation = node.generation.wrapping_add(1);
                node.scope = None;
            }
            wakers.extend(node.waker.take());
            // Always a `u32`: `push` never grows the slab past `NIL`.
            if let Ok(index) = u32::try_from(index) {
                node.next_free = self.free_head;
                self.free_head = index;
            }
        }
        wakers
    }

    /// Walks the queue in arrival order (tests and invariant checks).
    pub fn iter_all(&self) -> impl Iterator<Item = u32> + '_ {
        let mut i = self.all.head;
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let current = i;
            i = self.node(current).map_or(NIL, |node| node.all.next);
            Some(current)
        })
    }

    /// The waiter before `index` in its lane.
    pub fn lane_prev(&self, index: u32) -> Option<u32> {
        let prev = self.get(index)?.lane.prev;
        (prev != NIL).then_some(prev)
    }

    /// The newest waiter of a lane.
    pub fn lane_tail(&self, lane: &Lane) -> Option<u32> {
        (lane.tail != NIL).then_some(lane.tail)
    }

    /// Walks a lane in arrival order.
    pub fn iter_lane<'a>(&'a self, lane: &Lane) -> impl Iterator<Item = u32> + 'a {
        let mut i = lane.head;
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let current = i;
            i = self.node(current).map_or(NIL, |node| node.lane.next);
            Some(current)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_o1_unlink_and_stale_keys() {
        let mut q: WaitQueue<()> = WaitQueue::default();
        let mut a = Lane::default();
        let mut b = Lane::default();
        let k1 = q.push(&mut a, None, 0, Duration::ZERO, false).unwrap();
        let k2 = q.push(&mut b, None, 1, Duration::ZERO, false).unwrap();
        let k3 = q.push(&mut a, None, 0, Duration::ZERO, false).unwrap();
        assert_eq!(q.iter_all().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(q.iter_lane(&a).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(q.iter_class(0).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(q.iter_class(1).collect::<Vec<_>>(), vec![1]);
        assert_eq!((q.class_len(0), q.class_len(1), q.class_len(2)), (2, 1, 0));
        let i1 = q.resolve(k1).unwrap();
        q.unlink(i1, &mut a, WaiterState::Granted);
        assert_eq!(q.oldest(), Some(1));
        assert_eq!(q.class_head(0), Some(2));
        assert_eq!(q.lane_head(&a), Some(2));
        assert_eq!(q.len(), 2);
        q.free(i1);
        assert_eq!(q.resolve(k1), None);
        let k4 = q.push(&mut b, None, 0, Duration::ZERO, false).unwrap();
        assert_eq!(q.resolve(k4), Some(0), "the freed record is reused");
        assert_eq!(q.resolve(k1), None, "a stale key stays stale after reuse");
        assert_eq!(q.iter_lane(&b).collect::<Vec<_>>(), vec![1, 0]);
        let i3 = q.resolve(k3).unwrap();
        q.unlink(i3, &mut a, WaiterState::Refused(Rejection::Shed));
        assert!(a.is_empty());
        assert_eq!(q.iter_all().collect::<Vec<_>>(), vec![1, 0]);
        assert_eq!(q.records(), 3);
        let i2 = q.resolve(k2).unwrap();
        q.unlink(i2, &mut b, WaiterState::Granted);
        assert_eq!(q.iter_all().collect::<Vec<_>>(), vec![0]);
        let k5 = q.push(&mut a, None, 0, Duration::ZERO, false).unwrap();
        assert_eq!(q.clear().len(), 0, "no wakers were registered");
        assert!(q.is_empty() && q.records() == 0);
        assert_eq!(q.resolve(k4), None, "clear invalidates every key");
        assert_eq!(q.resolve(k5), None);
        let k6 = q
            .push(&mut Lane::default(), None, 0, Duration::ZERO, false)
            .unwrap();
        assert!(q.resolve(k6).is_some());
    }
}
