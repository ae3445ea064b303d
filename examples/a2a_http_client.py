"""An A2A client that honours the gate's retry hint, against the server of a2a_http_server.py,
which it starts in-process on a free port on 127.0.0.1 and stops at the end."""

import asyncio
import socket

import httpx
import uvicorn
from a2a.client import ClientConfig, create_client
from a2a.helpers.proto_helpers import new_text_message
from a2a.types import Role, SendMessageRequest

import admitgate
from a2a_http_server import build_app
from admitgate.client import RetryingTransport


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def main() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # One slot and no queue, taken for a moment by another caller: the message is refused with
    # 429 + Retry-After, waits it out and gets through once the slot is free.
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=0)
    assert gate is not None
    config = uvicorn.Config(build_app(url, gate), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        # RetryingTransport waits out a 429/503's Retry-After, then sends again.
        async with httpx.AsyncClient(transport=RetryingTransport(), timeout=60) as http:
            client = await create_client(url, client_config=ClientConfig(httpx_client=http))

            async def ask(text: str) -> str:
                request = SendMessageRequest(message=new_text_message(text, role=Role.ROLE_USER))
                async for event in client.send_message(request):
                    return event.message.parts[0].text
                return ""

            async def someone_else() -> None:
                async with gate.admit(session_id="someone-else"):
                    while gate.rejected == 0:  # holds the slot until the message was turned away
                        await asyncio.sleep(0.01)

            busy = asyncio.create_task(someone_else())
            await asyncio.sleep(0)  # it takes the only slot
            print(await ask("hello"))
            await busy
        print("refusals before it got through:", gate.rejected)
    finally:
        server.should_exit = True
        await serving


if __name__ == "__main__":
    asyncio.run(main())
