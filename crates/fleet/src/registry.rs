//! This replica's own view of its leases and tickets: what the heartbeat renews, whom a grant
//! wakes, and what is still owed to Redis after an outage. One plain mutex; nothing awaits while
//! holding it.
//!
//! `held` and `waiting` count the entries of each kind. They are bounded by the entries that
//! exist, so an increment cannot overflow (it saturates all the same). A decrement below zero
//! would be an accounting bug (an entry forgotten twice): checked by `debug_assert!`, and
//! stopped at zero in release builds, where a count wrapped to `usize::MAX` would make the
//! heartbeat re-check at its fast pace for good and the stats absurd.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::config::OnBackendError;
use crate::scripts::{Beat, ClaimRequest};

/// How a waiting turn's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grant {
    /// A lease in Redis.
    Fleet,
    /// A lease taken locally while Redis is down (`on_backend_error = local`).
    Local,
    /// Redis is down and `on_backend_error = reject`.
    Unavailable,
    /// The limit was shut down.
    Closed,
}

#[derive(Debug)]
enum Entry {
    /// A lease this replica holds. `lost`: a heartbeat found it gone with no room; it is no
    /// longer renewed and its release sends nothing.
    Held { scope: Arc<str>, lost: bool },
    /// A turn waiting for a lease (or a reclaim in flight). `arrival_us` is known once Redis
    /// queued the ticket; until then the heartbeat leaves it alone. A `resume` (reclaim) always
    /// falls back to a local lease during an outage: its turn was admitted already.
    /// `announced`: a grant was published for it and is being claimed; the turn starts only
    /// once the claim succeeds.
    Waiting {
        scope: Arc<str>,
        arrival_us: Option<i64>,
        tx: Option<oneshot::Sender<Grant>>,
        resume: bool,
        announced: bool,
    },
}

/// Adds one to `count`, saturating (see the module documentation).
fn increment(count: &mut usize) {
    *count = count.saturating_add(1);
}

/// Takes one from `count`, which must be positive; `what` names it for a failed check.
#[track_caller]
fn decrement(count: &mut usize, what: &str) {
    debug_assert!(*count > 0, "{what} went below zero");
    *count = count.saturating_sub(1);
}

/// What [`Registry::remove`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Removed {
    /// Nothing to tell Redis: unknown id, or a lease already lost.
    Nothing,
    /// A lease or ticket that Redis may hold: release or withdraw it.
    Release,
}

#[derive(Debug, Default)]
pub(crate) struct Registry {
    entries: HashMap<Arc<str>, Entry>,
    held: usize,
    waiting: usize,
    /// Releases owed to Redis, sent when it is back.
    pending: Vec<(Arc<str>, Arc<str>)>,
}

impl Registry {
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    pub(crate) fn waiting(&self) -> usize {
        self.waiting
    }

    /// A waiting turn (or a reclaim in flight); the receiver learns how its wait ends.
    pub(crate) fn insert_waiting(
        &mut self,
        id: Arc<str>,
        scope: Arc<str>,
        resume: bool,
    ) -> oneshot::Receiver<Grant> {
        let (tx, rx) = oneshot::channel();
        let entry = Entry::Waiting {
            scope,
            arrival_us: None,
            tx: Some(tx),
            resume,
            announced: false,
        };
        if let Some(old) = self.entries.insert(id, entry) {
            self.forget(&old);
        }
        increment(&mut self.waiting);
        rx
    }

    /// A lease taken without waiting (for example locally during an outage).
    pub(crate) fn insert_held(&mut self, id: Arc<str>, scope: Arc<str>) {
        if let Some(old) = self.entries.insert(id, Entry::Held { scope, lost: false }) {
            self.forget(&old);
        }
        increment(&mut self.held);
    }

    fn forget(&mut self, entry: &Entry) {
        match entry {
            Entry::Held { .. } => decrement(&mut self.held, "held leases"),
            Entry::Waiting { .. } => decrement(&mut self.waiting, "waiting turns"),
        }
    }

    /// Redis queued the ticket with this arrival; false when the wait already ended.
    pub(crate) fn set_arrival(&mut self, id: &str, arrival: i64) -> bool {
        match self.entries.get_mut(id) {
            Some(Entry::Waiting { arrival_us, .. }) => {
                *arrival_us = Some(arrival);
                true
            }
            _ => false,
        }
    }

    /// A grant for `id` was published: what its claim needs, when `id` is a turn of this
    /// replica still waiting (other replicas' ids, and turns that have their lease, get
    /// nothing).
    pub(crate) fn announce(&mut self, id: &str) -> Option<ClaimRequest> {
        let key = self.entries.get_key_value(id).map(|(key, _)| key.clone())?;
        match self.entries.get_mut(id) {
            Some(Entry::Waiting {
                scope,
                arrival_us,
                announced,
                resume: false,
                ..
            }) => {
                *announced = true;
                Some(ClaimRequest {
                    id: key,
                    scope: scope.clone(),
                    arrival_us: *arrival_us,
                })
            }
            _ => None,
        }
    }

    /// The claim found no grant (or the heartbeat queued the ticket again): `id` waits on.
    /// Returns whether a grant had been announced for it (and so was lost).
    pub(crate) fn unannounce(&mut self, id: &str) -> bool {
        match self.entries.get_mut(id) {
            Some(Entry::Waiting { announced, .. }) => std::mem::replace(announced, false),
            _ => false,
        }
    }

    /// Ends the wait of `id` with a lease (`Fleet` or `Local`). Returns whether `id` is (now or
    /// already) a lease this replica holds; false when it is unknown (withdrawn).
    pub(crate) fn grant(&mut self, id: &str, how: Grant) -> bool {
        let Some(entry) = self.entries.get_mut(id) else {
            return false;
        };
        if let Entry::Waiting { scope, tx, .. } = entry {
            let tx = tx.take();
            *entry = Entry::Held {
                scope: scope.clone(),
                lost: false,
            };
            decrement(&mut self.waiting, "waiting turns");
            increment(&mut self.held);
            if let Some(tx) = tx {
                // The waiter may be gone already; its guard then gives the lease back.
                let _ = tx.send(how);
            }
        }
        true
    }

    /// Whether `id` is tracked at all (held or waiting).
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.entries.contains_key(id)
    }

    /// Whether `id` is a lease this replica holds and has not lost.
    pub(crate) fn is_live_lease(&self, id: &str) -> bool {
        matches!(self.entries.get(id), Some(Entry::Held { lost: false, .. }))
    }

    /// Marks a held lease lost; false when it was released (or lost) meanwhile, which is not a
    /// loss to report.
    pub(crate) fn mark_lost(&mut self, id: &str) -> bool {
        match self.entries.get_mut(id) {
            Some(Entry::Held { lost, .. }) if !*lost => {
                *lost = true;
                true
            }
            _ => false,
        }
    }

    /// Stops tracking `id` and says whether Redis should be told.
    pub(crate) fn remove(&mut self, id: &str) -> Removed {
        match self.entries.remove(id) {
            None => Removed::Nothing,
            Some(entry) => {
                self.forget(&entry);
                match entry {
                    Entry::Held { lost: true, .. } => Removed::Nothing,
                    _ => Removed::Release,
                }
            }
        }
    }

    /// What the heartbeat renews: live leases and queued tickets.
    pub(crate) fn snapshot(&self) -> Vec<Beat> {
        let mut beats = Vec::with_capacity(self.entries.len());
        for (id, entry) in &self.entries {
            match entry {
                Entry::Held { scope, lost: false } => beats.push(Beat::Lease {
                    id: id.clone(),
                    scope: scope.clone(),
                }),
                Entry::Waiting {
                    scope,
                    arrival_us: Some(arrival_us),
                    ..
                } => beats.push(Beat::Ticket {
                    id: id.clone(),
                    scope: scope.clone(),
                    arrival_us: *arrival_us,
                }),
                _ => {}
            }
        }
        beats
    }

    /// Redis went down: ends the waits of `only` (or of every waiting turn) as `mode` says.
    /// `local`: they become local leases (registered when Redis returns). `reject`: they fail
    /// with `Unavailable` and their tickets are owed a withdrawal; a resuming turn (reclaim)
    /// always gets a local lease.
    pub(crate) fn end_waits_offline(&mut self, mode: OnBackendError, only: Option<&str>) {
        let ids: Vec<Arc<str>> = self
            .entries
            .iter()
            .filter(|(id, entry)| {
                matches!(entry, Entry::Waiting { .. }) && only.is_none_or(|only| &***id == only)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            let resume = matches!(
                self.entries.get(&id),
                Some(Entry::Waiting { resume: true, .. })
            );
            if mode == OnBackendError::Local || resume {
                self.grant(&id, Grant::Local);
            } else if let Some(Entry::Waiting { scope, tx, .. }) = self.entries.remove(&id) {
                decrement(&mut self.waiting, "waiting turns");
                self.pending.push((id, scope));
                if let Some(tx) = tx {
                    let _ = tx.send(Grant::Unavailable);
                }
            }
        }
    }

    /// Shutdown: every waiter learns the limit closed; returns every id Redis may hold.
    pub(crate) fn close(&mut self) -> Vec<(Arc<str>, Arc<str>)> {
        let mut owed = std::mem::take(&mut self.pending);
        for (id, entry) in self.entries.drain() {
            match entry {
                Entry::Held { scope, lost } => {
                    if !lost {
                        owed.push((id, scope));
                    }
                }
                Entry::Waiting { scope, tx, .. } => {
                    if let Some(tx) = tx {
                        let _ = tx.send(Grant::Closed);
                    }
                    owed.push((id, scope));
                }
            }
        }
        self.held = 0;
        self.waiting = 0;
        owed
    }

    /// Remembers a release Redis has not received yet.
    pub(crate) fn owe(&mut self, id: Arc<str>, scope: Arc<str>) {
        self.pending.push((id, scope));
    }

    /// Takes the releases owed to Redis.
    pub(crate) fn take_owed(&mut self) -> Vec<(Arc<str>, Arc<str>)> {
        std::mem::take(&mut self.pending)
    }

    /// Panics unless `held` and `waiting` count the entries of each kind (tests only).
    #[cfg(test)]
    fn check_counts(&self) {
        let held = self
            .entries
            .values()
            .filter(|e| matches!(e, Entry::Held { .. }))
            .count();
        assert_eq!((self.held, self.waiting), (held, self.entries.len() - held));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arc(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn a_grant_wakes_the_waiter_once_and_counts_move() {
        let mut r = Registry::default();
        let mut rx = r.insert_waiting(arc("a"), arc("t"), false);
        assert_eq!((r.held(), r.waiting()), (0, 1));
        assert!(
            r.snapshot().is_empty(),
            "no arrival yet: the heartbeat leaves it alone"
        );
        assert!(r.set_arrival("a", 42));
        assert!(matches!(
            r.snapshot()[..],
            [Beat::Ticket { arrival_us: 42, .. }]
        ));
        assert!(r.grant("a", Grant::Fleet));
        assert!(r.grant("a", Grant::Fleet), "a second grant is a no-op");
        assert_eq!(rx.try_recv().unwrap(), Grant::Fleet);
        assert_eq!((r.held(), r.waiting()), (1, 0));
        assert!(
            !r.set_arrival("a", 43),
            "a late reply does not reopen the wait"
        );
        assert!(matches!(r.snapshot()[..], [Beat::Lease { .. }]));
        assert_eq!(r.remove("a"), Removed::Release);
        assert_eq!(r.remove("a"), Removed::Nothing);
        assert!(!r.grant("a", Grant::Fleet), "a withdrawn id is not granted");
        r.check_counts();
    }

    #[test]
    fn a_lease_released_meanwhile_is_not_reported_lost() {
        let mut r = Registry::default();
        r.insert_held(arc("a"), arc(""));
        assert_eq!(r.remove("a"), Removed::Release);
        assert!(!r.mark_lost("a"));
        r.insert_held(arc("b"), arc(""));
        assert!(r.mark_lost("b"));
        assert!(!r.mark_lost("b"), "counted once");
        assert!(r.snapshot().is_empty(), "a lost lease is not renewed");
        assert_eq!(r.remove("b"), Removed::Nothing, "its release sends nothing");
        r.check_counts();
    }

    #[test]
    fn an_outage_ends_waits_by_mode() {
        let mut r = Registry::default();
        let mut a = r.insert_waiting(arc("a"), arc(""), false);
        let mut b = r.insert_waiting(arc("b"), arc(""), true);
        r.end_waits_offline(OnBackendError::Reject, None);
        assert_eq!(a.try_recv().unwrap(), Grant::Unavailable);
        assert_eq!(
            b.try_recv().unwrap(),
            Grant::Local,
            "a resuming turn runs on"
        );
        assert_eq!(
            r.take_owed().len(),
            1,
            "the refused ticket is withdrawn later"
        );
        let mut c = r.insert_waiting(arc("c"), arc(""), false);
        let mut d = r.insert_waiting(arc("d"), arc(""), false);
        r.end_waits_offline(OnBackendError::Local, Some("c"));
        assert_eq!(c.try_recv().unwrap(), Grant::Local);
        assert!(d.try_recv().is_err(), "only the named wait ended");
        assert_eq!((r.held(), r.waiting()), (2, 1));
        r.check_counts();
        let owed = r.close();
        assert_eq!(d.try_recv().unwrap(), Grant::Closed);
        assert_eq!(owed.len(), 3);
        assert_eq!((r.held(), r.waiting()), (0, 0));
        r.check_counts();
    }
}
