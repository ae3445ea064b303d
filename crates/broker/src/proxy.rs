//! The proxy's one service: classify a request, gate it if it is A2A work, forward it.
//!
//! Per request:
//!
//! 1. **Classification** ([`admitgate_classify::Rules`]), first, from what no header can
//!    change: a request is gated when either the HTTP rules (the SDK's route table; a POST
//!    to the JSON-RPC endpoint by its body, of which at most `max_peek_bytes` are read and
//!    replayed to the agent exactly) or the gRPC rules (the method path) call it work,
//!    whatever its `content-type` says.
//! 2. **Upgrades.** Only a request the rules pass may upgrade: a WebSocket is passed through
//!    ungated (the upstream's `101` is relayed and both upgraded connections are joined with
//!    `copy_bidirectional`). `Upgrade: h2c`, and any upgrade asked on a gated request, is
//!    refused: the header is dropped and the request served as HTTP/1.1 (so a client cannot
//!    tunnel past the broker to the agent, nor walk work past the gate).
//! 3. **Admission** through the [`Passage`], with the caller's deadline
//!    ([`crate::deadline`]: `grpc-timeout`, or Envoy's `x-envoy-expected-rq-timeout-ms`), once
//!    the body has arrived (up to `--max-buffered-body`, within `--request-body-timeout`):
//!    a request whose client closes while it waits withdraws, counted as cancelled (an
//!    HTTP/1.1 body not all read yet: seen on the socket, [`crate::leaving`]);
//!    a refusal is answered in place ([`crate::refusal`]); an admitted request's permit is
//!    held by the upstream exchange, then rides in its response body ([`Held`]) until the
//!    body ends; if the client leaves first, the rest is read and discarded, the permit held,
//!    for at most `--abandoned-response-timeout` ([`crate::body::discard`]). Its deadline
//!    header is forwarded with the time left.
//! 4. **Forwarding**: hop-by-hop headers stripped both ways (`te: trailers` kept), gRPC to
//!    the gRPC upstream over h2c, everything else as `--upstream-protocol` says: over
//!    HTTP/1.1 (the default), over h2c, or as the client spoke. Both pools drop idle
//!    connections before the agent's keep-alive would close them. An HTTP/2 client answered
//!    from HTTP/1.1 needs one upstream connection per stream in flight, and its requests
//!    cross from the h2 connection's task to an h1 connection's task and back; over h2c
//!    every stream shares one upstream connection, as HAProxy's `proto h2` does.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_classify::{decode_path, Kind, Rules, Verdict};
use admitgate_passage::core_api::{RequestLabel, TransportId};
use admitgate_passage::{Passage, Permit};
use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE, HOST, UPGRADE};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::body::{discard, BoxError, ClientBody, Held, Replayed};
use crate::config::{Config, TenantFrom, Upstream, UpstreamProtocol};
use crate::deadline;
use crate::headers::{strip_hop_by_hop, upgrade_protocol};
use crate::logging::RefusalLog;
use crate::priority::ClassPicker;
use crate::rate_limit::{self, DoorCounters};
use crate::readiness::UpstreamHealth;
use crate::refusal::{self, Shape};

/// What the proxy answers with.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// The transports of gated requests, as metric labels.
#[derive(Clone, Copy)]
pub struct TransportIds {
    pub jsonrpc: TransportId,
    pub rest: TransportId,
    pub grpc: TransportId,
}

/// Everything a request needs, shared by every connection.
pub struct Broker {
    pub config: Config,
    pub passage: Arc<Passage>,
    pub rules: Rules,
    pub transports: TransportIds,
    pub refusals: RefusalLog,
    /// Each gated request's priority class (`--priority-from`).
    pub classes: ClassPicker,
    http1: Client<HttpConnector, Replayed>,
    http2: Client<HttpConnector, Replayed>,
    /// When the upstream last answered (what /readyz and `broker_upstream_up` follow).
    pub upstream_health: UpstreamHealth,
    /// The budget door's counters: the agents' usage reports (`admitgate-usage-tokens`), and
    /// refusals by policy.
    pub usage: Arc<DoorCounters>,
}

/// What one stream of the shared h2c upstream connection may have unread in the broker.
pub const UPSTREAM_H2_STREAM_WINDOW: u32 = 256 * 1024;
/// The h2c upstream connection's window: the largest RFC 9113 allows (2^31 - 1), so that
/// only a stream's own window ever fills.
pub const UPSTREAM_H2_CONNECTION_WINDOW: u32 = (1 << 31) - 1;

fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(std::time::Duration::from_secs(5)));
    connector
}

impl Broker {
    /// The broker for `config`, admitting through `passage`.
    pub fn new(config: Config, passage: Arc<Passage>) -> Result<Self, String> {
        let rules = Rules::new(
            &config.path_prefix,
            config.jsonrpc_path.as_deref(),
            config.gate_all,
            config.max_peek_bytes,
        );
        let transport = |name: &str| passage.transport(name).map_err(|e| e.to_string());
        let transports = TransportIds {
            jsonrpc: transport("jsonrpc")?,
            rest: transport("rest")?,
            grpc: transport("grpc")?,
        };
        let mut h1 = Client::builder(TokioExecutor::new());
        h1.pool_timer(TokioTimer::new())
            .pool_idle_timeout(config.upstream_idle_timeout)
            .pool_max_idle_per_host(config.upstream_max_idle)
            .retry_canceled_requests(true)
            .set_host(true);
        let mut h2 = Client::builder(TokioExecutor::new());
        h2.pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(config.upstream_idle_timeout)
            .pool_max_idle_per_host(config.upstream_max_idle)
            .http2_only(true)
            // Every client's stream shares one h2c connection to the agent. hyper hands the
            // flow-control window back as each response body is read, so with its defaults
            // (2 MiB per stream, 5 MiB for the connection) three clients that stop reading
            // stalled every other stream. The connection's window is the protocol's largest,
            // so only each stream's own (what one slow reader may leave buffered in the
            // broker) can fill: one client can stall only its own stream.
            .http2_initial_stream_window_size(UPSTREAM_H2_STREAM_WINDOW)
            .http2_initial_connection_window_size(UPSTREAM_H2_CONNECTION_WINDOW);
        Ok(Self {
            http1: h1.build(connector()),
            http2: h2.build(connector()),
            rules,
            transports,
            refusals: RefusalLog::default(),
            classes: ClassPicker::new(&config.priority),
            upstream_health: UpstreamHealth::default(),
            usage: Arc::default(),
            passage,
            config,
        })
    }

    /// Whether a (non-gRPC) request from a client that spoke `version` goes to the upstream
    /// over h2c, as `--upstream-protocol` says.
    fn h2_upstream(&self, version: Version) -> bool {
        match self.config.upstream_protocol {
            UpstreamProtocol::Http1 => false,
            UpstreamProtocol::H2 => true,
            UpstreamProtocol::Auto => version >= Version::HTTP_2,
        }
    }

    fn transport_name(&self, id: TransportId) -> &'static str {
        if id == self.transports.grpc {
            "grpc"
        } else if id == self.transports.rest {
            "rest"
        } else {
            "jsonrpc"
        }
    }

    /// Asks the upstream for `--readiness-path` (`GET`; by default the agent card, which an
    /// A2A agent serves without side effects), for readiness: any answer within `timeout`
    /// counts.
    pub async fn probe_upstream(&self, timeout: Duration) -> bool {
        let uri = upstream_uri(&self.config.upstream, &self.config.readiness_path);
        let Ok(uri) = uri else { return false };
        let mut request = Request::new(Replayed::new(Bytes::new(), None, None));
        *request.uri_mut() = uri;
        let client = if self.config.upstream_protocol == UpstreamProtocol::H2 {
            *request.version_mut() = Version::HTTP_2;
            &self.http2
        } else {
            &self.http1
        };
        let answered = tokio::time::timeout(timeout, client.request(request)).await;
        let ok = matches!(answered, Ok(Ok(_)));
        if ok {
            self.upstream_health.answered();
        }
        ok
    }

    /// Handles one request from `peer`.
    pub async fn handle(
        self: Arc<Self>,
        mut request: Request<ClientBody>,
        peer: SocketAddr,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let started = Instant::now();
        // Classification comes first, for every request, from what the client cannot turn
        // into passthrough by a header: a request is gated when either the HTTP rules (the
        // SDK's routes, the JSON-RPC body) or the gRPC rules (the method path) call it work,
        // whatever its `content-type` or `Upgrade` say. An h2c agent routes by path alone,
        // so `POST /message:send` labelled `application/grpc` is still a send there.
        let grpc = is_grpc(&request);
        // The URI's clone shares its bytes (no copy of the path).
        let uri = request.uri().clone();
        let raw_path = uri.path();
        let path = decode_path(raw_path);
        let grpc_work = self.rules.grpc_gates(raw_path) || self.rules.grpc_gates(&path);
        let reached = self.rules.route(request.method().as_str(), &path, "");
        let route_verdict = self.rules.route_verdict(reached.kind);
        if request.version() == Version::HTTP_11 {
            let passes = !grpc_work && route_verdict == Some(Verdict::Pass);
            match upgrade_protocol(request.headers()).as_deref() {
                None => {}
                // Only what the rules pass through may upgrade (a WebSocket), ungated.
                Some(protocol) if protocol != "h2c" && passes => {
                    return Ok(self.upgrade(request, peer, started).await);
                }
                Some(_) => {
                    // h2c (a client would reach the agent's own HTTP/2 past the broker), or
                    // an upgrade on a request the rules gate: the upgrade is refused and the
                    // request served (and gated) as plain HTTP/1.1.
                    request.headers_mut().remove(UPGRADE);
                    request.headers_mut().remove("http2-settings");
                }
            }
        }
        let (mut parts, body) = request.into_parts();
        // The body a request is classified or gated by must arrive by this (the rest of a
        // gated body longer than --max-buffered-body: within the same time from admission).
        let body_deadline = tokio::time::Instant::from_std(started)
            .checked_add(self.config.request_body_timeout)
            .unwrap_or_else(tokio::time::Instant::now);
        // The tenant the SDK's router takes from a REST path (`--tenant-from path`).
        let mut route_tenant = None;
        let (http_verdict, http_transport, body) = match route_verdict {
            Some(verdict) => {
                route_tenant = reached.tenant;
                let label = (reached.kind != Kind::Pass).then_some(self.transports.rest);
                (verdict, label, Replayed::whole(body))
            }
            None => match tokio::time::timeout_at(
                body_deadline,
                peek(body, self.rules.max_peek_bytes()),
            )
            .await
            {
                Err(_elapsed) => return Ok(body_timed_out()),
                Ok(Ok((prefix, trailers, rest))) => {
                    let verdict = self.rules.jsonrpc_verdict(&prefix, rest.is_none());
                    (
                        verdict,
                        Some(self.transports.jsonrpc),
                        Replayed::new(prefix, trailers, rest),
                    )
                }
                Ok(Err(_)) => {
                    // The client broke off its own body: nothing to forward.
                    return Ok(plain(StatusCode::BAD_REQUEST, "request body broken off\n"));
                }
            },
        };
        let http_gates = matches!(http_verdict, Verdict::Gate { .. });
        let (verdict, transport) = if grpc || (grpc_work && !http_gates) {
            // A gRPC call (as its client says), or a gRPC A2A method path sent as plain HTTP:
            // counted as gRPC, gated if either rule calls it work.
            let gated = grpc_work || http_gates;
            let verdict = match http_verdict {
                Verdict::Gate { id } => Verdict::Gate { id },
                Verdict::Pass if gated => Verdict::Gate { id: None },
                Verdict::Pass => Verdict::Pass,
            };
            (verdict, gated.then_some(self.transports.grpc))
        } else {
            (http_verdict, http_transport)
        };
        let label = transport.map_or(RequestLabel::Passthrough, RequestLabel::Gated);
        let mut body = body;
        let permit = match (&verdict, transport) {
            (Verdict::Gate { id }, Some(tid)) => {
                // The body first (up to --max-buffered-body), then the slot: a client that
                // sends its body slowly holds no slot meanwhile, and one that leaves while
                // queued is seen (hyper reads on for the connection's end once the body is
                // read), so it withdraws, counted as cancelled.
                body = match tokio::time::timeout_at(
                    body_deadline,
                    body.buffered(self.config.max_buffered_body),
                )
                .await
                {
                    Ok(Ok(body)) => body,
                    Ok(Err(_)) => {
                        return Ok(plain(StatusCode::BAD_REQUEST, "request body broken off\n"))
                    }
                    Err(_elapsed) => return Ok(body_timed_out()),
                };
                let tenant = self.tenant(&parts.headers, route_tenant);
                let class = self.classes.pick(&parts.headers, &tenant);
                let deadline = deadline::deadline(started, deadline::timeout(&parts.headers, grpc));
                // Hashed by the budget before anything keeps it; never logged.
                let identity = self
                    .config
                    .rate_limit
                    .as_ref()
                    .map(|_| self.config.rate_key.identity(&parts.headers, &tenant));
                let cost = self.config.rate_limit.as_ref().map_or(0, |spec| spec.cost);
                let admitting =
                    self.passage
                        .admit_as(&tenant, class, tid, deadline, identity.as_deref(), cost);
                let admitted = match body.unread_client() {
                    None => admitting.await,
                    // The rest of a longer body is still to come and nothing reads it while
                    // the request waits: the client's leaving shows on its socket, and the
                    // request withdraws (dropping `admitting`), counted as cancelled.
                    Some(client) => tokio::select! {
                        biased;
                        () = client.closed() => {
                            self.passage
                                .transports()
                                .record_request(label, started.elapsed());
                            return Ok(client_left());
                        }
                        admitted = admitting => admitted,
                    },
                };
                match admitted {
                    Ok(permit) => {
                        // What is left of a longer body must come within the same time.
                        if let Some(by) = tokio::time::Instant::now()
                            .checked_add(self.config.request_body_timeout)
                        {
                            body.rest_by(by);
                        }
                        if let Some(deadline) = deadline {
                            // The agent sees what its caller still waits, after the queue.
                            deadline::rewrite_remaining(
                                &mut parts.headers,
                                grpc,
                                deadline,
                                Instant::now(),
                            );
                        }
                        Some(permit)
                    }
                    Err(refused) => {
                        let shape = if grpc {
                            Shape::Grpc
                        } else if tid == self.transports.jsonrpc {
                            Shape::JsonRpc(id.clone())
                        } else {
                            Shape::Rest
                        };
                        let limit = self.passage.limits().max_concurrent_runs;
                        let in_flight = self.passage.stats().in_flight;
                        self.refusals.refused(
                            refused.reason,
                            self.transport_name(tid),
                            in_flight,
                            limit,
                        );
                        let mut response = refusal::respond_in(
                            &shape,
                            refused.reason,
                            refused.retry_after,
                            self.classes.name(class),
                        );
                        if let (Some(spec), Some(by)) = (&self.config.rate_limit, refused.by) {
                            self.usage.refused(by.limit);
                            if !grpc {
                                spec.add_refusal_headers(
                                    response.headers_mut(),
                                    by.limit,
                                    refused.retry_after,
                                );
                            }
                        }
                        if parts.version < Version::HTTP_2 && !drain(body).await {
                            // Say so rather than let a client reuse a connection that closes.
                            response
                                .headers_mut()
                                .insert(CONNECTION, HeaderValue::from_static("close"));
                        }
                        self.passage
                            .transports()
                            .record_request(label, started.elapsed());
                        return Ok(response.map(full));
                    }
                }
            }
            _ => None,
        };
        Ok(self
            .forward(parts, body, permit, grpc, label, started, peer)
            .await)
    }

    /// The tenant of a gated request, as `--tenant-from` says ("" for none). `route_tenant`
    /// is the one the SDK's router takes from a REST path (`None` off its tenant routes,
    /// and for JSON-RPC and gRPC, whose paths have none).
    fn tenant(&self, headers: &http::HeaderMap, route_tenant: Option<String>) -> String {
        match &self.config.tenant_from {
            TenantFrom::None => String::new(),
            TenantFrom::Header(name) => headers
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default(),
            TenantFrom::Path => route_tenant.unwrap_or_default(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn forward(
        &self,
        mut parts: http::request::Parts,
        body: Replayed,
        permit: Option<Permit>,
        grpc: bool,
        label: RequestLabel,
        started: Instant,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let upstream = if grpc {
            &self.config.grpc_upstream
        } else {
            &self.config.upstream
        };
        let Ok(uri) = upstream_uri(upstream, request_target(&parts.uri)) else {
            return plain(StatusCode::BAD_REQUEST, "bad request target\n");
        };
        let over_h2 = grpc || self.h2_upstream(parts.version);
        let authority = parts.uri.authority().cloned();
        strip_hop_by_hop(&mut parts.headers, false);
        if over_h2 {
            // :authority is the agent's address (the connection's); RFC 9113 §8.3.1 wants a
            // Host, if any, to carry the same value, and a strict h2 server (the `h2`
            // library's, hypercorn's) refuses a request whose two differ. So none is sent.
            parts.headers.remove(HOST);
        } else if !parts.headers.contains_key(HOST) {
            // An HTTP/2 client names the host in :authority; an HTTP/1.1 agent wants Host.
            if let Some(value) = authority.and_then(|a| HeaderValue::from_str(a.as_str()).ok()) {
                parts.headers.insert(HOST, value);
            }
        }
        forwarded_for(&mut parts.headers, peer);
        parts.uri = uri;
        parts.version = if over_h2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let request = Request::from_parts(parts, body);
        let client = if over_h2 { &self.http2 } else { &self.http1 };
        let (answer, permit) = match permit {
            None => (client.request(request).await, None),
            Some(permit) => {
                // The exchange holds the slot until the upstream has answered: a client
                // leaving drops this future, not the exchange, which goes on by itself (the
                // agent keeps working; the cap counts runs at the agent).
                let mut exchange = Exchange {
                    sending: Some(client.request(request)),
                    permit: Some(permit),
                    abandoned: self.config.abandoned_response_timeout,
                };
                match (&mut exchange).await {
                    Ok(response) => (Ok(response), exchange.permit.take()),
                    Err(error) => (Err(error), None),
                }
            }
        };
        let passage = self.passage.clone();
        let record = move || {
            passage
                .transports()
                .record_request(label, started.elapsed())
        };
        match answer {
            Ok(response) => {
                self.upstream_health.answered();
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers, false);
                head.version = Version::HTTP_11;
                // The agent's usage report (a header, or a trailers-only gRPC answer's
                // trailer) is settled against the turn and never reaches the client.
                let usage = rate_limit::take_usage(&mut head.headers);
                let mut permit = permit;
                let settled = permit
                    .as_mut()
                    .is_some_and(|permit| rate_limit::settle(permit, usage));
                self.usage.count(usage, settled);
                let held = Held::new(
                    body,
                    permit,
                    grpc,
                    self.config.abandoned_response_timeout,
                    self.config.send_timeout,
                    Box::new(record),
                    self.usage.clone(),
                    settled,
                );
                Response::from_parts(head, held.boxed_unsync())
            }
            Err(error) => {
                drop(permit);
                record();
                upstream_failed(grpc, &error)
            }
        }
    }

    /// An upgrade other than h2c (WebSocket): passed through, ungated.
    async fn upgrade(
        &self,
        mut request: Request<ClientBody>,
        peer: SocketAddr,
        started: Instant,
    ) -> Response<ProxyBody> {
        let client_side = hyper::upgrade::on(&mut request);
        let (mut parts, body) = request.into_parts();
        let Ok(uri) = upstream_uri(&self.config.upstream, request_target(&parts.uri)) else {
            return plain(StatusCode::BAD_REQUEST, "bad request target\n");
        };
        strip_hop_by_hop(&mut parts.headers, true);
        forwarded_for(&mut parts.headers, peer);
        parts.uri = uri;
        let answer = self
            .http1
            .request(Request::from_parts(parts, Replayed::whole(body)))
            .await;
        let passage = self.passage.clone();
        let record = move || {
            passage
                .transports()
                .record_request(RequestLabel::Passthrough, started.elapsed())
        };
        match answer {
            Ok(mut response) if response.status() == StatusCode::SWITCHING_PROTOCOLS => {
                self.upstream_health.answered();
                let upstream_side = hyper::upgrade::on(&mut response);
                tokio::spawn(async move {
                    if let (Ok(client), Ok(upstream)) = (client_side.await, upstream_side.await) {
                        let mut client = TokioIo::new(client);
                        let mut upstream = TokioIo::new(upstream);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
                let (mut head, _) = response.into_parts();
                strip_hop_by_hop(&mut head.headers, true);
                self.usage
                    .count(rate_limit::take_usage(&mut head.headers), false);
                record();
                Response::from_parts(head, full(Bytes::new()))
            }
            Ok(response) => {
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers, false);
                self.usage
                    .count(rate_limit::take_usage(&mut head.headers), false);
                let held = Held::new(
                    body,
                    None,
                    false,
                    Duration::ZERO,
                    Duration::ZERO,
                    Box::new(record),
                    self.usage.clone(),
                    false,
                );
                Response::from_parts(head, held.boxed_unsync())
            }
            Err(error) => {
                record();
                upstream_failed(false, &error)
            }
        }
    }
}

/// A gated request's exchange with the upstream, holding its `permit` until the upstream has
/// answered (the caller then takes the permit into the response body, [`Held`]).
///
/// It runs in the request's own task. If it is dropped before the upstream has answered (the
/// client went away), the exchange goes on on a task of its own, still holding the permit,
/// and the response is read and discarded, for at most `abandoned` from the moment the
/// client went ([`discard`]): the slot is freed when the agent's exchange has ended, not
/// before. (It once ran on a task of its own from the start, answering through a channel:
/// a spawn, a channel and a cross-task wake-up per gated request, measured in BENCHMARKS.md,
/// for what only a client that leaves needs.)
struct Exchange {
    /// `None` once the upstream has answered (or failed).
    sending: Option<hyper_util::client::legacy::ResponseFuture>,
    permit: Option<Permit>,
    abandoned: Duration,
}

impl std::future::Future for Exchange {
    type Output = Result<Response<Incoming>, hyper_util::client::legacy::Error>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let Some(sending) = self.sending.as_mut() else {
            // Polled again after its answer: it has nothing more to give.
            return std::task::Poll::Pending;
        };
        let answered = std::task::ready!(std::pin::Pin::new(sending).poll(cx));
        self.sending = None;
        std::task::Poll::Ready(answered)
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let (Some(sending), Some(permit)) = (self.sending.take(), self.permit.take()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let until = tokio::time::Instant::now()
            .checked_add(self.abandoned)
            .unwrap_or_else(tokio::time::Instant::now);
        runtime.spawn(async move {
            if let Ok(Ok(response)) = tokio::time::timeout_at(until, sending).await {
                discard(response.into_body(), permit, until).await;
            }
        });
    }
}

/// Whether a request is a gRPC call (`content-type: application/grpc*`).
fn is_grpc<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The ASCII digit for `d` (0-9, so the addition never wraps).
fn digit(d: u8) -> u8 {
    b'0'.wrapping_add(d)
}

fn forwarded_for(headers: &mut http::HeaderMap, peer: SocketAddr) {
    // The name as a constant (a `&str` key is parsed and hashed at every use), an IPv4
    // address written without the formatting machinery, the value's bytes handed over rather
    // than copied: about 3,100 instructions a request before, 600 now (BENCHMARKS.md).
    let mut value = Vec::with_capacity(64);
    if let Some(before) = headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        value.extend_from_slice(before.as_bytes());
        value.extend_from_slice(b", ");
    }
    match peer.ip() {
        std::net::IpAddr::V4(ip) => {
            for (i, octet) in ip.octets().into_iter().enumerate() {
                if i > 0 {
                    value.push(b'.');
                }
                if octet >= 100 {
                    value.push(digit(octet / 100));
                }
                if octet >= 10 {
                    value.push(digit(octet / 10 % 10));
                }
                value.push(digit(octet % 10));
            }
        }
        ip @ std::net::IpAddr::V6(_) => value.extend_from_slice(ip.to_string().as_bytes()),
    }
    if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
        headers.insert(X_FORWARDED_FOR, value);
    }
}

/// The path and query a request is forwarded with: its own, already parsed (a clone shares
/// the bytes: nothing is copied or parsed again), or `/` for a target without one.
fn request_target(uri: &Uri) -> PathAndQuery {
    uri.path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"))
}

fn upstream_uri<T>(upstream: &Upstream, target: T) -> Result<Uri, http::Error>
where
    PathAndQuery: TryFrom<T>,
    <PathAndQuery as TryFrom<T>>::Error: Into<http::Error>,
{
    Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(target)
        .build()
}

/// The request's body did not arrive within `--request-body-timeout`: 408, and the
/// connection closes (the rest of the body is not waited for).
fn body_timed_out() -> Response<ProxyBody> {
    let mut response = plain(StatusCode::REQUEST_TIMEOUT, "request body timed out\n");
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The client closed its connection while its request waited: the answer no one reads
/// (hyper drops it with the connection).
fn client_left() -> Response<ProxyBody> {
    let mut response = plain(StatusCode::BAD_REQUEST, "client closed the connection\n");
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

fn plain(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(full(text));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The upstream could not be reached or broke before answering: 502, or for gRPC a
/// trailers-only `UNAVAILABLE`.
fn upstream_failed(grpc: bool, error: &hyper_util::client::legacy::Error) -> Response<ProxyBody> {
    if grpc {
        let mut response = Response::new(full(Bytes::new()));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert("grpc-status", HeaderValue::from_static("14"));
        let message = refusal::grpc_message(&format!("upstream unavailable: {error}"));
        if let Ok(value) = HeaderValue::from_str(&message) {
            headers.insert("grpc-message", value);
        }
        return response;
    }
    plain(StatusCode::BAD_GATEWAY, "upstream unavailable\n")
}

/// Reads at most about `limit` bytes of a body: `(prefix, trailers, rest)`, `rest` being
/// `None` when the body ended within the prefix.
async fn peek(
    mut body: ClientBody,
    limit: usize,
) -> Result<(Bytes, Option<http::HeaderMap>, Option<ClientBody>), hyper::Error> {
    let mut prefix = BytesMut::new();
    loop {
        if http_body::Body::is_end_stream(&body) {
            return Ok((prefix.freeze(), None, None));
        }
        if prefix.len() >= limit {
            return Ok((prefix.freeze(), None, Some(body)));
        }
        match body.frame().await {
            None => return Ok((prefix.freeze(), None, None)),
            Some(Err(error)) => return Err(error),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => prefix.extend_from_slice(&data),
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        return Ok((prefix.freeze(), Some(trailers), None));
                    }
                }
            },
        }
    }
}

/// How much of a refused request's body is read and discarded so its connection can be
/// reused, and for how long.
const DRAIN_LIMIT: usize = 64 * 1024;
/// See [`DRAIN_LIMIT`].
const DRAIN_TIMEOUT: Duration = Duration::from_millis(200);

/// Reads and discards what is left of a refused request's body, at most [`DRAIN_LIMIT`]
/// bytes for at most [`DRAIN_TIMEOUT`]; true if it was read to its end.
///
/// hyper closes an HTTP/1.1 connection whose request body was not read to its end, after the
/// response and without saying so; a client that sends its next request on that kept-alive
/// connection then meets a closed socket ("server disconnected without sending a
/// response"). A body read to its end keeps the connection; one that is longer or slower is
/// not waited for, and the refusal says `Connection: close` instead.
async fn drain(mut body: Replayed) -> bool {
    let read_to_end = async {
        let mut read = 0usize;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            if let Some(data) = frame.data_ref() {
                read = read.saturating_add(data.len());
                if read > DRAIN_LIMIT {
                    return false;
                }
            }
        }
        true
    };
    tokio::time::timeout(DRAIN_TIMEOUT, read_to_end)
        .await
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_for_appends_the_peer_address_as_display_writes_it() {
        let peers = [
            "0.0.0.0:1",
            "127.0.0.1:2",
            "10.9.99.100:3",
            "255.250.205.199:4",
            "[::1]:5",
            "[2001:db8::8a2e:370:7334]:6",
        ];
        for peer in peers {
            let peer: SocketAddr = peer.parse().unwrap();
            let mut headers = http::HeaderMap::new();
            forwarded_for(&mut headers, peer);
            assert_eq!(headers[&X_FORWARDED_FOR], peer.ip().to_string().as_str());
            forwarded_for(&mut headers, peer);
            let twice = format!("{0}, {0}", peer.ip());
            assert_eq!(headers[&X_FORWARDED_FOR], twice.as_str());
        }
        // A value that is not visible ASCII is replaced, not extended.
        let mut headers = http::HeaderMap::new();
        headers.insert(X_FORWARDED_FOR, HeaderValue::from_bytes(b"\xff").unwrap());
        forwarded_for(&mut headers, "1.2.3.4:5".parse().unwrap());
        assert_eq!(headers[&X_FORWARDED_FOR], "1.2.3.4");
    }
}
