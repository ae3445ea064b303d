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
            .set_response_timeout(Some(config.command_timeout))
            // One dial per call: the outage logic, not the driver, decides when to try again.
            .set_number_of_retries(0);
        Ok(Backend {
            client,
            manager_config,
            manager: Mutex::new(None),
            handle,
            connect_timeout: config.connect_timeout,
            command_timeout: config.command_timeout,
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

    /// Runs one call on the connection, bounded by `connect_timeout + command_timeout` in all.
    /// A call that finds its connection dropped (Redis restarted, a proxy closed it) is sent
    /// once more on a fresh connection within the same bound, so a quick restart is not an
    /// outage; every script is idempotent per lease id, so a repeat is harmless.
    pub(crate) async fn call<T, F, Fut>(&self, f: F) -> Result<T, Failure>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        // Both are validated (at most a minute each), so the sum never saturates; if it did,
        // `timeout` would take `Duration::MAX` as no bound at all.
        let bound = self.connect_timeout.saturating_add(self.command_timeout);
        let attempts = async {
            let first = f(self.connection()?).await;
            match first {
                Err(e) if e.is_connection_dropped() && !e.is_connection_refusal() => {
                    self.reset();
                    f(self.connection()?).await.map_err(|e| self.failure(&e))
                }
                other => other.map_err(|e| self.failure(&e)),
            }
        };
        match tokio::time::timeout(bound, attempts).await {
            Ok(result) => result,
            Err(_) => Err(Failure(format!("no answer within {bound:?}"))),
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
