//! Hop-by-hop headers (RFC 9110 §7.6.1): meant for one connection, never forwarded.
//!
//! Removed: `Connection` and every header it names, `Proxy-Connection`, `Keep-Alive`, `TE`
//! (except `te: trailers`, which gRPC needs end to end), `Transfer-Encoding`, `Upgrade`
//! (kept, with `Connection: upgrade`, only on an upgrade the proxy carries through).

use http::header::{
    HeaderMap, HeaderName, HeaderValue, CONNECTION, TE, TRANSFER_ENCODING, UPGRADE,
};

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Whether a `TE` value is exactly `trailers` (what gRPC sends).
fn te_is_trailers(value: &HeaderValue) -> bool {
    value.to_str().is_ok_and(|v| {
        v.split(',')
            .all(|token| token.trim().eq_ignore_ascii_case("trailers"))
    })
}

/// Strips the hop-by-hop headers; `upgrade` keeps `Upgrade` and sends `Connection: upgrade`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .filter(|name| *name != TE || !upgrade)
        .collect();
    for name in named {
        if upgrade && name == UPGRADE {
            continue;
        }
        headers.remove(&name);
    }
    headers.remove(CONNECTION);
    headers.remove(KEEP_ALIVE);
    headers.remove(PROXY_CONNECTION);
    headers.remove(TRANSFER_ENCODING);
    let keep_te = headers.get(TE).is_some_and(te_is_trailers);
    if !keep_te {
        headers.remove(TE);
    }
    if upgrade {
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(UPGRADE);
    }
}

/// The protocol a request asks to upgrade to, lowercased (`websocket`, `h2c`), if any.
pub fn upgrade_protocol(headers: &HeaderMap) -> Option<String> {
    let asks = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    if !asks {
        return None;
    }
    headers
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_per_rfc_9110() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(TE, HeaderValue::from_static("trailers"));
        h.insert(UPGRADE, HeaderValue::from_static("h2c"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        let names: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["te", "x-kept"]);
        let mut h = HeaderMap::new();
        h.insert(TE, HeaderValue::from_static("gzip, trailers"));
        strip_hop_by_hop(&mut h, false);
        assert!(h.is_empty());
    }
}
