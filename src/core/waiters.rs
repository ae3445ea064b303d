//! The wait queue: a slab of waiter records threaded on intrusive doubly-linked lists.
//!
//! Every waiting turn is on two lists: the queue of all waiters in arrival order (whose head
//! is the oldest waiter, the `shed_oldest` victim when the global queue is full) and the lane
//! of its scope (whose head is the next turn of that tenant to run, and the victim when the
//! tenant's own queue is full). Unlinking any record is O(1), so cancellation and eviction do
//! not scan. A record outlives its place in the lists: once granted a slot or shed it stays in
//! the slab, off every list, until its owner claims the outcome (or cancels), so a grant and a
//! cancellation that race are always settled under the gate's lock and never lose a slot.
//!
//! Keys carry a generation, so a stale key (a record already freed and reused) finds nothing.

use std::sync::Arc;
use std::time::Duration;

use super::gate::Rejection;

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

/// A FIFO list of waiters threaded through the slab (one per scope, plus the list of all).
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
    all: Links,
    lane: Links,
    next_free: u32,
}

/// The slab of waiter records and the list of all waiters in arrival order.
#[derive(Debug)]
pub struct WaitQueue<W> {
    nodes: Vec<Waiter<W>>,
    free_head: u32,
    all: Lane,
    next_seq: u64,
}

impl<W> Default for WaitQueue<W> {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            free_head: NIL,
            all: Lane::default(),
            next_seq: 0,
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
        let mut free = 0;
        let mut i = self.free_head;
        while i != NIL {
            free += 1;
            i = self.nodes[i as usize].next_free;
        }
        self.nodes.len() - free
    }

    /// Adds a waiter at the back of the queue and of `lane`.
    pub fn push(&mut self, lane: &mut Lane, scope: Option<Arc<str>>, now: Duration) -> WaiterKey {
        let seq = self.next_seq;
        self.next_seq += 1;
        let index = if self.free_head != NIL {
            let index = self.free_head;
            let node = &mut self.nodes[index as usize];
            self.free_head = node.next_free;
            node.occupied = true;
            node.state = WaiterState::Waiting;
            node.waker = None;
            node.scope = scope;
            node.seq = seq;
            node.enqueued_at = now;
            node.outside_depth = false;
            index
        } else {
            let index = u32::try_from(self.nodes.len()).expect("more than 2**32 waiters");
            assert!(index != NIL, "more than 2**32 - 1 waiters");
            self.nodes.push(Waiter {
                generation: 0,
                occupied: true,
                state: WaiterState::Waiting,
                waker: None,
                scope,
                seq,
                enqueued_at: now,
                outside_depth: false,
                all: Links::default(),
                lane: Links::default(),
                next_free: NIL,
            });
            index
        };
        self.link_back(index, true, lane);
        self.link_back(index, false, lane);
        WaiterKey {
            index,
            generation: self.nodes[index as usize].generation,
        }
    }

    fn links(&mut self, index: u32, all: bool) -> &mut Links {
        let node = &mut self.nodes[index as usize];
        if all {
            &mut node.all
        } else {
            &mut node.lane
        }
    }

    fn link_back(&mut self, index: u32, all: bool, lane: &mut Lane) {
        let list = if all { &mut self.all } else { lane };
        let tail = list.tail;
        list.tail = index;
        if list.head == NIL {
            list.head = index;
        }
        list.len += 1;
        *self.links(index, all) = Links {
            prev: tail,
            next: NIL,
        };
        if tail != NIL {
            self.links(tail, all).next = index;
        }
    }

    fn unlink_from(&mut self, index: u32, all: bool, lane: &mut Lane) {
        let Links { prev, next } = *self.links(index, all);
        let list = if all { &mut self.all } else { lane };
        if prev == NIL {
            list.head = next;
        }
        if next == NIL {
            list.tail = prev;
        }
        list.len -= 1;
        if prev != NIL {
            self.links(prev, all).next = next;
        }
        if next != NIL {
            self.links(next, all).prev = prev;
        }
    }

    /// Takes a waiting record off the queue and its lane, leaving it in the slab in `state`.
    pub fn unlink(&mut self, index: u32, lane: &mut Lane, state: WaiterState) {
        debug_assert_eq!(self.nodes[index as usize].state, WaiterState::Waiting);
        self.unlink_from(index, true, lane);
        self.unlink_from(index, false, lane);
        self.nodes[index as usize].state = state;
    }

    /// Frees a record that is off the lists, returning its waker (to be dropped by the
    /// caller outside the gate's lock).
    pub fn free(&mut self, index: u32) -> Option<W> {
        let node = &mut self.nodes[index as usize];
        debug_assert!(node.occupied && node.state != WaiterState::Waiting);
        node.occupied = false;
        node.generation = node.generation.wrapping_add(1);
        node.scope = None;
        node.next_free = self.free_head;
        self.free_head = index;
        node.waker.take()
    }

    /// The record a key names, if it is still the same record.
    pub fn resolve(&self, key: WaiterKey) -> Option<u32> {
        let node = self.nodes.get(key.index as usize)?;
        (node.occupied && node.generation == key.generation).then_some(key.index)
    }

    /// The record at `index`.
    pub fn get(&self, index: u32) -> &Waiter<W> {
        &self.nodes[index as usize]
    }

    /// The record at `index`, mutably.
    pub fn get_mut(&mut self, index: u32) -> &mut Waiter<W> {
        &mut self.nodes[index as usize]
    }

    /// The oldest waiter of all, if any.
    pub fn oldest(&self) -> Option<u32> {
        (self.all.head != NIL).then_some(self.all.head)
    }

    /// The oldest waiter of a lane, if any.
    pub fn lane_head(&self, lane: &Lane) -> Option<u32> {
        (lane.head != NIL).then_some(lane.head)
    }

    /// The key of the record at `index`.
    pub fn key(&self, index: u32) -> WaiterKey {
        WaiterKey {
            index,
            generation: self.nodes[index as usize].generation,
        }
    }

    /// Frees every record, returning all wakers (to be dropped outside the lock). The
    /// generations move on, so no key handed out before stays valid (after `fork()`, the
    /// parent's waiters must not name the child's).
    pub fn clear(&mut self) -> Vec<W> {
        let mut wakers = Vec::new();
        self.free_head = NIL;
        self.all = Lane::default();
        for (index, node) in self.nodes.iter_mut().enumerate().rev() {
            if node.occupied {
                node.occupied = false;
                node.generation = node.generation.wrapping_add(1);
                node.scope = None;
            }
            wakers.extend(node.waker.take());
            node.next_free = self.free_head;
            self.free_head = index as u32;
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
            i = self.nodes[i as usize].all.next;
            Some(current)
        })
    }

    /// The waiter before `index` in its lane.
    pub fn lane_prev(&self, index: u32) -> Option<u32> {
        let prev = self.nodes[index as usize].lane.prev;
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
            i = self.nodes[i as usize].lane.next;
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
        let k1 = q.push(&mut a, None, Duration::ZERO);
        let k2 = q.push(&mut b, None, Duration::ZERO);
        let k3 = q.push(&mut a, None, Duration::ZERO);
        assert_eq!(q.iter_all().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(q.iter_lane(&a).collect::<Vec<_>>(), vec![0, 2]);
        let i1 = q.resolve(k1).unwrap();
        q.unlink(i1, &mut a, WaiterState::Granted);
        assert_eq!(q.oldest(), Some(1));
        assert_eq!(q.lane_head(&a), Some(2));
        assert_eq!(q.len(), 2);
        q.free(i1);
        assert_eq!(q.resolve(k1), None);
        let k4 = q.push(&mut b, None, Duration::ZERO);
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
        let k5 = q.push(&mut a, None, Duration::ZERO);
        assert_eq!(q.clear().len(), 0, "no wakers were registered");
        assert!(q.is_empty() && q.records() == 0);
        assert_eq!(q.resolve(k4), None, "clear invalidates every key");
        assert_eq!(q.resolve(k5), None);
        let k6 = q.push(&mut Lane::default(), None, Duration::ZERO);
        assert!(q.resolve(k6).is_some());
    }
}
