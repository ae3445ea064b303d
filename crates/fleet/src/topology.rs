//! What a fleet URL names: one server, a Sentinel-managed primary, or a Redis Cluster.
//!
//! - `redis://` / `rediss://`: one server (standalone, or a primary behind a stable address).
//! - `redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]` (and
//!   `rediss+sentinel://`): the sentinels to ask for the primary of `service_name`. The
//!   credentials and the db are the Redis nodes'; the sentinels are asked without them.
//! - `redis+cluster://[user:password@]host:port[,host:port...]` (and `rediss+cluster://`):
//!   seed nodes of a Redis Cluster (db 0 only, as Cluster has no others).
//!
//! Parsed textually into the pieces, and every address checked by the driver's own URL parser,
//! so a URL that is accepted here is read the same way when it is dialled.

use redis::{ConnectionAddr, IntoConnectionInfo};

/// Which kind of deployment a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Single,
    Sentinel,
    Cluster,
}

impl Kind {
    /// The name metrics and logs use.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Single => "single",
            Kind::Sentinel => "sentinel",
            Kind::Cluster => "cluster",
        }
    }
}

/// A parsed multi-node URL (Sentinel or Cluster).
#[derive(Clone)]
pub(crate) struct Nodes {
    pub(crate) kind: Kind,
    pub(crate) tls: bool,
    /// The sentinels' or seed nodes' addresses, in the order written.
    pub(crate) addrs: Vec<(String, u16)>,
    /// Sentinel only: the monitored primary's name.
    pub(crate) service: String,
    pub(crate) db: i64,
}

/// The URL's scheme: its kind and whether it speaks TLS; `None` for an unknown scheme.
pub(crate) fn scheme(url: &str) -> Option<(Kind, bool)> {
    let (scheme, _) = url.split_once("://")?;
    Some(match scheme {
        "redis" => (Kind::Single, false),
        "rediss" => (Kind::Single, true),
        "redis+sentinel" => (Kind::Sentinel, false),
        "rediss+sentinel" => (Kind::Sentinel, true),
        "redis+cluster" => (Kind::Cluster, false),
        "rediss+cluster" => (Kind::Cluster, true),
        _ => return None,
    })
}

/// Parses a Sentinel or Cluster URL; the error says what is wrong without quoting the URL.
pub(crate) fn parse_nodes(url: &str) -> Result<Nodes, &'static str> {
    let (kind, tls) = scheme(url).ok_or("has an unknown scheme")?;
    if kind == Kind::Single {
        return Err("names a single server");
    }
    let base = if tls { "rediss" } else { "redis" };
    let rest = url.split_once("://").map_or("", |(_, rest)| rest);
    // The user-info runs to the last `@` (as the redaction reads it); the host list and the
    // path follow it.
    let (userinfo, after) = match rest.rsplit_once('@') {
        Some((userinfo, after)) => (Some(userinfo), after),
        None => (None, rest),
    };
    let (hosts, path) = match after.split_once('/') {
        Some((hosts, path)) => (hosts, Some(path)),
        None => (after, None),
    };
    if after.contains(['?', '#']) {
        return Err("takes no query or fragment");
    }
    let mut addrs = Vec::new();
    for host in hosts.split(',') {
        if host.is_empty() {
            return Err("has an empty host in its host list");
        }
        let info = format!("{base}://{host}")
            .into_connection_info()
            .map_err(|_| "has a host that is not host:port")?;
        match info.addr() {
            ConnectionAddr::Tcp(h, port) | ConnectionAddr::TcpTls { host: h, port, .. }
                if !h.is_empty() =>
            {
                addrs.push((h.clone(), *port));
            }
            _ => return Err("has a host that is not host:port"),
        }
    }
    let mut segments = path.unwrap_or("").split('/').filter(|s| !s.is_empty());
    let (service, db) = match kind {
        Kind::Sentinel => {
            let service = segments
                .next()
                .ok_or("needs the monitored primary's name: .../service_name[/db]")?;
            (service.to_owned(), segments.next())
        }
        _ => (String::new(), segments.next()),
    };
    if segments.next().is_some() {
        return Err("has too many path segments");
    }
    let db = match db {
        None => 0,
        Some(db) => db
            .parse::<i64>()
            .map_err(|_| "has a db that is not a number")?,
    };
    if kind == Kind::Cluster && db != 0 {
        return Err("has a db other than 0 (Redis Cluster has only db 0)");
    }
    // The credentials must parse as the driver reads them (through a one-node URL), since
    // each node is dialled with them.
    if let Some(userinfo) = userinfo {
        let (first_host, _) = hosts.split_once(',').unwrap_or((hosts, ""));
        format!("{base}://{userinfo}@{first_host}")
            .into_connection_info()
            .map_err(|_| {
                "has user-info that does not parse (percent-encode any / ? # @ , or % in the \
                 password)"
            })?;
    }
    Ok(Nodes {
        kind,
        tls,
        addrs,
        service,
        db,
    })
}

impl Nodes {
    /// A one-node URL for `(host, port)` without credentials (a sentinel's).
    pub(crate) fn bare_url(&self, host: &str, port: u16) -> String {
        let base = if self.tls { "rediss" } else { "redis" };
        format!("{base}://{}:{port}", bracketed(host))
    }

    /// A one-node URL for `(host, port)` with the credentials, for the driver's `Client::open`.
    pub(crate) fn node_url(&self, host: &str, port: u16, url: &str) -> String {
        let base = if self.tls { "rediss" } else { "redis" };
        let rest = url.split_once("://").map_or("", |(_, rest)| rest);
        let userinfo = rest
            .rsplit_once('@')
            .map(|(userinfo, _)| format!("{userinfo}@"))
            .unwrap_or_default();
        format!("{base}://{userinfo}{}:{port}/{}", bracketed(host), self.db)
    }
}

/// An IPv6 address in brackets, as a URL writes it.
fn bracketed(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_parse() {
        let n = parse_nodes("redis+sentinel://u:p%2Cw@10.0.0.1:26379,h2:26380/mymaster/3").unwrap();
        assert_eq!(n.kind, Kind::Sentinel);
        assert!(!n.tls);
        assert_eq!(
            n.addrs,
            vec![("10.0.0.1".to_owned(), 26379), ("h2".to_owned(), 26380)]
        );
        assert_eq!(n.service, "mymaster");
        assert_eq!(n.db, 3);
        let url = "redis+sentinel://u:p%2Cw@10.0.0.1:26379,h2:26380/mymaster/3";
        assert_eq!(
            n.node_url("10.0.0.2", 6379, url),
            "redis://u:p%2Cw@10.0.0.2:6379/3"
        );
        assert_eq!(n.bare_url("h2", 26380), "redis://h2:26380");
        let n = parse_nodes("rediss+sentinel://h:1/svc").unwrap();
        assert!(n.tls);
        assert_eq!(n.db, 0);
        assert_eq!(
            n.node_url("h", 1, "rediss+sentinel://h:1/svc"),
            "rediss://h:1/0"
        );
    }

    #[test]
    fn cluster_urls_parse() {
        let n = parse_nodes("rediss+cluster://:pw@a:7000,b:7001,[::1]:7002").unwrap();
        assert_eq!(n.kind, Kind::Cluster);
        assert_eq!(n.addrs.len(), 3);
        assert_eq!(n.addrs[2].0, "::1");
        assert_eq!(
            n.node_url("::1", 7002, "rediss+cluster://:pw@a:7000"),
            "rediss://:pw@[::1]:7002/0"
        );
    }

    #[test]
    fn bad_multi_node_urls_are_refused() {
        for (url, why) in [
            ("redis+sentinel://h:1", "primary's name"),
            ("redis+sentinel://h:1,/svc", "empty host"),
            ("redis+sentinel://h:x/svc", "host:port"),
            ("redis+sentinel://h:1/svc/zero", "not a number"),
            ("redis+sentinel://h:1/svc/0/x", "too many"),
            ("redis+cluster://h:1/2", "only db 0"),
            ("redis+cluster://h:1?x=1", "query"),
            ("redis+cluster://", "empty host"),
        ] {
            let err = parse_nodes(url).err().unwrap();
            assert!(err.contains(why), "{url}: {err}");
        }
    }
}
