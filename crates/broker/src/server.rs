//! Accepting clients: HTTP/1.1 and cleartext HTTP/2 (prior knowledge) on one port, upgrades
//! enabled, a bound on how long a new connection may stay silent, and the drain on SIGTERM /
//! SIGINT.
//!
//! # One hyper connection per HTTP/1.1 exchange
//!
//! hyper keeps an 8 KiB read buffer and an 8 KiB write buffer for the whole life of an
//! HTTP/1.1 connection, idle or not (it cannot shrink or drop them), which made an idle
//! keep-alive client cost about 23 KB of the broker's memory. So the broker builds hyper's
//! connection only while a client has something to say: it waits for the socket's first bytes
//! with nothing but the `TcpStream` and a small task, serves with hyper until every exchange
//! received has ended both ways (the request body read to its end, the response body sent
//! to its end: [`Exchanges`]), then asks hyper to finish ([`graceful_shutdown`] disables
//! keep-alive only once the response head is out, so no `Connection: close` is sent), takes
//! the socket back without shutting it down ([`ClientIo`]), and waits again. Bytes hyper had
//! already read (a pipelined next request) are replayed to the next connection first. An
//! exchange that did not end cleanly (a request body left unread, a response cut off, an
//! upgrade) keeps hyper's own handling: the connection closes (or is upgraded) as before.
//! The cost is a fresh hyper connection per request on a kept-alive socket (two buffer
//! allocations and one `peek`), measured in BENCHMARKS.md. A *busy* socket skips it: once a
//! client sends its next request within [`LINGER`] of the socket being taken back, each
//! later hyper connection on it lingers that long after its exchanges end before handing
//! the socket back, so a client sending requests back to back keeps one hyper connection
//! (and its buffers) while it is busy, and a socket idle for longer holds none, as before.
//!
//! The protocol is chosen by the first bytes: the HTTP/2 preface, else HTTP/1.1.
//!
//! Drain: stop accepting, close the gate (queued requests are refused with `closing`, new
//! ones too), ask every connection to finish gracefully (HTTP/1.1 closes after its current
//! response, HTTP/2 sends GOAWAY, an idle connection closes), let running requests finish for
//! up to `drain_timeout`, then return (the process exits 0).
//!
//! [`graceful_shutdown`]: hyper::server::conn::http1::UpgradeableConnection::graceful_shutdown

mod io;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::Request;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::body::{ClientBody, Ending, Exchanges};
use crate::headers::upgrade_protocol;
use crate::logging;
use crate::proxy::Broker;
use io::ClientIo;

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How soon a client's next request must follow for its socket to count as busy, and how
/// long the hyper connection of a busy socket waits for the next request before the socket
/// is taken back (see the module documentation).
pub const LINGER: Duration = Duration::from_millis(100);

/// The hyper builders every connection uses.
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

fn builders(first_bytes_timeout: Duration) -> Builders {
    let mut h1 = http1::Builder::new();
    h1.timer(TokioTimer::new())
        .header_read_timeout(first_bytes_timeout)
        .keep_alive(true);
    let mut h2 = http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .max_concurrent_streams(1024)
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20));
    Builders {
        http1: h1,
        http2: h2,
    }
}

/// Serves `broker` on `listener` until `stop` turns true; then drains.
pub async fn serve(broker: Arc<Broker>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    let builders = Arc::new(builders(broker.config.first_bytes_timeout));
    // Every connection holds a receiver; the drain sends `true` and waits for all of them to
    // be dropped (their connections ended).
    let (draining, drain_signal) = watch::channel(false);
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
        let connection = Connection {
            broker: broker.clone(),
            builders: builders.clone(),
            drain: drain_signal.clone(),
            peer,
        };
        tokio::spawn(connection.run(stream));
    }
    drop(listener);
    drop(drain_signal);
    drain(&broker, draining).await;
}

/// One client connection.
struct Connection {
    broker: Arc<Broker>,
    builders: Arc<Builders>,
    drain: watch::Receiver<bool>,
    peer: SocketAddr,
}

/// How a hyper connection ended.
enum Served {
    /// Every exchange ended: the socket is handed back, with bytes already read.
    HandedBack(ClientIo),
    /// Closed, upgraded, or broken: nothing more to do.
    Done,
}

impl Connection {
    async fn run(mut self, stream: TcpStream) {
        let timeout = self.broker.config.first_bytes_timeout;
        let Some((stream, prefix)) = self.first_bytes(stream, timeout).await else {
            return;
        };
        if prefix.starts_with(H2_PREFACE) {
            let send_timeout = self.broker.config.send_timeout;
            self.serve_h2(ClientIo::new(stream, prefix, send_timeout))
                .await;
            return;
        }
        let mut io = ClientIo::new(stream, prefix, self.broker.config.send_timeout);
        let mut busy = false;
        loop {
            match self.serve_h1(io, busy).await {
                Served::Done => return,
                Served::HandedBack(back) => io = back,
            }
            let handed_back = tokio::time::Instant::now();
            if !io.has_buffered() && !self.readable(&io, timeout).await {
                return;
            }
            busy = handed_back.elapsed() < LINGER;
        }
    }

    /// Reads the first bytes, enough to tell the HTTP/2 preface from an HTTP/1.1 request;
    /// `None` if the client stays silent past `timeout`, closes, or the drain begins.
    async fn first_bytes(
        &mut self,
        mut stream: TcpStream,
        timeout: Duration,
    ) -> Option<(TcpStream, Bytes)> {
        // Nothing is allocated for a connection until it speaks (a silent one costs the
        // socket and this task).
        if !self.readable_stream(&stream, timeout).await {
            return None;
        }
        let read = async {
            let mut prefix = BytesMut::with_capacity(H2_PREFACE.len());
            while prefix.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(&prefix) {
                if stream.read_buf(&mut prefix).await.ok()? == 0 {
                    // Closed early: hyper answers whatever was sent (or nothing).
                    break;
                }
            }
            Some(prefix.freeze())
        };
        let prefix = tokio::time::timeout(timeout, read).await.ok()??;
        Some((stream, prefix))
    }

    /// Waits until `io`'s socket has bytes to read (true), or it closes, stays silent past
    /// `timeout`, or the drain begins (false).
    async fn readable(&mut self, io: &ClientIo, timeout: Duration) -> bool {
        self.readable_stream(io.stream(), timeout).await
    }

    async fn readable_stream(&mut self, stream: &TcpStream, timeout: Duration) -> bool {
        let mut byte = [0u8; 1];
        tokio::select! {
            peeked = tokio::time::timeout(timeout, stream.peek(&mut byte)) => {
                matches!(peeked, Ok(Ok(n)) if n > 0)
            }
            _ = self.drain.wait_for(|draining| *draining) => false,
        }
    }

    /// Serves HTTP/1.1 on `io` until the connection ends or every exchange has ended (and,
    /// on a `busy` socket, no new one began for [`LINGER`]).
    async fn serve_h1(&mut self, mut io: ClientIo, busy: bool) -> Served {
        let exchanges = Arc::new(Exchanges::default());
        let service = {
            let broker = self.broker.clone();
            let exchanges = exchanges.clone();
            let peer = self.peer;
            let socket = io.watch();
            service_fn(move |request: Request<Incoming>| {
                exchanges.request();
                if upgrade_protocol(request.headers()).is_some() {
                    // An upgrade takes the socket for good (or is refused, h2c): hyper's own
                    // handling, never handed back.
                    exchanges.upgrade();
                }
                let request = request.map(|body| {
                    ClientBody::new(body, Some(exchanges.clone())).watching(socket.clone())
                });
                let exchanges = exchanges.clone();
                let broker = broker.clone();
                // Boxed: hyper keeps a box the size of this future for the connection's
                // life; boxed, that box is a pointer and the request's state is freed once
                // its response head is out (a stream's body no longer pays for it).
                Box::pin(async move {
                    let response = broker.handle(request, peer).await?;
                    Ok::<_, std::convert::Infallible>(
                        response.map(|body| Ending::new(body, exchanges)),
                    )
                })
            })
        };
        let hand_back = io.hand_back_flag();
        let connection = self
            .builders
            .http1
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades();
        let mut connection = Box::pin(connection);
        let mut asked = false;
        let mut drain = self.drain.clone();
        let mut drained = Box::pin(async move {
            let _ = drain.wait_for(|draining| *draining).await;
        });
        let mut draining = false;
        // A busy socket's connection lingers: armed while every exchange has ended.
        let mut linger = busy.then(|| Box::pin(tokio::time::sleep(LINGER)));
        // The request count the linger was armed at: a later request re-arms it.
        let mut armed_at = None;
        let ended = std::future::poll_fn(|cx| {
            if !draining && drained.as_mut().poll(cx).is_ready() {
                draining = true;
                // The drain: finish the current response, then close (not handed back).
                hand_back.refuse();
                connection.as_mut().graceful_shutdown();
            }
            loop {
                let polled = connection.as_mut().poll(cx);
                if polled.is_ready() {
                    return polled;
                }
                if asked || draining || !exchanges.all_ended() {
                    return Poll::Pending;
                }
                if let Some(linger) = linger.as_mut() {
                    let requests = exchanges.requests();
                    if armed_at != Some(requests) {
                        armed_at = Some(requests);
                        let now = tokio::time::Instant::now();
                        linger
                            .as_mut()
                            .reset(now.checked_add(LINGER).unwrap_or(now));
                    }
                    if linger.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                }
                // Every exchange ended both ways: hyper finishes what it writes, then ends
                // without shutting the socket down, and the socket is taken back.
                asked = true;
                hand_back.ask();
                connection.as_mut().graceful_shutdown();
            }
        })
        .await;
        if ended.is_err() || !hand_back.asked() {
            return Served::Done;
        }
        match Pin::into_inner(connection).into_parts() {
            Some(parts) => {
                let mut io = parts.io.into_inner();
                io.replay(parts.read_buf);
                Served::HandedBack(io)
            }
            None => Served::Done,
        }
    }

    async fn serve_h2(&mut self, io: ClientIo) {
        let broker = self.broker.clone();
        let peer = self.peer;
        let service = service_fn(move |request: Request<Incoming>| {
            let request = request.map(|body| ClientBody::new(body, None));
            // Boxed: hyper's task for the stream holds the future inline for the stream's
            // whole life; boxed, the request's state is freed once the response head is out.
            Box::pin(broker.clone().handle(request, peer))
        });
        let connection = self
            .builders
            .http2
            .serve_connection(TokioIo::new(io), service);
        let mut connection = std::pin::pin!(connection);
        tokio::select! {
            _ = connection.as_mut() => return,
            _ = self.drain.wait_for(|draining| *draining) => {}
        }
        // GOAWAY; streams in flight run to their end.
        connection.as_mut().graceful_shutdown();
        let _ = connection.await;
    }
}

async fn drain(broker: &Broker, connections: watch::Sender<bool>) {
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
    connections.send_replace(true);
    let closed = tokio::time::timeout_at(deadline, connections.closed())
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
