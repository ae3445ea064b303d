"""The HTTP front door's JSON-RPC body read, in Python (before) and in Rust (after).

Until this change ``AdmissionMiddleware`` read a JSON-RPC body's ``method`` and ``id`` with
:mod:`json` (``_parse``: ``json.loads`` for a body within ``max_peek_bytes``; ``_scan_head``:
one json C-scanner step per top-level member of a longer body's prefix), while the broker
read them with ``crates/classify``. Now the middleware calls the same Rust reader
(``A2ARules.jsonrpc``). The Python reader is copied below from commit 185608d as the *before*
subject (nothing else uses it), and a middleware whose ``_inspect`` runs it stands for the
middleware before. Timed, interleaved in one process:

- the read alone, on a typical ``SendMessage`` (about 250 bytes), an 8 KiB one (a long text
  part) and the 64 KiB prefix of a longer one;
- one whole gated request through the middleware (raw ASGI in-process, an uncontended gate
  of 64 slots, an app that answers at once): the per-request cost the read is part of; and
  one ``GetTask`` (read, then passed without a slot).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, MutableMapping
from typing import Any, Final

from admitgate import build_admission_gate
from admitgate._admitgate import A2ARules
from admitgate.asgi import AdmissionMiddleware

from .harness import Result, Timed, rotations

# -- the Python reader before this change (commit 185608d), for comparison only ------------

_WORK_METHODS: Final = frozenset(
    {
        "SendMessage",
        "SendStreamingMessage",
        "SubscribeToTask",
        "message/send",
        "message/stream",
        "tasks/resubscribe",
    }
)
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_SCAN_VALUE: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
_PLAIN_KEY = re.compile(r'[ \t\n\r]*"([^"\\\x00-\x1f]*)"[ \t\n\r]*:[ \t\n\r]*')
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
_AFTER_VALUE = re.compile(r"[ \t\n\r]*([,}])")
_MAX_HEAD_MEMBERS: Final = 64
_TOO_DEEP: Final = object()


def scan_head_before(head: bytes | bytearray) -> tuple[object, object]:
    """``_scan_head`` as it was before this change."""
    text = head.decode("utf-8", "replace")
    found: dict[str, object] = {}
    i = _WS.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("{", i):
        return None, None
    i += 1
    for _ in range(_MAX_HEAD_MEMBERS):
        try:
            plain = _PLAIN_KEY.match(text, i)
            if plain is not None:
                key: object = plain.group(1)
                i = plain.end()
            else:
                i = _WS.match(text, i).end()  # type: ignore[union-attr]
                if not text.startswith('"', i):
                    break
                key, i = _SCAN_VALUE(text, i)
                colon = _COLON.match(text, i)
                if colon is None:
                    break
                i = colon.end()
            value, i = _SCAN_VALUE(text, i)
        except (StopIteration, ValueError, RecursionError):
            break
        after = _AFTER_VALUE.match(text, i)
        if after is None:
            break
        if key == "method" or key == "id":
            found[key] = value  # type: ignore[index]
        if after.group(1) == "}":
            break
        i = after.end()
    return found.get("method"), found.get("id")


def parse_before(body: bytes | bytearray) -> object:
    """``_parse`` as it was before this change."""
    try:
        if body[:1] == b"{" and body[1:2] not in (b"\x00", b""):
            text = body.decode("utf-8", "surrogatepass")
            value, end = _DECODER.raw_decode(text)
            if end != len(text) and text[end:].lstrip(" \t\n\r"):
                return None
            return value
        return json.loads(body)
    except ValueError:
        return None
    except RecursionError:
        return _TOO_DEEP


def _response_id(value: object) -> str | int | None:
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return value


def inspect_before(
    body: bytes | bytearray, more: bool, max_peek_bytes: int, gate_all: bool
) -> tuple[bool, object]:
    """``AdmissionMiddleware._inspect`` of a JSON-RPC request as it was before this change."""
    rpc_id: object = None
    gated = True
    if more or len(body) > max_peek_bytes:
        rpc_id = scan_head_before(body[:max_peek_bytes])[1]
    else:
        request = parse_before(body)
        if request is _TOO_DEEP:
            rpc_id = scan_head_before(body)[1]
        else:
            method = None
            if type(request) is dict:
                method = request.get("method")
                rpc_id = request.get("id")
            gated = gate_all or method in _WORK_METHODS
    return gated, _response_id(rpc_id)


class PythonReadMiddleware(AdmissionMiddleware):
    """The middleware as it was: everything of today's but the body read, which is Python's."""

    def _inspect(self, kind: int, body: bytes | bytearray, more: bool) -> tuple[bool, object]:
        if kind == 3:  # the JSON-RPC endpoint
            return inspect_before(body, more, self.max_peek_bytes, self._gate_all)
        return True, None


# -- the workload ---------------------------------------------------------------------------


def request_body(method: str, text_bytes: int) -> bytes:
    """A JSON-RPC request as the A2A SDK's client sends it, with a text part of that size."""
    message = {
        "messageId": "0f8d3c4e-7a51-4d1e-9c0b-2f6a8e1d5b37",
        "role": "ROLE_USER",
        "parts": [{"text": "x" * text_bytes}],
    }
    request = {"jsonrpc": "2.0", "id": "req-1", "method": method, "params": {"message": message}}
    return json.dumps(request).encode()


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


_SCOPE: Final = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/",
    "raw_path": b"/",
    "root_path": "",
    "query_string": b"",
    "headers": [(b"content-type", b"application/json")],
}


def _per_request(middleware: AdmissionMiddleware, body: bytes, calls: int) -> float:
    """Seconds per request of ``body`` through ``middleware``, on one event loop."""
    message = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    async def send(_message: MutableMapping[str, Any]) -> None:
        return None

    async def loop() -> float:
        with Timed() as timed:
            for _ in range(calls):
                await middleware(_SCOPE, receive, send)
        return timed.elapsed / calls

    return asyncio.run(loop())


def _per_call(fn: Callable[[], object], calls: int) -> float:
    with Timed() as timed:
        for _ in range(calls):
            fn()
    return timed.elapsed / calls


def bench_asgi_jsonrpc(size: dict[str, Any]) -> Result:
    """The JSON-RPC body read and a whole request through the middleware, before and after
    the read moved into Rust."""
    result = Result(
        "asgi-jsonrpc", "HTTP front door: the JSON-RPC body read, Python before, Rust after", "us"
    )
    calls = size["jsonrpc_calls"]
    peek = 65536
    rules = A2ARules("", "/", gate_all=False, max_peek_bytes=peek)
    typical = request_body("SendMessage", 40)
    eight_k = request_body("SendMessage", 8192)
    head = request_body("SendMessage", 2 * peek)[:peek]
    get_task = json.dumps(
        {"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {"id": "t-1"}}
    ).encode()
    gate = build_admission_gate(max_concurrent_runs=64)
    assert gate is not None
    after = AdmissionMiddleware(_app, gate)
    before = PythonReadMiddleware(_app, gate)
    reads: dict[str, tuple[bytes, bool]] = {
        f"{len(typical)} B": (typical, True),
        "8 KiB": (eight_k, True),
        "64 KiB prefix": (head, False),
    }
    variants: dict[str, Callable[[], float]] = {}
    for label, (body, complete) in reads.items():
        n = max(10, calls // max(1, len(body) // 256))
        variants[f"read {label}, python"] = lambda b=body, c=complete, n=n: _per_call(  # type: ignore[misc]
            lambda: inspect_before(b, not c, peek, False), n
        )
        variants[f"read {label}, rust"] = (
            lambda b=body, c=complete, n=n: _per_call(lambda: rules.jsonrpc(b, c), n)  # type: ignore[misc]
        )
    requests = max(10, calls // 10)
    variants["SendMessage request, python read"] = lambda: _per_request(before, typical, requests)
    variants["SendMessage request, rust read"] = lambda: _per_request(after, typical, requests)
    variants["GetTask request, python read"] = lambda: _per_request(before, get_task, requests)
    variants["GetTask request, rust read"] = lambda: _per_request(after, get_task, requests)
    for order in rotations(list(variants), size["reps"]):
        for name in order:
            result.rows.setdefault(name, []).append(variants[name]())
    for label in reads:
        result.ratio(f"read {label} rust/python", f"read {label}, rust", f"read {label}, python")
    for what in ("SendMessage", "GetTask"):
        result.ratio(
            f"{what} request rust/python",
            f"{what} request, rust read",
            f"{what} request, python read",
        )
    for label, (body, complete) in reads.items():
        result.check(
            f"both readers agree on the {label} body",
            inspect_before(body, not complete, peek, False) == rules.jsonrpc(body, complete),
        )
    stats = gate.stats()
    result.check(
        "every gated request was admitted and ended",
        stats["in_flight"] == 0 and stats["rejected"] == 0,
        repr(stats),
    )
    result.notes.append(
        f"bodies: {len(typical)} B and {len(eight_k)} B read whole, a {len(head)} B prefix "
        "scanned for its id; requests: raw ASGI in-process, uncontended gate of 64"
    )
    return result
