"""The HTTP front door's parsers of untrusted input, before and after issue 15.

``AdmissionMiddleware`` runs two parsers on what a client sends, on the server's event loop,
before admission: the JSON-RPC head scan (for a body longer than ``max_peek_bytes``; since
issue 17 the Rust reader of ``crates/classify``, ``A2ARules.jsonrpc(head, False)``, which
``benchmarks/asgi_jsonrpc.py`` compares with the Python scan it replaced) and the request path
classification (``_classify``). This workload times
both against the implementations they replaced (copied below from the commit before, 317640a,
as the *before* subjects; nothing else uses them):

- the head scan on the adversarial 64 KiB head of issue 15 (``{"params":["\\"\\"\\"...``, an
  unterminated run of escaped quotes, which the old skipper rescanned to the end from every
  quote: quadratic), and on a typical 64 KiB head (a SendMessage whose ``params`` carry a long
  text);
- the path classification, per request, on a mix of typical paths (JSON-RPC ``/``, REST
  ``/message:send``, a tenant's ``/acme/tasks/t1``, a passthrough ``/custom``). The new
  classifier matches Starlette's route table exactly instead of splitting segments, so this
  row says what exactness costs per request.

The *before* scan is quadratic: one 64 KiB call takes seconds (19.6 s when the issue was
filed), so it gets fewer repetitions (``scan_before_reps``) than the rest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Final

from admitgate import build_admission_gate
from admitgate._admitgate import A2ARules
from admitgate.asgi import AdmissionMiddleware

from .harness import Result, Timed, median, rotations

# -- the implementation before issue 15 (commit 317640a), for comparison only ---------------

_PASS: Final = 0
_REST_READ: Final = 1
_REST_WORK: Final = 2
_JSONRPC: Final = 3
_SUBSCRIBE_METHODS: Final = frozenset({"GET", "HEAD", "POST"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_SKIP = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)
_SCALAR = re.compile(r"[^\s,\]}]+")
_WS = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def _skip_value_before(text: str, i: int) -> int:
    if i >= len(text):
        return -1
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        return m.end() if m else -1
    if c == "{" or c == "[":
        depth = 0
        for m in _SKIP.finditer(text, i):
            t = m.group()
            if t[0] == '"':
                continue
            depth += 1 if t in "{[" else -1
            if depth == 0:
                return m.end()
        return -1
    m = _SCALAR.match(text, i)
    return m.end() if m and m.end() < len(text) else -1


def scan_head_before(head: bytes) -> tuple[object, object]:
    """``_scan_head`` as it was before issue 15."""
    text = head.decode("utf-8", "replace")
    found: dict[str, object] = {}
    i = _WS.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("{", i):
        return None, None
    i += 1
    while True:
        i = _WS.match(text, i).end()  # type: ignore[union-attr]
        m = _STRING.match(text, i)
        if m is None:
            break
        try:
            key = json.loads(m.group())
        except ValueError:
            break
        i = _WS.match(text, m.end()).end()  # type: ignore[union-attr]
        if not text.startswith(":", i):
            break
        i = _WS.match(text, i + 1).end()  # type: ignore[union-attr]
        if key == "method" or key == "id":
            try:
                value, end = _DECODER.raw_decode(text, i)
            except ValueError:
                break
            if end >= len(text):
                break
            found[key] = value
            i = end
        else:
            i = _skip_value_before(text, i)
            if i < 0:
                break
        i = _WS.match(text, i).end()  # type: ignore[union-attr]
        if not text.startswith(",", i):
            break
        i += 1
    return found.get("method"), found.get("id")


def _rest_route_before(method: str, segs: list[str], lead: str) -> int:
    n = len(segs)
    first = segs[0]
    if n == 1:
        if first == "message:send" or first == "message:stream":
            return _REST_WORK if method == "POST" else _REST_READ
        if first == "tasks" or first == "extendedAgentCard" or (first == "card" and lead == "v1"):
            return _REST_READ
        return _PASS
    if first != "tasks" or not segs[1]:
        return _PASS
    if n == 2:
        if segs[1].endswith(":subscribe") and method in _SUBSCRIBE_METHODS:
            return _REST_WORK
        return _REST_READ
    if segs[2] == "pushNotificationConfigs" and (n == 3 or (n == 4 and segs[3])):
        return _REST_READ
    return _PASS


def classify_before(method: str, path: str) -> int:
    """``AdmissionMiddleware._classify`` as it was before issue 15 (no path prefix)."""
    if method == "POST" and path == "/":
        return _JSONRPC
    segs = path[1:].split("/")
    if not segs[0]:
        return _PASS
    kind = _rest_route_before(method, segs, "")
    if kind == _PASS and len(segs) >= 2 and segs[1]:
        kind = _rest_route_before(method, segs[1:], segs[0])
    return kind


# -- the workload ---------------------------------------------------------------------------

_HEAD_RULES: Final = A2ARules("", "/", gate_all=False, max_peek_bytes=1 << 20)


def _scan_head(head: bytes) -> object:
    """The head scan now: the ``id`` a refusal of a body cut at ``head`` carries."""
    return _HEAD_RULES.jsonrpc(head, False)[1]


def adversarial_head(size: int) -> bytes:
    """Issue 15's head: an unterminated run of escaped quotes inside ``params``."""
    return (b'{"params":["' + b'\\"' * size)[:size]


def typical_head(size: int) -> bytes:
    """A SendMessage whose text runs past the head, ``id`` and ``method`` first."""
    request = {
        "jsonrpc": "2.0",
        "id": "req-1",
        "method": "SendMessage",
        "params": {"message": {"role": "ROLE_USER", "parts": [{"text": "x" * size}]}},
    }
    return json.dumps(request).encode()[:size]


PATHS: Final = (
    ("POST", "/"),
    ("POST", "/message:send"),
    ("GET", "/acme/tasks/t1"),
    ("GET", "/custom"),
)


async def _noop_app(scope: Any, receive: Any, send: Any) -> None:
    return None


def _time_calls(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn``, over ``calls`` calls in one timed region."""
    with Timed() as timed:
        for _ in range(calls):
            fn()
    return timed.elapsed / calls


def bench_asgi_parsers(size: dict[str, Any]) -> Result:
    """The JSON-RPC head scan and the path classification, before and after issue 15."""
    result = Result(
        "asgi-parsers", "HTTP front door parsers of untrusted input, before/after issue 15", "us"
    )
    n = size["scan_bytes"]
    adversarial, typical = adversarial_head(n), typical_head(n)
    gate = build_admission_gate(max_concurrent_runs=1)
    middleware = AdmissionMiddleware(_noop_app, gate)
    classify_calls = size["classify_calls"]

    def classify_after() -> None:
        for method, path in PATHS:
            middleware._classify(method, path, "")

    def classify_old() -> None:
        for method, path in PATHS:
            classify_before(method, path)

    variants: dict[str, Callable[[], float]] = {
        "scan adversarial, after": lambda: _time_calls(lambda: _scan_head(adversarial), 20),
        "scan typical, before": lambda: _time_calls(lambda: scan_head_before(typical), 20),
        "scan typical, after": lambda: _time_calls(lambda: _scan_head(typical), 20),
        "classify 4 paths, before": lambda: _time_calls(classify_old, classify_calls),
        "classify 4 paths, after": lambda: _time_calls(classify_after, classify_calls),
    }
    for order in rotations(list(variants), size["reps"]):
        for name in order:
            result.rows.setdefault(name, []).append(variants[name]())
    # The quadratic one alone, fewer times: each call takes seconds at 64 KiB.
    before = [
        _time_calls(lambda: scan_head_before(adversarial), 1)
        for _ in range(size["scan_before_reps"])
    ]
    result.rows = {"scan adversarial, before": before, **result.rows}
    result.ratio("adversarial before/after", "scan adversarial, before", "scan adversarial, after")
    result.ratio("typical before/after", "scan typical, before", "scan typical, after")
    result.ratio("classify after/before", "classify 4 paths, after", "classify 4 paths, before")
    result.target(
        f"adversarial {n // 1024} KiB head scan, ms",
        result.median("scan adversarial, after") * 1e3,
        5.0,
    )
    result.check(
        "the scans agree on the typical head",
        _scan_head(typical) == scan_head_before(typical)[1] == "req-1",
        repr(_scan_head(typical)),
    )
    result.check(
        "the classifiers agree on the typical paths",
        all(middleware._classify(m, p, "") == classify_before(m, p) for m, p in PATHS),
    )
    result.notes.append(
        f"head size {n} bytes; before-adversarial is the median of {len(before)} "
        f"(min {min(before):.3f} s, median {median(before):.3f} s)"
    )
    return result
