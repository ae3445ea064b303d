"""A turn parked on a person gives its slot back: with a ceiling of 1, a second turn runs while
the first waits for a human to approve its tool call through PraisonAI's approval registry.
Needs praisonaiagents (admitgate[praisonai])."""

import asyncio

from praisonaiagents.approval import ApprovalDecision, ApprovalRegistry, ApprovalRequest

import admitgate


class Person:
    """An approval backend: here the "person" answers when the example says so."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def request_approval(self, request: ApprovalRequest) -> ApprovalDecision:
        print(f"  asking a person about {request.tool_name}({request.arguments}) ...")
        self.asked.set()
        await self.answer.wait()
        return ApprovalDecision(approved=True, approver="alice")


async def main() -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=4)
    assert gate is not None
    person = Person()
    approvals = ApprovalRegistry()
    approvals.add_requirement("delete_file", risk_level="high")
    approvals.set_backend(person)

    async def needs_approval() -> str:
        async with gate.admit(session_id="user-a"):
            # The registry enters the gate's human-wait scope around the wait for a person.
            decision = await approvals.approve_async(None, "delete_file", {"path": "/tmp/x"})
            return f"user-a: approved by {decision.approver}"

    async def quick() -> str:
        async with gate.admit(session_id="user-b"):
            await asyncio.sleep(0.05)  # stands in for your agent's run
            return "user-b: done while user-a waited for a person"

    first = asyncio.create_task(needs_approval())
    await person.asked.wait()
    print("while the person thinks:", gate.in_flight, "in flight,", gate.awaiting_human, "waiting")
    print(await quick())  # gets the slot user-a lent, although the ceiling is 1
    person.answer.set()
    print(await first)  # resumes without waiting in line
    print(gate.stats())


if __name__ == "__main__":
    asyncio.run(main())
