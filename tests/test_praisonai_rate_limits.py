"""BotOS's rate limiters on admitgate (``admitgate.praisonai.rate_limit_policy`` and the
``build_auth_rate_limiter`` install() wires), against the real reference classes:
praisonaiagents 1.7.17's ``SlidingWindowRateLimitPolicy`` and praisonai-bot 0.1.16's
``AuthRateLimiter``.

Parity: 10,000 generated ``(identity, scope, now)`` sequences each, every decision and retry
hint equal (``==`` on floats: the same float operations), locally; fleet-wide, every decision
equal to the reference fed with the Redis time the decision was made at. Then each documented
fix, shown against the reference; the fleet's keys, outages and the event loop's worst block,
with Redis frozen and with Redis slow (answering around the bound a loop waits for).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
import types
from typing import Any

import admitgate
import pytest
from admitgate.praisonai import build_auth_rate_limiter, rate_limit_policy
from praisonai_bot.gateway import rate_limiter as reference_module
from praisonaiagents.gateway.protocols import (
    RateLimitDecision,
    RateLimitPolicyProtocol,
    SlidingWindowRateLimitPolicy,
)

SEQUENCES = 10_000

IDENTITIES = ["10.0.0.1", "10.0.0.2", "alice", "bob@example.com", "", "ünï", "a" * 60]
SCOPES = ["approval_pending", "ws_upgrade", "magic_link", "tenant-7", ""]
WINDOWS = [0.05, 0.1, 0.3, 1.0, 2.5, 60.0]


def _rule(rng: random.Random, *, zero_max: bool = True, zero_lockout: bool = True) -> tuple:
    max_requests = rng.randint(0 if zero_max else 1, 5)
    window = rng.choice(WINDOWS) if rng.random() < 0.7 else round(rng.uniform(0.01, 5), 3)
    lockout = (
        0.0 if zero_lockout and rng.random() < 0.4 else rng.choice([0.07, 0.2, 1.0, 3.0, 300.0])
    )
    return max_requests, window, lockout


def _times(rng: random.Random, window: float, lockout: float, steps: int) -> list[float]:
    """Clock readings that land on and around the rule's edges: equal times, steps of exactly a
    window or a lockout (where float rounding decides), tiny and large steps, and (rarely) a
    clock that steps back."""
    now = rng.choice([0.0, 1000.125, 1.7e9 + rng.random(), rng.uniform(0, 1e6)])
    out = []
    for _ in range(steps):
        out.append(now)
        r = rng.random()
        if r < 0.15:
            step = 0.0
        elif r < 0.3:
            step = window
        elif r < 0.4:
            step = lockout
        elif r < 0.5:
            step = window * rng.choice([0.5, 0.999999, 1.000001, 2.0, 0.1])
        elif r < 0.55:
            step = -rng.uniform(0, window)
        else:
            step = rng.uniform(0, window * 0.6)
        now += step
    return out


def _sequence(rng: random.Random, window: float, lockout: float) -> list[tuple[str, str, float]]:
    steps = rng.randint(1, 30)
    identities = rng.sample(IDENTITIES, rng.randint(1, 3))
    scopes = rng.sample(SCOPES, rng.randint(1, 2))
    return [
        (rng.choice(identities), rng.choice(scopes), now)
        for now in _times(rng, window, lockout, steps)
    ]


# ------------------------------------------------------------------ the policy, locally


def test_the_policy_is_a_rate_limit_policy_protocol_with_the_references_attributes():
    policy = rate_limit_policy(5, window_seconds=60, lockout_seconds=300)
    reference = SlidingWindowRateLimitPolicy(5, 60, 300)
    assert isinstance(policy, RateLimitPolicyProtocol)
    for name in ("max_requests", "window_seconds", "lockout_seconds", "enabled"):
        assert getattr(policy, name) == getattr(reference, name), name
    assert rate_limit_policy(0).enabled is False
    decision = policy.check(identity="alice", scope="login", now=1.0)
    assert type(decision) is RateLimitDecision and decision == RateLimitDecision(allowed=True)


def test_policy_parity_on_generated_sequences():
    """10,000 sequences: every decision (allowed, retry_after_seconds) equal to the reference's."""
    decisions = refused = 0
    for seed in range(SEQUENCES):
        rng = random.Random(seed)
        max_requests, window, lockout = _rule(rng)
        ours = rate_limit_policy(max_requests, window, lockout)
        reference = SlidingWindowRateLimitPolicy(max_requests, window, lockout)
        for step, (identity, scope, now) in enumerate(_sequence(rng, window, lockout)):
            got = ours.check(identity=identity, scope=scope, now=now)
            want = reference.check(identity=identity, scope=scope, now=now)
            assert got == want, (
                f"seed {seed} step {step}: rule {(max_requests, window, lockout)} "
                f"{identity!r}/{scope!r} at {now!r}: {got} != {want}"
            )
            decisions += 1
            refused += not want.allowed
    # The generator reaches both answers often (a test that cannot fail proves nothing).
    assert decisions > 100_000 and refused > 20_000, (decisions, refused)


# ------------------------------------------------------------------ the auth limiter, locally


class _Clock:
    """Stands in for the ``time`` module inside praisonai-bot's rate_limiter module, so the
    reference reads the generated clock (it calls ``time.time()``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def reference_clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(reference_module, "time", types.SimpleNamespace(time=clock.time))
    return clock


def test_auth_limiter_parity_on_generated_sequences(reference_clock: _Clock):
    """10,000 sequences of allow / time_until_allowed / reset, with a lockout (the gateway's
    configuration) and fewer keys than max_keys: every answer equal to AuthRateLimiter's."""
    answers = refused = 0
    for seed in range(SEQUENCES):
        rng = random.Random(seed)
        max_attempts, window, lockout = _rule(rng, zero_max=False, zero_lockout=False)
        ours = build_auth_rate_limiter(
            max_attempts=max_attempts, window_seconds=window, lockout_seconds=lockout
        )
        reference = reference_module.AuthRateLimiter(max_attempts, window, lockout)
        for step, (identity, endpoint, now) in enumerate(_sequence(rng, window, lockout)):
            reference_clock.now = now
            r = rng.random()
            where = f"seed {seed} step {step}: {identity!r}/{endpoint!r} at {now!r}"
            if r < 0.03:
                ours.reset(endpoint, identity)
                reference.reset(endpoint, identity)
                continue
            got = ours.allow(endpoint, identity, now)
            want = reference.allow(endpoint, identity)
            assert got == want, where
            got_wait = ours.time_until_allowed(endpoint, identity, now)
            assert got_wait == reference.time_until_allowed(endpoint, identity), where
            answers += 1
            refused += not want
    assert answers > 100_000 and refused > 20_000, (answers, refused)


def test_install_puts_the_builder_in_the_gateways_place_and_uninstall_restores_it():
    import admitgate.praisonai as integration

    original = reference_module.build_auth_rate_limiter
    integration.install()
    try:
        assert reference_module.build_auth_rate_limiter is build_auth_rate_limiter
        limiter = reference_module.build_auth_rate_limiter(None, max_attempts=10, window_seconds=60)
        assert isinstance(limiter, admitgate._admitgate.WindowLockout)
        assert (limiter.max_requests, limiter.window_seconds, limiter.lockout_seconds) == (
            10,
            60.0,
            300.0,
        )
    finally:
        integration.uninstall()
    assert reference_module.build_auth_rate_limiter is original


# ------------------------------------------------------------------ documented fixes


def test_fix_the_auth_limiter_keeps_admitting_new_identities_past_max_keys(reference_clock):
    """The reference refuses every new identity for good once it has seen max_keys of them
    (it prunes only above max_keys, and refuses a new key at max_keys): admitgate reclaims
    idle keys, and refuses new ones only while max_keys keys are live."""
    reference = reference_module.AuthRateLimiter(5, 60.0, 300.0, max_keys=3)
    ours = build_auth_rate_limiter(
        max_attempts=5, window_seconds=60, lockout_seconds=300, max_keys=3
    )
    for i in range(3):
        reference_clock.now = float(i)
        assert reference.allow("magic_link", f"10.0.0.{i}")
        assert ours.allow("magic_link", f"10.0.0.{i}", float(i))
    # A day later every window has long ended.
    reference_clock.now = 86_400.0
    assert not reference.allow("magic_link", "10.0.0.99")
    assert ours.allow("magic_link", "10.0.0.99", 86_400.0)
    # While max_keys keys are live, a new one is refused (the reference's fail-closed intent),
    # with the time the first of them goes idle as its hint.
    for i in range(2):
        assert ours.allow("magic_link", f"10.1.0.{i}", 86_400.5)
    assert not ours.allow("magic_link", "10.2.0.0", 86_401.0)
    assert ours.time_until_allowed("magic_link", "10.2.0.0", 86_401.0) == 0.0
    assert ours.stats()["refused_at_capacity"] == 1


def test_fix_the_auth_limiter_without_a_lockout_refuses_until_the_window_ends(reference_clock):
    """With lockout_seconds=0 the reference starts a fresh window right after a refusal, so
    only every (N+1)-th request is refused at any rate; admitgate refuses until the window
    ends, as SlidingWindowRateLimitPolicy does."""
    reference = reference_module.AuthRateLimiter(2, 60.0, 0.0)
    ours = build_auth_rate_limiter(max_attempts=2, window_seconds=60, lockout_seconds=0)
    policy = SlidingWindowRateLimitPolicy(2, 60.0, 0.0)
    got, want, window_policy = [], [], []
    for i in range(30):
        reference_clock.now = 1.0 + i
        want.append(reference.allow("approval_resolve", "10.0.0.1"))
        got.append(ours.allow("approval_resolve", "10.0.0.1", 1.0 + i))
        window_policy.append(
            policy.check(identity="10.0.0.1", scope="approval_resolve", now=1.0 + i).allowed
        )
    assert sum(want) == 20  # 2 allowed, 1 refused, over and over
    assert sum(got) == 2 and got == window_policy


def test_fix_bad_arguments_fail_with_a_message_naming_them():
    for args, kwargs, words in [
        ((-1,), {}, "max_requests must be an integer >= 0, got -1"),
        ((2.5,), {}, "max_requests must be an integer >= 0, got 2.5"),
        ((True,), {}, "max_requests must be an integer >= 0, got True"),
        ((1, 0), {}, "window_seconds must be a finite number of seconds > 0, got 0"),
        ((1, float("nan")), {}, "window_seconds must be a finite number of seconds > 0, got nan"),
        ((1, 60, -1), {}, "lockout_seconds must be a finite number of seconds >= 0, got -1"),
        ((1, 60, "5"), {}, "lockout_seconds must be a number of seconds >= 0, got '5'"),
        (
            (1,),
            {"on_backend_error": "later"},
            "on_backend_error must be 'local', 'reject' or 'allow'",
        ),
    ]:
        with pytest.raises(ValueError) as raised:
            rate_limit_policy(*args, **kwargs)
        assert words in str(raised.value)
    with pytest.raises(ValueError, match="now must be a finite number of seconds, got nan"):
        rate_limit_policy(1).check(identity="a", scope="b", now=float("nan"))
    with pytest.raises(ValueError, match="max_attempts must be an integer >= 1, got 0"):
        build_auth_rate_limiter(max_attempts=0)
    with pytest.raises(ValueError, match="max_keys must be an integer >= 1, got 0"):
        rate_limit_policy(1, max_keys=0)
    with pytest.raises(ValueError, match="max_keys must be an integer >= 1, got '10'"):
        build_auth_rate_limiter(max_keys="10")
    with pytest.raises(ValueError, match="max_block_s must be a finite number of seconds >= 0"):
        rate_limit_policy(1, max_block_s=float("inf"))
    with pytest.raises(TypeError, match="unexpected keyword arguments: max_attempt"):
        build_auth_rate_limiter(max_attempt=3)
    with pytest.raises(ValueError, match="redis_url must be a Redis URL str"):
        rate_limit_policy(1, redis_url=6379)  # type: ignore[arg-type]


# ------------------------------------------------------------------ memory


def test_random_identities_hold_memory_bounded():
    # 2,000 new identities a second, 1 s windows: about 2,000 live; idle ones are reclaimed.
    policy = rate_limit_policy(3, window_seconds=1.0, max_keys=5000)
    for i in range(50_000):
        decision = policy.check(identity=f"10.{i}", scope="ws_upgrade", now=i / 2000)
        assert decision.allowed
    stats = policy.stats()
    assert stats["keys"] <= 4100 and stats["reclaimed"] >= 45_000, stats
    # A flood of fresh identities past max_keys live ones: memory stays at the cap, the new
    # keys are refused, and no existing key's state (a lockout) is pushed out.
    policy = rate_limit_policy(1, window_seconds=60.0, lockout_seconds=600.0, max_keys=1000)
    policy.check(identity="attacker", scope="login", now=0.0)
    assert not policy.check(identity="attacker", scope="login", now=0.1).allowed
    for i in range(20_000):
        policy.check(identity=f"flood-{i}", scope="login", now=1.0 + i / 1000)
    stats = policy.stats()
    assert stats["keys"] == 1000 and stats["refused_at_capacity"] == 20_000 - 999, stats
    assert not policy.check(identity="attacker", scope="login", now=21.0).allowed


# ------------------------------------------------------------------ fleet-wide, on a real Redis

# 2,000 in the suite (about 10 s); ADMITGATE_FLEET_PARITY_SEQUENCES=10000 for the full run.
FLEET_SEQUENCES = int(os.environ.get("ADMITGATE_FLEET_PARITY_SEQUENCES", "2000"))


def _fleet_rule(rng: random.Random) -> tuple:
    max_requests = rng.randint(1, 4)
    window = rng.choice([0.004, 0.01, 0.03, 0.06])
    lockout = 0.0 if rng.random() < 0.4 else rng.choice([0.003, 0.01, 0.04])
    return max_requests, window, lockout


def _run_sequences(count: int, worker: Any, threads: int = 4) -> list[Any]:
    """Runs ``worker(seed)`` for every seed on a few threads (the fleet waits release the GIL,
    so Redis round trips overlap); returns their results."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(start: int) -> None:
        try:
            for seed in range(start, count, threads):
                results[seed] = worker(seed)
        except BaseException as exc:  # reported below, with its seed in the message
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    return results


def _fleet_step(rng: random.Random) -> None:
    if rng.random() < 0.2:
        time.sleep(rng.choice([0.0005, 0.002, 0.005, 0.012]))


def test_fleet_policy_parity_at_the_servers_time(redis_server):
    """Fleet-wide, the decision's time is Redis TIME: every decision equals the reference's
    fed with that time (bit for bit when Redis decided; a refusal answered locally until its
    known retry time stands for a server time no earlier than the true one)."""
    fleet = admitgate.FleetLimit(redis_server.url, "parity-conn", 1)

    def sequence(seed: int) -> tuple[int, int, int]:
        rng = random.Random(seed)
        max_requests, window, lockout = _fleet_rule(rng)
        ours = rate_limit_policy(
            max_requests, window, lockout, redis_url=fleet, name=f"parity-{seed}"
        )
        reference = SlidingWindowRateLimitPolicy(max_requests, window, lockout)
        identities = rng.sample(IDENTITIES, rng.randint(1, 2))
        scopes = rng.sample(SCOPES, rng.randint(1, 2))
        counts = [0, 0, 0]
        for step in range(rng.randint(1, 12)):
            _fleet_step(rng)
            identity, scope = rng.choice(identities), rng.choice(scopes)
            allowed, retry, at, decider = ours.decide(scope, identity)
            want = reference.check(identity=identity, scope=scope, now=at)
            where = f"seed {seed} step {step} ({decider}, rule {(max_requests, window, lockout)})"
            assert decider in ("fleet", "known_refusal"), where
            assert allowed == want.allowed, where
            if decider == "fleet":
                assert retry == want.retry_after_seconds, where
                counts[0 if allowed else 1] += 1
            else:
                assert retry == pytest.approx(want.retry_after_seconds, abs=1e-6), where
                counts[2] += 1
        return tuple(counts)

    totals = [sum(c) for c in zip(*_run_sequences(FLEET_SEQUENCES, sequence), strict=True)]
    allowed, refused, known = totals
    assert allowed > 3000 and refused > 1000 and known > 500, totals


def test_fleet_auth_limiter_parity_at_the_servers_time(redis_server, reference_clock):
    """The gateway's limiter with ``push.redis`` set, against AuthRateLimiter (whose Redis
    variant states the same semantics) fed with the time Redis decided at."""

    def sequence(seed: int) -> int:
        rng = random.Random(seed)
        max_attempts, window, lockout = _fleet_rule(rng)
        lockout = lockout or 0.02
        config = types.SimpleNamespace(url=redis_server.url, prefix=f"authparity{seed}:")
        ours = build_auth_rate_limiter(
            config, max_attempts=max_attempts, window_seconds=window, lockout_seconds=lockout
        )
        reference = reference_module.AuthRateLimiter(max_attempts, window, lockout)
        endpoint, identity = rng.choice(SCOPES), rng.choice(IDENTITIES)
        decisions = 0
        for step in range(rng.randint(1, 12)):
            _fleet_step(rng)
            allowed, retry, at, decider = ours.decide(endpoint, identity)
            with reference_lock:
                reference_clock.now = at
                want = reference.allow(endpoint, identity)
                want_wait = reference.time_until_allowed(endpoint, identity)
            assert decider in ("fleet", "known_refusal") and allowed == want, (seed, step)
            if not allowed:
                assert retry == pytest.approx(want_wait, abs=1e-6), (seed, step)
            decisions += 1
        return decisions

    reference_lock = threading.Lock()
    assert sum(_run_sequences(FLEET_SEQUENCES // 2, sequence)) > 5000


def test_replicas_share_one_count_where_per_pod_limiters_multiply_it(redis_server):
    """Three replicas (three connections) bursting on one client address: the fleet admits
    max_attempts in the window, exactly; three reference AuthRateLimiters admit three times."""
    config = types.SimpleNamespace(url=redis_server.url, prefix="replicas:")
    limiters = [
        admitgate._admitgate.WindowLockout(
            5, 60.0, 300.0, max_keys=100, name="replicas-authrl",
            fleet=admitgate.FleetLimit(redis_server.url, f"replica-{i}", 1),
        )
        for i in range(3)
    ]  # fmt: skip
    per_pod = [reference_module.AuthRateLimiter(5, 60.0, 300.0) for _ in range(3)]
    assert config.prefix  # the gateway's key prefix would name the keys the same way
    allowed = [0, 0, 0]
    per_pod_allowed = [0, 0, 0]

    def burst(i: int) -> None:
        for _ in range(200):
            allowed[i] += limiters[i].allow("magic_link", "198.51.100.4")
            per_pod_allowed[i] += per_pod[i].allow("magic_link", "198.51.100.4")

    pool = [threading.Thread(target=burst, args=(i,)) for i in range(3)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    assert sum(allowed) == 5 and sum(per_pod_allowed) == 15
    stats = [limiter.stats() for limiter in limiters]
    # Almost all of the 600 were answered from the known lockout, without a round trip.
    assert sum(s["known_refusals"] for s in stats) >= 500, stats
    waits = [limiter.time_until_allowed("magic_link", "198.51.100.4") for limiter in limiters]
    assert all(299 < w <= 300 for w in waits), waits
    # A replica that never saw the key asks Redis (the "wait" op: nothing counted).
    fresh = admitgate._admitgate.WindowLockout(
        5, 60.0, 300.0, max_keys=100, name="replicas-authrl",
        fleet=admitgate.FleetLimit(redis_server.url, "replica-fresh", 1),
    )  # fmt: skip
    assert 299 < fresh.time_until_allowed("magic_link", "198.51.100.4") <= 300
    assert fresh.stats()["allowed"] + fresh.stats()["limited"] == 0
    # A reset anywhere clears the key fleet-wide; the replica that made it forgets its known
    # refusal at once (the others keep theirs until its time: early refusals, never over).
    fresh.reset("magic_link", "198.51.100.4")
    assert fresh.time_until_allowed("magic_link", "198.51.100.4") == 0.0
    assert fresh.allow("magic_link", "198.51.100.4")
    assert not limiters[0].allow("magic_link", "198.51.100.4")


def test_fleet_keys_are_hash_tagged_hashed_and_expire_with_their_window(redis_server):
    policy = rate_limit_policy(2, 0.5, 2.0, redis_url=redis_server.url, name="keys-test")
    policy.check(identity="203.0.113.9", scope="ws_upgrade", now=0.0)
    client = redis_server.client()
    keys = client.keys("{keys-test:*")
    assert len(keys) == 1
    (key,) = keys
    assert key.startswith("{keys-test:") and key.endswith("}") and "203.0.113" not in key
    assert 0 < client.pttl(key) <= 1500
    for _ in range(2):
        policy.check(identity="203.0.113.9", scope="ws_upgrade", now=0.0)
    assert 2000 < client.pttl(key) <= 3000  # locked out: expires with the lockout
    assert "203.0.113" not in repr(client.hgetall(key))


# ------------------------------------------------------------------ outages and the event loop


async def _worst_block(limiter: Any, decisions: int) -> tuple[float, list[float]]:
    """Decides on the running loop (as the gateway's handlers do); the longest a decision
    held the loop, and every duration."""
    durations = []
    for i in range(decisions):
        started = time.perf_counter()
        limiter.allow("ws_upgrade", f"192.0.2.{i % 40}")
        durations.append(time.perf_counter() - started)
        await asyncio.sleep(0.001)
    return max(durations), durations


async def _blocks(limiters: list[Any], decisions: int) -> list[list[float]]:
    """Each limiter decides in turn on the running loop, ``decisions`` times over 250 client
    addresses (a few requests each: no key is refused, so every decision asks Redis or its
    fallback): how long each decision held the loop, per limiter."""
    durations: list[list[float]] = [[] for _ in limiters]
    for i in range(decisions):
        for limiter, held in zip(limiters, durations, strict=True):
            started = time.perf_counter()
            limiter.allow("ws_upgrade", f"198.51.100.{i % 250}")
            held.append(time.perf_counter() - started)
        await asyncio.sleep(0.001)
    return durations


def _p99(durations: list[float]) -> float:
    return sorted(durations)[int(len(durations) * 0.99)]


def test_a_frozen_redis_never_blocks_the_event_loop_for_long():
    """Redis paused (SIGSTOP) mid-traffic. The first decision that finds it frozen waits
    max_block_s (3 ms) and the fallback answers; until that call answers or fails, no decision
    on that connection waits at all (Redis is suspect), and none does once the connection is
    marked down. The reference RedisAuthRateLimiter holds the loop for its 0.5 s socket
    timeout. After SIGCONT, decisions are the fleet's again.

    Three limiters on the frozen Redis: two of the gateway's on its one connection (default
    timeouts: the late call fails only 6 s after the freeze, past the 1 s frozen here), and one
    on a connection that gives up after 0.1 + 0.1 s, so that outage is marked down inside the
    freeze."""
    from fleet_support import RedisServer, redis_server_binary

    server = RedisServer(redis_server_binary(), name="frozen")
    server.start()
    try:
        assert server.process is not None
        config = types.SimpleNamespace(url=server.url, prefix="frozen:")
        # As the gateway builds its approval and magic-link limiters: one connection.
        ours = build_auth_rate_limiter(config, max_attempts=10, window_seconds=60)
        magic = build_auth_rate_limiter(config, max_attempts=8, window_seconds=60)
        short_fleet = admitgate.FleetLimit(
            server.url, "frozen-short", 1, connect_timeout_s=0.1, command_timeout_s=0.1
        )
        short = rate_limit_policy(10, 60, redis_url=short_fleet, name="frozen-short")
        limiters = [ours, magic, short]
        reference = reference_module.build_auth_rate_limiter(
            config, max_attempts=10, window_seconds=60
        )
        assert type(reference).__name__ == "RedisAuthRateLimiter"
        healthy_durations = asyncio.run(_blocks(limiters, 200))
        healthy = max(max(d) for d in healthy_durations)
        # Which decision it was (the first connects to Redis and starts admitgate's runtime).
        healthy_at = max(d.index(max(d)) for d in healthy_durations if max(d) == healthy)
        before = [limiter.stats() for limiter in limiters]
        assert all(s["fleet_decisions"] >= 100 for s in before), before
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            durations = asyncio.run(_blocks(limiters, 900))
            reference_worst, _ = asyncio.run(_worst_block(reference, 3))
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        after = [limiter.stats() for limiter in limiters]
        # Decisions that waited for the frozen Redis (and were late): load-independent.
        late, suspect, offline = (
            [a[name] - b[name] for a, b in zip(after, before, strict=True)]
            for name in ("late_decisions", "suspect_decisions", "offline_decisions")
        )
        every = [d for held in durations for d in held]
        frozen = max(every)
        print(
            f"loop block: healthy max {healthy * 1e3:.2f} ms (decision {healthy_at}); Redis "
            f"frozen max {frozen * 1e3:.2f} ms, p99 {_p99(every) * 1e3:.2f} ms; decisions that "
            f"waited (late) during the freeze: {late[0] + late[1]} of 1800 on the gateway's "
            f"connection, {late[2]} of 900 on the short one; suspect {suspect}; reference "
            f"{reference_worst * 1e3:.0f} ms; {after}"
        )
        assert reference_worst >= 0.4
        # One decision per outage and connection waits (and is late); the rest answer at
        # once. Without the suspect state every decision until the connection was marked down
        # waited its 3 ms (about 1,300 of 1,800 on the gateway's connection, marked down 6 s in;
        # 28 of 900 on the short one),
        # and hundreds of 3 ms timer waits on a VM exceed 5 ms now and then. 0 is possible: a
        # healthy decision made just before the freeze may be the late one.
        assert late[0] + late[1] <= 2 and late[2] <= 2, late
        # Every frozen decision was the fallback's: the late one, then those that suspected
        # Redis (a call still unanswered) or knew it down. The gateway's limiters suspected it
        # for as long as the call waited (6 s: all the freeze, unless a loaded host made the
        # freeze longer); the short one until its call failed, then it knew Redis was down.
        assert all(n >= 900 for n in offline) and all(n > 0 for n in suspect), (offline, suspect)
        assert short_fleet.stats()["fleet_outages"] >= 1, short_fleet.stats()
        assert after[2]["late_outstanding"] == 0, after[2]
        # The target is 5 ms (max_block_s is 3 ms, plus waking the thread), met on a quiet
        # host. The bounds leave room for a loaded machine: at a load average of 11 on 2 cores
        # the code before the suspect state measured p99 7-8 ms, max 8-46 ms (a thread waits
        # for a CPU after its timeout), against the reference's 500 ms on every outage.
        assert _p99(every) < 0.02 and frozen < 0.1, (_p99(every), frozen)
        # Recovered: the late call answers (or the probe sees Redis again), and decisions on
        # the loop are the fleet's. (A new client each try: one the fallback locked out
        # meanwhile stays refused here until its local lockout ends, as documented.)
        for limiter in limiters:
            deadline = time.monotonic() + 15
            tries = iter(range(1 << 20))
            while _decide_on_a_loop(limiter, f"recovering-{next(tries)}") != "fleet":
                assert time.monotonic() < deadline, f"never back on the fleet: {limiter.stats()}"
                time.sleep(0.05)
    finally:
        server.close()


def _decide_on_a_loop(limiter: Any, identity: str) -> str:
    """Who decided one request made on a running event loop (where waits are bounded)."""

    async def decide() -> str:
        return str(limiter.decide("ws_upgrade", identity)[3])

    return asyncio.run(decide())


# A Lua script that keeps Redis busy for ARGV[1] microseconds (Redis runs one script at a
# time: every other client's call waits behind it, as behind a slow command).
_SPIN = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat
  t = redis.call('TIME')
until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1])
return 1
"""


def _unlimited(redis_url: str) -> Any:
    """A fleet policy on a connection of its own that refuses nothing (every decision asks
    Redis, none is a known refusal)."""
    name = f"slow-{random.randrange(1 << 30)}"
    return rate_limit_policy(
        1_000_000, 60, redis_url=admitgate.FleetLimit(redis_url, name, 1), name=name
    )


def _settled(limiter: Any) -> dict[str, Any]:
    """The limiter's stats once no late call is outstanding (each answers within
    milliseconds of Redis going idle); fails if one stays outstanding."""
    deadline = time.monotonic() + 10
    while (stats := limiter.stats())["late_outstanding"] != 0:
        assert time.monotonic() < deadline, f"a late call never settled: {stats}"
        time.sleep(0.01)
    return stats


def test_a_slow_redis_is_waited_for_again_as_soon_as_it_answers(redis_server):
    """Redis alive but busy for 50 ms (a spinning script from another connection), five
    times: the decision that finds it busy waits max_block_s and is late; the next ones answer
    from the fallback at once (the limiter suspects Redis); once the late call has answered,
    decisions wait for Redis again and are the fleet's."""
    limiter = _unlimited(redis_server.url)
    spin = redis_server.client().register_script(_SPIN)
    spin(args=[0])  # loaded: the busy rounds below run it by its SHA

    async def busy_round(r: int) -> tuple[list[str], list[str]]:
        spinning = asyncio.create_task(asyncio.to_thread(spin, args=[50_000]))
        await asyncio.sleep(0.005)  # the script has started
        during = []
        while not spinning.done():
            during.append(limiter.decide("ws_upgrade", f"busy-{r}")[3])
            await asyncio.sleep(0.001)
        after = []
        for _ in range(20):
            after.append(limiter.decide("ws_upgrade", f"busy-{r}")[3])
            await asyncio.sleep(0.002)
        return during, after

    for r in range(5):
        before = _settled(limiter)
        during, after = asyncio.run(busy_round(r))
        stats = _settled(limiter)
        late = stats["late_decisions"] - before["late_decisions"]
        suspect = stats["suspect_decisions"] - before["suspect_decisions"]
        print(
            f"busy round {r}: {late} late, {suspect} suspect; of {len(during)} decisions "
            f"during, {during.count('fallback')} the fallback's; of {len(after)} after, "
            f"{after.count('fleet')} the fleet's"
        )
        # One decision waited for the busy Redis (two if a call sent just before the script
        # answered late, settling before the script ended; three on a very loaded host);
        # the rest did not wait. Before the suspect state, every one of them waited 3 ms.
        assert 1 <= late <= 3 and suspect >= 1, (r, late, suspect, during)
        # (The first decisions after the script may still find the late call unsettled.)
        assert (during + after).count("fallback") == late + suspect, (r, during, after)
        # Waiting again: decisions are the fleet's (a loaded host can make one late).
        assert after.count("fleet") >= 10, (r, after)


def test_calls_answering_around_the_bound_never_leave_the_limiter_suspecting_redis(
    redis_server,
):
    """Redis busy with spins of 0.5 to 6 ms, back to back from another connection, so that
    replies come before, at and after the 3 ms bound, while three event loops (threads) decide
    on one limiter. A call that answers just as its waiter gives up must be settled exactly
    once: a count of late calls left above 0 would turn the limiter local for good, silently.
    Afterwards no late call is outstanding and decisions on a loop are the fleet's."""
    limiter = _unlimited(redis_server.url)
    stop = threading.Event()

    def spinner() -> None:
        rng = random.Random(7)
        spin = redis_server.client().register_script(_SPIN)
        while not stop.is_set():
            spin(args=[rng.randint(500, 6000)])
            if rng.random() < 0.3:
                time.sleep(rng.uniform(0, 0.003))

    def decider(i: int) -> None:
        async def run() -> None:
            rng = random.Random(i)
            deadline = time.monotonic() + 3
            n = 0
            while time.monotonic() < deadline:
                limiter.decide("ws_upgrade", f"edge-{i}-{n % 64}")
                n += 1
                await asyncio.sleep(rng.choice([0, 0.0005, 0.001, 0.002]))

        asyncio.run(run())

    spinning = threading.Thread(target=spinner)
    spinning.start()
    try:
        pool = [threading.Thread(target=decider, args=(i,)) for i in range(3)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=60)
    finally:
        stop.set()
        spinning.join(timeout=30)
    stats = _settled(limiter)
    print(f"around the bound: {stats}")
    # Both sides of the bound were reached, and the suspect state in between.
    assert stats["fleet_decisions"] >= 20 and stats["late_decisions"] >= 20, stats
    assert stats["suspect_decisions"] >= 20, stats
    deciders = [_decide_on_a_loop(limiter, "edge-after") for _ in range(20)]
    assert deciders.count("fleet") >= 10, deciders


def test_while_redis_is_suspect_a_wait_is_not_asked_and_a_reset_is_sent_unwaited(redis_server):
    """time_until_allowed and reset share the decisions' suspect state (one connection, one
    Redis). On a loop, while a late call is outstanding: time_until_allowed answers from what
    this replica knows, without sending a call; reset is sent but not waited for, and reaches
    Redis once the busy script ends (a replica that never saw the key then finds it free)."""
    name = f"suspect-calls-{random.randrange(1 << 30)}"

    def replica(i: int) -> Any:
        fleet = admitgate.FleetLimit(redis_server.url, f"{name}-{i}", 1)
        return rate_limit_policy(1, 60, 300, redis_url=fleet, name=name)

    locker, suspecting, fresh = replica(0), replica(1), replica(2)
    for _ in range(2):
        locker.decide("magic_link", "198.51.100.7")  # from a thread: always the fleet's
    assert 299 < fresh.time_until_allowed("magic_link", "198.51.100.7") <= 300
    spin = redis_server.client().register_script(_SPIN)
    spin(args=[0])

    async def while_busy() -> tuple[dict[str, Any], float, dict[str, Any], dict[str, Any]]:
        spinning = asyncio.create_task(asyncio.to_thread(spin, args=[300_000]))
        # Decisions are the fleet's until the script runs; the first after that is late.
        tries = 0
        while suspecting.decide("magic_link", f"someone-else-{tries}")[3] != "fallback":
            assert not spinning.done(), "no decision went late while the script ran"
            tries += 1
            await asyncio.sleep(0.001)
        late = suspecting.stats()
        wait = suspecting.time_until_allowed("magic_link", "198.51.100.7")
        asked = suspecting.stats()
        suspecting.reset("magic_link", "198.51.100.7")
        reset = suspecting.stats()
        assert not spinning.done(), "the script ended before the calls were made"
        await spinning
        return late, wait, asked, reset

    late, wait, asked, reset = asyncio.run(while_busy())
    assert late["late_decisions"] == 1 and late["late_outstanding"] == 1, late
    # Not asked: nothing more outstanding, and the answer is this replica's own (it knows
    # nothing of the key); Redis would have said ~300 s.
    assert wait == 0.0 and asked["late_outstanding"] == 1, asked
    # Sent and not waited for: a second call outstanding, answered after the script.
    assert reset["late_outstanding"] == 2, reset
    assert _settled(suspecting)["late_outstanding"] == 0
    assert fresh.time_until_allowed("magic_link", "198.51.100.7") == 0.0


# ------------------------------------------------------------------ the real gateway


def test_the_real_gateway_rate_limits_through_admitgate_fleet_wide(
    redis_server, tmp_path, monkeypatch
):
    """praisonai-bot's WebSocketGateway, with install() and ``push.redis`` set, on two ports
    (two replicas) sharing one Redis: the magic-link endpoint (5 attempts a minute, then a
    300 s lockout) and the approval endpoint (10) refuse fleet-wide with the retry hint, and
    Redis holds admitgate's hashed keys, never the client address."""
    import admitgate.praisonai as integration
    import httpx
    from fleet_support import free_port
    from praisonai_bot.gateway.server import WebSocketGateway
    from praisonaiagents.gateway.config import GatewayConfig, PushConfig, RedisConfig

    # A loaded test machine can answer later than the 3 ms a decision may hold the loop, and a
    # late decision is the fallback's (documented, and measured by the frozen-Redis test):
    # here every decision is the fleet's, so the counts are exact.
    monkeypatch.setattr("admitgate._botos_rate_limits.DEFAULT_MAX_BLOCK_S", 1.0)
    integration.install()
    prefix = f"gw{random.randrange(1 << 30)}:"

    def gateway() -> tuple[Any, int]:
        port = free_port()
        # The config's host and port are the ones served (the constructor's are not).
        config = GatewayConfig(
            host="127.0.0.1",
            port=port,
            push=PushConfig(redis=RedisConfig(url=redis_server.url, prefix=prefix)),
        )
        return WebSocketGateway(host="127.0.0.1", port=port, config=config), port

    async def scenario() -> tuple[list[int], list[int], Any, list[int]]:
        (a, port_a), (b, port_b) = gateway(), gateway()
        servers = []
        async with httpx.AsyncClient(timeout=10) as client:
            # The gateway takes a PID lock in ~/.praisonai, one per HOME: a HOME each.
            for gw, port, home in ((a, port_a, "a"), (b, port_b, "b")):
                (tmp_path / home).mkdir()
                monkeypatch.setenv("HOME", str(tmp_path / home))
                servers.append(asyncio.create_task(gw.start()))
                for _ in range(400):
                    if servers[-1].done():
                        servers[-1].result()  # raises why the gateway did not start
                    try:
                        await client.get(f"http://127.0.0.1:{port}/health")
                        break
                    except httpx.HTTPError:
                        await asyncio.sleep(0.025)
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                magic = [
                    (
                        await client.get(f"http://127.0.0.1:{port}/", params={"link": "x"})
                    ).status_code
                    for port in [port_a] * 4 + [port_b, port_a, port_b]
                ]
                refused = await client.get(f"http://127.0.0.1:{port_b}/", params={"link": "x"})
                approvals = [
                    (await client.get(f"http://127.0.0.1:{port}/api/approval/pending")).status_code
                    for port in [port_a, port_b] * 6
                ]
                return magic, approvals, refused.json(), []
        finally:
            for gw in (a, b):
                await gw.stop()
            await asyncio.wait_for(asyncio.gather(*servers, return_exceptions=True), 15)

    try:
        magic, approvals, body, _ = asyncio.run(scenario())
    finally:
        integration.uninstall()
    assert magic == [401] * 5 + [429, 429], magic
    assert body["retry_after_seconds"] == 300
    assert approvals.count(429) == 2 and approvals[:10].count(429) == 0, approvals
    keys = redis_server.client().keys(f"{{{prefix}authrl:*")
    assert keys and not any("127.0.0.1" in k for k in keys), keys


# ------------------------------------------------------------------ check-config


def _check_config(tmp_path, text: str, *flags: str) -> Any:
    import subprocess
    import sys

    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "admitgate", "check-config", str(path), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_config_reads_gateway_rate_limit_as_the_policy_takes_it(tmp_path):
    import json

    from admitgate.config import load

    text = "gateway:\n  max_concurrent_runs: 4\n  rate_limit:\n    max_requests: 5\n    lockout_seconds: 300\n"
    (tmp_path / "g.yaml").write_text(text)
    settings = load(str(tmp_path / "g.yaml"))
    assert settings.rate_limit is not None
    kwargs = settings.rate_limit.policy_kwargs()
    assert kwargs == {"max_requests": 5, "window_seconds": 60.0, "lockout_seconds": 300.0}
    # The block builds the drop-in and the reference alike, and they decide alike.
    ours, reference = rate_limit_policy(**kwargs), SlidingWindowRateLimitPolicy(**kwargs)
    for now in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 301.0, 306.0):
        assert ours.check(identity="i", scope="s", now=now) == reference.check(
            identity="i", scope="s", now=now
        )
    assert "rate-limit-not-read" in [w.code for w in settings.warnings]
    done = _check_config(tmp_path, text, "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["rate_limit"]["max_requests"] == 5
    assert "up to 10 can pass within 60 s" in report["rate_limit"]["meaning"]
    done = _check_config(tmp_path, text)
    assert "gateway.rate_limit: at most 5 requests" in done.stdout


@pytest.mark.parametrize(
    ("block", "words"),
    [
        (
            "    max_requests: 2.5\n",
            "gateway.rate_limit.max_requests = 2.5: max_requests must be a whole number",
        ),
        ("    max_requests: '5'\n", "gateway.rate_limit.max_requests = '5'"),
        ("    max_requests: true\n", "gateway.rate_limit.max_requests = true"),
        ("    window_seconds: 0\n", "window_seconds must be a finite number of seconds > 0"),
        ("    lockout_seconds: -1\n", "lockout_seconds must be a finite number of seconds >= 0"),
        ("    lockout_seconds: .inf\n", "lockout_seconds must be a finite number of seconds >= 0"),
    ],
)
def test_check_config_refuses_a_bad_rate_limit_naming_key_value_and_line(tmp_path, block, words):
    done = _check_config(tmp_path, "gateway:\n  rate_limit:\n" + block)
    assert done.returncode == 2 and done.stdout == "", done
    assert words in done.stderr and ":2: " in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_check_config_warns_of_a_misspelt_rate_limit_key(tmp_path):
    done = _check_config(tmp_path, "gateway:\n  rate_limit:\n    max_request: 5\n")
    assert done.returncode == 0
    assert "gateway.rate_limit.max_request is not a setting" in done.stdout
    assert "did you mean max_requests?" in done.stdout
    done = _check_config(tmp_path, "gateway:\n  rate_limit: [5, 60]\n")
    assert done.returncode == 2 and "rate_limit must be a mapping" in done.stderr


def test_no_redis_password_in_reprs_stats_errors_or_logs(caplog):
    """The gateway's push.redis password (in its URL or as a field) never shows."""
    secret = "s3cr3t/pa55:w@rd"
    import urllib.parse

    url = f"redis://:{urllib.parse.quote(secret, safe='')}@127.0.0.1:1/0"
    caplog.set_level("DEBUG")
    shown = []
    for config in (
        types.SimpleNamespace(url=url, prefix="secret:"),
        types.SimpleNamespace(
            url=None, host="127.0.0.1", port=1, db=0, password=secret, prefix="s2:"
        ),
    ):
        limiter = build_auth_rate_limiter(config, max_attempts=2, window_seconds=60)
        for i in range(3):
            shown.append(repr(limiter.decide("login", f"id-{i}")))
        shown += [repr(limiter), repr(limiter.stats())]
    policy = rate_limit_policy(1, redis_url=url, name="secret-policy")
    shown += [repr(policy), repr(policy.check(identity="a", scope="b", now=0.0))]
    text = "\n".join(shown) + caplog.text
    assert "pa55" not in text and urllib.parse.quote(secret, safe="") not in text, text
    assert "fallback" in text  # the unreachable Redis was tried and fell back


def test_concurrent_replicas_decide_as_one_reference_in_the_servers_order(redis_server):
    """Three replicas (three connections, three threads) hammer a few keys with short windows:
    replaying every decision Redis made through one SlidingWindowRateLimitPolicy, in the
    server's time order, gives the same answers (at one microsecond, the same number allowed),
    so no interleaving lets the fleet pass more than the reference would."""
    name = f"concurrent-{random.randrange(1 << 30)}"
    rules = (3, 0.02, 0.0)
    replicas = [
        rate_limit_policy(
            *rules, redis_url=admitgate.FleetLimit(redis_server.url, f"{name}-{i}", 1), name=name
        )
        for i in range(3)
    ]
    records: list[tuple[float, str, bool]] = []
    lock = threading.Lock()

    def hammer(i: int) -> None:
        rng = random.Random(i)
        for _ in range(400):
            identity = rng.choice(["a", "b", "c"])
            allowed, _, at, decider = replicas[i].decide("login", identity)
            if decider == "fleet":
                with lock:
                    records.append((at, identity, allowed))
            if rng.random() < 0.05:
                time.sleep(0.005)

    pool = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    reference = SlidingWindowRateLimitPolicy(*rules)
    records.sort()
    groups: dict[tuple[float, str], list[bool]] = {}
    for at, identity, allowed in records:
        groups.setdefault((at, identity), []).append(allowed)
    for (at, identity), got in groups.items():
        want = [reference.check(identity=identity, scope="login", now=at).allowed for _ in got]
        assert sorted(got) == sorted(want), (at, identity, got, want)
    allowed = sum(a for _, _, a in records)
    assert len(records) > 100 and 0 < allowed < len(records), (len(records), allowed)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_decides_on_the_fleet_and_the_parent_sees_its_count(redis_server):
    from conftest import in_forked_child

    policy = rate_limit_policy(
        2, 60, 300, redis_url=redis_server.url, name=f"fork-{random.randrange(1 << 30)}"
    )
    assert policy.decide("login", "k")[::3] == (True, "fleet")

    def child() -> None:
        # The child rebuilds the connection on its own runtime and counts on the same key.
        assert policy.decide("login", "k")[::3] == (True, "fleet")
        refused = policy.decide("login", "k")
        assert refused[0] is False and refused[1] == 300.0 and refused[3] == "fleet", refused

    assert in_forked_child(child) == (0, "ok")
    allowed, retry, _, decider = policy.decide("login", "k")
    assert not allowed and decider == "fleet" and 299 < retry < 300
