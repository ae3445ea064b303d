"""Budgets without a cost per turn: the gate estimates each turn's tokens from what that
identity's recent turns reported (admitgate.RecentUsage), reserves the estimate, and settles it
to what the turn reports."""

import asyncio

from admitgate import RateLimit, RecentUsage, build_admission_gate


async def main() -> None:
    usage = RecentUsage(initial=500, half_life=2)  # 500 tokens until anyone has reported
    gate = build_admission_gate(
        max_concurrent_runs=8,
        rate_limit=RateLimit(tokens="10_000/min", name="chat"),
        estimator=usage,  # or any callable: lambda session_id, identity: 2000
    )
    assert gate is not None

    async def chat(user: str, used: int) -> None:
        async with gate.admit(session_id=user) as turn:  # no cost=: the estimator's
            reserved = turn.cost
            turn.report_usage(tokens=used)  # refunds the difference, or records a debt
        print(f"{user}: reserved {reserved}, used {used}")

    for used in (1200, 3000, 1000, 1000, 1000):
        await chat("alice", used)  # up at once to a larger report, back down gradually
    await chat("bob", 800)  # no report of bob's yet: the average of everyone's

    async with gate.admit(session_id="carol", cost=50) as turn:  # an explicit cost= wins
        print(f"carol: reserved {turn.cost} (cost=)")

    stats = gate.stats()["rate_limits"]["chat"]
    print({k: stats[k] for k in ("allowed", "tokens_reserved", "tokens_settled")})
    print({k: usage.stats()[k] for k in ("identities", "reports")})  # nothing per identity


asyncio.run(main())
