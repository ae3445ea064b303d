//! The connection to Redis and whether it is up. Every call is bounded by
//! `connect_timeout + command_timeout`, so nothing waits on a dead socket for longer; failures
//! come back as messages scrubbed of the URL's password.

use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::RedisResult;
use tokio::runtime::Handle;

use crate::config::{url_secrets, ConfigError, FleetConfig};

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

pub(crate) struct Backend {
    client: redis::Client,
    manager_config: ConnectionManagerConfig,
    /// Built lazily inside the runtime; dropped after a failure so the next call dials afresh
    /// (a connection that timed out may otherwise never be replaced).
    manager: Mutex<Option<ConnectionManager>>,
    handle: Handle,
    connect_timeout: Duration,
    command_timeout: Duration,
    /// How long a call waits for a Redis that answers PING: `lease_ttl`.
    budget: Duration,
    secrets: Vec<String>,
    up: AtomicBool,
    down_since: Mutex<Option<Instant>>,
    outages: AtomicU64,
}

impl Backend {
    pub(crate) fn new(config: &FleetConfig, handle: Handle) -> Result<Self, ConfigError> {
        let client = build_client(config)?;
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
            client,
            manager_config,
            manager: Mutex::new(None),
            handle,
            connect_timeout: config.connect_timeout,
            command_timeout: config.command_timeout,
            budget: config.lease_ttl,
            secrets: url_secrets(&config.url),
            up: AtomicBool::new(true),
            down_since: Mutex::new(None),
            outages: AtomicU64::new(0),
        })
    }

    /// The driver's client, for the pub/sub connection.
    pub(crate) fn client(&self) -> &redis::Client {
        &self.client
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    pub(crate) fn command_timeout(&self) -> Duration {
        self.command_timeout
    }

    /// A handle on the shared (multiplexed, pipelining) connection.
    pub(crate) fn connection(&self) -> Result<ConnectionManager, Failure> {
        let mut slot = self.manager.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(manager) = slot.as_ref() {
            return Ok(manager.clone());
        }
        // The manager spawns its driver task on the current runtime.
        let _runtime = self.handle.enter();
        let manager = ConnectionManager::new_lazy_with_config(
            self.client.clone(),
            self.manager_config.clone(),
        )
        .map_err(|e| self.failure(&e))?;
        *slot = Some(manager.clone());
        Ok(manager)
    }

    /// Forgets the connection; the next call dials again.
    pub(crate) fn reset(&self) {
        self.manager
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
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
    pub(crate) async fn call<T, F, Fut>(&self, f: F) -> Result<T, Failure>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        // Both are validated (at most a minute each), so the sum never saturates; if it did,
        // `timeout` would take `Duration::MAX` as no bound at all.
        let bound = self.connect_timeout.saturating_add(self.command_timeout);
        let started = Instant::now();
        // Time this process was not scheduled during the call: not charged to its budget.
        let mut paused = Duration::ZERO;
        loop {
            let attempts = async {
                // Ok(Err(failure)): Redis is busy and the call did not run.
                let sort = |answer: RedisResult<T>| match answer {
                    Ok(value) => Ok(Ok(value)),
                    Err(e) if is_busy(&e) => Ok(Err(self.failure(&e))),
                    Err(e) => Err(self.failure(&e)),
                };
                let first = f(self.connection()?).await;
                match first {
                    Err(e) if e.is_connection_dropped() && !e.is_connection_refusal() => {
                        self.reset();
                        sort(f(self.connection()?).await)
                    }
                    other => sort(other),
                }
            };
            tokio::pin!(attempts);
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
        let mut tries: u32 = 0;
        loop {
            tries = tries.saturating_add(1);
            let started = Instant::now();
            let ping = async {
                let mut con = self
                    .client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                redis::cmd("PING").query_async::<String>(&mut con).await
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
    match &config.tls_ca_file {
        None => redis::Client::open(config.url.as_str()).map_err(url_error),
        Some(path) => {
            let root_cert = read_ca(path)?;
            redis::Client::build_with_tls(
                config.url.as_str(),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root_cert),
                },
            )
            .map_err(url_error)
        }
    }
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
