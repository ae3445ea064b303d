"""A gRPC client whose interceptors retry a refusal after the gate's pushback, against the
server of grpc_server.py, which it starts in-process on a free port on 127.0.0.1."""

import asyncio

import grpc
from a2a.types import a2a_pb2, a2a_pb2_grpc

import admitgate
from admitgate.grpc import retry_pushback_interceptors
from grpc_server import build_server


async def ask(address: str, text: str) -> str:
    interceptors = retry_pushback_interceptors(max_retries=3, deadline_s=30.0, jitter=0.2)
    async with grpc.aio.insecure_channel(address, interceptors=interceptors) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        message = a2a_pb2.Message(
            message_id=f"m-{text}", role=a2a_pb2.Role.ROLE_USER, parts=[a2a_pb2.Part(text=text)]
        )
        reply = await stub.SendMessage(
            a2a_pb2.SendMessageRequest(message=message), metadata=(("x-tenant", "acme"),)
        )
        return reply.message.parts[0].text


async def main() -> None:
    # One slot and no queue, taken for a moment by another caller: the call is refused, waits
    # out the pushback and gets through once the slot is free.
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=0)
    assert gate is not None
    server, port = build_server(gate, "127.0.0.1:0")
    await server.start()

    async def someone_else() -> None:
        async with gate.admit(session_id="someone-else"):
            while gate.rejected == 0:  # holds the slot until the call below was turned away
                await asyncio.sleep(0.01)

    try:
        address = f"127.0.0.1:{port}"
        busy = asyncio.create_task(someone_else())
        await asyncio.sleep(0)  # it takes the only slot
        print(await ask(address, "hello"))
        print("refusals before it got through:", gate.rejected)
        await busy
    finally:
        await server.stop(grace=1)


if __name__ == "__main__":
    asyncio.run(main())
