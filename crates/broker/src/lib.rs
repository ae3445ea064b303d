//! admitgate's broker: the gate as a sidecar in front of an agent written in any language.
//!
//! A reverse proxy (hyper 1.x, HTTP/1.1 and h2c on one port) that refuses A2A traffic past
//! the agent's in-flight cap before it reaches the container and proxies everything else
//! untouched. It is built from the same parts as the in-process front doors:
//!
//! * [`admitgate_classify`]: which requests are A2A work (the same rules as the ASGI
//!   middleware and the gRPC interceptor);
//! * [`admitgate_passage`]: a turn's passage (local slot, fleet lease, refusal reasons,
//!   counters) over the core gate;
//! * this crate: the network side, one module per concern: [`config`] (flags, YAML,
//!   defaults), [`server`] (accepting, first-bytes timeout, drain), [`proxy`] (classify,
//!   admit, forward, upgrades), [`body`] (the permit held until the response body ends),
//!   [`headers`] (hop-by-hop), [`refusal`] (the refusal answers), [`metrics`] (`/metrics`,
//!   `/livez`, `/readyz`), [`readiness`] (whether the agent answers), [`memory`] (the agent
//!   container's cgroup memory), [`logging`], [`deadline`] (the caller's deadline, from its
//!   headers), [`rate_limit`] (budgets at the door: `--rate-limit`, `--rate-key`, the
//!   refusal's RateLimit fields, the agent's usage report).
//!
//! Two ways to run it: [`run`] (the standalone binary: its own runtime and SIGTERM / SIGINT
//! handlers) and [`Running`] (stopped from outside: the Python binding's
//! `admitgate.broker.serve()`, which leaves signals to the interpreter).
//!
//! # No panics
//!
//! The lints below deny `unwrap`, `expect`, `panic!`, indexing and overflowing arithmetic
//! outside tests. A panic anywhere else (a dependency's) ends only the task it happens in:
//! each connection is its own task, and a permit held by a request whose task unwinds is
//! released by its `Drop`.

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

pub mod body;
pub mod config;
pub mod deadline;
mod exposition;
pub mod headers;
pub mod leaving;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod priority;
pub mod proxy;
pub mod rate_limit;
pub mod readiness;
pub mod refusal;
pub mod server;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use admitgate_fleet::{Durability, FleetClasses, FleetConfig, FleetLimit, OnBackendError};
use admitgate_passage::core_api::ConcurrencyLimit;
use admitgate_passage::{Passage, PassageConfig};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{Config, Flags};

/// The warning a broker started without a cap logs: with `max_in_flight` 0 (the default) it
/// counts and classifies but refuses nothing.
pub const NO_CAP_WARNING: &str = "no --max-in-flight (or max_in_flight in the config file) \
     was set: this broker gates nothing, every request reaches the agent at once. Set \
     --max-in-flight N to the number of runs the agent can take at once.";

/// Builds the passage and the broker for `config` (on the current runtime).
fn broker(config: Config) -> Result<Arc<proxy::Broker>, Error> {
    let limits = ConcurrencyLimit::new(
        config.max_in_flight,
        config.queue_depth,
        &config.overflow_policy,
        config.max_in_flight_per_tenant,
    )
    .map_err(|e| Error::Settings(e.to_string()))?;
    let fleet = match &config.fleet {
        None => None,
        Some(url) => {
            let mut fleet = FleetConfig::new(
                url.clone(),
                config.fleet_key.clone(),
                limits.max_concurrent_runs,
            );
            fleet.max_in_flight_per_scope = limits.max_per_scope;
            fleet.tls_ca_file = config.fleet_tls_ca_file.clone();
            fleet.tls_cert_file = config.fleet_tls_cert_file.clone();
            fleet.tls_key_file = config.fleet_tls_key_file.clone();
            if config.fleet_durability == "replicated" {
                fleet.durability = Durability::Replicated;
            }
            fleet.on_backend_error = if config.fleet_on_error == "reject" {
                OnBackendError::Reject
            } else {
                OnBackendError::Local
            };
            let limit = FleetLimit::new(fleet, tokio::runtime::Handle::current())
                .map_err(|e| Error::Settings(format!("fleet: {e}")))?;
            Some(limit)
        }
    };
    let rate_limits = match &config.rate_limit {
        None => admitgate_passage::budget::RateLimits::default(),
        Some(spec) => spec
            .rate_limits(&config.fleet_key, fleet.as_ref())
            .map_err(|e| Error::Settings(format!("rate_limit: {e}")))?,
    };
    let resource = memory::cgroup_check(
        config.memory_cgroup.clone(),
        config.memory_soft_ratio,
        config.memory_hard_ratio,
    );
    let passage = Passage::new(PassageConfig {
        limits,
        queue_timeout: config.queue_timeout,
        fleet,
        resource,
        rate_limits,
    });
    if let Some(order) = config.priority.order.clone() {
        if let Some(fleet) = passage.fleet() {
            // The fleet's lease queue orders tickets by the same classes, fleet-wide (every
            // broker of the fleet must configure the same; one with others is refused).
            let classes =
                FleetClasses::new(order.priorities.clone(), order.fair, order.weights.clone());
            fleet
                .set_classes(classes)
                .map_err(|e| Error::Settings(format!("fleet: {}", e.reason)))?;
        }
        passage
            .set_order(order)
            .map_err(|e| Error::Settings(e.to_string()))?;
    }
    proxy::Broker::new(config, passage)
        .map(Arc::new)
        .map_err(Error::Start)
}

/// Why the broker could not start or stopped on its own.
#[derive(Debug)]
pub enum Error {
    /// A listening address could not be bound (in use, not this host's, no permission):
    /// `setting` is `listen` or `metrics_listen`.
    Bind {
        setting: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// A setting the flags' validation cannot see is unusable: the fleet's URL or CA file.
    Settings(String),
    /// The broker could not be built (its runtime's threads).
    Start(String),
    /// The broker's own task panicked (a bug); the message is the panic's.
    Panicked(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Bind {
                setting,
                addr,
                source,
            } => write!(f, "{setting} {addr}: {source}"),
            Error::Settings(message) | Error::Start(message) => f.write_str(message),
            Error::Panicked(message) => write!(f, "the broker panicked: {message}"),
        }
    }
}

impl std::error::Error for Error {}

/// A broker whose ports are bound, not yet serving.
pub struct Bound {
    broker: Arc<proxy::Broker>,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
}

async fn bind(setting: &'static str, addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr).await.map_err(|source| Error::Bind {
        setting,
        addr,
        source,
    })
}

impl Bound {
    /// Binds `config`'s ports and builds the broker (on the current runtime), then logs the
    /// `listening` line with the bound addresses.
    pub async fn new(config: Config) -> Result<Self, Error> {
        let listener = bind("listen", config.listen).await?;
        let metrics_listener = match config.metrics_listen {
            Some(addr) => Some(bind("metrics_listen", addr).await?),
            None => None,
        };
        let broker = broker(config)?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Start(e.to_string()))?;
        let mut fields = vec![
            ("listen", logging::text(&local.to_string())),
            (
                "upstream",
                logging::text(broker.config.upstream.authority.as_str()),
            ),
            ("max_in_flight", broker.config.max_in_flight.to_string()),
        ];
        if let Some(m) = &metrics_listener {
            let addr = m.local_addr().map_err(|e| Error::Start(e.to_string()))?;
            fields.push(("metrics_listen", logging::text(&addr.to_string())));
        }
        if let Some(fleet) = broker.passage.fleet() {
            fields.push(("fleet", logging::text(&fleet.config().redacted_url())));
        }
        logging::line("info", "listening", &fields);
        if broker.config.max_in_flight == 0 {
            // The default gates nothing: say so where an operator looks, in plain words.
            logging::line(
                "warn",
                "no_cap",
                &[("message", logging::text(NO_CAP_WARNING))],
            );
        }
        Ok(Self {
            broker,
            listener,
            metrics_listener,
        })
    }

    /// Serves until `stop` turns true, then drains. Returns once drained.
    pub async fn serve(self, stop: watch::Receiver<bool>) {
        let Self {
            broker,
            listener,
            metrics_listener,
        } = self;
        test_hooks::panic_if_asked();
        if let Some(m) = metrics_listener {
            tokio::spawn(metrics::serve(broker.clone(), m));
            // The probe feeds /readyz alone: without it, the agent sees no request that no
            // client sent.
            tokio::spawn(readiness::probe(broker.clone()));
        }
        server::serve(broker.clone(), listener, stop).await;
        if let Some(fleet) = broker.passage.fleet() {
            fleet.shutdown().await;
        }
    }
}

/// Serves `config` until `stop` turns true, then drains. Returns once drained.
pub async fn serve(config: Config, stop: watch::Receiver<bool>) -> Result<(), Error> {
    Bound::new(config).await?.serve(stop).await;
    Ok(())
}

/// Waits for SIGTERM or SIGINT. The handlers are installed when this is called, not when
/// the future is first polled, so a signal that comes right after start-up is not missed
/// (the default action would kill the process without a drain).
fn signalled() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The broker's own runtime, `threads` wide (`--threads`). With one thread and a caller
/// that drives it (`driven`: [`run`] blocks on it for the broker's whole life) it is a
/// current-thread runtime: every task (the accept loop, each connection, hyper's h2 stream
/// tasks, the upstream pool's connections) runs on that thread, so no wake crosses threads.
/// Otherwise (more threads, or [`Running`], whose caller enters the runtime only now and
/// then) a multi-thread runtime with `threads` workers.
fn runtime(threads: usize, driven: bool) -> Result<tokio::runtime::Runtime, Error> {
    let mut builder = if threads <= 1 && driven {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads.max(1));
        builder
    };
    builder
        .enable_all()
        .build()
        .map_err(|e| Error::Start(format!("runtime: {e}")))
}

/// Runs the broker in this process (its own runtime) until SIGTERM / SIGINT and the drain:
/// the standalone binary.
pub fn run(config: Config) -> Result<(), Error> {
    logging::install();
    let runtime = runtime(config.threads, true)?;
    runtime.block_on(async move {
        let (stop, stopped) = watch::channel(false);
        let signal = signalled();
        tokio::spawn(async move {
            signal.await;
            stop.send_replace(true);
        });
        serve(config, stopped).await
    })
}

/// A broker serving on its own runtime, stopped from outside rather than by its own signal
/// handlers: the Python binding's `admitgate.broker.serve()`, which must leave the process's
/// signals to the interpreter. [`Running::stop`] starts the same drain as SIGTERM does to the
/// binary; [`Running::wait`] waits for the end in slices, so the caller can look at other
/// things (Python's signals) between them.
pub struct Running {
    runtime: Option<tokio::runtime::Runtime>,
    stop: watch::Sender<bool>,
    /// The serving task, until it has ended.
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Binds `config`'s ports (an error names the address) and starts serving; returns once
    /// the `listening` line is logged.
    pub fn start(config: Config) -> Result<Self, Error> {
        logging::install();
        let runtime = runtime(config.threads, false)?;
        let bound = runtime.block_on(Bound::new(config))?;
        let (stop, stopped) = watch::channel(false);
        let task = Some(runtime.spawn(bound.serve(stopped)));
        Ok(Self {
            runtime: Some(runtime),
            stop,
            task,
        })
    }

    /// Starts the drain: stop accepting, refuse queued requests with `closing`, let running
    /// ones finish for up to `drain_timeout`.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// Waits up to `timeout` for the broker to end: `None` while it still serves or drains,
    /// then how it ended (a panic of its task is [`Error::Panicked`]), then `Ok` for good.
    pub fn wait(&mut self, timeout: Duration) -> Option<Result<(), Error>> {
        let (Some(runtime), Some(task)) = (self.runtime.as_ref(), self.task.as_mut()) else {
            return Some(Ok(()));
        };
        let ended = match runtime.block_on(async { tokio::time::timeout(timeout, task).await }) {
            Err(_elapsed) => return None,
            Ok(Ok(())) => Ok(()),
            Ok(Err(join)) => Err(Error::Panicked(panic_message(join))),
        };
        self.task = None;
        Some(ended)
    }
}

/// Dropping a [`Running`] ends the broker at once, without waiting for its drain: every
/// connection and request still open is cut (their slots are released as their tasks are
/// dropped). Blocks for at most a second, for the runtime's threads.
impl Drop for Running {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

fn panic_message(join: tokio::task::JoinError) -> String {
    match join.try_into_panic() {
        Ok(payload) => {
            if let Some(text) = payload.downcast_ref::<&str>() {
                (*text).to_owned()
            } else if let Some(text) = payload.downcast_ref::<String>() {
                text.clone()
            } else {
                "unknown panic payload".to_owned()
            }
        }
        Err(join) => join.to_string(),
    }
}

/// A deliberate panic for the Python binding's tests, which prove a panic inside the broker
/// becomes an exception rather than an abort. Off unless a test asks.
#[doc(hidden)]
pub mod test_hooks {
    use std::sync::atomic::{AtomicBool, Ordering};

    static PANIC_NEXT_SERVE: AtomicBool = AtomicBool::new(false);

    /// Makes the next broker to start serving panic in its own task, right after start-up.
    pub fn panic_in_next_serve() {
        PANIC_NEXT_SERVE.store(true, Ordering::Relaxed);
    }

    #[allow(clippy::panic, reason = "the test hook panics on purpose")]
    pub(crate) fn panic_if_asked() {
        if PANIC_NEXT_SERVE.swap(false, Ordering::Relaxed) {
            panic!("deliberate panic in the broker's task, for a test");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(listen: &str) -> Config {
        Config::from_args(["b", "--upstream", "http://127.0.0.1:9", "--listen", listen]).unwrap()
    }

    #[test]
    fn running_serves_until_stopped_then_drains() {
        let mut running = Running::start(config("127.0.0.1:0")).unwrap();
        assert!(running.wait(Duration::from_millis(50)).is_none());
        running.stop();
        assert!(matches!(
            running.wait(Duration::from_secs(10)),
            Some(Ok(()))
        ));
        // Asked again once it has ended: still ended.
        assert!(matches!(running.wait(Duration::ZERO), Some(Ok(()))));
    }

    #[test]
    fn a_port_in_use_names_the_setting_and_the_address() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let Err(error) = Running::start(config(&addr.to_string())) else {
            panic!("bound a port in use");
        };
        assert!(matches!(
            error,
            Error::Bind {
                setting: "listen",
                ..
            }
        ));
        assert!(error.to_string().starts_with(&format!("listen {addr}: ")));
    }
}
