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

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use admitgate_passage::Permit;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

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
/// (none on HTTP/2, where streams are independent).
pub struct ClientBody {
    inner: Incoming,
    exchanges: Option<Arc<Exchanges>>,
}

impl ClientBody {
    /// `inner`, counted in `exchanges` if given.
    pub fn new(inner: Incoming, exchanges: Option<Arc<Exchanges>>) -> Self {
        let mut body = Self { inner, exchanges };
        body.ended_if_done();
        body
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

/// A request body: the peeked prefix (data, and trailers if the body ended with them), then
/// whatever is left of the client's stream.
pub struct Replayed {
    prefix: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<ClientBody>,
}

impl Replayed {
    /// The body as it arrived: nothing peeked.
    pub fn whole(body: ClientBody) -> Self {
        Self {
            prefix: None,
            trailers: None,
            rest: Some(body),
        }
    }

    /// `prefix` (and `trailers`), then `rest` (`None`: the body ended within the prefix).
    pub fn new(prefix: Bytes, trailers: Option<HeaderMap>, rest: Option<ClientBody>) -> Self {
        Self {
            prefix: (!prefix.is_empty()).then_some(prefix),
            trailers,
            rest,
        }
    }
}

impl Body for Replayed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        if let Some(trailers) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
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

/// A response body holding the request's permit until it ends or is dropped.
pub struct Held<B> {
    inner: B,
    permit: Option<Permit>,
    /// A gRPC response: an upstream failure becomes a status trailer.
    grpc: bool,
    /// Called once when the body ends or is dropped (the request's duration is recorded).
    on_end: Option<Box<dyn FnOnce() + Send>>,
    done: bool,
}

impl<B> Held<B> {
    /// `inner`, holding `permit` (if gated), running `on_end` once at its end.
    pub fn new(
        inner: B,
        permit: Option<Permit>,
        grpc: bool,
        on_end: Box<dyn FnOnce() + Send>,
    ) -> Self {
        Self {
            inner,
            permit,
            grpc,
            on_end: Some(on_end),
            done: false,
        }
    }

    fn finish(&mut self) {
        self.done = true;
        drop(self.permit.take());
        if let Some(on_end) = self.on_end.take() {
            on_end();
        }
    }
}

impl<B> Drop for Held<B> {
    fn drop(&mut self) {
        self.finish();
    }
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

impl<B> Body for Held<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.finish();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                // Trailers are the last frame; so is data the body says ends it.
                if frame.is_trailers() || self.inner.is_end_stream() {
                    self.finish();
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
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
