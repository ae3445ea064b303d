//! The bodies the proxy forwards.
//!
//! * [`ClientBody`]: a client's request body as it arrived, telling its HTTP/1.1 connection
//!   (through [`Exchanges`]) once it has been read to its end, and [`Ending`], a response
//!   body that does the same: the connection is released between exchanges only when both
//!   ended, so the next bytes on the socket are surely the next request's.
//! * [`Replayed`]: a request body whose first bytes were read to classify it (the JSON-RPC
//!   peek), replayed exactly, then the rest of the stream.
//! * [`Held`]: a response body that holds the request's [`Permit`] until the body has ended
//!   (its last DATA frame or its trailers) or is dropped (the client went away), whichever
//!   is first: an SSE stream or a streaming gRPC call is counted for its whole life. This is
//!   the body-holding shape of tower-http's PR #447, where tower's `ConcurrencyLimit` and
//!   linkerd2-proxy release at the response headers. For gRPC, an upstream failure in the
//!   middle of the stream becomes a proper status trailer (`UNAVAILABLE`) instead of a reset.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use admitgate_passage::Permit;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::leaving::ClientSocket;
use crate::rate_limit::{self, DoorCounters};

/// Any error a forwarded body can end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How far the exchanges of one HTTP/1.1 connection have come: requests received, request
/// bodies read to their end, response bodies sent to their end. All three equal: between
/// exchanges (nothing of a request is left unread, nothing of a response left unsent).
#[derive(Default, Debug)]
pub struct Exchanges {
    requests: AtomicU32,
    request_bodies_ended: AtomicU32,
    responses_ended: AtomicU32,
    /// An upgrade was asked for: the socket may belong to another protocol now.
    upgraded: AtomicBool,
}

impl Exchanges {
    /// A request arrived.
    pub fn request(&self) {
        self.requests.fetch_add(1, Ordering::AcqRel);
    }

    /// How many requests arrived.
    pub fn requests(&self) -> u32 {
        self.requests.load(Ordering::Acquire)
    }

    /// A request asked for an upgrade.
    pub fn upgrade(&self) {
        self.upgraded.store(true, Ordering::Release);
    }

    /// Whether at least one exchange happened, none asked for an upgrade, and every one has
    /// ended both ways.
    pub fn all_ended(&self) -> bool {
        let requests = self.requests.load(Ordering::Acquire);
        requests > 0
            && !self.upgraded.load(Ordering::Acquire)
            && self.request_bodies_ended.load(Ordering::Acquire) == requests
            && self.responses_ended.load(Ordering::Acquire) == requests
    }
}

/// A client's request body: hyper's, counting its end in the connection's [`Exchanges`]
/// (none on HTTP/2, where streams are independent), with the HTTP/1.1 client's socket to
/// see it leave while the body is not all read ([`ClientSocket`]).
pub struct ClientBody {
    inner: Incoming,
    exchanges: Option<Arc<Exchanges>>,
    socket: Option<ClientSocket>,
}

impl ClientBody {
    /// `inner`, counted in `exchanges` if given.
    pub fn new(inner: Incoming, exchanges: Option<Arc<Exchanges>>) -> Self {
        let mut body = Self {
            inner,
            exchanges,
            socket: None,
        };
        body.ended_if_done();
        body
    }

    /// The body of a request from the HTTP/1.1 client on `socket`. (An HTTP/2 client's
    /// leaving needs no watch: hyper reads its connection whatever a stream's body does,
    /// and drops the stream's request on a reset.)
    pub fn watching(mut self, socket: ClientSocket) -> Self {
        self.socket = Some(socket);
        self
    }

    fn ended_if_done(&mut self) {
        if self.inner.is_end_stream() {
            self.ended();
        }
    }

    /// Counts the end once.
    fn ended(&mut self) {
        if let Some(exchanges) = self.exchanges.take() {
            exchanges
                .request_bodies_ended
                .fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended(),
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => self.ended(),
            Poll::Ready(Some(Ok(_))) => self.ended_if_done(),
            // A broken body is not at a message boundary: never counted as ended.
            Poll::Ready(Some(Err(_))) => self.exchanges = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body counting its end in its connection's [`Exchanges`] (a body dropped
/// before its end, or broken, is not counted: that connection is not released between
/// exchanges).
pub struct Ending<B> {
    inner: B,
    exchanges: Arc<Exchanges>,
    /// Counted (or broken): never counted again.
    settled: AtomicBool,
}

impl<B: Body> Ending<B> {
    /// `inner`, counted in `exchanges`.
    pub fn new(inner: B, exchanges: Arc<Exchanges>) -> Self {
        Self {
            inner,
            exchanges,
            settled: AtomicBool::new(false),
        }
    }

    fn ended(&self) {
        if !self.settled.swap(true, Ordering::AcqRel) {
            self.exchanges
                .responses_ended
                .fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl<B> Body for Ending<B>
where
    B: Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended(),
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => self.ended(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.ended(),
            Poll::Ready(Some(Err(_))) => self.settled.store(true, Ordering::Release),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        // hyper asks this before polling: an empty body (a refusal's, a 101's) is never polled.
        let ended = self.inner.is_end_stream();
        if ended {
            self.ended();
        }
        ended
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body: the bytes already read (the peeked or buffered prefix, and trailers if
/// the body ended with them), then whatever is left of the client's stream, which may have
/// to arrive by a deadline ([`Replayed::rest_by`]).
pub struct Replayed {
    prefix: Option<Bytes>,
    /// Boxed (a request's trailers are rare): every upstream HTTP/1.1 connection's request
    /// channel holds 32 slots the size of a request, for the connection's life.
    trailers: Option<Box<HeaderMap>>,
    rest: Option<ClientBody>,
    /// When the rest must have arrived; past it the body fails ([`BodyTimedOut`]).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// A request body that did not arrive by its deadline (`--request-body-timeout`).
#[derive(Debug)]
pub struct BodyTimedOut;

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive within request_body_timeout")
    }
}

impl std::error::Error for BodyTimedOut {}

impl Replayed {
    /// The body as it arrived: nothing peeked.
    pub fn whole(body: ClientBody) -> Self {
        Self {
            prefix: None,
            trailers: None,
            rest: Some(body),
            deadline: None,
        }
    }

    /// `prefix` (and `trailers`), then `rest` (`None`: the body ended within the prefix).
    pub fn new(prefix: Bytes, trailers: Option<HeaderMap>, rest: Option<ClientBody>) -> Self {
        Self {
            prefix: (!prefix.is_empty()).then_some(prefix),
            trailers: trailers.map(Box::new),
            rest,
            deadline: None,
        }
    }

    /// Reads on until the body has ended or at least `limit` bytes of it are held (HAProxy's
    /// `http-buffer-request`): what a gated request sends before it takes a slot. An error
    /// is the client's (it broke its body off, or went away).
    pub async fn buffered(mut self, limit: usize) -> Result<Self, hyper::Error> {
        let mut held = BytesMut::new();
        if let Some(prefix) = self.prefix.take() {
            held.extend_from_slice(&prefix);
        }
        while self.trailers.is_none() && held.len() < limit {
            let Some(rest) = self.rest.as_mut() else {
                break;
            };
            if rest.is_end_stream() {
                self.rest = None;
                break;
            }
            match rest.frame().await {
                None => self.rest = None,
                Some(Err(error)) => return Err(error),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => held.extend_from_slice(&data),
                    Err(frame) => {
                        self.trailers = frame.into_trailers().ok().map(Box::new);
                        self.rest = None;
                    }
                },
            }
        }
        self.prefix = (!held.is_empty()).then(|| held.freeze());
        Ok(self)
    }

    /// Whether the whole body is held (nothing is left to arrive).
    pub fn is_held(&self) -> bool {
        self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    /// The client's socket while part of the body is still to arrive (and nothing reads
    /// it): where the client's leaving shows.
    pub fn unread_client(&self) -> Option<&ClientSocket> {
        self.rest
            .as_ref()
            .filter(|rest| !rest.is_end_stream())
            .and_then(|rest| rest.socket.as_ref())
    }

    /// What is left of the body must arrive by `deadline`, or the body fails.
    pub fn rest_by(&mut self, deadline: tokio::time::Instant) {
        if !self.is_held() {
            self.deadline = Some(Box::pin(tokio::time::sleep_until(deadline)));
        }
    }
}

impl Body for Replayed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        if let Some(trailers) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(*trailers))));
        }
        let polled = match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx).map_err(Into::into),
            None => return Poll::Ready(None),
        };
        if polled.is_pending() {
            if let Some(deadline) = self.deadline.as_mut() {
                if deadline.as_mut().poll(cx).is_ready() {
                    self.rest = None;
                    return Poll::Ready(Some(Err(Box::new(BodyTimedOut))));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.trailers.is_none() && self.is_held()
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        // Upper first: `set_lower` asserts it does not pass the upper bound.
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(prefix));
        }
        hint.set_lower(rest.lower().saturating_add(prefix));
        hint
    }
}

/// A response body holding the request's permit until it ends. If it is dropped before
/// its end (the client went away) while it holds a permit, the agent may still be working:
/// the rest of the upstream response is read and discarded on a task of its own, holding
/// the permit, until it ends or `abandoned_timeout` passes ([`discard`]). The cap counts
/// runs at the agent, not clients still waiting.
///
/// A client that stops asking for the response (it reads nothing: an HTTP/2 client that
/// grants no flow-control window, or an HTTP/1.1 one whose socket is full) is treated the
/// same way once `send_timeout` has passed since the last frame was handed to it without
/// it asking for the next ([`watch`]): the upstream response and the permit are taken from
/// this body and discarded on their own, and the body ends in an error if it is ever asked
/// again. A response waiting on the agent (a quiet SSE stream) is not a slow client.
pub struct Held {
    /// The upstream response and the permit, shared with the slow-client watch.
    stream: Arc<Mutex<Option<Stream>>>,
    /// A gRPC response: an upstream failure becomes a status trailer.
    grpc: bool,
    /// How long an abandoned response is read on before the slot is freed anyway.
    abandoned_timeout: Duration,
    /// How long a client may leave a handed frame unasked for; zero: not watched.
    send_timeout: Duration,
    /// The slow-client watch was started (at the first frame handed before the end).
    watched: bool,
    /// When a frame was last handed to the client without it asking for the next
    /// (milliseconds since `epoch`, plus one); 0 while it waits on the upstream.
    handed: Arc<AtomicU64>,
    epoch: Instant,
    /// Called once when the body ends or is dropped (the request's duration is recorded).
    on_end: Option<Box<dyn FnOnce() + Send>>,
    done: bool,
    /// Where usage reports in the trailers are counted; whether this turn's was settled
    /// (from the response's header) already.
    usage: Arc<DoorCounters>,
    usage_settled: bool,
}

/// The upstream response a [`Held`] relays, with the permit it holds.
struct Stream {
    inner: Incoming,
    permit: Option<Permit>,
}

/// The client stopped asking for its response for `--send-timeout`.
#[derive(Debug)]
pub struct ClientTooSlow;

impl std::fmt::Display for ClientTooSlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the client did not read its response within send_timeout")
    }
}

impl std::error::Error for ClientTooSlow {}

fn lock(stream: &Mutex<Option<Stream>>) -> std::sync::MutexGuard<'_, Option<Stream>> {
    stream
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn millis_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

impl Held {
    /// `inner`, holding `permit` (if gated), running `on_end` once at its end; a gated one
    /// is watched for a client slower than `send_timeout`. A usage report in its trailers
    /// (`admitgate-usage-tokens`) is settled against the permit's turn, unless
    /// `usage_settled`, counted in `usage`, and never passed on.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        inner: Incoming,
        permit: Option<Permit>,
        grpc: bool,
        abandoned_timeout: Duration,
        send_timeout: Duration,
        on_end: Box<dyn FnOnce() + Send>,
        usage: Arc<DoorCounters>,
        usage_settled: bool,
    ) -> Self {
        let gated = permit.is_some();
        Self {
            stream: Arc::new(Mutex::new(Some(Stream { inner, permit }))),
            grpc,
            abandoned_timeout,
            send_timeout: if gated { send_timeout } else { Duration::ZERO },
            watched: false,
            handed: Arc::new(AtomicU64::new(0)),
            epoch: Instant::now(),
            on_end: Some(on_end),
            done: false,
            usage,
            usage_settled,
        }
    }

    /// A frame was handed to the client and the body goes on: from now on the client must
    /// ask for the next within `send_timeout`. The watch starts here, not with the body:
    /// it acts only once a frame has been handed, so a response that ends with its first
    /// frame (most unary answers) never needs it, and is spared a task and a timer.
    fn handed_one(&mut self) {
        self.handed
            .store(millis_since(self.epoch), Ordering::Release);
        if self.watched || self.send_timeout.is_zero() {
            return;
        }
        self.watched = true;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(watch(
                Arc::downgrade(&self.stream),
                self.handed.clone(),
                self.epoch,
                self.send_timeout,
                self.abandoned_timeout,
            ));
        }
    }

    /// Trailers without the usage report, which is settled against the permit's turn (once).
    fn settle_trailers(&mut self, frame: Frame<Bytes>) -> Frame<Bytes> {
        let Ok(mut trailers) = frame.into_trailers() else {
            return Frame::data(Bytes::new());
        };
        let usage = rate_limit::take_usage(&mut trailers);
        let settled = !self.usage_settled
            && lock(&self.stream)
                .as_mut()
                .and_then(|stream| stream.permit.as_mut())
                .is_some_and(|permit| rate_limit::settle(permit, usage));
        self.usage_settled |= settled;
        self.usage.count(usage, settled);
        Frame::trailers(trailers)
    }

    fn finish(&mut self) {
        self.done = true;
        drop(lock(&self.stream).take());
        if let Some(on_end) = self.on_end.take() {
            on_end();
        }
    }
}

/// Watches a gated response for a client that stops asking for it (see [`Held`]); ends
/// when the response does.
async fn watch(
    stream: Weak<Mutex<Option<Stream>>>,
    handed: Arc<AtomicU64>,
    epoch: Instant,
    send_timeout: Duration,
    abandoned_timeout: Duration,
) {
    let limit = u64::try_from(send_timeout.as_millis()).unwrap_or(u64::MAX);
    let tick = send_timeout
        .checked_div(4)
        .unwrap_or(send_timeout)
        .max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(tick).await;
        let Some(stream) = stream.upgrade() else {
            return;
        };
        let at = handed.load(Ordering::Acquire);
        if at == 0 || millis_since(epoch).saturating_sub(at) < limit {
            continue;
        }
        let taken = lock(&stream).take();
        if let Some(Stream {
            inner,
            permit: Some(permit),
        }) = taken
        {
            let until = tokio::time::Instant::now()
                .checked_add(abandoned_timeout)
                .unwrap_or_else(tokio::time::Instant::now);
            tokio::spawn(discard(inner, permit, until));
        }
        return;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.done && !self.abandoned_timeout.is_zero() {
            if let Some(Stream {
                inner,
                permit: Some(permit),
            }) = lock(&self.stream).take()
            {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let until = tokio::time::Instant::now()
                        .checked_add(self.abandoned_timeout)
                        .unwrap_or_else(tokio::time::Instant::now);
                    runtime.spawn(discard(inner, permit, until));
                }
            }
        }
        self.finish();
    }
}

/// Reads and discards `body` until it ends or `until`, then frees `permit`: the slot of a
/// request whose client left, held while the agent still answers. Reading it also hands the
/// flow-control window back on a shared h2c connection.
pub async fn discard(mut body: Incoming, permit: Permit, until: tokio::time::Instant) {
    let read_to_end = async {
        while let Some(frame) = body.frame().await {
            if frame.is_err() {
                return;
            }
        }
    };
    let _ = tokio::time::timeout_at(until, read_to_end).await;
    drop(permit);
}

/// The trailers of a gRPC call the upstream broke off: `UNAVAILABLE` (retryable), with why.
pub fn broken_stream_trailers(why: &str) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("14"));
    let message = crate::refusal::grpc_message(&format!("upstream stream failed: {why}"));
    if let Ok(value) = HeaderValue::from_str(&message) {
        trailers.insert("grpc-message", value);
    }
    trailers
}

impl Body for Held {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let (polled, ends) = {
            let mut stream = lock(&self.stream);
            let Some(Stream { inner, .. }) = stream.as_mut() else {
                // The watch took the response: the client was too slow for it.
                drop(stream);
                self.finish();
                return Poll::Ready(Some(Err(Box::new(ClientTooSlow))));
            };
            let polled = Pin::new(&mut *inner).poll_frame(cx);
            (polled, inner.is_end_stream())
        };
        match polled {
            Poll::Pending => {
                // Waiting on the agent, not on the client.
                self.handed.store(0, Ordering::Release);
                Poll::Pending
            }
            Poll::Ready(None) => {
                self.finish();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                let trailers = frame.is_trailers();
                // The agent's usage report is the broker's, never the client's.
                let frame = if trailers {
                    self.settle_trailers(frame)
                } else {
                    frame
                };
                // Trailers are the last frame; so is data the body says ends it.
                if trailers || ends {
                    self.finish();
                } else {
                    self.handed_one();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                let error: BoxError = error.into();
                self.finish();
                if self.grpc {
                    return Poll::Ready(Some(Ok(Frame::trailers(broken_stream_trailers(
                        &error.to_string(),
                    )))));
                }
                Poll::Ready(Some(Err(error)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
            || lock(&self.stream)
                .as_ref()
                .is_none_or(|stream| stream.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        lock(&self.stream).as_ref().map_or_else(
            || SizeHint::with_exact(0),
            |stream| stream.inner.size_hint(),
        )
    }
}
