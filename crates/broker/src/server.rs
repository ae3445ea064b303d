//! Accepting clients: HTTP/1.1 and cleartext HTTP/2 (prior knowledge) on one port
//! (hyper-util's `auto` builder reads the first bytes and picks), upgrades enabled, a bound
//! on how long a new connection may stay silent, and the drain on SIGTERM / SIGINT.
//!
//! Drain: stop accepting, close the gate (queued requests are refused with `closing`, new
//! ones too), ask every connection to finish gracefully (HTTP/1.1 closes after its current
//! response, HTTP/2 sends GOAWAY), let running requests finish for up to `drain_timeout`,
//! then return (the process exits 0).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::logging;
use crate::proxy::Broker;

/// Waits for the first bytes of a connection; false if it stays silent past `timeout` or
/// closes first (an idle socket that never sends a preface holds nothing for long).
async fn first_bytes(stream: &TcpStream, timeout: Duration) -> bool {
    let mut byte = [0u8; 1];
    matches!(tokio::time::timeout(timeout, stream.peek(&mut byte)).await, Ok(Ok(n)) if n > 0)
}

fn builder(first_bytes_timeout: Duration) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(first_bytes_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(1024)
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20));
    builder
}

/// Serves `broker` on `listener` until `stop` turns true; then drains.
pub async fn serve(broker: Arc<Broker>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    let builder = Arc::new(builder(broker.config.first_bytes_timeout));
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopped| *stopped) => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // EMFILE and friends: back off instead of spinning.
                logging::line(
                    "error",
                    "accept_failed",
                    &[("error", logging::text(&error.to_string()))],
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let broker = broker.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            if !first_bytes(&stream, broker.config.first_bytes_timeout).await {
                return;
            }
            serve_connection(broker, builder, watcher, stream, peer).await;
        });
    }
    drop(listener);
    drain(&broker, graceful).await;
}

async fn serve_connection(
    broker: Arc<Broker>,
    builder: Arc<Builder<TokioExecutor>>,
    watcher: hyper_util::server::graceful::Watcher,
    stream: TcpStream,
    peer: SocketAddr,
) {
    let service = service_fn(move |request| broker.clone().handle(request, peer));
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    let _ = watcher.watch(connection.into_owned()).await;
}

async fn drain(broker: &Broker, graceful: GracefulShutdown) {
    let refused = broker.passage.close();
    let (running, _) = broker.passage.running();
    logging::line(
        "info",
        "draining",
        &[
            ("refused_queued", refused.to_string()),
            ("running", running.to_string()),
            (
                "drain_timeout_s",
                broker.config.drain_timeout.as_secs_f64().to_string(),
            ),
        ],
    );
    let deadline = tokio::time::Instant::now()
        .checked_add(broker.config.drain_timeout)
        .unwrap_or_else(tokio::time::Instant::now);
    // Connections finish their current exchanges (a streamed body runs to its end) and close.
    let closed = tokio::time::timeout_at(deadline, graceful.shutdown())
        .await
        .is_ok();
    let drained = broker.passage.drained(deadline).await;
    let (left, _) = broker.passage.running();
    logging::line(
        "info",
        "drained",
        &[
            ("connections_closed", closed.to_string()),
            ("all_requests_finished", drained.to_string()),
            ("requests_cut", left.to_string()),
        ],
    );
}
