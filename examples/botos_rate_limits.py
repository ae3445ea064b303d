"""BotOS's rate limiters decided by admitgate: praisonaiagents' RateLimitPolicyProtocol as a
drop-in, locally and across a fleet, and praisonai-bot's gateway limiters after install().

The fleet part needs a redis-server: $ADMITGATE_REDIS_URL, default redis://127.0.0.1:6379/0."""

import os
import time

import admitgate
import admitgate.praisonai
from admitgate.praisonai import rate_limit_policy

REDIS_URL = os.environ.get("ADMITGATE_REDIS_URL", "redis://127.0.0.1:6379/0")

# The drop-in for SlidingWindowRateLimitPolicy: 3 requests a minute, then 5 minutes locked out.
policy = rate_limit_policy(3, window_seconds=60, lockout_seconds=300)
for now in (0.0, 1.0, 2.0, 3.0, 200.0, 303.0):
    d = policy.check(identity="203.0.113.7", scope="login", now=now)
    print(f"t={now:g}: allowed={d.allowed} retry_after_seconds={d.retry_after_seconds}")

# As in the reference, a window starts at a key's first request: 2 × 3 pass within 61 s.
edge = rate_limit_policy(3, window_seconds=60)
times = [0.0, 59.0, 59.5, 60.0, 60.5, 61.0]
passed = sum(edge.check(identity="x", scope="api", now=t).allowed for t in times)
print(f"{passed} of {len(times)} passed within 61 s (3 per 60 s windows)")

# Fleet-wide: two replicas (two connections) share one count, by Redis' clock.
name = f"example-{os.getpid()}-{time.time_ns()}"  # a fresh namespace for this run
replicas = [
    rate_limit_policy(
        3, 60, 300, redis_url=admitgate.FleetLimit(REDIS_URL, f"{name}-{i}", 1), name=name
    )
    for i in range(2)
]
attempts = [replicas[i % 2].check(identity="203.0.113.7", scope="login", now=0.0) for i in range(6)]
print("6 attempts over 2 replicas:", [d.allowed for d in attempts])

# install() also hands praisonai-bot's gateway (approval, WebSocket-upgrade, pairing and
# magic-link endpoints) admitgate's limiter; with gateway push.redis set, it is fleet-wide.
admitgate.praisonai.install()
from praisonai_bot.gateway import rate_limiter  # noqa: E402

limiter = rate_limiter.build_auth_rate_limiter(None, max_attempts=5, window_seconds=60)
allowed = [limiter.allow("magic_link", "198.51.100.4") for _ in range(6)]
wait = limiter.time_until_allowed("magic_link", "198.51.100.4")
print(type(limiter).__name__, allowed, f"retry in {wait:.0f} s")
