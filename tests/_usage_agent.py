"""Test support: an agent that reports each turn's token use as admitgate's front doors read
it (``admitgate-usage-tokens``), the value chosen by the test per request.

- :class:`UsageReportingAgent` wraps an ASGI app (the A2A SDK's): it counts the POSTs that
  reached it by the API key they carried (``x-api-key``, else ``authorization``), and answers
  with the usage report the request's ``x-test-usage`` header asks for (as a response header).
- :class:`UsageTrailer` is a grpc.aio server interceptor that sets the report as trailing
  metadata when the call's ``x-test-usage`` metadata asks for it (with ``x-kept: 1`` beside
  it, which must reach the client).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import grpc
import grpc.aio

USAGE = "admitgate-usage-tokens"


class UsageReportingAgent:
    """The SDK app, recording which API key each request that reached it carried, and
    answering with the usage report the test asked for (request header ``x-test-usage``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.reached: Counter[str] = Counter()
        self.lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if scope["method"] == "POST":
            who = headers.get(b"x-api-key", headers.get(b"authorization", b"-")).decode()
            with self.lock:
                self.reached[who] += 1
        usage = headers.get(b"x-test-usage")

        async def reporting_send(message: Any) -> None:
            if message["type"] == "http.response.start" and usage is not None:
                message = {**message, "headers": [*message["headers"], (USAGE.encode(), usage)]}
            await send(message)

        await self.app(scope, receive, reporting_send)


class UsageTrailer(grpc.aio.ServerInterceptor):
    """Sets the ``admitgate-usage-tokens`` trailer a call's ``x-test-usage`` metadata asks for."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        usage = dict(details.invocation_metadata or ()).get("x-test-usage")
        if handler is None or usage is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            answer = await inner(request, context)
            context.set_trailing_metadata(((USAGE, usage), ("x-kept", "1")))
            return answer

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
