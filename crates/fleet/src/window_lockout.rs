//! The BotOS drop-ins' rule across the fleet: a window anchored at a key's first request, then
//! a lockout (the rule is `admitgate_budget::window_lockout`'s), one Lua call per decision
//! (`lua/window_lockout.lua`) by the server's clock.
//!
//! Every replica reads and writes one Redis hash per key, atomically, so the fleet decides as
//! one reference limiter would, fed with the server's `TIME` (seconds as a double) as its
//! `now`: a caller's clock is never read. Each reply carries that time, so a decision can be
//! checked against the reference fed with the same clock.
//!
//! The key is `{<name>:<hash>}`: its own hash tag (one cluster slot), where the hash is 128 bits
//! of SHA-1 over the scope and the identity, length-prefixed so that no two pairs share a key.
//! The raw identity (a client address, an account name) never leaves the process; note that a
//! hash of a guessable identity can be guessed by whoever reads Redis. The key expires a second
//! after its window ends or its lockout passes.
//!
//! Outages are the caller's to handle (`Err` from every call, after marking the backend down
//! as every fleet call does): the Python binding decides what a decision does then, and how
//! long a running event loop may wait for one.

use std::sync::Arc;

use admitgate_budget::{WindowLockoutRule, WindowVerdict};
use redis::Script;

use crate::config::{validate_name, ConfigError};
use crate::error::FleetError;
use crate::limit::FleetLimit;

/// A fleet decision and the server's time it was made at (seconds since the Unix epoch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FleetWindowVerdict {
    /// The decision.
    pub verdict: WindowVerdict,
    /// The server's `TIME` the decision used as its `now`.
    pub decided_at: f64,
}

/// The rule over a fleet's Redis (see the module docs).
#[derive(Clone)]
pub struct FleetWindowLockout {
    inner: Arc<Inner>,
}

struct Inner {
    fleet: FleetLimit,
    name: String,
    rule: WindowLockoutRule,
    script: Script,
}

impl std::fmt::Debug for FleetWindowLockout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetWindowLockout")
            .field("name", &self.inner.name)
            .field("rule", &self.inner.rule)
            .finish_non_exhaustive()
    }
}

/// 128 bits of SHA-1 over the scope and the identity, each length-prefixed, hex.
fn key_hash(scope: &str, identity: &str) -> String {
    let mut sha = sha1_smol::Sha1::new();
    for part in [scope, identity] {
        sha.update(&(part.len() as u64).to_le_bytes());
        sha.update(part.as_bytes());
    }
    sha.digest().to_string().chars().take(32).collect()
}

fn seconds(text: Option<&String>) -> Option<f64> {
    text?.parse::<f64>().ok().filter(|t| t.is_finite())
}

impl FleetWindowLockout {
    /// The rule on `fleet`'s connection, its keys named under `name` (so two services can share
    /// one Redis). `rule.max_requests()` must be > 0 (0 switches limiting off: nothing to ask).
    pub fn new(
        fleet: &FleetLimit,
        name: &str,
        rule: WindowLockoutRule,
    ) -> Result<Self, ConfigError> {
        validate_name(name)?;
        if rule.max_requests() == 0 {
            return Err(ConfigError::new(
                "max_requests",
                "0".to_owned(),
                "limiting is off: a fleet rule needs max_requests > 0",
            ));
        }
        Ok(FleetWindowLockout {
            inner: Arc::new(Inner {
                fleet: fleet.clone(),
                name: name.to_owned(),
                rule,
                script: Script::new(include_str!("lua/window_lockout.lua")),
            }),
        })
    }

    /// The rule with a connection of its own to `url`: a [`FleetLimit`] that holds only the
    /// connection and its outage probe.
    pub fn with_url(
        url: &str,
        name: &str,
        rule: WindowLockoutRule,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, ConfigError> {
        validate_name(name)?;
        let config =
            crate::config::FleetConfig::new(url, format!("admitgate:window-lockout:{name}"), 1);
        let fleet = FleetLimit::new(config, runtime)?;
        FleetWindowLockout::new(&fleet, name, rule)
    }

    /// The rule.
    pub fn rule(&self) -> &WindowLockoutRule {
        &self.inner.rule
    }

    /// The connection's limit (its backend state, its stats).
    pub fn fleet(&self) -> &FleetLimit {
        &self.inner.fleet
    }

    /// Whether the backend is believed up (a call made now would be tried).
    pub fn is_up(&self) -> bool {
        self.inner.fleet.inner.backend.is_up()
    }

    /// The Redis key of `identity` in `scope`.
    pub fn key(&self, scope: &str, identity: &str) -> String {
        format!("{{{}:{}}}", self.inner.name, key_hash(scope, identity))
    }

    async fn call(&self, key: &str, op: &str) -> Result<Vec<String>, FleetError> {
        let inner = &self.inner;
        let backend = &inner.fleet.inner.backend;
        if !backend.is_up() {
            return Err(FleetError::Unavailable);
        }
        inner.fleet.inner.ensure_started();
        let rule = inner.rule;
        let reply = backend
            .call(|mut con| {
                let mut call = inner.script.prepare_invoke();
                call.key(key)
                    .arg(op)
                    .arg(rule.max_requests())
                    .arg(format!("{:?}", rule.window_seconds()))
                    .arg(format!("{:?}", rule.lockout_seconds()));
                async move { call.invoke_async::<Vec<String>>(&mut con).await }
            })
            .await;
        reply.map_err(|failure| {
            inner.fleet.inner.backend_failed(failure);
            FleetError::Unavailable
        })
    }

    /// Decides one request of `key` (from [`key`](Self::key)) and counts it: one round trip.
    pub async fn check(&self, key: &str) -> Result<FleetWindowVerdict, FleetError> {
        let reply = self.call(key, "check").await?;
        let decided_at = seconds(reply.first()).ok_or(FleetError::Unavailable)?;
        let verdict = match reply.get(1).map(String::as_str) {
            Some("1") => WindowVerdict::Allowed,
            Some("0") => WindowVerdict::Limited {
                retry_after: seconds(reply.get(2)).ok_or(FleetError::Unavailable)?,
            },
            _ => return Err(FleetError::Unavailable),
        };
        Ok(FleetWindowVerdict {
            verdict,
            decided_at,
        })
    }

    /// Seconds until `key` is allowed again (0 if it is now), counting nothing; and the
    /// server's time.
    pub async fn wait(&self, key: &str) -> Result<(f64, f64), FleetError> {
        let reply = self.call(key, "wait").await?;
        match (seconds(reply.first()), seconds(reply.get(1))) {
            (Some(now), Some(wait)) => Ok((wait, now)),
            _ => Err(FleetError::Unavailable),
        }
    }

    /// Forgets `key` fleet-wide.
    pub async fn reset(&self, key: &str) -> Result<(), FleetError> {
        self.call(key, "reset").await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_hide_the_identity_and_never_collide_by_concatenation() {
        let a = key_hash("ab", "c");
        assert_eq!(a.len(), 32);
        assert_ne!(a, key_hash("a", "bc"));
        assert_eq!(a, key_hash("ab", "c"));
        assert!(!key_hash("login", "10.0.0.1").contains("10.0.0.1"));
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("auth").is_ok());
        for bad in ["", "a{b", "a b"] {
            assert_eq!(validate_name(bad).unwrap_err().field, "name");
        }
    }
}
