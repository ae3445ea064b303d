"""Budgets at the HTTP front door: the gate's RateLimit (2 requests per minute per API key,
and 1,000 tokens per minute), keyed by the X-API-Key header at the door (rate_key=).

The app is a small Starlette app with the A2A REST route `POST /message:send` (any A2A app,
the SDK's included, works the same); it reports the tokens each run used in the
admitgate-usage-tokens response header, which the middleware settles against the turn and
removes. key-a's third request is refused (429 rate_limited, the exact Retry-After and the
RateLimit fields); a request with no key spends the one anonymous budget."""

import asyncio
import socket

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import admitgate
from admitgate.asgi import AdmissionMiddleware


async def send_message(request: Request) -> JSONResponse:
    await request.body()
    # What the LLM said the run used: the door settles it and strips the header.
    return JSONResponse({"answer": "done"}, headers={"admitgate-usage-tokens": "120"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main() -> None:
    gate = admitgate.build_admission_gate(
        rate_limit=admitgate.RateLimit(requests="2/min", tokens="1000/min")
    )
    app = Starlette(routes=[Route("/message:send", send_message, methods=["POST"])])
    door = AdmissionMiddleware(app, gate, rate_key="header:x-api-key", cost=200)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(door, host="127.0.0.1", port=port, log_level="error"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        for key in ["key-a", "key-a", "key-a", "key-b", None]:
            headers = {"x-api-key": key} if key else {}
            answer = await client.post("/message:send", json={}, headers=headers)
            if answer.status_code == 200:
                usage = answer.headers.get("admitgate-usage-tokens", "not shown")
                print(f"{key or 'no key'}: 200 (usage header: {usage})")
            else:
                h = answer.headers
                print(
                    f"{key}: {answer.status_code} {h['admitgate-reason']}, RateLimit {h['ratelimit']}"
                )
                print(f"  RateLimit-Policy {h['ratelimit-policy']}")
    limits = gate.stats()["rate_limits"]["default"]
    print(
        f"allowed {limits['allowed']}, limited {limits['limited']}, tokens settled {limits['tokens_settled']}"
    )
    server.should_exit = True
    await serving


asyncio.run(main())
