//! The connection to Redis and whether it is up. Every call is bounded by
//! `connect_timeout + command_timeout`, so nothing waits on a dead socket for longer; failures
//! come back as messages scrubbed of the URL's password. One server, a Sentinel-named primary
//! and a Redis Cluster are reached through the same [`Backend::call`].

use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{RedisFuture, RedisResult, Value};
use tokio::runtime::Handle;

use crate::config::{url_secrets, ConfigError, Durability, FleetConfig};
use crate::topology::{self, Kind};

/// How late a timer may fire before the process is taken to have been paused (not scheduled).
const PAUSE_SLACK: Duration = Duration::from_millis(100);

/// The pause before a call that found Redis busy (BUSY, LOADING) is sent again.
const BUSY_PAUSE: Duration = Duration::from_millis(50);

/// Whether Redis refused the call because it is busy (a long script is running) or loading its
/// data: it is alive and the call did not run.
fn is_busy(e: &redis::RedisError) -> bool {
    e.code()
        .is_some_and(|code| code == "BUSY" || code == "LOADING")
}

/// A failed call: what went wrong, without secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure(pub(crate) String);

/// Where the fleet's keys live: one server, the primary a set of sentinels names, or a Redis
/// Cluster.
enum Target {
    Single(redis::Client),
    /// Asked for the primary at every (re)connection, so a failover is followed by dialling
    /// again.
    Sentinel(Sentinels),
    /// The cluster client (MOVED, ASK and TRYAGAIN are followed inside it), and one client per
    /// seed node for the pub/sub connection (plain PUBLISH reaches every node of a cluster).
    Cluster {
        client: Box<ClusterClient>,
        seeds: Vec<redis::Client>,
    },
}

/// The sentinels of a `redis+sentinel://` URL and what it takes to dial the primary they name.
struct Sentinels {
    sentinels: Vec<redis::Client>,
    nodes: topology::Nodes,
    url: String,
    tls: Option<redis::TlsCertificates>,
}

/// A connection to the fleet's Redis, whatever its topology: the shared, multiplexed
/// connection of one server (or of the primary a sentinel named), or a cluster connection.
/// Scripts and commands run on it through [`redis::aio::ConnectionLike`].
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(con) => con.req_packed_command(cmd),
            Connection::Cluster(con) => con.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(con) => con.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(con) => con.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(con) => con.get_db(),
            Connection::Cluster(con) => con.get_db(),
        }
    }
}

/// The connection in use, and the server it talks to (one server or the named primary).
#[derive(Clone)]
struct Live {
    connection: Connection,
    node: Option<redis::Client>,
}

/// Whether Redis answered that it is a replica now: the primary this connection dialled was
/// demoted by a failover, so the primary has moved.
fn is_read_only(e: &redis::RedisError) -> bool {
    e.code() == Some("READONLY") || e.to_string().contains("READONLY")
}

pub(crate) struct Backend {
    target: Target,
    kind: Kind,
    manager_config: ConnectionManagerConfig,
    /// Built inside the runtime; dropped after a failure so the next call dials afresh (a
    /// connection that timed out may otherwise never be replaced; with Sentinel, the next call
    /// asks the sentinels for the primary again).
    live: Mutex<Option<Live>>,
    /// Held while dialling (see [`Backend::live`]).
    dialing: tokio::sync::Mutex<()>,
    handle: Handle,
    connect_timeout: Duration,
    command_timeout: Duration,
    /// How long a call waits for a Redis that answers PING: `lease_ttl`.
    budget: Duration,
    /// `durability = replicated`: each call is confirmed by `WAIT 1 <this>`.
    confirm_within: Option<Duration>,
    /// The key every call's keys hash with (`{key}`), to route a cluster's WAIT to its node.
    hash_tag: String,
    secrets: Vec<String>,
    up: AtomicBool,
    down_since: Mutex<Option<Instant>>,
    outages: AtomicU64,
    /// The primary's address as last resolved (Sentinel), to count failovers.
    primary: Mutex<Option<String>>,
    failovers: AtomicU64,
    unconfirmed: AtomicU64,
}

impl Backend {
    pub(crate) fn new(config: &FleetConfig, handle: Handle) -> Result<Self, ConfigError> {
        let (target, kind) = build_target(config)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            // The call's own timers decide what a slow reply means (see `call`), and bound
            // every call: the driver never ends one itself. A driver timeout fired as this
            // process wakes from a pause (SIGSTOP, a stalled VM) would take a reply already in
            // the socket for an outage (issue 22 item 20).
            .set_response_timeout(None)
            // One dial per call: the outage logic, not the driver, decides when to try again.
            .set_number_of_retries(0);
        Ok(Backend {
            target,
            kind,
            manager_config,
            live: Mutex::new(None),
            dialing: tokio::sync::Mutex::new(()),
            handle,
            connect_timeout: config.connect_timeout,
            command_timeout: config.command_timeout,
            budget: config.lease_ttl,
            confirm_within: (config.durability == Durability::Replicated)
                .then_some(config.command_timeout),
            hash_tag: format!("{{{}}}", config.key),
            secrets: url_secrets(&config.url),
            up: AtomicBool::new(true),
            down_since: Mutex::new(None),
            outages: AtomicU64::new(0),
            primary: Mutex::new(None),
            failovers: AtomicU64::new(0),
            unconfirmed: AtomicU64::new(0),
        })
    }

    /// The topology the URL names.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    pub(crate) fn command_timeout(&self) -> Duration {
        self.command_timeout
    }

    /// The connection in use, dialled (with Sentinel: the primary asked for) when there is none.
    async fn live(&self) -> Result<Live, Failure> {
        let cached = || {
            self.live
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .cloned()
        };
        if let Some(live) = cached() {
            return Ok(live);
        }
        // One dial at a time: a burst of calls after a failure shares one new connection
        // (a cluster connection dials every node) instead of each making its own.
        let _dialing = self.dialing.lock().await;
        if let Some(live) = cached() {
            return Ok(live);
        }
        let live = match &self.target {
            Target::Single(client) => Live {
                connection: Connection::Single(self.manager(client.clone())?),
                node: Some(client.clone()),
            },
            Target::Sentinel(sentinels) => {
                let client = self.resolve_primary(sentinels).await?;
                Live {
                    connection: Connection::Single(self.manager(client.clone())?),
                    node: Some(client),
                }
            }
            Target::Cluster { client, .. } => {
                let connection =
                    tokio::time::timeout(self.connect_timeout, client.get_async_connection())
                        .await
                        .map_err(|_| {
                            Failure(format!(
                                "no cluster connection within {:?}",
                                self.connect_timeout
                            ))
                        })?
                        .map_err(|e| self.failure(&e))?;
                Live {
                    connection: Connection::Cluster(connection),
                    node: None,
                }
            }
        };
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) = Some(live.clone());
        Ok(live)
    }

    /// A multiplexed connection to `client`, dialled lazily by its first call.
    fn manager(&self, client: redis::Client) -> Result<ConnectionManager, Failure> {
        // The manager spawns its driver task on the current runtime.
        let _runtime = self.handle.enter();
        ConnectionManager::new_lazy_with_config(client, self.manager_config.clone())
            .map_err(|e| self.failure(&e))
    }

    /// Asks every sentinel for the primary (`SENTINEL GET-MASTER-ADDR-BY-NAME`, and `SENTINEL
    /// MASTER` for its epoch and flags), bounded by `connect_timeout`, and takes the one a
    /// sentinel names while it promotes it, else the one named with the highest configuration
    /// epoch and not taken for down; then checks it with `ROLE`. Counts a failover when it is
    /// not the one named last time.
    ///
    /// Not the driver's `redis::sentinel` lookup, which takes the first sentinel (in the
    /// order written) that names a server answering ROLE as a primary: right after a failover
    /// a sentinel that has not heard of it yet still names the old primary, and if that server
    /// was restarted meanwhile it answers as an (empty) primary until the sentinels turn it
    /// into a replica. Writing there would lose the leases. The epoch is how the sentinels
    /// themselves tell the newer configuration from the older.
    async fn resolve_primary(&self, sentinels: &Sentinels) -> Result<redis::Client, Failure> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.connect_timeout));
        let ask = |sentinel: &redis::Client| {
            let config = config.clone();
            let sentinel = sentinel.clone();
            async move {
                let asked = async {
                    let mut con = sentinel
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?;
                    redis::pipe()
                        .cmd("SENTINEL")
                        .arg("MASTER")
                        .arg(&sentinels.nodes.service)
                        .cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(&sentinels.nodes.service)
                        .query_async::<(std::collections::HashMap<String, String>, Vec<String>)>(
                            &mut con,
                        )
                        .await
                };
                tokio::time::timeout(self.connect_timeout, asked).await
            }
        };
        let answers = futures_util::future::join_all(sentinels.sentinels.iter().map(ask)).await;
        // Ranked by (mid-failover, epoch): a sentinel whose address differs from its master's
        // record is finishing a failover it leads and names the promoted replica (the newest
        // knowledge there is); otherwise the highest configuration epoch wins.
        let mut best: Option<((bool, u64), String, u16)> = None;
        let mut last_error = None;
        for answer in answers {
            let (master, address) = match answer {
                Ok(Ok(answer)) => answer,
                Ok(Err(e)) => {
                    last_error = Some(self.failure(&e).0);
                    continue;
                }
                Err(_) => continue,
            };
            let (Some(ip), Some(port)) = (
                address.first(),
                address.get(1).and_then(|p| p.parse::<u16>().ok()),
            ) else {
                continue;
            };
            let promoting = master.get("ip") != Some(ip)
                || master.get("port").and_then(|p| p.parse::<u16>().ok()) != Some(port);
            let flags = master.get("flags").map(String::as_str).unwrap_or("");
            if !promoting && (flags.contains("s_down") || flags.contains("o_down")) {
                continue;
            }
            let epoch = master
                .get("config-epoch")
                .and_then(|e| e.parse::<u64>().ok())
                .unwrap_or(0);
            let rank = (promoting, epoch);
            if best.as_ref().is_none_or(|(known, _, _)| rank > *known) {
                best = Some((rank, ip.clone(), port));
            }
        }
        let Some((_, ip, port)) = best else {
            return Err(Failure(format!(
                "no sentinel named a primary for {:?} within {:?}{}",
                sentinels.nodes.service,
                self.connect_timeout,
                last_error.map(|e| format!(" ({e})")).unwrap_or_default()
            )));
        };
        let url = sentinels.nodes.node_url(&ip, port, &sentinels.url);
        let resolved = match &sentinels.tls {
            None => redis::Client::open(url.as_str()),
            Some(tls) => redis::Client::build_with_tls(
                url.as_str(),
                redis::TlsCertificates {
                    client_tls: tls.client_tls.as_ref().map(|c| redis::ClientTlsConfig {
                        client_cert: c.client_cert.clone(),
                        client_key: c.client_key.clone(),
                    }),
                    root_cert: tls.root_cert.clone(),
                },
            ),
        }
        .map_err(|e| self.failure(&e))?;
        // Demoted (or not yet promoted): not the primary.
        let role = async {
            let mut con = resolved
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            redis::cmd("ROLE")
                .query_async::<Vec<redis::Value>>(&mut con)
                .await
        };
        match tokio::time::timeout(self.connect_timeout, role).await {
            Ok(Ok(role)) if matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master") =>
                {}
            Ok(Err(e)) => return Err(self.failure(&e)),
            _ => {
                return Err(Failure(format!(
                    "the primary the sentinels name, {ip}:{port}, is not a primary (yet)"
                )))
            }
        }
        let address = format!("{ip}:{port}");
        let mut primary = self.primary.lock().unwrap_or_else(|e| e.into_inner());
        if primary.as_ref().is_some_and(|known| *known != address) {
            self.failovers.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "admitgate fleet: the sentinels name a new primary, {address} (was {})",
                primary.as_deref().unwrap_or("?")
            );
        }
        *primary = Some(address);
        Ok(resolved)
    }

    /// Forgets the connection; the next call dials again (with Sentinel, after asking the
    /// sentinels which server is the primary now).
    pub(crate) fn reset(&self) {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// A pub/sub connection: to the server in use (one server, or the named primary), or to
    /// the first seed node that answers (a cluster relays plain PUBLISH to every node).
    pub(crate) async fn pubsub(&self) -> Option<redis::aio::PubSub> {
        let nodes: Vec<redis::Client> = match &self.target {
            Target::Cluster { seeds, .. } => seeds.clone(),
            _ => vec![self.live().await.ok()?.node?],
        };
        for node in nodes {
            let dialled = tokio::time::timeout(self.connect_timeout, node.get_async_pubsub()).await;
            if let Ok(Ok(pubsub)) = dialled {
                return Some(pubsub);
            }
        }
        None
    }

    /// Failovers seen: a new primary named by the sentinels (Sentinel only).
    pub(crate) fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// Calls that no replica confirmed within `command_timeout` (`durability = replicated`).
    pub(crate) fn unconfirmed(&self) -> u64 {
        self.unconfirmed.load(Ordering::Relaxed)
    }

    /// `WAIT 1 <timeout>` after a call (`durability = replicated`): every write this connection
    /// made is held by a replica, or the call fails. With a cluster, sent to the primary of the
    /// limit's slot (not to every primary, as the driver would route a bare WAIT).
    async fn confirm(&self, connection: &mut Connection, within: Duration) -> Result<(), Failure> {
        let ms = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
        let mut wait = redis::cmd("WAIT");
        wait.arg(1).arg(ms);
        let replicas: RedisResult<i64> = match connection {
            Connection::Single(con) => wait.query_async(con).await,
            Connection::Cluster(con) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::with_key(self.hash_tag.as_bytes(), SlotAddr::Master),
                ));
                con.route_command(wait, route).await.and_then(|value| {
                    redis::from_redis_value(value).map_err(redis::RedisError::from)
                })
            }
        };
        match replicas {
            Ok(n) if n >= 1 => Ok(()),
            Ok(_) => {
                self.unconfirmed.fetch_add(1, Ordering::Relaxed);
                Err(Failure(format!(
                    "no replica confirmed the write within {within:?} (durability=replicated)"
                )))
            }
            Err(e) => Err(self.failure(&e)),
        }
    }

    /// Runs one call on the connection. Its first answer is awaited for `connect_timeout +
    /// command_timeout`. A call that finds its connection dropped (Redis restarted, a proxy
    /// closed it) is sent once more on a fresh connection, so a quick restart is not an outage.
    ///
    /// A slow reply is not a dead server. When the first bound passes without an answer, a
    /// PING on a fresh connection (with the same bound) asks whether Redis is alive, while the
    /// call keeps waiting for its own reply (it is never sent twice: a busy server is not given
    /// more work). Only a connection error or an unanswered PING is a failure (an outage). An
    /// answered PING means Redis is alive but busy, or this process was not scheduled (a
    /// pause, a stalled VM, a starved CPU): the call waits on, asking again every bound, for at
    /// most `lease_ttl` in all (past that a lease could not be kept alive anyway). A BUSY or
    /// LOADING reply (the script did not run) is sent again after a short pause, within the
    /// same budget. A server that accepts connections but never answers therefore fails a call
    /// within `2 × (connect_timeout + command_timeout)`; a refused or reset connection fails
    /// it at once.
    ///
    /// With `durability = replicated` the call's writes are then confirmed by `WAIT 1
    /// <command_timeout>`; a call no replica confirms fails (see [`Durability::Replicated`]).
    pub(crate) async fn call<T, F, Fut>(&self, f: F) -> Result<T, Failure>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        self.call_confirmed(f, self.confirm_within).await
    }

    /// [`call`](Self::call) without the replica's confirmation, whatever the durability: for
    /// calls that only give room back (a release lost in a failover leaves a stale lease for
    /// at most its TTL: fewer admissions, never more).
    pub(crate) async fn call_unconfirmed<T, F, Fut>(&self, f: F) -> Result<T, Failure>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        self.call_confirmed(f, None).await
    }

    async fn call_confirmed<T, F, Fut>(
        &self,
        f: F,
        confirm_within: Option<Duration>,
    ) -> Result<T, Failure>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        // Both are validated (at most a minute each), so the sum never saturates; if it did,
        // `timeout` would take `Duration::MAX` as no bound at all.
        let bound = self.connect_timeout.saturating_add(self.command_timeout);
        let started = Instant::now();
        // Time this process was not scheduled during the call: not charged to its budget.
        let mut paused = Duration::ZERO;
        loop {
            // Boxed: the callers' futures (a broker's request handler) nest this one, and an
            // unboxed Sentinel/Cluster dial inside would make their types too deep to lay out.
            let mut attempts = Box::pin(async {
                // Ok(Err(failure)): Redis is busy and the call did not run.
                let sort = |answer: RedisResult<T>| match answer {
                    Ok(value) => Ok(Ok(value)),
                    Err(e) if is_busy(&e) => Ok(Err(self.failure(&e))),
                    Err(e) => Err(self.failure(&e)),
                };
                let live = self.live().await?;
                let first = f(live.connection.clone()).await;
                let (answer, mut connection) = match first {
                    // The connection dropped (a restart, a proxy), or the server it reaches is
                    // a replica now (a failover demoted it): dial again, once. With Sentinel
                    // the fresh connection goes to the primary the sentinels name now.
                    Err(e)
                        if (e.is_connection_dropped() && !e.is_connection_refusal())
                            || (self.kind == Kind::Sentinel && is_read_only(&e)) =>
                    {
                        self.reset();
                        let live = self.live().await?;
                        (f(live.connection.clone()).await, live.connection)
                    }
                    other => (other, live.connection),
                };
                match (sort(answer)?, confirm_within) {
                    (Ok(value), Some(within)) => {
                        self.confirm(&mut connection, within).await?;
                        Ok(Ok(value))
                    }
                    (sorted, _) => Ok(sorted),
                }
            });
            let answer = loop {
                let waited_from = Instant::now();
                match tokio::time::timeout(bound, &mut attempts).await {
                    Ok(answer) => break answer,
                    Err(_) => {
                        // A timer that fired far later than its bound: this process was not
                        // scheduled (paused, a stalled VM), and the reply may be waiting in
                        // the socket. The pause is not the call's: it is not charged to the
                        // budget, and the call is given its chance to answer below.
                        let waited = waited_from.elapsed();
                        if waited > overslept_after(bound) {
                            paused = paused.saturating_add(waited.saturating_sub(bound));
                        }
                        if started.elapsed().saturating_sub(paused) >= self.budget {
                            return Err(Failure(format!(
                                "no answer within {:?} although Redis answers PING",
                                self.budget
                            )));
                        }
                        // Is Redis alive? The call may answer meanwhile, which settles it.
                        tokio::select! {
                            biased;
                            answer = &mut attempts => break answer,
                            alive = self.ping() => if let Err(dead) = alive {
                                return Err(Failure(format!(
                                    "no answer within {bound:?}; then {}", dead.0
                                )));
                            },
                        }
                    }
                }
            };
            match answer {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(_)) if started.elapsed() < self.budget => {
                    // The script did not run: Redis is busy with another one, or loading.
                    tokio::time::sleep(BUSY_PAUSE.min(self.command_timeout)).await;
                }
                Ok(Err(busy)) => return Err(busy),
                Err(failure) => return Err(failure),
            }
        }
    }

    /// Whether Redis is alive: a PING on a fresh connection (not queued behind the shared
    /// connection's pending calls), bounded by `connect_timeout + command_timeout` in all. A reply, even an
    /// error such as BUSY (a long script is running), means alive. A PING that timed out but
    /// took far longer than its bound says this process was not scheduled meanwhile (paused,
    /// or a stalled VM), which is not Redis' fault: it is tried once more.
    async fn ping(&self) -> Result<(), Failure> {
        let bound = self.connect_timeout.saturating_add(self.command_timeout);
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(bound));
        // The server the call went to (a sentinel's primary is not asked for again: a
        // different, newer primary answering would not say the call's server is alive).
        let node = match &self.target {
            Target::Single(client) => Some(client.clone()),
            Target::Cluster { .. } => None,
            Target::Sentinel(_) => self
                .live
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .and_then(|live| live.node.clone()),
        };
        let mut tries: u32 = 0;
        loop {
            tries = tries.saturating_add(1);
            let started = Instant::now();
            let ping = async {
                match (&node, &self.target) {
                    (Some(node), _) => {
                        let mut con = node
                            .get_multiplexed_async_connection_with_config(&config)
                            .await?;
                        redis::cmd("PING").query_async::<String>(&mut con).await
                    }
                    (None, Target::Cluster { client, .. }) => {
                        let mut con = client.get_async_connection().await?;
                        redis::cmd("PING").query_async::<String>(&mut con).await
                    }
                    (None, _) => Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no connection to ask",
                    ))),
                }
            };
            match tokio::time::timeout(bound, ping).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) if is_busy(&e) => return Ok(()),
                Ok(Err(e)) if !e.is_timeout() => return Err(self.failure(&e)),
                _ => {}
            }
            let overslept = started.elapsed() > overslept_after(bound);
            if !overslept || tries >= 2 {
                return Err(Failure(format!("PING: no answer within {bound:?}")));
            }
        }
    }

    /// A driver error as a message without the URL's password.
    pub(crate) fn failure(&self, error: &redis::RedisError) -> Failure {
        Failure(self.scrub(error.to_string()))
    }

    pub(crate) fn scrub(&self, mut text: String) -> String {
        for secret in &self.secrets {
            text = text.replace(secret.as_str(), "***");
        }
        text
    }

    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Records a failure; true for the call that turned the backend down (one per outage).
    pub(crate) fn mark_down(&self) -> bool {
        if self.up.swap(false, Ordering::AcqRel) {
            self.outages.fetch_add(1, Ordering::Relaxed);
            *self.down_since.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            self.reset();
            true
        } else {
            false
        }
    }

    /// Records a recovery; the outage's length for the call that turned the backend up.
    pub(crate) fn mark_up(&self) -> Option<Duration> {
        if self.up.swap(true, Ordering::AcqRel) {
            return None;
        }
        let since = self
            .down_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        Some(since.map_or(Duration::ZERO, |t| t.elapsed()))
    }

    pub(crate) fn outages(&self) -> u64 {
        self.outages.load(Ordering::Relaxed)
    }
}

/// How long a wait bounded by `bound` may take before the process is taken to have been
/// paused (not scheduled) during it.
fn overslept_after(bound: Duration) -> Duration {
    bound
        .saturating_add(bound.checked_div(2).unwrap_or_default())
        .saturating_add(PAUSE_SLACK)
}

fn build_target(config: &FleetConfig) -> Result<(Target, Kind), ConfigError> {
    let url_error = |e: redis::RedisError| {
        let mut text = e.to_string();
        for secret in url_secrets(&config.url) {
            text = text.replace(secret.as_str(), "***");
        }
        ConfigError::new("url", format!("{:?}", config.redacted_url()), text)
    };
    let kind = topology::scheme(&config.url).map_or(Kind::Single, |(kind, _)| kind);
    if kind == Kind::Single {
        return Ok((Target::Single(build_client(config)?), kind));
    }
    let nodes = topology::parse_nodes(&config.url).map_err(|reason| {
        ConfigError::new("url", format!("{:?}", config.redacted_url()), reason)
    })?;
    let tls = tls_certificates(config)?;
    let root_cert = tls.as_ref().and_then(|t| t.root_cert.clone());
    if nodes.tls {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let certificates = || redis::TlsCertificates {
        client_tls: tls.as_ref().and_then(|t| {
            t.client_tls.as_ref().map(|c| redis::ClientTlsConfig {
                client_cert: c.client_cert.clone(),
                client_key: c.client_key.clone(),
            })
        }),
        root_cert: root_cert.clone(),
    };
    match nodes.kind {
        Kind::Sentinel => {
            // The sentinels are asked without the nodes' credentials.
            let sentinels = nodes
                .addrs
                .iter()
                .map(|(host, port)| {
                    let url = nodes.bare_url(host, *port);
                    match &tls {
                        None => redis::Client::open(url.as_str()),
                        Some(_) => redis::Client::build_with_tls(url.as_str(), certificates()),
                    }
                })
                .collect::<RedisResult<Vec<_>>>()
                .map_err(url_error)?;
            Ok((
                Target::Sentinel(Sentinels {
                    sentinels,
                    nodes: nodes.clone(),
                    url: config.url.clone(),
                    tls: tls.as_ref().map(|_| certificates()),
                }),
                kind,
            ))
        }
        _ => {
            let urls: Vec<String> = nodes
                .addrs
                .iter()
                .map(|(host, port)| nodes.node_url(host, *port, &config.url))
                .collect();
            let mut builder = ClusterClientBuilder::new(urls.iter().map(String::as_str))
                .connection_timeout(config.connect_timeout)
                .response_timeout(config.lease_ttl.saturating_add(config.connect_timeout))
                // MOVED, ASK, TRYAGAIN and a slot map being rebuilt are retried inside the
                // driver with a short back-off; the call's own timers bound the whole.
                .retries(RETRIES_IN_CLUSTER)
                .min_retry_wait(5)
                .max_retry_wait(100);
            if nodes.tls {
                builder = builder.tls(redis::TlsMode::Secure);
                if tls.is_some() {
                    builder = builder.certs(certificates());
                }
            }
            let client = builder.build().map_err(url_error)?;
            let seeds = urls
                .iter()
                .map(|url| match &tls {
                    None => redis::Client::open(url.as_str()),
                    Some(_) => redis::Client::build_with_tls(url.as_str(), certificates()),
                })
                .collect::<RedisResult<Vec<_>>>()
                .map_err(url_error)?;
            Ok((
                Target::Cluster {
                    client: Box::new(client),
                    seeds,
                },
                kind,
            ))
        }
    }
}

/// How many times the cluster driver retries a redirected or refused (TRYAGAIN) command.
const RETRIES_IN_CLUSTER: u32 = 16;

fn build_client(config: &FleetConfig) -> Result<redis::Client, ConfigError> {
    let url_error = |e: redis::RedisError| {
        let mut text = e.to_string();
        for secret in url_secrets(&config.url) {
            text = text.replace(secret.as_str(), "***");
        }
        ConfigError::new("url", format!("{:?}", config.redacted_url()), text)
    };
    if config.url.starts_with("rediss://") {
        // redis' rustls takes the process-wide crypto provider; make it ring unless the process
        // chose one already.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    match tls_certificates(config)? {
        None => redis::Client::open(config.url.as_str()).map_err(url_error),
        Some(certificates) => {
            redis::Client::build_with_tls(config.url.as_str(), certificates).map_err(url_error)
        }
    }
}

/// The CA and client certificate files, read; `None` when neither is given (the system's
/// roots, no client certificate).
fn tls_certificates(config: &FleetConfig) -> Result<Option<redis::TlsCertificates>, ConfigError> {
    let root_cert = match &config.tls_ca_file {
        Some(path) => Some(read_ca(path)?),
        None => None,
    };
    let client_tls = match (&config.tls_cert_file, &config.tls_key_file) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read_pem("tls_cert_file", cert, "CERTIFICATE-----")?,
            client_key: read_pem("tls_key_file", key, "PRIVATE KEY-----")?,
        }),
        _ => None,
    };
    if root_cert.is_none() && client_tls.is_none() {
        return Ok(None);
    }
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// A PEM file holding a block whose `-----BEGIN ...` line ends with `marker`. Its content is
/// never shown (a key is a secret); only its path.
fn read_pem(field: &'static str, path: &Path, marker: &str) -> Result<Vec<u8>, ConfigError> {
    let shown = || format!("{:?}", path.display().to_string());
    let pem = std::fs::read(path)
        .map_err(|e| ConfigError::new(field, shown(), format!("cannot be read: {e}")))?;
    let text = String::from_utf8_lossy(&pem);
    let found = text
        .lines()
        .any(|line| line.starts_with("-----BEGIN ") && line.ends_with(marker));
    if !found {
        return Err(ConfigError::new(
            field,
            shown(),
            format!("holds no PEM block ending in {marker:?}"),
        ));
    }
    Ok(pem)
}

fn read_ca(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let shown = || format!("{:?}", path.display().to_string());
    let pem = std::fs::read(path)
        .map_err(|e| ConfigError::new("tls_ca_file", shown(), format!("cannot be read: {e}")))?;
    if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
        return Err(ConfigError::new(
            "tls_ca_file",
            shown(),
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok(pem)
}
