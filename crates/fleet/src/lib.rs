//! A fleet-wide admission limit on Redis: one in-flight cap shared by every replica of an agent.
//!
//! Each admitted turn holds a **lease** in Redis. Taking one is a single Lua call that prunes
//! expired leases, checks the cap (and the tenant's slice) and adds the lease atomically, so the
//! fleet never holds more leases than the cap. A replica renews all of its leases with one
//! pipelined heartbeat call per interval; a replica that dies stops renewing and its leases
//! expire after `lease_ttl`, with nothing else to clean up. Turns that find no room wait in a
//! fleet-wide FIFO of **tickets**; a release hands its room to the oldest ticket that can run,
//! in the same Lua call, and pushes the news over pub/sub. The waiting replica **claims** the
//! grant (one more call) before the turn starts, so a grant that expired while its replica was
//! paused is never started on.
//!
//! This crate never depends on pyo3: a standalone Rust process uses it as it is, and admitgate's
//! Python binding awaits it from asyncio (through pyo3-async-runtimes) on a tokio runtime that
//! admitgate owns.
//!
//! ```no_run
//! # async fn turn() -> Result<(), Box<dyn std::error::Error>> {
//! use admitgate_fleet::{FleetConfig, FleetLimit};
//!
//! let mut config = FleetConfig::new("redis://127.0.0.1:6379/0", "agent:coordinator", 20);
//! config.max_in_flight_per_scope = 4;
//! let limit = FleetLimit::new(config, tokio::runtime::Handle::current())?;
//!
//! let lease = limit.acquire("tenant-42").await?; // waits, fleet-wide FIFO
//! // ... run the turn ...
//! lease.release().await;
//! # Ok(()) }
//! ```
//!
//! **Budgets** ([`FleetBudget`]) share the connection: requests and tokens per identity per
//! window, exact across the fleet, one Lua call per decision by the server's clock (see the
//! `budget` module's docs and `src/lua/budget.lua`).
//!
//! # Guarantees
//!
//! **Never over the cap, with two stated exceptions.** Leases are taken by an atomic
//! check-and-add, so the number of leases never exceeds `max_in_flight` (nor a tenant's
//! `max_in_flight_per_scope`), except:
//!
//! 1. **A human-approval borrow.** A turn that lent its lease while a person decided and finds
//!    no room on resume borrows one over the cap ([`FleetLimit::reclaim`]). It is counted in
//!    `borrowed` and repaid by the next release anywhere in the fleet (that release lowers the
//!    holder count back towards the cap instead of freeing room).
//! 2. **A lease that expired under a paused holder.** A process paused (GC, SIGSTOP, a frozen
//!    VM, a network partition) for longer than `lease_ttl` stops renewing; its leases expire and
//!    another replica may take the room. The paused turn keeps running and learns so at its next
//!    heartbeat: the lease is re-taken if there is room, otherwise it is counted in `lease_lost`
//!    ([`FleetEvent::LeaseLost`]). Until that turn ends it overlaps a newer one. **The bound:**
//!    after a pause, the fleet runs over the cap by at most the number of turns that held a
//!    lease on the paused replica when the pause began (and were still running when it ended),
//!    for as long as those turns run on. No turn starts on a grant that reached the replica's
//!    waiting tickets during the pause: every grant is claimed first, and a grant older than its
//!    claim window (by the server's clock) is refused, counted in `lease_lost`, and its turn
//!    waits again with its place in line.
//!
//! **Sizing `lease_ttl` against pauses.** A lease survives a pause shorter than
//! `lease_ttl - heartbeat_interval - command_timeout` (with the defaults, 10 s − 3.3 s − 1 s
//! ≈ 5.6 s). Set it above the longest stall you expect (GC pauses, CPU throttling, a slow
//! Redis failover). A longer TTL costs only how long a crashed replica's leases stay taken
//! before they return to the fleet.
//!
//! **Time** is always the Redis server's (`TIME` inside the scripts), never a replica's clock:
//! lease expiry and ticket order cannot be skewed by a replica's clock.
//!
//! **Fairness.** Tickets are scored by the server's time of arrival. Room goes to the oldest
//! ticket that can run (under its replica's cap, its tenant below its slice, its replica
//! present); a ticket that cannot run is skipped, not dropped. A newcomer takes a lease directly
//! only when no waiting ticket can run. So a turn never starts after a turn that arrived
//! anywhere in the fleet more than one hand-off latency later (except around a replica that
//! lost its presence, below).
//!
//! **Priority classes** ([`FleetClasses`], [`FleetLimit::set_classes`],
//! [`FleetLimit::acquire_in`]): with classes, room goes to the most important class below its
//! guaranteed share of the fleet's limit, else the most important class below its cap, and
//! within a class FIFO or, with fair queuing, to the tenant furthest behind, across replicas;
//! every replica must configure the same classes or it is refused. The design is the
//! `classes` module's documentation (`src/classes.rs`).
//!
//! **Room never sits with a replica that cannot use it for longer than the claim window.** A
//! grant is a lease that expires after the **claim window** (`command_timeout`) unless its
//! replica claims it; a live replica claims at once (the pub/sub message, or its next
//! re-check). A grant that goes unclaimed ends its replica's **presence**: its tickets get no
//! more room until it calls again. Presence also lapses on its own
//! `min(lease_ttl, 2 × min(heartbeat_interval, recheck_interval) + command_timeout)` after the
//! replica last queued or renewed a ticket (the defaults: 3 s). So after a replica dies
//! (`kill -9`) or pauses: grants made to it before it lost its presence hold their room for at
//! most the claim window each; the room then goes to the live replicas' tickets at the next
//! call of any replica (at the latest their next re-check, `min(heartbeat_interval,
//! recheck_interval)`). Its running turns' leases are a different matter: they stay taken
//! until `lease_ttl` after their last renewal (a live holder's lease cannot be told from a dead
//! one's sooner). When the replica returns, its heartbeat puts its tickets back in line with
//! their original arrival. Its own tickets' expiry (`lease_ttl` after their last renewal)
//! remains the backstop that removes them from the fleet's count.
//!
//! **Hand-off** is pushed: a release grants the room to the next ticket inside its Lua call and
//! publishes the ticket's id on `{key}:grants`; the waiting replica's listener claims the grant
//! (one call: still its own and not expired, by the server's clock) and starts the turn. Since a
//! published message can be lost, a replica with waiting turns also re-checks every
//! `recheck_interval` (the same heartbeat call, which claims any grant it finds), which also
//! hands a dead holder's room to waiters soon after it expires.
//!
//! **Cancellation.** Dropping an [`FleetLimit::acquire`] future withdraws its ticket (best
//! effort; the ticket otherwise expires with the heartbeat), and a lease granted at that moment
//! is given back, never leaked. Dropping a [`Lease`] gives it back too.
//!
//! # Outages
//!
//! **A slow reply is not an outage.** A call unanswered after `connect_timeout +
//! command_timeout` is not failed: a PING on a fresh connection (with the same bound) asks
//! whether Redis is alive, while the call keeps waiting for its own reply (never sent twice, so
//! a busy server is not given more work). Redis is taken to be down only on a connection error
//! (refused, reset, a TLS or AUTH failure) or an unanswered PING. So a busy Redis (a burst far
//! beyond the cap), a starved CPU or a pause of this process longer than `command_timeout` is
//! waited out, for at most `lease_ttl` per call. A PING that itself fires far later than its
//! bound (this process was not scheduled) is tried once more before Redis is blamed. A server
//! that accepts connections but never answers fails a call within `2 × (connect_timeout +
//! command_timeout)`; a refused connection fails it at once: an admission never hangs on a dead
//! socket. The first failure marks the backend down (counted in `outages`, one
//! [`FleetEvent::BackendDown`] per outage) and, from then on, admissions decide without a round
//! trip, as `on_backend_error` says:
//!
//! - **`local`** (the default: availability over the exact quota): admit against the replica's
//!   local ceiling alone (admitgate's own gate). **N replicas may then admit up to N times their
//!   local ceilings**; size the local ceiling (`max_concurrent_runs`) so that N times it is
//!   something the protected dependency survives for the length of an outage. Turns waiting for
//!   a lease run at once.
//! - **`reject`**: refuse with [`FleetError::Unavailable`] (reason `fleet_unavailable`), and so
//!   never exceed the cap; turns waiting for a lease are refused too.
//!
//! A background probe (every `probe_interval`) detects recovery. Before saying the backend is
//! up it sends the releases owed from the outage and registers, in one heartbeat, every lease
//! taken during it: re-taken if there is room, else counted lost.
//!
//! A **Redis restart without persistence** erases every lease and ticket. The next heartbeat
//! re-takes each running turn's lease if there is room (counted in `lease_retaken`), otherwise
//! counts it lost, and queues each waiting turn's ticket again with its original arrival time.
//! Scripts are reloaded on NOSCRIPT.
//!
//! # Rolling deploys with different caps
//!
//! Each replica enforces **its own** `max_in_flight` (and slice): every script call carries the
//! caller's cap, and a ticket stores its replica's cap. A replica configured with 10 takes a
//! lease only while fewer than 10 are held fleet-wide, one configured with 20 while fewer than
//! 20. During a deploy that lowers the cap from 20 to 10 the fleet therefore holds at most 20
//! (the largest cap still running), and new replicas wait until the fleet drains below 10; once
//! the old replicas are gone the cap is 10 everywhere. No cap is stored in Redis, so there is no
//! "last writer wins" flapping and no stale cap after a rollback.
//!
//! # The learned limit
//!
//! Replicas whose gates learn an adaptive ceiling ([`FleetLearner`], admitgate's `adaptive=`
//! with `fleet=`) share one learned limit, `{key}:learned`, which every script honours: the
//! fleet holds at most `min(max_in_flight, learned limit)` leases, each replica's own cap still
//! bounding it. A lower proposal is taken at once, a higher one is a compare-and-set on its
//! generation at most once per round trip by the server's clock; see [`FleetLearner`]
//! for the design. Without one (no adaptive replica, or after a restart until one proposes), the
//! caps alone count, exactly as before; a turn costs no extra round trip either way.
//!
//! # Redis layout
//!
//! All keys of one limit share the hash tag `{key}` (one cluster slot):
//! `{key}:holders` (sorted set, lease id → expiry in server milliseconds),
//! `{key}:scope:<scope>` (the same, per tenant), `{key}:granted` (grants not yet claimed → their
//! claim deadline), `{key}:tickets` (sorted set, ticket id → arrival in server microseconds),
//! `{key}:ticket_expiry`, `{key}:ticket_info` (a ticket's cap, TTL, slice, claim window and
//! scope), `{key}:lane:<replica instance>|<scope>` (one replica's tickets of one scope, by
//! arrival), `{key}:heads:<cap>` (the oldest ticket of each lane of the replicas with that cap),
//! `{key}:classes` (those caps), `{key}:replicas` (replica instance → end of its presence),
//! with priority classes `{key}:cls:<c>`, `{key}:conf`, `{key}:vt`, `{key}:ftag:<c>` and
//! `{key}:flow:<c>:<tenant>` (see the `classes` module),
//! `{key}:borrowed`, `{key}:learned` (the learned limit: limit, generation, time of the last
//! change; an hour's expiry, renewed by every heartbeat) and the pub/sub channel `{key}:grants`. Every key carries an expiry just
//! past its newest member, so an idle limit leaves nothing behind. The per-tenant, per-lane and
//! per-cap keys are derived inside the scripts from the `{key}:` prefix; they share the hash
//! tag, so they live in the same slot as the declared keys.
//!
//! # Topologies and durability
//!
//! The URL names one server (`redis://`, `rediss://`), the primary a set of sentinels names
//! (`redis+sentinel://host:port[,host:port...]/service[/db]`: asked again at every
//! reconnection, the one named while being promoted or with the highest configuration epoch;
//! `READONLY` from a demoted primary is "the primary moved", not an outage), or a Redis
//! Cluster (`redis+cluster://host:port[,...]`: every key of a limit in the slot of `{key}`;
//! MOVED, ASK and TRYAGAIN retried by the driver; grants published with plain PUBLISH, which
//! every node relays). A failover to a replica that had not received the latest writes looks
//! like a restart without persistence and is handled as one: with the default
//! [`Durability::Primary`] the fleet may then run over the cap by the leases the replica
//! lacked (counted in `lease_lost`); with [`Durability::Replicated`] every call that can grant
//! is confirmed by `WAIT 1 <command_timeout>` first, and the cap holds through a failover to
//! the confirming replica.
//!
//! # Cost
//!
//! An uncontended turn costs one round trip to take its lease and one to release it; a turn
//! that waited costs one more, to claim its grant (one per pub/sub message, which may carry
//! several grants). A replica's heartbeat is one pipelined call per `lease_ttl / 3` (per
//! `recheck_interval` while it has waiting turns), whatever the number of its leases.
//!
//! **No script walks the queue.** Tickets are kept in lanes (one replica's tickets of one
//! scope, which share a cap and a slice), and the oldest ticket of each lane in a sorted set
//! per cap, so a grant is a few O(log n) steps in the number n of tickets and leases: the
//! oldest lane head of the caps above the holder count, skipping only lanes whose tenant is at
//! its slice (at most `max_in_flight / max_in_flight_per_scope` tenants per replica). Expired
//! entries are pruned at most 100 of each kind per call. A heartbeat costs O(log n) per id it
//! carries. Measured (`python benchmarks/fleet_queue.py`): about 60 µs of Lua per call with
//! 100, 1,000 or 10,000 tickets waiting, where the walk cost 0.2, 1.3 and 15.7 ms.
//!
//! # No panics
//!
//! The crate never panics: no `unwrap`, `expect`, `panic!`, unchecked indexing or overflowing
//! arithmetic, which the lints below deny and CI's `cargo clippy` enforces. The durations are
//! validated before anything runs, so deadline arithmetic cannot overflow (and saturates
//! anyway); a case that could only arise from a bug (a count of this replica's leases going
//! below zero) is checked by `debug_assert!` and stops at zero in release builds. The
//! replica's own record of its leases and waiting turns changes under one mutex that is never
//! held across an `await` or a call out. The event handler, the one callback into foreign
//! code, runs with no lock held, and a panic in it is contained: the event is lost, not the
//! heartbeat. What can still panic is tokio itself, if the runtime given to
//! [`FleetLimit::new`] lacks its time or I/O driver. Allocation failure aborts the process.
//!
//! **A network failure halfway** (the request sent, no reply) cannot leave Redis half-changed:
//! each step of the protocol is one Lua script, which Redis runs to its end once it has started,
//! whatever becomes of the connection, with no other command in between. What the replica
//! cannot know is whether it ran, and it need not: the failure is an outage (see
//! [Outages](#outages)) and the id the call carried is settled when Redis answers again. With
//! `local` (and always for a [`reclaim`](FleetLimit::reclaim)) the turn runs on a local lease
//! under that id, which the recovery heartbeat registers: renewed if the lost call took it,
//! else re-taken or counted lost. With `reject` the turn is refused and a release of the id
//! (which removes whichever of lease and ticket exists) is owed, and sent before the backend is
//! said to be up. Every script is idempotent per lease id, so running one twice (the retry on a
//! dropped connection, or a release sent again) is harmless.

// Denied outside tests only, as in admitgate's core: tests unwrap and index to state what they
// expect, and a test that panics is a test that fails. The integration tests in `tests/` are
// separate crates and are not covered.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

mod backend;
mod budget;
mod classes;
mod config;
mod error;
mod events;
mod heartbeat;
mod learned;
mod lease;
mod lending;
mod limit;
mod registry;
mod scripts;
mod stats;
mod subscriber;
mod tickets;
mod topology;
mod window_lockout;

pub use budget::{
    BudgetFallback, BudgetRefusal, Decider, FleetBudget, FleetBudgetStats, FleetDecision,
    FleetReservation,
};
pub use classes::{FleetClasses, FAIR_QUANTUM};
pub use config::{ConfigError, Durability, FleetConfig, OnBackendError};
pub use error::FleetError;
pub use events::{log_events, EventHandler, FleetEvent};
pub use learned::{FleetLearner, LimitSource};
pub use lease::Lease;
pub use lending::Reclaim;
pub use limit::FleetLimit;
pub use scripts::{Change, Learned, Proposal};
pub use stats::FleetStats;
pub use window_lockout::{FleetWindowLockout, FleetWindowVerdict};
