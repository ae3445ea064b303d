//! The proxy's one service: classify a request, gate it if it is A2A work, forward it.
//!
//! Per request:
//!
//! 1. **Upgrades.** `Upgrade: h2c` is refused (the header is dropped and the request served
//!    as HTTP/1.1, so a client cannot tunnel past the broker to the agent's own HTTP/2);
//!    any other upgrade (WebSocket) is passed through ungated: the upstream's `101` is
//!    relayed and both upgraded connections are joined with `copy_bidirectional`.
//! 2. **Classification** ([`admitgate_classify::Rules`]): gRPC by its method path; HTTP by
//!    the SDK's route table; a POST to the JSON-RPC endpoint by its body, of which at most
//!    `max_peek_bytes` are read (and replayed to the agent exactly).
//! 3. **Admission** through the [`Passage`], with the caller's deadline
//!    ([`crate::deadline`]: `grpc-timeout`, or Envoy's `x-envoy-expected-rq-timeout-ms`):
//!    a refusal is answered in place ([`crate::refusal`]); an admitted request's permit
//!    rides in its response body ([`Held`]) until the body ends or the client goes away,
//!    and its deadline header is forwarded with the time left.
//! 4. **Forwarding**: hop-by-hop headers stripped both ways (`te: trailers` kept), gRPC to
//!    the gRPC upstream over h2c, everything else over HTTP/1.1 from a pool whose idle
//!    connections are dropped before the agent's keep-alive would close them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_classify::{decode_path, Kind, Rules, Verdict};
use admitgate_passage::core_api::{RequestLabel, TransportId};
use admitgate_passage::{Passage, Permit};
use bytes::{Bytes, BytesMut};
use http::header::{HeaderValue, CONNECTION, CONTENT_TYPE, HOST, UPGRADE};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::body::{BoxError, Held, Replayed};
use crate::config::{Config, TenantFrom, Upstream};
use crate::deadline;
use crate::headers::{strip_hop_by_hop, upgrade_protocol};
use crate::logging::RefusalLog;
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
    http1: Client<HttpConnector, Replayed>,
    http2: Client<HttpConnector, Replayed>,
    /// When the upstream last answered (what /readyz and `broker_upstream_up` follow).
    pub upstream_health: UpstreamHealth,
}

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
            .http2_only(true);
        Ok(Self {
            http1: h1.build(connector()),
            http2: h2.build(connector()),
            rules,
            transports,
            refusals: RefusalLog::default(),
            upstream_health: UpstreamHealth::default(),
            passage,
            config,
        })
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

    /// Asks the upstream something cheap (`GET /`), for readiness: any answer within
    /// `timeout` counts.
    pub async fn probe_upstream(&self, timeout: Duration) -> bool {
        let uri = upstream_uri(&self.config.upstream, "/");
        let Ok(uri) = uri else { return false };
        let mut request = Request::new(Replayed::new(Bytes::new(), None, None));
        *request.uri_mut() = uri;
        let answered = tokio::time::timeout(timeout, self.http1.request(request)).await;
        let ok = matches!(answered, Ok(Ok(_)));
        if ok {
            self.upstream_health.answered();
        }
        ok
    }

    /// Handles one request from `peer`.
    pub async fn handle(
        self: Arc<Self>,
        mut request: Request<Incoming>,
        peer: SocketAddr,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let started = Instant::now();
        if request.version() == Version::HTTP_11 {
            match upgrade_protocol(request.headers()).as_deref() {
                None => {}
                Some("h2c") => {
                    // Refused: served as HTTP/1.1 without the upgrade, so a client cannot reach
                    // the agent's own HTTP/2 past the broker (h2c smuggling).
                    request.headers_mut().remove(UPGRADE);
                    request.headers_mut().remove("http2-settings");
                }
                Some(_) => return Ok(self.upgrade(request, peer, started).await),
            }
        }
        let grpc = is_grpc(&request);
        let (mut parts, body) = request.into_parts();
        let path = decode_path(parts.uri.path());
        // The tenant the SDK's router takes from a REST path (`--tenant-from path`).
        let mut route_tenant = None;
        let (verdict, transport, body) = if grpc {
            let gated = self.rules.grpc_gates(parts.uri.path());
            let verdict = if gated {
                Verdict::Gate { id: None }
            } else {
                Verdict::Pass
            };
            (
                verdict,
                gated.then_some(self.transports.grpc),
                Replayed::whole(body),
            )
        } else {
            let reached = self.rules.route(parts.method.as_str(), &path, "");
            let kind = reached.kind;
            match self.rules.route_verdict(kind) {
                Some(verdict) => {
                    route_tenant = reached.tenant;
                    let label = (kind != Kind::Pass).then_some(self.transports.rest);
                    (verdict, label, Replayed::whole(body))
                }
                None => match peek(body, self.rules.max_peek_bytes()).await {
                    Ok((prefix, trailers, rest)) => {
                        let verdict = self.rules.jsonrpc_verdict(&prefix, rest.is_none());
                        (
                            verdict,
                            Some(self.transports.jsonrpc),
                            Replayed::new(prefix, trailers, rest),
                        )
                    }
                    Err(_) => {
                        // The client broke off its own body: nothing to forward.
                        return Ok(plain(StatusCode::BAD_REQUEST, "request body broken off\n"));
                    }
                },
            }
        };
        let label = transport.map_or(RequestLabel::Passthrough, RequestLabel::Gated);
        let permit = match (&verdict, transport) {
            (Verdict::Gate { id }, Some(tid)) => {
                let tenant = self.tenant(&parts.headers, route_tenant);
                let deadline = deadline::deadline(started, deadline::timeout(&parts.headers, grpc));
                match self.passage.admit_by(&tenant, tid, deadline).await {
                    Ok(permit) => {
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
                        let mut response =
                            refusal::respond(&shape, refused.reason, refused.retry_after);
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
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let Ok(uri) = upstream_uri(upstream, target) else {
            return plain(StatusCode::BAD_REQUEST, "bad request target\n");
        };
        let authority = parts.uri.authority().cloned();
        strip_hop_by_hop(&mut parts.headers, false);
        if !parts.headers.contains_key(HOST) {
            // An HTTP/2 client names the host in :authority; an HTTP/1.1 agent wants Host.
            if let Some(value) = authority.and_then(|a| HeaderValue::from_str(a.as_str()).ok()) {
                parts.headers.insert(HOST, value);
            }
        }
        forwarded_for(&mut parts.headers, peer);
        parts.uri = uri;
        parts.version = if grpc {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let request = Request::from_parts(parts, body);
        let answer = if grpc {
            self.http2.request(request).await
        } else {
            self.http1.request(request).await
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
                Response::from_parts(
                    head,
                    Held::new(body, permit, grpc, Box::new(record)).boxed_unsync(),
                )
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
        mut request: Request<Incoming>,
        peer: SocketAddr,
        started: Instant,
    ) -> Response<ProxyBody> {
        let client_side = hyper::upgrade::on(&mut request);
        let (mut parts, body) = request.into_parts();
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let Ok(uri) = upstream_uri(&self.config.upstream, target) else {
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
                record();
                Response::from_parts(head, full(Bytes::new()))
            }
            Ok(response) => {
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers, false);
                Response::from_parts(
                    head,
                    Held::new(body, None, false, Box::new(record)).boxed_unsync(),
                )
            }
            Err(error) => {
                record();
                upstream_failed(false, &error)
            }
        }
    }
}

/// Whether a request is a gRPC call (`content-type: application/grpc*`).
fn is_grpc<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

fn forwarded_for(headers: &mut http::HeaderMap, peer: SocketAddr) {
    let ip = peer.ip().to_string();
    let value = match headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(before) => format!("{before}, {ip}"),
        None => ip,
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert("x-forwarded-for", value);
    }
}

fn upstream_uri(upstream: &Upstream, target: &str) -> Result<Uri, http::Error> {
    Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(target)
        .build()
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
    mut body: Incoming,
    limit: usize,
) -> Result<(Bytes, Option<http::HeaderMap>, Option<Incoming>), hyper::Error> {
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
