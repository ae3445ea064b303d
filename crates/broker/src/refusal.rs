//! How a refused request is answered: one place for every transport, with the in-process
//! front doors' statuses, headers and bodies (`admitgate.asgi`, `admitgate.grpc`,
//! `admitgate._frontdoor`), byte for byte.
//!
//! * JSON-RPC: HTTP 429/503, a JSON-RPC 2.0 error with the request's `id` and code -32029,
//!   `data: {reason, retryAfter}`.
//! * REST: HTTP 429/503, the SDK's error shape (`google.rpc.Status` as JSON, with `ErrorInfo`
//!   of domain `admitgate` and, with a hint, `RetryInfo`).
//! * gRPC: a trailers-only response, `RESOURCE_EXHAUSTED` or `UNAVAILABLE`, with
//!   `grpc-retry-pushback-ms`, the `admitgate-reason` trailer and `grpc-status-details-bin`.
//!
//! HTTP refusals carry `Retry-After` in whole seconds (rounded up; none without a hint) and
//! the `admitgate-reason` header.

use std::time::Duration;

use admitgate_classify::RpcId;
use admitgate_passage::core_api::Rejection;
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

/// `admitgate._errors.DEFAULT_BUSY_MESSAGE`.
pub const BUSY_MESSAGE: &str = "Busy right now \u{2014} please resend in a moment.";
/// `admitgate._frontdoor.JSONRPC_REJECTED_CODE`.
pub const JSONRPC_REJECTED_CODE: i64 = -32029;
/// `admitgate._frontdoor.ERROR_DOMAIN`.
pub const ERROR_DOMAIN: &str = "admitgate";
/// `admitgate._frontdoor.REASON_KEY`.
pub const REASON_KEY: &str = "admitgate-reason";
/// `admitgate._frontdoor.PRIORITY_KEY`: the gRPC trailer naming a refused call's class.
pub const PRIORITY_KEY: &str = "admitgate-priority";
const ERROR_INFO_TYPE: &str = "type.googleapis.com/google.rpc.ErrorInfo";
const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// Which front door's shape a refusal takes.
#[derive(Clone, Debug)]
pub enum Shape {
    /// A JSON-RPC request, with the id to echo.
    JsonRpc(Option<RpcId>),
    /// A REST request.
    Rest,
    /// A gRPC call.
    Grpc,
}

/// `admitgate.REJECTION_REASONS`: the HTTP status and the gRPC code (number, name).
pub fn statuses(reason: Rejection) -> (StatusCode, u8, &'static str) {
    match reason {
        Rejection::MemoryPressure | Rejection::Closing | Rejection::FleetUnavailable => {
            (StatusCode::SERVICE_UNAVAILABLE, 14, "UNAVAILABLE")
        }
        Rejection::QueueFull
        | Rejection::Shed
        | Rejection::Policy
        | Rejection::Timeout
        | Rejection::RateLimited => (StatusCode::TOO_MANY_REQUESTS, 8, "RESOURCE_EXHAUSTED"),
        // The caller's own deadline cannot be met: not a reason to retry sooner.
        Rejection::Deadline => (StatusCode::GATEWAY_TIMEOUT, 4, "DEADLINE_EXCEEDED"),
    }
}

/// `whole_seconds`: rounded up, never negative.
pub fn whole_seconds(hint: Duration) -> u64 {
    let secs = hint.as_secs();
    if hint.subsec_nanos() > 0 {
        secs.saturating_add(1)
    } else {
        secs
    }
}

/// `whole_ms`: rounded up.
pub fn whole_ms(hint: Duration) -> u64 {
    let ms = u64::try_from(hint.as_millis()).unwrap_or(u64::MAX);
    if !hint.subsec_nanos().is_multiple_of(1_000_000) {
        ms.saturating_add(1)
    } else {
        ms
    }
}

/// A JSON string as Python's `json.dumps(ensure_ascii=False)` writes it.
fn json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn jsonrpc_body(
    id: Option<&RpcId>,
    reason: &str,
    seconds: Option<u64>,
    class: Option<&str>,
) -> String {
    let mut out = String::from("{\"jsonrpc\":\"2.0\",\"id\":");
    match id {
        Some(RpcId::Str(text)) => json_string(&mut out, text),
        Some(RpcId::Int(digits)) => out.push_str(digits),
        Some(RpcId::Null) | None => out.push_str("null"),
    }
    out.push_str(&format!(
        ",\"error\":{{\"code\":{JSONRPC_REJECTED_CODE},\"message\":"
    ));
    json_string(&mut out, BUSY_MESSAGE);
    out.push_str(",\"data\":{\"reason\":");
    json_string(&mut out, reason);
    out.push_str(",\"retryAfter\":");
    match seconds {
        Some(s) => out.push_str(&s.to_string()),
        None => out.push_str("null"),
    }
    if let Some(class) = class {
        out.push_str(",\"priority\":");
        json_string(&mut out, class);
    }
    out.push_str("}}}");
    out
}

fn rest_body(
    status: StatusCode,
    grpc_name: &str,
    reason: &str,
    seconds: Option<u64>,
    class: Option<&str>,
) -> String {
    let mut out = format!("{{\"error\":{{\"code\":{},\"status\":", status.as_u16());
    json_string(&mut out, grpc_name);
    out.push_str(",\"message\":");
    json_string(&mut out, BUSY_MESSAGE);
    out.push_str(",\"details\":[{\"@type\":");
    json_string(&mut out, ERROR_INFO_TYPE);
    out.push_str(",\"reason\":");
    json_string(&mut out, &reason.to_uppercase());
    out.push_str(",\"domain\":");
    json_string(&mut out, ERROR_DOMAIN);
    out.push_str(",\"metadata\":{\"reason\":");
    json_string(&mut out, reason);
    if let Some(s) = seconds {
        out.push_str(&format!(",\"retryAfter\":\"{s}\""));
    }
    if let Some(class) = class {
        out.push_str(",\"priority\":");
        json_string(&mut out, class);
    }
    out.push_str("}}");
    if let Some(s) = seconds {
        out.push_str(",{\"@type\":");
        json_string(&mut out, RETRY_INFO_TYPE);
        out.push_str(&format!(",\"retryDelay\":\"{s}s\"}}"));
    }
    out.push_str("]}}");
    out
}

/// `grpc-message`: percent-encoded outside printable ASCII (and `%` itself), per the gRPC
/// HTTP/2 protocol.
pub fn grpc_message(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

// -- google.rpc.Status, protobuf-encoded by hand (three small messages) -------------------

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(u8::try_from(value & 0x7f).unwrap_or(0) | 0x80);
        value >>= 7;
    }
    out.push(u8::try_from(value).unwrap_or(0));
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn any(type_url: &str, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    field_bytes(&mut out, 1, type_url.as_bytes());
    field_bytes(&mut out, 2, value);
    out
}

/// The serialized `google.rpc.Status` the gRPC front door sends in `grpc-status-details-bin`.
fn status_details(
    code: u8,
    reason: &str,
    pushback: Option<Duration>,
    class: Option<&str>,
) -> Vec<u8> {
    let mut info = Vec::new();
    field_bytes(&mut info, 1, reason.to_uppercase().as_bytes());
    field_bytes(&mut info, 2, ERROR_DOMAIN.as_bytes());
    let mut entry = Vec::new();
    field_bytes(&mut entry, 1, b"reason");
    field_bytes(&mut entry, 2, reason.as_bytes());
    field_bytes(&mut info, 3, &entry);
    if let Some(class) = class {
        let mut entry = Vec::new();
        field_bytes(&mut entry, 1, b"priority");
        field_bytes(&mut entry, 2, class.as_bytes());
        field_bytes(&mut info, 3, &entry);
    }
    let mut status = Vec::new();
    varint(&mut status, 1 << 3);
    varint(&mut status, u64::from(code));
    field_bytes(&mut status, 2, BUSY_MESSAGE.as_bytes());
    field_bytes(&mut status, 3, &any(ERROR_INFO_TYPE, &info));
    if let Some(hint) = pushback {
        // Whole milliseconds, rounded up, as the pushback trailer and the Python interceptor
        // send it.
        let delay = Duration::from_millis(whole_ms(hint));
        let mut duration = Vec::new();
        let (secs, nanos) = (delay.as_secs(), delay.subsec_nanos());
        if secs > 0 {
            varint(&mut duration, 1 << 3);
            varint(&mut duration, secs);
        }
        if nanos > 0 {
            varint(&mut duration, 2 << 3);
            varint(&mut duration, u64::from(nanos));
        }
        let mut retry = Vec::new();
        field_bytes(&mut retry, 1, &duration);
        field_bytes(&mut status, 3, &any(RETRY_INFO_TYPE, &retry));
    }
    status
}

fn base64(bytes: &[u8]) -> String {
    // Unpadded standard base64, as gRPC's binary metadata is sent.
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().saturating_mul(2));
    for chunk in bytes.chunks(3) {
        let b = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (b(0) << 16) | (b(1) << 8) | b(2);
        let digits = chunk.len().saturating_add(1);
        for k in 0..digits {
            let shift = 18u32.saturating_sub(6u32.saturating_mul(u32::try_from(k).unwrap_or(0)));
            let index = usize::try_from((n >> shift) & 63).unwrap_or(0);
            out.push(char::from(ALPHABET.get(index).copied().unwrap_or(b'A')));
        }
    }
    out
}

/// The answer to a request refused for `reason` with `hint`, in the shape of its transport.
pub fn respond(shape: &Shape, reason: Rejection, hint: Option<Duration>) -> Response<Bytes> {
    respond_in(shape, reason, hint, None)
}

/// [`respond`] for a request of priority class `class` (a broker with classes): the class is
/// named in the JSON-RPC error's `data.priority`, the REST `ErrorInfo`'s `metadata.priority`,
/// and for gRPC the [`PRIORITY_KEY`] trailer and the `ErrorInfo` metadata.
pub fn respond_in(
    shape: &Shape,
    reason: Rejection,
    hint: Option<Duration>,
    class: Option<&str>,
) -> Response<Bytes> {
    let (status, grpc_code, grpc_name) = statuses(reason);
    let name = reason.as_str();
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    let reason_value = HeaderValue::from_static(name);
    if let Shape::Grpc = shape {
        // Trailers-only: one HEADERS frame ending the stream, status and trailers in it.
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert("grpc-status", HeaderValue::from(u16::from(grpc_code)));
        if let Ok(message) = HeaderValue::from_str(&grpc_message(BUSY_MESSAGE)) {
            headers.insert("grpc-message", message);
        }
        headers.insert(REASON_KEY, reason_value);
        if let Some(hint) = hint {
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from(whole_ms(hint)));
        }
        if let Some(value) = class.and_then(|c| HeaderValue::from_str(c).ok()) {
            headers.insert(PRIORITY_KEY, value);
        }
        let details = status_details(grpc_code, name, hint, class);
        if let Ok(details) = HeaderValue::from_str(&base64(&details)) {
            headers.insert("grpc-status-details-bin", details);
        }
        return response;
    }
    let seconds = hint.map(whole_seconds);
    let body = match shape {
        Shape::JsonRpc(id) => jsonrpc_body(id.as_ref(), name, seconds, class),
        _ => rest_body(status, grpc_name, name, seconds, class),
    };
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    headers.insert(REASON_KEY, reason_value);
    if let Some(s) = seconds {
        headers.insert(http::header::RETRY_AFTER, HeaderValue::from(s));
    }
    *response.body_mut() = Bytes::from(body);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_match_the_python_front_door() {
        let r = respond(
            &Shape::JsonRpc(Some(RpcId::Str("a\"b".into()))),
            Rejection::QueueFull,
            Some(Duration::from_millis(1500)),
        );
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "2");
        assert_eq!(
            std::str::from_utf8(r.body()).unwrap(),
            "{\"jsonrpc\":\"2.0\",\"id\":\"a\\\"b\",\"error\":{\"code\":-32029,\"message\":\"Busy right now \u{2014} please resend in a moment.\",\"data\":{\"reason\":\"queue_full\",\"retryAfter\":2}}}"
        );
        let r = respond(&Shape::Rest, Rejection::Closing, None);
        assert_eq!(r.status(), 503);
        assert!(r.headers().get("retry-after").is_none());
        assert_eq!(
            std::str::from_utf8(r.body()).unwrap(),
            "{\"error\":{\"code\":503,\"status\":\"UNAVAILABLE\",\"message\":\"Busy right now \u{2014} please resend in a moment.\",\"details\":[{\"@type\":\"type.googleapis.com/google.rpc.ErrorInfo\",\"reason\":\"CLOSING\",\"domain\":\"admitgate\",\"metadata\":{\"reason\":\"closing\"}}]}}"
        );
        let r = respond(
            &Shape::Rest,
            Rejection::Timeout,
            Some(Duration::from_secs(3)),
        );
        assert!(std::str::from_utf8(r.body()).unwrap().ends_with(
            "\"metadata\":{\"reason\":\"timeout\",\"retryAfter\":\"3\"}},{\"@type\":\"type.googleapis.com/google.rpc.RetryInfo\",\"retryDelay\":\"3s\"}]}}"
        ));
        let r = respond(
            &Shape::Grpc,
            Rejection::QueueFull,
            Some(Duration::from_micros(1500)),
        );
        assert_eq!(r.headers()["grpc-status"], "8");
        assert_eq!(r.headers()["grpc-retry-pushback-ms"], "2");
        assert_eq!(base64(b"abcd"), "YWJjZA");
    }

    /// A broker with classes names the refused request's class in every shape; one without
    /// answers byte for byte as before.
    #[test]
    fn refusals_name_the_class() {
        let r = respond_in(
            &Shape::JsonRpc(Some(RpcId::Int("3".into()))),
            Rejection::Shed,
            None,
            Some("batch"),
        );
        assert!(std::str::from_utf8(r.body()).unwrap().ends_with(
            "\"data\":{\"reason\":\"shed\",\"retryAfter\":null,\"priority\":\"batch\"}}}"
        ));
        let r = respond_in(
            &Shape::Rest,
            Rejection::QueueFull,
            Some(Duration::from_secs(2)),
            Some("batch"),
        );
        let body = std::str::from_utf8(r.body()).unwrap();
        assert!(
            body.contains("\"metadata\":{\"reason\":\"queue_full\",\"retryAfter\":\"2\",\"priority\":\"batch\"}},{\"@type\""),
            "{body}"
        );
        let r = respond_in(&Shape::Grpc, Rejection::QueueFull, None, Some("batch"));
        assert_eq!(r.headers()[PRIORITY_KEY], "batch");
        let details = status_details(8, "queue_full", None, Some("batch"));
        assert!(details.windows(8).any(|w| w == b"priority"));
        for shape in [Shape::Rest, Shape::Grpc, Shape::JsonRpc(None)] {
            let before = respond(&shape, Rejection::Timeout, Some(Duration::from_secs(1)));
            let after = respond_in(
                &shape,
                Rejection::Timeout,
                Some(Duration::from_secs(1)),
                None,
            );
            assert_eq!(before.body(), after.body());
            assert_eq!(before.headers(), after.headers());
            assert!(after.headers().get(PRIORITY_KEY).is_none());
        }
    }
}
