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
//!   `/livez`, `/readyz`), [`memory`] (the agent container's cgroup memory), [`logging`],
//!   [`deadline`] (the caller's deadline, from its headers).
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
pub mod headers;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod proxy;
pub mod refusal;
pub mod server;

use std::sync::Arc;

use admitgate_fleet::{FleetConfig, FleetLimit, OnBackendError};
use admitgate_passage::core_api::ConcurrencyLimit;
use admitgate_passage::{Passage, PassageConfig};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{Config, Flags};

/// Builds the passage and the broker for `config` (on the current runtime).
fn broker(config: Config) -> Result<Arc<proxy::Broker>, String> {
    let limits = ConcurrencyLimit::new(
        config.max_in_flight,
        config.queue_depth,
        &config.overflow_policy,
        config.max_in_flight_per_tenant,
    )
    .map_err(|e| e.to_string())?;
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
            fleet.on_backend_error = if config.fleet_on_error == "reject" {
                OnBackendError::Reject
            } else {
                OnBackendError::Local
            };
            let limit = FleetLimit::new(fleet, tokio::runtime::Handle::current())
                .map_err(|e| format!("fleet: {e}"))?;
            Some(limit)
        }
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
    });
    proxy::Broker::new(config, passage).map(Arc::new)
}

/// Serves `config` until `stop` turns true, then drains. Returns once drained.
pub async fn serve(config: Config, stop: watch::Receiver<bool>) -> Result<(), String> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("listen {}: {e}", config.listen))?;
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|e| format!("metrics_listen {addr}: {e}"))?,
        ),
        None => None,
    };
    let broker = broker(config)?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let mut fields = vec![
        ("listen", logging::text(&local.to_string())),
        (
            "upstream",
            logging::text(broker.config.upstream.authority.as_str()),
        ),
        ("max_in_flight", broker.config.max_in_flight.to_string()),
    ];
    if let Some(m) = &metrics_listener {
        let addr = m.local_addr().map_err(|e| e.to_string())?;
        fields.push(("metrics_listen", logging::text(&addr.to_string())));
    }
    if let Some(fleet) = broker.passage.fleet() {
        fields.push(("fleet", logging::text(&fleet.config().redacted_url())));
    }
    logging::line("info", "listening", &fields);
    if let Some(m) = metrics_listener {
        tokio::spawn(metrics::serve(broker.clone(), m));
    }
    tokio::spawn(metrics::probe_until_ready(broker.clone()));
    server::serve(broker.clone(), listener, stop).await;
    if let Some(fleet) = broker.passage.fleet() {
        fleet.shutdown().await;
    }
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

/// Runs the broker in this process (its own runtime) until SIGTERM / SIGINT and the drain.
pub fn run(config: Config) -> Result<(), String> {
    logging::install();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 4)))
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
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
