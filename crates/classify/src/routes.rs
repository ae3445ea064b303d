//! Which A2A endpoint a request reaches, decided exactly as Starlette routes the A2A SDK's
//! routes (a port of `admitgate._a2a_routes`; that module's essay explains why the table is
//! the SDK's own and not an approximation).
//!
//! A route path is a template of literals and `{name}` parameters. As Starlette compiles it,
//! a parameter matches `[^/]+`, the whole path is anchored with `^` and `$`, and Python's `$`
//! also matches just before one final newline (so `/message:send\n` is `SendMessage`). A
//! `Mount(path)` matches `path` followed by `/{rest}` where `rest` is `.*` (which stops at a
//! newline) and routes the rest below it.
//!
//! Linear time: a parameter is followed either by a literal starting with `/` (which only
//! the end of the parameter's maximal run can meet, so one try) or by a fixed suffix ending
//! the template (at most one try per character of the run, each costing the suffix's length).

/// What a request is, as far as the gate is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Not an A2A endpoint (or no endpoint at all: 404, 405, a redirect): passes through.
    Pass = 0,
    /// An A2A REST endpoint that reads, cancels or configures.
    Read = 1,
    /// An A2A REST endpoint that starts or continues agent work.
    Work = 2,
    /// The JSON-RPC endpoint: the body says what it does.
    JsonRpc = 3,
}

type Route = (&'static str, &'static str, Kind);

/// `create_rest_routes(enable_v0_3_compat=True)`'s v0.3 routes, in the SDK's order.
const V03: [Route; 10] = [
    ("/v1/message:send", "POST", Kind::Work),
    ("/v1/message:stream", "POST", Kind::Work),
    ("/v1/tasks/{id}:cancel", "POST", Kind::Read),
    ("/v1/tasks/{id}:subscribe", "GET", Kind::Work),
    ("/v1/tasks/{id}:subscribe", "POST", Kind::Work),
    ("/v1/tasks/{id}", "GET", Kind::Read),
    (
        "/v1/tasks/{id}/pushNotificationConfigs/{push_id}",
        "GET",
        Kind::Read,
    ),
    ("/v1/tasks/{id}/pushNotificationConfigs", "POST", Kind::Read),
    ("/v1/tasks/{id}/pushNotificationConfigs", "GET", Kind::Read),
    ("/v1/card", "GET", Kind::Read),
];

/// The 1.0 routes, in the SDK's order (also mounted under `/{tenant}`).
const V10: [Route; 12] = [
    ("/message:send", "POST", Kind::Work),
    ("/message:stream", "POST", Kind::Work),
    ("/tasks/{id}:cancel", "POST", Kind::Read),
    ("/tasks/{id}:subscribe", "GET", Kind::Work),
    ("/tasks/{id}:subscribe", "POST", Kind::Work),
    ("/tasks/{id}", "GET", Kind::Read),
    (
        "/tasks/{id}/pushNotificationConfigs/{push_id}",
        "GET",
        Kind::Read,
    ),
    (
        "/tasks/{id}/pushNotificationConfigs/{push_id}",
        "DELETE",
        Kind::Read,
    ),
    ("/tasks/{id}/pushNotificationConfigs", "POST", Kind::Read),
    ("/tasks/{id}/pushNotificationConfigs", "GET", Kind::Read),
    ("/tasks", "GET", Kind::Read),
    ("/extendedAgentCard", "GET", Kind::Read),
];

/// What a request reaches: the endpoint's kind and, on the SDK's tenant routes
/// (`Mount("/{tenant}", ...)`), the tenant its router takes from the path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reached {
    /// What the endpoint does.
    pub kind: Kind,
    /// Starlette's `path_params["tenant"]` (what the SDK hands its handler as the call's
    /// tenant); `None` for a route outside the tenant mount, and for [`Kind::Pass`].
    pub tenant: Option<String>,
}

impl Reached {
    const PASS: Self = Self {
        kind: Kind::Pass,
        tenant: None,
    };
}

/// The one path parameter the SDK's routers bind that the gate cares about.
const TENANT: &str = "tenant";

/// One piece of a route template.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Literal(String),
    /// `{name}`: `[^/]+`. Only whether the name is `tenant` matters.
    Param {
        tenant: bool,
    },
}

/// A compiled route template.
#[derive(Clone, Debug)]
struct Template {
    pieces: Vec<Piece>,
}

impl Template {
    fn compile(path: &str) -> Self {
        let mut pieces = Vec::new();
        let mut rest = path;
        while let Some(open) = rest.find('{') {
            let Some(close) = rest.get(open..).and_then(|tail| tail.find('}')) else {
                break;
            };
            if let Some(literal) = rest.get(..open).filter(|l| !l.is_empty()) {
                pieces.push(Piece::Literal(literal.to_owned()));
            }
            let name = rest
                .get(open.saturating_add(1)..open.saturating_add(close))
                .unwrap_or("");
            pieces.push(Piece::Param {
                tenant: name == TENANT,
            });
            rest = rest
                .get(open.saturating_add(close).saturating_add(1)..)
                .unwrap_or("");
        }
        if !rest.is_empty() {
            pieces.push(Piece::Literal(rest.to_owned()));
        }
        Self { pieces }
    }

    /// Whether the template matches the start of `text` at `pos` and `tail` matches after it.
    fn match_at(pieces: &[Piece], text: &str, pos: usize, tail: &dyn Fn(usize) -> bool) -> bool {
        let Some((first, rest)) = pieces.split_first() else {
            return tail(pos);
        };
        let Some(here) = text.get(pos..) else {
            return false;
        };
        match first {
            Piece::Literal(literal) => {
                here.starts_with(literal.as_str())
                    && Self::match_at(rest, text, pos.saturating_add(literal.len()), tail)
            }
            Piece::Param { .. } => {
                let run = here.find('/').unwrap_or(here.len());
                // Greedy with backtracking, as the regex engine; each candidate end is a char
                // boundary (the run holds whole characters).
                let mut ends: Vec<usize> = here
                    .get(..run)
                    .unwrap_or("")
                    .char_indices()
                    .map(|(i, c)| i.saturating_add(c.len_utf8()))
                    .collect();
                ends.reverse();
                // A following literal starting with "/" can only meet the run's end.
                let next_is_slash =
                    matches!(rest.first(), Some(Piece::Literal(l)) if l.starts_with('/'));
                if next_is_slash {
                    ends.truncate(1);
                }
                ends.into_iter()
                    .any(|end| Self::match_at(rest, text, pos.saturating_add(end), tail))
            }
        }
    }

    /// `^template$`, with Python's `$` (the end, or just before one final newline).
    fn full_match(&self, text: &str) -> bool {
        Self::match_at(&self.pieces, text, 0, &|end| at_dollar(text, end))
    }
}

/// Python's `$` without MULTILINE: at the end, or before a final `\n`.
fn at_dollar(text: &str, pos: usize) -> bool {
    pos == text.len() || (pos.saturating_add(1) == text.len() && text.ends_with('\n'))
}

/// The path a Starlette router matches: `path` below `root_path`
/// (`starlette._utils.get_route_path`).
pub fn route_path<'a>(path: &'a str, root_path: &str) -> &'a str {
    if root_path.is_empty() || !path.starts_with(root_path) {
        return path;
    }
    if path.len() == root_path.len() {
        return "";
    }
    match path.get(root_path.len()..) {
        Some(rest) if rest.starts_with('/') => rest,
        _ => path,
    }
}

/// Routes (template, method, kind) in order, then at most one mount, as Starlette's `Router`
/// tries them.
#[derive(Clone, Debug)]
pub struct Router {
    routes: Vec<(Template, &'static str, Kind)>,
    mount: Option<(Template, Box<Router>)>,
}

impl Router {
    fn new(routes: Vec<(String, &'static str, Kind)>, mount: Option<(&str, Router)>) -> Self {
        Self {
            routes: routes
                .into_iter()
                .map(|(path, method, kind)| (Template::compile(&path), method, kind))
                .collect(),
            mount: mount.map(|(path, inner)| (Template::compile(path), Box::new(inner))),
        }
    }

    /// What the endpoint this router reaches for `method path` does ([`Kind::Pass`] when it
    /// reaches none).
    pub fn kind(&self, method: &str, path: &str, root_path: &str) -> Kind {
        self.route(method, path, root_path).kind
    }

    /// The endpoint this router reaches for `method path`, with the tenant its mount took
    /// from the path ([`Reached::PASS`] when it reaches none).
    pub fn route(&self, method: &str, path: &str, root_path: &str) -> Reached {
        let rpath = route_path(path, root_path);
        // The first route whose path matches and whose methods include the request's wins
        // (a GET route answers HEAD too); a path match with another method is a 405.
        for (template, route_method, kind) in &self.routes {
            let accepts = *route_method == method || (method == "HEAD" && *route_method == "GET");
            if accepts && template.full_match(rpath) {
                // No route of the SDK's tables binds a tenant: only its mount does.
                return Reached {
                    kind: *kind,
                    tenant: None,
                };
            }
        }
        if let Some((template, inner)) = &self.mount {
            // `^mount/(.*)$`: `.*` stops at a newline, `$` may stand before a final one.
            let mut group_start = None;
            let mut tenant = None;
            let matched = Template::match_at(&template.pieces, rpath, 0, &|end| {
                let Some(after) = rpath.get(end..) else {
                    return false;
                };
                if !after.starts_with('/') {
                    return false;
                }
                let start = end.saturating_add(1);
                let rest = rpath.get(start..).unwrap_or("");
                let line = rest.find('\n').unwrap_or(rest.len());
                at_dollar(rpath, start.saturating_add(line))
            });
            if matched {
                // Recover the group: the parameter run is maximal (a "/" follows it).
                if let Some((end, bound)) = mount_end(&template.pieces, rpath) {
                    group_start = Some(end.saturating_add(1));
                    tenant = bound;
                }
            }
            if let Some(start) = group_start {
                let rest = rpath.get(start..).unwrap_or("");
                let group = rest.split('\n').next().unwrap_or("");
                // As Mount.matches: matched_path = route_path[: -len(remaining)], with
                // remaining = "/" + group, counted in characters.
                let remaining = group.chars().count().saturating_add(1);
                let total = rpath.chars().count();
                let keep = total.saturating_sub(remaining);
                let cut = rpath
                    .char_indices()
                    .nth(keep)
                    .map_or(rpath.len(), |(i, _)| i);
                let mut below = String::with_capacity(root_path.len().saturating_add(cut));
                below.push_str(root_path);
                below.push_str(rpath.get(..cut).unwrap_or(""));
                let reached = inner.route(method, path, &below);
                if reached.kind == Kind::Pass {
                    return Reached::PASS; // a 404 below the mount has no tenant
                }
                // A tenant bound further in (none in the SDK's layouts) is the nearer one.
                let tenant = reached.tenant.or_else(|| tenant.map(str::to_owned));
                return Reached {
                    kind: reached.kind,
                    tenant,
                };
            }
        }
        Reached::PASS
    }
}

/// Where the mount template's match ends in `text` (its parameters take maximal runs), and
/// the value its `{tenant}` parameter binds, if it has one.
fn mount_end<'t>(pieces: &[Piece], text: &'t str) -> Option<(usize, Option<&'t str>)> {
    let mut pos = 0usize;
    let mut tenant = None;
    for piece in pieces {
        let here = text.get(pos..)?;
        match piece {
            Piece::Literal(literal) => {
                if !here.starts_with(literal.as_str()) {
                    return None;
                }
                pos = pos.saturating_add(literal.len());
            }
            Piece::Param { tenant: binds } => {
                let run = here.find('/').unwrap_or(here.len());
                if run == 0 {
                    return None;
                }
                if *binds {
                    tenant = here.get(..run);
                }
                pos = pos.saturating_add(run);
            }
        }
    }
    Some((pos, tenant))
}

/// What `method path` reaches in the strongest of `routers` (the layouts of
/// [`sdk_routers`]), with the tenant of the first layout that gives that kind.
pub fn strongest(routers: &[Router], method: &str, path: &str, root_path: &str) -> Reached {
    let mut best = Reached::PASS;
    for router in routers {
        let reached = router.route(method, path, root_path);
        if reached.kind > best.kind {
            best = reached;
        }
    }
    best
}

fn at(prefix: &str, routes: &[Route]) -> Vec<(String, &'static str, Kind)> {
    routes
        .iter()
        .map(|(path, method, kind)| (format!("{prefix}{path}"), *method, *kind))
        .collect()
}

fn jsonrpc(path: &str) -> Vec<(String, &'static str, Kind)> {
    // The endpoint and its trailing-slash twin (Starlette redirects one to the other).
    let rpc = path.trim_end_matches('/');
    let first = if rpc.is_empty() {
        "/".to_owned()
    } else {
        rpc.to_owned()
    };
    let second = format!("{rpc}/");
    let mut routes = vec![(first.clone(), "POST", Kind::JsonRpc)];
    if second != first {
        routes.push((second, "POST", Kind::JsonRpc));
    }
    routes
}

/// The layouts of the SDK's routes for `path_prefix = prefix` (no trailing `/`), with
/// JSON-RPC at `prefix + jsonrpc_path` (`None`: none), as `admitgate._a2a_routes.sdk_routers`.
pub fn sdk_routers(prefix: &str, jsonrpc_path: Option<&str>) -> Vec<Router> {
    let mut routes = jsonrpc_path.map_or_else(Vec::new, |p| jsonrpc(&format!("{prefix}{p}")));
    routes.extend(at(prefix, &V03));
    routes.extend(at(prefix, &V10));
    let root = Router::new(
        routes,
        Some(("/{tenant}", Router::new(at(prefix, &V10), None))),
    );
    if prefix.is_empty() {
        return vec![root];
    }
    let inner = sdk_routers("", jsonrpc_path).into_iter().next();
    let mut all = vec![root];
    if let Some(inner) = inner {
        all.push(Router::new(Vec::new(), Some((prefix, inner))));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(method: &str, path: &str) -> Kind {
        sdk_routers("", Some("/"))
            .iter()
            .map(|r| r.kind(method, path, ""))
            .max()
            .unwrap_or(Kind::Pass)
    }

    #[test]
    fn sdk_layout() {
        assert_eq!(kind("POST", "/"), Kind::JsonRpc);
        assert_eq!(kind("POST", "/message:send"), Kind::Work);
        assert_eq!(kind("POST", "/message:send\n"), Kind::Work);
        assert_eq!(kind("POST", "/message:send\n\n"), Kind::Pass);
        assert_eq!(kind("GET", "/message:send"), Kind::Pass);
        assert_eq!(kind("POST", "/v1/message:stream"), Kind::Work);
        assert_eq!(kind("POST", "/acme/message:send"), Kind::Work);
        assert_eq!(kind("POST", "/tasks/message:send"), Kind::Work);
        assert_eq!(kind("GET", "/tasks/abc"), Kind::Read);
        assert_eq!(kind("HEAD", "/tasks/abc:subscribe"), Kind::Work);
        assert_eq!(kind("GET", "/tasks/a:b:subscribe"), Kind::Work);
        assert_eq!(kind("POST", "/tasks/abc:cancel"), Kind::Read);
        assert_eq!(kind("GET", "/.well-known/agent-card.json"), Kind::Pass);
        assert_eq!(kind("GET", "/v1/card"), Kind::Read);
        assert_eq!(kind("GET", "/acme/v1/card"), Kind::Pass);
        assert_eq!(kind("GET", "/healthz"), Kind::Pass);
    }

    #[test]
    fn prefixed_layouts() {
        let routers = sdk_routers("/a2a", Some("/"));
        let kind = |m: &str, p: &str| routers.iter().map(|r| r.kind(m, p, "")).max();
        assert_eq!(kind("POST", "/a2a/message:send"), Some(Kind::Work));
        assert_eq!(kind("POST", "/t/a2a/message:send"), Some(Kind::Work));
        assert_eq!(kind("POST", "/a2a/t/message:send"), Some(Kind::Work));
        assert_eq!(kind("POST", "/a2a"), Some(Kind::JsonRpc));
        assert_eq!(kind("POST", "/message:send"), Some(Kind::Pass));
    }

    fn tenant(prefix: &str, method: &str, path: &str) -> (Kind, Option<String>) {
        let reached = strongest(&sdk_routers(prefix, Some("/")), method, path, "");
        (reached.kind, reached.tenant)
    }

    #[test]
    fn the_tenant_is_the_one_the_sdks_mount_binds() {
        let t = |s: &str| Some(s.to_owned());
        assert_eq!(
            tenant("", "POST", "/acme/message:send"),
            (Kind::Work, t("acme"))
        );
        assert_eq!(tenant("", "POST", "/message:send"), (Kind::Work, None));
        // Segments that are route words elsewhere are tenants here, as Starlette routes them.
        assert_eq!(
            tenant("", "POST", "/tasks/message:send"),
            (Kind::Work, t("tasks"))
        );
        assert_eq!(tenant("", "POST", "/v1/message:send"), (Kind::Work, None));
        assert_eq!(
            tenant("", "POST", "/v1/message:stream/x"),
            (Kind::Pass, None)
        );
        assert_eq!(
            tenant("", "POST", "/message:send/message:send"),
            (Kind::Work, t("message:send"))
        );
        assert_eq!(
            tenant("", "GET", "/acme/tasks/abc:subscribe"),
            (Kind::Work, t("acme"))
        );
        assert_eq!(
            tenant("", "GET", "/acme/tasks/abc"),
            (Kind::Read, t("acme"))
        );
        assert_eq!(
            tenant("", "POST", "/ac\nme/message:send"),
            (Kind::Work, t("ac\nme"))
        );
        // Below a mount, Starlette's `$` before a final newline leaves the child a path it
        // cannot route (see `Router::route`): a 404.
        assert_eq!(
            tenant("", "POST", "/acme/message:send\n"),
            (Kind::Pass, None)
        );
        // A tenant mount reaching no route is a 404: no tenant.
        assert_eq!(
            tenant("", "POST", "/acme/v1/message:send"),
            (Kind::Pass, None)
        );
        assert_eq!(
            tenant("", "GET", "/acme/.well-known/agent-card.json"),
            (Kind::Pass, None)
        );
        // The JSON-RPC endpoint has no tenant segment.
        assert_eq!(tenant("", "POST", "/"), (Kind::JsonRpc, None));
        // Both prefixed layouts: /{tenant}/a2a/... and /a2a/{tenant}/...
        assert_eq!(
            tenant("/a2a", "POST", "/t/a2a/message:send"),
            (Kind::Work, t("t"))
        );
        assert_eq!(
            tenant("/a2a", "POST", "/a2a/t/message:send"),
            (Kind::Work, t("t"))
        );
        assert_eq!(
            tenant("/a2a", "POST", "/a2a/message:send"),
            (Kind::Work, None)
        );
        assert_eq!(
            tenant("/a2a", "POST", "/t/message:send"),
            (Kind::Pass, None)
        );
    }

    #[test]
    fn adversarial_paths_are_linear() {
        let started = std::time::Instant::now();
        for shape in [
            ":".repeat(200_000),
            "a".repeat(200_000),
            "/t".repeat(100_000),
        ] {
            let path = format!("/tasks/{shape}");
            let _ = kind("GET", &path);
            let _ = kind("POST", &format!("/{shape}/message:send"));
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }
}
