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

/// The hop-by-hop headers RFC 9110 §7.6.1 names, as [`strip_hop_by_hop`] looks for them.
const HOP_BY_HOP: [HeaderName; 6] = [
    CONNECTION,
    KEEP_ALIVE,
    PROXY_CONNECTION,
    TE,
    TRANSFER_ENCODING,
    UPGRADE,
];

/// Which of [`HOP_BY_HOP`] `headers` holds, one bit each (bit `i` for `HOP_BY_HOP[i]`).
fn hop_by_hop_present(headers: &HeaderMap) -> u8 {
    headers.keys().fold(0, |present, name| {
        HOP_BY_HOP
            .iter()
            .position(|hop| hop == name)
            .map_or(present, |i| present | (1 << i))
    })
}

/// Whether a `Connection` option names a header that is removed whatever it says (so it
/// need not be parsed into a name: nginx's `Connection: keep-alive` on every response).
fn removed_anyway(token: &str) -> bool {
    [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
    ]
    .iter()
    .any(|name| token.eq_ignore_ascii_case(name))
}

/// Strips the hop-by-hop headers; `upgrade` keeps `Upgrade` and sends `Connection: upgrade`.
///
/// It runs twice a request (the request, the response), so it looks for the six names in
/// one pass of cheap comparisons and removes only those present, instead of six hashed
/// removals each time (about 1,750 instructions a call before; BENCHMARKS.md).
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    let present = hop_by_hop_present(headers);
    let has = |name: &HeaderName| {
        HOP_BY_HOP
            .iter()
            .position(|hop| hop == name)
            .is_some_and(|i| present & (1 << i) != 0)
    };
    if has(&CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|token| !removed_anyway(token))
            .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
            .filter(|name| *name != TE || !upgrade)
            .collect();
        for name in named {
            if upgrade && name == UPGRADE {
                continue;
            }
            headers.remove(&name);
        }
        headers.remove(CONNECTION);
    }
    for name in [KEEP_ALIVE, PROXY_CONNECTION, TRANSFER_ENCODING] {
        if has(&name) {
            headers.remove(name);
        }
    }
    if has(&TE) && !headers.get(TE).is_some_and(te_is_trailers) {
        headers.remove(TE);
    }
    if upgrade {
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    } else if has(&UPGRADE) {
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
        // Each hop-by-hop header alone is still removed (only those present are looked at),
        // and so is a header `Connection` names besides one removed anyway.
        let mut h = HeaderMap::new();
        h.append(CONNECTION, HeaderValue::from_static("keep-alive"));
        h.append(
            CONNECTION,
            HeaderValue::from_static("Keep-Alive , x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(KEEP_ALIVE, HeaderValue::from_static("timeout=5"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        let names: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-kept"]);
        for name in [
            CONNECTION,
            KEEP_ALIVE,
            PROXY_CONNECTION,
            TE,
            TRANSFER_ENCODING,
            UPGRADE,
        ] {
            let mut h = HeaderMap::new();
            h.insert(name.clone(), HeaderValue::from_static("gzip"));
            h.insert("x-kept", HeaderValue::from_static("1"));
            strip_hop_by_hop(&mut h, false);
            let names: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
            assert_eq!(names, ["x-kept"], "{name} was kept");
        }
        let mut h = HeaderMap::new();
        h.insert(TE, HeaderValue::from_static("gzip, trailers"));
        strip_hop_by_hop(&mut h, false);
        assert!(h.is_empty());
    }
}
