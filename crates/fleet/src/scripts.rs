//! The Lua scripts of the lease protocol (in `src/lua/`), the keys they work on, and typed
//! calls. Every script is sent as EVALSHA and loaded on NOSCRIPT (`redis::Script`), so a
//! restarted Redis, which has forgotten them, costs one extra round trip.

use redis::aio::ConnectionManager;
use redis::{RedisResult, Script};

const COMMON: &str = include_str!("lua/common.lua");

/// Most ids one heartbeat script call carries; a replica holding more sends several calls on
/// one pipelined connection, so one Redis call never blocks the server for long.
pub(crate) const HEARTBEAT_CHUNK: usize = 1000;

/// The Redis keys of one limit. They all share the hash tag `{key}`, so they live in one slot.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    holders: String,
    tickets: String,
    ticket_expiry: String,
    ticket_info: String,
    borrowed: String,
    scope_prefix: String,
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
            scope_prefix: format!("{tag}:scope:"),
            channel: format!("{tag}:grants"),
        }
    }
}

/// What every script reports about the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FleetStatus {
    pub(crate) in_flight: u64,
    pub(crate) borrowed: u64,
    pub(crate) waiting: u64,
}

/// Outcome of the acquire script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taken {
    Granted,
    /// Queued with this arrival (µs, server time).
    Queued(i64),
    Busy,
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
}

pub(crate) struct Scripts {
    keys: Keys,
    caps: Caps,
    acquire: Script,
    release: Script,
    reclaim: Script,
    heartbeat: Script,
}

fn script(body: &str) -> Script {
    Script::new(&format!("{COMMON}\n{body}"))
}

fn status(reply: &[i64]) -> RedisResult<FleetStatus> {
    // A count below zero (never sent) reads as zero.
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    match reply {
        [in_flight, borrowed, waiting, ..] => Ok(FleetStatus {
            in_flight: count(*in_flight),
            borrowed: count(*borrowed),
            waiting: count(*waiting),
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
    pub(crate) fn new(keys: Keys, caps: Caps) -> Self {
        Scripts {
            keys,
            caps,
            acquire: script(include_str!("lua/acquire.lua")),
            release: script(include_str!("lua/release.lua")),
            reclaim: script(include_str!("lua/reclaim.lua")),
            heartbeat: script(include_str!("lua/heartbeat.lua")),
        }
    }

    pub(crate) fn keys(&self) -> &Keys {
        &self.keys
    }

    fn invocation<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let k = &self.keys;
        let mut call = script.prepare_invoke();
        call.key(&k.holders)
            .key(&k.tickets)
            .key(&k.ticket_expiry)
            .key(&k.ticket_info)
            .key(&k.borrowed)
            .arg(&k.scope_prefix)
            .arg(&k.channel);
        call
    }

    /// Takes a lease for `id`, or (with `wait`) queues a ticket for it.
    pub(crate) async fn acquire(
        &self,
        con: &mut ConnectionManager,
        id: &str,
        scope: &str,
        wait: bool,
    ) -> RedisResult<(FleetStatus, Taken)> {
        let Caps { cap, slice, ttl_ms } = self.caps;
        let mut call = self.invocation(&self.acquire);
        call.arg(id)
            .arg(scope)
            .arg(cap)
            .arg(slice)
            .arg(ttl_ms)
            .arg(if wait { "1" } else { "0" });
        let reply: Vec<i64> = call.invoke_async(con).await?;
        let taken = match reply.get(3..5) {
            Some([1, _]) => Taken::Granted,
            Some([2, arrival]) => Taken::Queued(*arrival),
            Some([0, _]) => Taken::Busy,
            _ => return Err(malformed(&reply)),
        };
        Ok((status(&reply)?, taken))
    }

    /// Gives back the lease `id` or withdraws the ticket `id`; true when either existed.
    pub(crate) async fn release(
        &self,
        con: &mut ConnectionManager,
        id: &str,
        scope: &str,
    ) -> RedisResult<(FleetStatus, bool)> {
        let mut call = self.invocation(&self.release);
        call.arg(id).arg(scope);
        let reply: Vec<i64> = call.invoke_async(con).await?;
        match reply.get(3) {
            Some(removed) => Ok((status(&reply)?, *removed > 0)),
            None => Err(malformed(&reply)),
        }
    }

    /// Takes a lease for a resuming turn, borrowing one when there is no room.
    pub(crate) async fn reclaim(
        &self,
        con: &mut ConnectionManager,
        id: &str,
        scope: &str,
    ) -> RedisResult<(FleetStatus, Reclaimed)> {
        let Caps { cap, slice, ttl_ms } = self.caps;
        let mut call = self.invocation(&self.reclaim);
        call.arg(id).arg(scope).arg(cap).arg(slice).arg(ttl_ms);
        let reply: Vec<i64> = call.invoke_async(con).await?;
        let reclaimed = match reply.get(3) {
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
        con: &mut ConnectionManager,
        beats: &[Beat],
    ) -> RedisResult<(FleetStatus, Vec<BeatResult>)> {
        let Caps { cap, slice, ttl_ms } = self.caps;
        let mut call = self.invocation(&self.heartbeat);
        call.arg(cap).arg(slice).arg(ttl_ms);
        for beat in beats {
            match beat {
                Beat::Lease { id, scope } => {
                    call.arg("L").arg(&**id).arg(&**scope).arg(0);
                }
                Beat::Ticket {
                    id,
                    scope,
                    arrival_us,
                } => {
                    call.arg("T").arg(&**id).arg(&**scope).arg(*arrival_us);
                }
            }
        }
        let reply: Vec<i64> = call.invoke_async(con).await?;
        // The status, then one code per beat.
        let codes = match reply.get(3..) {
            Some(codes) if codes.len() == beats.len() => codes,
            _ => return Err(malformed(&reply)),
        };
        let mut results = Vec::with_capacity(beats.len());
        for code in codes {
            results.push(match code {
                0 => BeatResult::Renewed,
                1 => BeatResult::Retaken,
                2 => BeatResult::Lost,
                3 => BeatResult::Granted,
                4 => BeatResult::Requeued,
                _ => return Err(malformed(&reply)),
            });
        }
        Ok((status(&reply)?, results))
    }
}
