//! The operations port: `/metrics` (Prometheus text), `/livez`, `/readyz`.
//!
//! Names and labels follow the mesh broker's document: `broker_inflight_requests{transport}`
//! (the in-flight count the limit is compared against) and `broker_rejected_total{transport}`
//! (requests refused at admission), plus admissions, queue, requests and their durations,
//! the limit, saturation, and the fleet figures when a fleet limit is set. Everything is read
//! from the gate and its counters at scrape time; nothing is counted for the scrape.
//!
//! `/readyz` is 200 while the upstream answers ([`crate::readiness`]: it answered within the
//! last 3 s, a probe or any request) and the broker is not draining, 503 otherwise; `/livez`
//! is 200 while the process serves.

use std::convert::Infallible;
use std::fmt::Write;
use std::sync::Arc;
use std::time::Instant;

use admitgate_passage::core_api::{HistogramSnapshot, Rejection};
use bytes::Bytes;
use http::{header::CONTENT_TYPE, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::exposition::family;
use crate::proxy::Broker;
use crate::readiness;

fn histogram(out: &mut String, name: &str, labels: &str, snapshot: &HistogramSnapshot) {
    let sep = if labels.is_empty() { "" } else { "," };
    for (bound, count) in &snapshot.buckets {
        let le = if bound.is_infinite() {
            "+Inf".to_owned()
        } else {
            bound.to_string()
        };
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {count}");
    }
    let braces = if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    };
    let _ = writeln!(out, "{name}_sum{braces} {}", snapshot.sum);
    let _ = writeln!(out, "{name}_count{braces} {}", snapshot.count);
}

/// The exposition, read now.
pub fn render(broker: &Broker) -> String {
    let passage = &broker.passage;
    let mut out = String::with_capacity(4096);
    let transports: Vec<_> = passage
        .transports()
        .stats()
        .into_iter()
        .filter(|t| ["jsonrpc", "rest", "grpc"].contains(&&*t.name))
        .collect();
    family(
        &mut out,
        "broker_inflight_requests",
        "gauge",
        "Gated requests holding a slot, by transport.",
    );
    for t in &transports {
        let _ = writeln!(
            out,
            "broker_inflight_requests{{transport=\"{}\"}} {}",
            t.name, t.in_flight
        );
    }
    family(
        &mut out,
        "broker_rejected_total",
        "counter",
        "Requests refused at admission, by transport.",
    );
    for t in &transports {
        let total: u64 = t.rejected.iter().sum();
        let _ = writeln!(
            out,
            "broker_rejected_total{{transport=\"{}\"}} {total}",
            t.name
        );
    }
    family(
        &mut out,
        "broker_rejected_reason_total",
        "counter",
        "Requests refused at admission, by transport and reason.",
    );
    for t in &transports {
        for reason in Rejection::ALL {
            let count = t.rejected.get(reason.index()).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "broker_rejected_reason_total{{transport=\"{}\",reason=\"{}\"}} {count}",
                t.name,
                reason.as_str()
            );
        }
    }
    family(
        &mut out,
        "broker_admitted_total",
        "counter",
        "Gated requests admitted, by transport.",
    );
    for t in &transports {
        let _ = writeln!(
            out,
            "broker_admitted_total{{transport=\"{}\"}} {}",
            t.name, t.admitted
        );
    }
    family(
        &mut out,
        "broker_cancelled_total",
        "counter",
        "Gated requests withdrawn while they waited for a slot (their client left).",
    );
    let _ = writeln!(out, "broker_cancelled_total {}", passage.stats().cancelled);
    family(
        &mut out,
        "broker_queued_requests",
        "gauge",
        "Gated requests waiting for a slot, by transport.",
    );
    for t in &transports {
        let _ = writeln!(
            out,
            "broker_queued_requests{{transport=\"{}\"}} {}",
            t.name, t.queued
        );
    }
    let requests = passage.transports().request_stats();
    family(
        &mut out,
        "broker_requests_total",
        "counter",
        "Requests finished, by transport (passthrough: not gated).",
    );
    for (name, snapshot) in &requests {
        let _ = writeln!(
            out,
            "broker_requests_total{{transport=\"{name}\"}} {}",
            snapshot.count
        );
    }
    family(
        &mut out,
        "broker_request_duration_seconds",
        "histogram",
        "From arrival to the last byte of the response, by transport.",
    );
    for (name, snapshot) in &requests {
        histogram(
            &mut out,
            "broker_request_duration_seconds",
            &format!("transport=\"{name}\""),
            snapshot,
        );
    }
    family(
        &mut out,
        "broker_queue_wait_seconds",
        "histogram",
        "How long admitted requests waited for their slot.",
    );
    histogram(
        &mut out,
        "broker_queue_wait_seconds",
        "",
        &passage.queue_wait(),
    );
    let stats = passage.stats();
    let limits = passage.limits();
    let fleet = passage.fleet().map(|f| f.stats());
    let limit = fleet
        .as_ref()
        .map_or(u64::from(limits.max_concurrent_runs), |f| {
            u64::from(f.max_in_flight)
        });
    family(
        &mut out,
        "broker_limit",
        "gauge",
        "The in-flight cap that bounds the agent (the fleet cap when one is set; 0: none).",
    );
    let _ = writeln!(out, "broker_limit {limit}");
    family(
        &mut out,
        "broker_queue_depth",
        "gauge",
        "How many requests may wait for a slot.",
    );
    let _ = writeln!(out, "broker_queue_depth {}", limits.queue_depth);
    let in_flight = fleet
        .as_ref()
        .map_or(stats.in_flight, |f| f.fleet_in_flight);
    let saturated = limit > 0 && in_flight >= limit;
    family(
        &mut out,
        "broker_saturated",
        "gauge",
        "1 while the agent is at its cap.",
    );
    let _ = writeln!(out, "broker_saturated {}", u8::from(saturated));
    family(
        &mut out,
        "broker_draining",
        "gauge",
        "1 while the broker drains (SIGTERM).",
    );
    let _ = writeln!(out, "broker_draining {}", u8::from(passage.running().1));
    family(
        &mut out,
        "broker_upstream_up",
        "gauge",
        &format!(
            "1 while the agent answers (within the last {} s, a probe or any request).",
            readiness::DOWN_AFTER.as_secs()
        ),
    );
    let _ = writeln!(
        out,
        "broker_upstream_up {}",
        u8::from(broker.upstream_health.is_up())
    );
    family(
        &mut out,
        "broker_gate_in_flight",
        "gauge",
        "Slots of this broker's gate held (every transport).",
    );
    let _ = writeln!(out, "broker_gate_in_flight {}", stats.in_flight);
    if let Some(f) = fleet {
        let gauges = [
            (
                "broker_fleet_in_flight",
                "gauge",
                "Requests holding a fleet lease across every replica (last known).",
                f.fleet_in_flight,
            ),
            (
                "broker_fleet_max_in_flight",
                "gauge",
                "The fleet-wide in-flight cap.",
                u64::from(f.max_in_flight),
            ),
            (
                "broker_fleet_backend_up",
                "gauge",
                "1 while the fleet backend (Redis) answers.",
                u64::from(f.backend_up),
            ),
            (
                "broker_fleet_lease_lost_total",
                "counter",
                "Running requests whose fleet lease expired under them.",
                f.lease_lost,
            ),
            (
                "broker_fleet_borrowed",
                "gauge",
                "Fleet leases borrowed over the cap.",
                f.borrowed,
            ),
            (
                "broker_fleet_outages_total",
                "counter",
                "Fleet backend outages seen by this broker.",
                f.outages,
            ),
            (
                "broker_fleet_failovers_total",
                "counter",
                "Fleet backend failovers followed by this broker (a new primary named by Sentinel).",
                f.failovers,
            ),
        ];
        for (name, kind, help, value) in gauges {
            family(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {value}");
        }
        let durability = passage
            .fleet()
            .map_or("primary", |limit| limit.config().durability.as_str());
        family(
            &mut out,
            "broker_fleet_backend_info",
            "gauge",
            "The fleet backend's topology (single, sentinel, cluster) and durability (primary, \
             replicated); always 1.",
        );
        let _ = writeln!(
            out,
            "broker_fleet_backend_info{{topology=\"{}\",durability=\"{durability}\"}} 1",
            f.topology
        );
    }
    crate::rate_limit::render_metrics(
        &mut out,
        broker.config.rate_limit.as_ref(),
        passage,
        &broker.usage,
    );
    crate::priority::render_metrics(&mut out, passage, &broker.classes);
    out
}

fn answer(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

async fn route(
    broker: Arc<Broker>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(match request.uri().path() {
        "/metrics" => answer(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            render(&broker),
        ),
        "/livez" => answer(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => {
            let draining = broker.passage.running().1;
            if draining {
                answer(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "draining\n")
            } else if broker.upstream_health.is_up() {
                answer(StatusCode::OK, "text/plain", "ok\n")
            } else if broker.upstream_health.silent_for(Instant::now()).is_none() {
                answer(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "upstream not answering yet\n",
                )
            } else {
                answer(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "upstream not answering\n",
                )
            }
        }
        _ => answer(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    })
}

/// Serves the operations port for as long as the broker's runtime runs.
pub async fn serve(broker: Arc<Broker>, listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let broker = broker.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| route(broker.clone(), request));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
