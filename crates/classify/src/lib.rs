//! Which A2A requests admitgate gates: the rules every front door shares, in one place.
//!
//! The broker (`crates/broker`) classifies with this crate; the rules are those of the
//! in-process front doors (`admitgate.asgi`, `admitgate._a2a_routes`, `admitgate.grpc`):
//!
//! * [`routes`]: which A2A endpoint an HTTP request reaches, as Starlette routes the A2A
//!   SDK's own routes (REST 1.0 and v0.3, tenant segments, the JSON-RPC endpoint), and the
//!   tenant the SDK's router takes from the path.
//! * [`jsonrpc`]: the `method` and `id` of a JSON-RPC body, read as `json.loads` reads it,
//!   whole within the peek limit, or from a bounded prefix (linear time, constant stack).
//! * [`Rules`]: the method rule on top of both (work is gated, reads and cancellations
//!   pass; `gate_methods = "all"` gates every A2A request), and the gRPC method rule.
//!
//! Pure functions of a method, a path and bytes: no I/O, no allocation beyond the path
//! being matched, no dependency.

#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

pub mod jsonrpc;
pub mod routes;

pub use jsonrpc::{parse_request, scan_head, Request, RpcId};
pub use routes::{sdk_routers, Kind, Reached, Router};

/// The JSON-RPC methods that start or continue agent work (A2A 1.0 names, then v0.3 names).
pub const JSONRPC_WORK_METHODS: [&str; 6] = [
    "SendMessage",
    "SendStreamingMessage",
    "SubscribeToTask",
    "message/send",
    "message/stream",
    "tasks/resubscribe",
];

/// The A2A gRPC services: the current protocol's and the v0.3 one the SDK keeps serving.
pub const A2A_SERVICES: [&str; 2] = ["lf.a2a.v1.A2AService", "a2a.v1.A2AService"];

/// The gRPC methods that start or continue agent work.
pub const GRPC_WORK_METHODS: [&str; 6] = [
    "/lf.a2a.v1.A2AService/SendMessage",
    "/lf.a2a.v1.A2AService/SendStreamingMessage",
    "/lf.a2a.v1.A2AService/SubscribeToTask",
    "/a2a.v1.A2AService/SendMessage",
    "/a2a.v1.A2AService/SendStreamingMessage",
    "/a2a.v1.A2AService/TaskSubscription",
];

/// What the front door does with a request, once it knows what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not A2A work under the rules: forwarded without a slot.
    Pass,
    /// Gated: takes a slot first. `id` is the JSON-RPC id a refusal echoes.
    Gate { id: Option<RpcId> },
}

/// The front door's configuration of the rules.
#[derive(Clone, Debug)]
pub struct Rules {
    routers: Vec<Router>,
    gate_all: bool,
    max_peek_bytes: usize,
}

impl Rules {
    /// The rules for the SDK's routes under `path_prefix` (no trailing `/`), with JSON-RPC at
    /// `path_prefix + jsonrpc_path` (`None`: none); `gate_all` is `gate_methods = "all"`.
    pub fn new(
        path_prefix: &str,
        jsonrpc_path: Option<&str>,
        gate_all: bool,
        max_peek_bytes: usize,
    ) -> Self {
        let prefix = path_prefix.trim_end_matches('/');
        Self {
            routers: sdk_routers(prefix, jsonrpc_path),
            gate_all,
            max_peek_bytes: max_peek_bytes.max(1),
        }
    }

    /// How much of a JSON-RPC body is read before admission.
    pub fn max_peek_bytes(&self) -> usize {
        self.max_peek_bytes
    }

    /// What `method path` (decoded, below `root_path`) reaches: the most gated kind any of
    /// the SDK's layouts gives it (the front door does not know which layout the app uses).
    pub fn kind(&self, method: &str, path: &str, root_path: &str) -> Kind {
        self.routers
            .iter()
            .map(|router| router.kind(method, path, root_path))
            .max()
            .unwrap_or(Kind::Pass)
    }

    /// [`Rules::kind`] with the tenant the SDK's router takes from the path (its
    /// `Mount("/{tenant}", ...)`): see [`routes::strongest`].
    pub fn route(&self, method: &str, path: &str, root_path: &str) -> Reached {
        routes::strongest(&self.routers, method, path, root_path)
    }

    /// Whether a request of `kind` is gated before its body is seen; `None` for JSON-RPC,
    /// whose body decides ([`Rules::jsonrpc_verdict`]).
    pub fn route_verdict(&self, kind: Kind) -> Option<Verdict> {
        match kind {
            Kind::Pass => Some(Verdict::Pass),
            Kind::Read if !self.gate_all => Some(Verdict::Pass),
            Kind::Read | Kind::Work => Some(Verdict::Gate { id: None }),
            Kind::JsonRpc => None,
        }
    }

    /// The verdict on a JSON-RPC request whose first bytes are `body`; `complete` says
    /// whether the body ended there. A body longer than the peek limit is gated whatever its
    /// method says (only its `id` is read, from the prefix).
    pub fn jsonrpc_verdict(&self, body: &[u8], complete: bool) -> Verdict {
        if !complete || body.len() > self.max_peek_bytes {
            let head = body.get(..self.max_peek_bytes).unwrap_or(body);
            return Verdict::Gate {
                id: scan_head(head).id,
            };
        }
        match parse_request(body) {
            Some(request) => {
                let work = request
                    .method
                    .as_deref()
                    .is_some_and(|m| JSONRPC_WORK_METHODS.contains(&m));
                if self.gate_all || work {
                    Verdict::Gate { id: request.id }
                } else {
                    Verdict::Pass
                }
            }
            // Invalid JSON is no request: the app answers a parse error, with no work.
            None if !self.gate_all => Verdict::Pass,
            None => Verdict::Gate { id: None },
        }
    }

    /// Whether a gRPC call to `method` (`/package.Service/Method`) is gated.
    pub fn grpc_gates(&self, method: &str) -> bool {
        if self.gate_all {
            let service = method
                .strip_prefix('/')
                .and_then(|m| m.split('/').next())
                .unwrap_or("");
            return A2A_SERVICES.contains(&service);
        }
        GRPC_WORK_METHODS.contains(&method)
    }
}

/// A request target's path as an ASGI server hands it to the app: percent-decoded as
/// `urllib.parse.unquote` decodes (UTF-8, invalid sequences replaced by U+FFFD), the query
/// dropped. A path with no `%` (nearly every request) is borrowed, not copied: classifying
/// a request allocates nothing.
pub fn decode_path(target: &str) -> std::borrow::Cow<'_, str> {
    let path = target.split('?').next().unwrap_or("");
    if !path.contains('%') {
        return std::borrow::Cow::Borrowed(path);
    }
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = |j: usize| bytes.get(j).and_then(|&c| char::from(c).to_digit(16));
            if let (Some(hi), Some(lo)) = (hex(i.saturating_add(1)), hex(i.saturating_add(2))) {
                out.push(u8::try_from(hi.wrapping_mul(16).wrapping_add(lo)).unwrap_or(0));
                i = i.saturating_add(3);
                continue;
            }
        }
        out.push(b);
        i = i.saturating_add(1);
    }
    std::borrow::Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let rules = Rules::new("", Some("/"), false, 64);
        assert_eq!(
            rules.route_verdict(rules.kind("GET", "/tasks/1", "")),
            Some(Verdict::Pass)
        );
        assert_eq!(
            rules.route_verdict(rules.kind("POST", "/message:send", "")),
            Some(Verdict::Gate { id: None })
        );
        assert_eq!(
            rules.jsonrpc_verdict(br#"{"method":"GetTask","id":1}"#, true),
            Verdict::Pass
        );
        assert_eq!(
            rules.jsonrpc_verdict(br#"{"method":"message/send","id":"x"}"#, true),
            Verdict::Gate {
                id: Some(RpcId::Str("x".into()))
            }
        );
        let long = format!(
            r#"{{"id":3,"method":"GetTask","params":"{}"}}"#,
            "x".repeat(100)
        );
        assert_eq!(
            rules.jsonrpc_verdict(long.as_bytes(), true),
            Verdict::Gate {
                id: Some(RpcId::Int("3".into()))
            }
        );
        // UTF-16 holding a lone surrogate is JSON to Python (surrogatepass): still work.
        let utf16: Vec<u8> = r#"{"method":"SendMessage","x":"?"}"#
            .encode_utf16()
            .map(|u| if u == 0x3f { 0xd800 } else { u })
            .flat_map(u16::to_le_bytes)
            .collect();
        assert_eq!(
            rules.jsonrpc_verdict(&utf16, true),
            Verdict::Gate { id: None }
        );
        assert!(rules.grpc_gates("/lf.a2a.v1.A2AService/SendMessage"));
        assert!(!rules.grpc_gates("/lf.a2a.v1.A2AService/GetTask"));
        assert!(Rules::new("", Some("/"), true, 64).grpc_gates("/a2a.v1.A2AService/GetTask"));
    }

    #[test]
    fn paths_decode_as_unquote() {
        assert_eq!(decode_path("/message:send%0A?x=1"), "/message:send\n");
        assert!(matches!(
            decode_path("/message:send?x=%41"),
            std::borrow::Cow::Borrowed("/message:send")
        ));
        assert_eq!(
            decode_path("/a%2Fb%zz%e2%82%ac%ff"),
            "/a/b%zz\u{20ac}\u{fffd}"
        );
    }
}
