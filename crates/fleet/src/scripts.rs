//! The Lua scripts of the lease protocol (in `src/lua/`), the keys they work on, and typed
//! calls. Every script is sent as EVALSHA and loaded on NOSCRIPT (`redis::Script`), so a
//! restarted Redis, which has forgotten them, costs one extra round trip.

use std::sync::{Arc, RwLock};

use crate::backend::Connection;
use crate::classes::FleetClasses;
use redis::{RedisResult, Script};

const COMMON: &str = include_str!("lua/common.lua");

/// Most ids one heartbeat script call carries; a replica holding more sends several calls on
/// one pipelined connection, so one Redis call never blocks the server for long.
pub(crate) const HEARTBEAT_CHUNK: usize = 1000;

/// The Redis keys of one limit. They all share the hash tag `{key}`, so they live in one slot
/// (the scripts derive the per-scope, per-lane and per-cap keys from `prefix`).
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    holders: String,
    tickets: String,
    ticket_expiry: String,
    ticket_info: String,
    borrowed: String,
    granted: String,
    replicas: String,
    classes: String,
    prefix: String,
    /// Where granted ticket ids are published.
    pub(crate) channel: String,
}

impl Keys {
    pub(crate) fn new(key: &str) -> Self {
        let tag = format!("{{{key}}}");
        Keys {
            holders: format!("{tag}:holders"),
            tickets: format!("{tag}:tickets"),
            ticket_expiry: format!("{tag}:ticket_expiry"),
            ticket_info: format!("{tag}:ticket_info"),
            borrowed: format!("{tag}:borrowed"),
            granted: format!("{tag}:granted"),
            replicas: format!("{tag}:replicas"),
            classes: format!("{tag}:classes"),
            prefix: format!("{tag}:"),
            channel: format!("{tag}:grants"),
        }
    }
}

/// What every script reports about the fleet, stamped with the server time it was read at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FleetStatus {
    pub(crate) in_flight: u64,
    pub(crate) borrowed: u64,
    pub(crate) waiting: u64,
    /// Server time (µs) of the reading: replies handled out of order keep the newest one.
    pub(crate) at_us: u64,
    /// The fleet's learned limit, if an adaptive replica set one.
    pub(crate) learned: Option<Learned>,
}

/// The fleet's learned limit as Redis holds it (`{key}:learned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learned {
    /// The most leases the fleet grants now (at most each replica's `max_in_flight`).
    pub limit: u64,
    /// Moves by one at each change; a fresh value (the first, or after a Redis restart) starts
    /// at the server's time in µs, so it is above every generation seen before.
    pub generation: u64,
}

/// The longest `Retry-After` hold kept in Redis: a day.
const MAX_HOLD_US: u64 = 86_400_000_000;

/// What a [`Proposal`] asks of the learned limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Set it if there is none yet (a replica's first value); otherwise leave it.
    Seed,
    /// Lower it (taken at once, whatever the generation: a throttle is a measurement).
    Lower,
    /// Raise it: taken only if `generation` is still current and a round trip passed since
    /// the last change.
    Raise,
}

impl Change {
    fn as_str(self) -> &'static str {
        match self {
            Change::Seed => "seed",
            Change::Lower => "lower",
            Change::Raise => "raise",
        }
    }
}

/// A change of the learned limit a replica proposes ([`Scripts::learn`]). With none in Redis
/// (the first proposal, or after a restart), any change seeds it with `limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proposal {
    /// What to do.
    pub change: Change,
    /// The limit proposed (the script bounds it to `[min_limit, max_limit]`).
    pub limit: u64,
    /// The generation the proposer last saw.
    pub generation: u64,
    /// The lowest limit.
    pub min_limit: u64,
    /// The fleet's cap.
    pub max_limit: u64,
    /// The least time between two changes, by the server's clock: the proposer's round trip.
    pub spacing: std::time::Duration,
    /// A provider's `Retry-After` seen by the proposer (zero: none): no raise is taken, from
    /// any replica, until it has passed by the server's clock (a hold is the provider's, so
    /// it holds fleet-wide; two compose as the later end).
    pub hold: std::time::Duration,
}

/// Outcome of the acquire script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taken {
    Granted,
    /// Queued with this arrival (µs, server time).
    Queued(i64),
    Busy,
    /// The caller's class configuration is not the fleet's (nothing taken or queued).
    Conflict,
}

/// Outcome of the reclaim script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reclaimed {
    Taken,
    BorrowedFleet,
    BorrowedScope,
}

/// One id sent with a heartbeat.
#[derive(Debug, Clone)]
pub(crate) enum Beat {
    Lease {
        id: std::sync::Arc<str>,
        scope: std::sync::Arc<str>,
    },
    Ticket {
        id: std::sync::Arc<str>,
        scope: std::sync::Arc<str>,
        arrival_us: i64,
    },
}

/// What a claim found for one granted ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claimed {
    /// A lease now: the turn may start.
    Lease,
    /// Still waiting (the message was stale).
    Waiting,
    /// The grant expired before it was claimed; queued again with its arrival.
    Expired,
    /// The grant expired, and the ticket was granted again at once and claimed.
    ExpiredRegranted,
}

/// One granted ticket to claim.
#[derive(Debug, Clone)]
pub(crate) struct ClaimRequest {
    pub(crate) id: std::sync::Arc<str>,
    pub(crate) scope: std::sync::Arc<str>,
    /// Its arrival, when the acquire reply has arrived (needed to queue it again).
    pub(crate) arrival_us: Option<i64>,
}

/// What the heartbeat found for one id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BeatResult {
    Renewed,
    Retaken,
    Lost,
    Granted,
    Requeued,
}

/// The limit's caps and lease TTL, as this replica passes them to every script.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    pub(crate) cap: u32,
    pub(crate) slice: u32,
    pub(crate) ttl_ms: u64,
    /// How long a grant to this replica's tickets waits to be claimed.
    pub(crate) claim_ms: u64,
    /// How long this replica's tickets may get room after its last call.
    pub(crate) presence_ms: u64,
}

pub(crate) struct Scripts {
    keys: Keys,
    caps: Caps,
    /// `<replica_id>#<nonce>`: the prefix of this replica's ids, without the last `#`.
    instance: String,
    /// The priority classes this replica orders its tickets by (none until the gate sets them).
    classes: RwLock<Arc<FleetClasses>>,
    acquire: Script,
    release: Script,
    reclaim: Script,
    heartbeat: Script,
    claim: Script,
    learn: Script,
}

fn script(body: &str) -> Script {
    Script::new(&format!("{COMMON}\n{body}"))
}

/// How many values every reply starts with (the status).
const STATUS_LEN: usize = 6;

fn status(reply: &[i64]) -> RedisResult<FleetStatus> {
    // A count below zero (never sent) reads as zero.
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    match reply {
        [in_flight, borrowed, waiting, at_us, limit, generation, ..] => Ok(FleetStatus {
            in_flight: count(*in_flight),
            borrowed: count(*borrowed),
            waiting: count(*waiting),
            at_us: count(*at_us),
            learned: (*limit > 0).then(|| Learned {
                limit: count(*limit),
                generation: count(*generation),
            }),
        }),
        _ => Err(malformed(reply)),
    }
}

fn malformed(reply: &[i64]) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Parse,
        "unexpected reply from an admitgate fleet script",
        format!("{reply:?}"),
    ))
}

impl Scripts {
    pub(crate) fn new(keys: Keys, caps: Caps, instance: String) -> Self {
        Scripts {
            keys,
            caps,
            instance,
            classes: RwLock::new(Arc::new(FleetClasses::default())),
            acquire: script(include_str!("lua/acquire.lua")),
            release: script(include_str!("lua/release.lua")),
            reclaim: script(include_str!("lua/reclaim.lua")),
            heartbeat: script(include_str!("lua/heartbeat.lua")),
            claim: script(include_str!("lua/claim.lua")),
            learn: script(include_str!("lua/learn.lua")),
        }
    }

    pub(crate) fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The classes tickets are ordered by.
    pub(crate) fn classes(&self) -> Arc<FleetClasses> {
        self.classes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn set_classes(&self, classes: FleetClasses) {
        *self.classes.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(classes);
    }

    fn invocation<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let k = &self.keys;
        let classes = self.classes();
        let mut call = script.prepare_invoke();
        call.key(&k.holders)
            .key(&k.tickets)
            .key(&k.ticket_expiry)
            .key(&k.ticket_info)
            .key(&k.borrowed)
            .key(&k.granted)
            .key(&k.replicas)
            .key(&k.classes)
            .arg(&k.prefix)
            .arg(&k.channel)
            .arg(&self.instance)
            .arg(self.caps.presence_ms)
            .arg(classes.shares_arg())
            .arg(classes.identity());
        call
    }

    /// Takes a lease for `id`, or (with `wait`) queues a ticket for it.
    pub(crate) async fn acquire(
        &self,
        con: &mut Connection,
        id: &str,
        scope: &str,
        wait: bool,
    ) -> RedisResult<(FleetStatus, Taken)> {
        let Caps {
            cap,
            slice,
            ttl_ms,
            claim_ms,
            ..
        } = self.caps;
        let mut call = self.invocation(&self.acquire);
        call.arg(id)
            .arg(scope)
            .arg(cap)
            .arg(slice)
            .arg(ttl_ms)
            .arg(if wait { "1" } else { "0" })
            .arg(claim_ms)
            .arg(self.classes().step(scope));
        let reply: Vec<i64> = call.invoke_async(con).await?;
        let taken = match reply.get(STATUS_LEN..STATUS_LEN + 2) {
            Some([1, _]) => Taken::Granted,
            Some([2, arrival]) => Taken::Queued(*arrival),
            Some([0, _]) => Taken::Busy,
            Some([5, _]) => Taken::Conflict,
            _ => return Err(malformed(&reply)),
        };
        Ok((status(&reply)?, taken))
    }

    /// Gives back the lease `id` or withdraws the ticket `id`; true when either existed.
    pub(crate) async fn release(
        &self,
        con: &mut Connection,
        id: &str,
        scope: &str,
    ) -> RedisResult<(FleetStatus, bool)> {
        let mut call = self.invocation(&self.release);
        call.arg(id).arg(scope);
        let reply: Vec<i64> = call.invoke_async(con).await?;
        match reply.get(STATUS_LEN) {
            Some(removed) => Ok((status(&reply)?, *removed > 0)),
            None => Err(malformed(&reply)),
        }
    }

    /// Takes a lease for a resuming turn, borrowing one when there is no room.
    pub(crate) async fn reclaim(
        &self,
        con: &mut Connection,
        id: &str,
        scope: &str,
    ) -> RedisResult<(FleetStatus, Reclaimed)> {
        let Caps {
            cap, slice, ttl_ms, ..
        } = self.caps;
        let mut call = self.invocation(&self.reclaim);
        call.arg(id).arg(scope).arg(cap).arg(slice).arg(ttl_ms);
        let reply: Vec<i64> = call.invoke_async(con).await?;
        let reclaimed = match reply.get(STATUS_LEN) {
            Some(1) => Reclaimed::Taken,
            Some(3) => Reclaimed::BorrowedFleet,
            Some(4) => Reclaimed::BorrowedScope,
            _ => return Err(malformed(&reply)),
        };
        Ok((status(&reply)?, reclaimed))
    }

    /// Renews (or re-registers) `beats`, at most [`HEARTBEAT_CHUNK`] of them; returns one result
    /// per beat, in order.
    pub(crate) async fn heartbeat(
        &self,
        con: &mut Connection,
        beats: &[Beat],
    ) -> RedisResult<(FleetStatus, Vec<BeatResult>)> {
        let mut call = self.invocation(&self.heartbeat);
        self.caps_args(&mut call);
        let classes = self.classes();
        for beat in beats {
            match beat {
                Beat::Lease { id, scope } => {
                    call.arg("L").arg(&**id).arg(&**scope).arg(0).arg(0);
                }
                Beat::Ticket {
                    id,
                    scope,
                    arrival_us,
                } => {
                    call.arg("T")
                        .arg(&**id)
                        .arg(&**scope)
                        .arg(*arrival_us)
                        .arg(classes.step(scope));
                }
            }
        }
        let reply: Vec<i64> = call.invoke_async(con).await?;
        status_and_codes(&reply, beats.len(), |code| match code {
            0 => Some(BeatResult::Renewed),
            1 => Some(BeatResult::Retaken),
            2 => Some(BeatResult::Lost),
            3 => Some(BeatResult::Granted),
            4 => Some(BeatResult::Requeued),
            _ => None,
        })
    }

    /// This replica's cap, slice, lease TTL and claim window, as the heartbeat and claim
    /// scripts take them.
    fn caps_args(&self, call: &mut redis::ScriptInvocation<'_>) {
        let Caps {
            cap,
            slice,
            ttl_ms,
            claim_ms,
            ..
        } = self.caps;
        call.arg(cap).arg(slice).arg(ttl_ms).arg(claim_ms);
    }

    /// Applies `proposal` to the learned limit (see `lua/learn.lua`); the status says what it
    /// is now.
    pub(crate) async fn learn(
        &self,
        con: &mut Connection,
        proposal: &Proposal,
    ) -> RedisResult<FleetStatus> {
        let spacing_us = u64::try_from(proposal.spacing.as_micros()).unwrap_or(u64::MAX);
        // Bounded so the server's `now + hold` stays an exact Lua number (a day at most, as the
        // front doors bound a throttle's hint).
        let hold_us = u64::try_from(proposal.hold.as_micros())
            .unwrap_or(u64::MAX)
            .min(MAX_HOLD_US);
        let mut call = self.invocation(&self.learn);
        call.arg(proposal.change.as_str())
            .arg(proposal.limit)
            .arg(proposal.generation)
            .arg(proposal.min_limit)
            .arg(proposal.max_limit)
            .arg(spacing_us)
            .arg(hold_us);
        let reply: Vec<i64> = call.invoke_async(con).await?;
        status(&reply)
    }

    /// Claims granted tickets, at most [`HEARTBEAT_CHUNK`] of them; one result per request.
    pub(crate) async fn claim(
        &self,
        con: &mut Connection,
        requests: &[ClaimRequest],
    ) -> RedisResult<(FleetStatus, Vec<Claimed>)> {
        let mut call = self.invocation(&self.claim);
        self.caps_args(&mut call);
        let classes = self.classes();
        for request in requests {
            call.arg(&*request.id)
                .arg(&*request.scope)
                .arg(request.arrival_us.unwrap_or(-1))
                .arg(classes.step(&request.scope));
        }
        let reply: Vec<i64> = call.invoke_async(con).await?;
        status_and_codes(&reply, requests.len(), |code| match code {
            1 => Some(Claimed::Lease),
            2 => Some(Claimed::Waiting),
            3 => Some(Claimed::Expired),
            4 => Some(Claimed::ExpiredRegranted),
            _ => None,
        })
    }
}

/// A batch script's reply: the status, then one code per item (`expected` of them), each
/// decoded by `decode`; a reply of another length or with an unknown code is malformed.
fn status_and_codes<T>(
    reply: &[i64],
    expected: usize,
    decode: impl Fn(i64) -> Option<T>,
) -> RedisResult<(FleetStatus, Vec<T>)> {
    let codes = match reply.get(STATUS_LEN..) {
        Some(codes) if codes.len() == expected => codes,
        _ => return Err(malformed(reply)),
    };
    let results = codes
        .iter()
        .map(|&code| decode(code).ok_or_else(|| malformed(reply)))
        .collect::<RedisResult<Vec<T>>>()?;
    Ok((status(reply)?, results))
}
