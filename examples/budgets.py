"""Budgets: at most 3 turns per user in any 2 seconds, and 1,000 tokens per user a minute,
checked before the gate's slot; a refusal says exactly when to retry."""

import asyncio

from admitgate import AdmissionRejected, RateLimit, build_admission_gate


async def main() -> None:
    gate = build_admission_gate(
        max_concurrent_runs=8,
        queue_depth=16,
        rate_limit=RateLimit(
            requests=(3, 2.0),  # or "60/min", or a list: ["60/min", "1000/day"]
            tokens="1000/min",
            key=lambda session_id: session_id.split(":")[0],  # the tenant part of the id
            name="chat",  # labels stats and metrics; namespaces Redis keys with fleet=
        ),
    )
    assert gate is not None

    # Turns reserve their estimate (cost=) and settle what they really used.
    async with gate.admit(session_id="acme:alice", cost=400) as turn:
        turn.report_usage(tokens=250)  # 150 refunded at once
    for user in ("acme:bob", "acme:carol"):
        async with gate.admit(session_id=user, cost=100):
            pass  # unreported: the estimate stays spent
    try:
        async with gate.admit(session_id="acme:dave", cost=100):
            pass
    except AdmissionRejected as refusal:  # the 4th acme turn within 2 s
        print(f"refused: {refusal.reason}, retry in {refusal.retry_after_s:.1f} s")
        await asyncio.sleep(refusal.retry_after_s)
    async with gate.admit(session_id="acme:dave", cost=100):
        print("after the retry time: admitted")

    # A cost above the whole window never fits: refused at once, with no retry time.
    try:
        async with gate.admit(session_id="globex:erin", cost=5000):
            pass
    except AdmissionRejected as refusal:
        print(f"cost 5000 of 1000/min: {refusal.reason}, retry_after={refusal.retry_after}")

    # on_limit="wait": a turn waits for its budget (within its queue timeout and deadline).
    patient = build_admission_gate(rate_limit=RateLimit(requests=(1, 0.5), on_limit="wait"))
    assert patient is not None
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(3):
        async with patient.admit(session_id="frank"):
            pass
    print(f"3 turns at 1 per 0.5 s took {loop.time() - started:.1f} s")

    stats = gate.stats()["rate_limits"]["chat"]
    print({k: stats[k] for k in ("allowed", "limited", "tokens_reserved", "tokens_settled")})


asyncio.run(main())
