"""The parsers AdmissionMiddleware runs on untrusted bytes: right, and linear in their input.

Before admission the middleware reads the start of a JSON-RPC body (``_parse`` when it fits
``max_peek_bytes``, ``_scan_head`` when it does not) and classifies the request path. A
client chooses every byte of both, and the middleware runs on the server's event loop, so a
parse that is slower than linear on some shape stalls every other request on that server.

Checked here:

- ``_scan_head`` finds what ``json.loads`` finds in a whole body (same ``method`` and ``id``,
  duplicate keys included; it looks at the first 64 top-level members only), and never a
  wrong value in a cut one;
- every parser, on every adversarial shape, scans 64 KiB within a bound and scales linearly
  (64 KiB against eight times 8 KiB);
- nesting deeper than ``json`` follows is an unreadable body (which the middleware gates),
  not an exception out of the middleware.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from typing import Any

import admitgate
import pytest
from admitgate.asgi import _TOO_DEEP, AdmissionMiddleware, _parse, _scan_head
from hypothesis import given, settings
from hypothesis import strategies as st

KIB = 1024

# -- differential: _scan_head against json.loads ----------------------------------------------

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
_KEYS = st.sampled_from(["method", "id", "params", "jsonrpc", "x", 'm"e', "méthode", ""])
# Members of a request object, duplicates allowed (json.loads keeps the last).
_MEMBERS = st.lists(
    st.tuples(
        _KEYS,
        st.one_of(
            _VALUES,
            st.sampled_from(["SendMessage", "GetTask", "message/send"]),
            # A nested "method"/"id" that must not be taken for the request's.
            st.fixed_dictionaries({"method": st.just("GetTask"), "id": st.just("inner")}),
        ),
    ),
    max_size=6,
)


def _encode(members: list[tuple[str, Any]], ensure_ascii: bool, spaced: bool) -> bytes:
    colon, comma = (" : ", " ,\n\t") if spaced else (":", ",")
    parts = [
        json.dumps(k, ensure_ascii=ensure_ascii) + colon + json.dumps(v, ensure_ascii=ensure_ascii)
        for k, v in members
    ]
    return ("{" + comma.join(parts) + "}").encode()


@given(members=_MEMBERS, ensure_ascii=st.booleans(), spaced=st.booleans(), cut=st.data())
@settings(max_examples=100, deadline=None)
def test_scan_head_finds_what_json_loads_finds(
    members: list[tuple[str, Any]], ensure_ascii: bool, spaced: bool, cut: st.DataObject
) -> None:
    body = _encode(members, ensure_ascii, spaced)
    request = json.loads(body)
    expected = (request.get("method"), request.get("id"))
    assert _scan_head(body) == expected
    # Any prefix: a member is either not found yet or found with a whole value it has in the
    # body (with duplicate keys, the last one the prefix holds).
    n = cut.draw(st.integers(min_value=0, max_value=len(body)))
    method, rpc_id = _scan_head(body[:n])
    assert method is None or method in [v for k, v in members if k == "method"]
    assert rpc_id is None or rpc_id in [v for k, v in members if k == "id"]


def test_scan_head_edge_cases() -> None:
    # A value must be followed by "," or "}" to be whole: "1." may be a cut "1.5".
    assert _scan_head(b'{"id": 1.') == (None, None)
    assert _scan_head(b'{"id": 1') == (None, None)
    assert _scan_head(b'{"id": 1.5,') == (None, 1.5)
    assert _scan_head(b'{"id": "a"') == (None, None)
    assert _scan_head(b'{"id": "a" }') == (None, "a")
    # Escaped keys are keys: "\u006d..." is "method".
    assert _scan_head(b'{"\\u006dethod": "SendMessage", "id": 7}') == ("SendMessage", 7)
    # Only JSON whitespace separates tokens, as for json.loads.
    assert _scan_head(b'{\x0b"id": 1}') == (None, None)
    # Past the first 64 members the scan stops (a JSON-RPC request has four).
    many = b'{"id": 1, ' + b'"x": 0, ' * 62 + b'"id": 2, "id": 3}'
    assert json.loads(many)["id"] == 3 and _scan_head(many) == (None, 2)
    # Not an object, or nothing at all.
    assert _scan_head(b"") == (None, None)
    assert _scan_head(b'["id", 1]') == (None, None)


# -- nesting deeper than json follows ---------------------------------------------------------


def test_nesting_deeper_than_json_follows_is_unreadable_not_an_error() -> None:
    """Fails before the fix: json raised RecursionError out of _parse and _scan_head, so the
    middleware raised (a 500) instead of deciding."""
    deep = b"[" * 5000
    assert _parse(deep) is _TOO_DEEP
    assert _parse(b'{"method": "SendMessage", "params": ' + deep) is _TOO_DEEP
    assert _parse(b"[" * 50 + b"]" * 50) == json.loads(b"[" * 50 + b"]" * 50)
    assert _scan_head(b'{"id": 5, "params": ' + deep) == (None, 5)
    assert _scan_head(b'{"id": ' + deep) == (None, None)


# -- time bounds ------------------------------------------------------------------------------


def _repeat_to(unit: str, size: int, head: str = "") -> bytes:
    """``head`` then ``unit`` repeated, ``size`` bytes in all."""
    data = (head + unit * (size // max(1, len(unit)) + 1)).encode()
    return data[:size]


# Adversarial shapes: a head whose length is the parameter. Each is a shape some scanner is
# slower than linear on (the first one was 19.6 s at 64 KiB before this fix).
SHAPES: dict[str, Callable[[int], bytes]] = {
    "unterminated escaped run": lambda n: _repeat_to('\\"', n, '{"params":["'),
    "escaped run, id after it": lambda n: _repeat_to('\\"', n, '{"id":"'),
    "backslash run": lambda n: _repeat_to("\\", n, '{"params":"'),
    "quote run": lambda n: _repeat_to('"', n, '{"params":'),
    "deep nesting [": lambda n: _repeat_to("[", n, '{"params":'),
    "deep nesting {": lambda n: _repeat_to('{"a":', n, '{"params":'),
    "deep nesting in id": lambda n: _repeat_to("[", n, '{"id":'),
    "brackets in strings": lambda n: _repeat_to('"[{",', n, '{"params":['),
    "alternating brackets": lambda n: _repeat_to("[],", n, '{"params":['),
    "many short strings": lambda n: _repeat_to('"",', n, '{"params":['),
    "many keys": lambda n: _repeat_to('"k":1,', n, "{"),
    "many nested members": lambda n: _repeat_to('"":[],', n, "{"),
    "many escaped keys": lambda n: _repeat_to('"\\u0069d":[0],', n, "{"),
    "many method keys": lambda n: _repeat_to('"method":"SendMessage",', n, "{"),
    "long string": lambda n: _repeat_to("x", n, '{"params":"'),
    "long unicode escapes": lambda n: _repeat_to("\\u00e9", n, '{"params":"'),
    "multibyte": lambda n: _repeat_to("\u4e2d\u00e9", n, '{"params":"'),
    "long number": lambda n: _repeat_to("1", n, '{"id":'),
    "mixed": lambda n: _repeat_to('[{"a":"\\"]}\\\\",', n, '{"params":'),
    "not json": lambda n: _repeat_to('\x00"\\', n),
}


def _best_of(fn: Callable[[], object], reps: int = 5) -> float:
    """The fastest of ``reps`` runs in this thread's CPU time (a loaded machine that
    deschedules the test is not the parser's time either), with the garbage collector paused:
    a collection that the parse's own allocations trigger costs in proportion to every object
    alive, which is not the parser's time."""
    best = float("inf")
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.thread_time()
            fn()
            best = min(best, time.thread_time() - t0)
    finally:
        gc.enable()
    return best


def assert_linear(parse: Callable[[bytes], object], shape: Callable[[int], bytes]) -> None:
    """``parse`` on 64 KiB of ``shape``: under 50 ms, and no slower than ~3x eight scans of
    8 KiB (linear: ~1x; quadratic: ~8x)."""
    large = shape(64 * KIB)
    small = shape(8 * KIB)
    t_large = _best_of(lambda: parse(large))
    t_small = _best_of(lambda: [parse(small) for _ in range(8)])
    assert t_large < 0.050, f"{t_large * 1e3:.1f} ms for 64 KiB"
    # Below 3 ms the ratio is the machine's noise; above it, it must look linear.
    assert t_large < 0.003 or t_large < 3 * t_small, (t_large, t_small)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_scan_head_is_linear(shape: str) -> None:
    """Fails before the fix on the escaped runs (seconds on 64 KiB: quadratic)."""
    assert_linear(_scan_head, SHAPES[shape])


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_parse_is_linear(shape: str) -> None:
    assert_linear(_parse, SHAPES[shape])


def test_every_64_kib_prefix_scans_quickly() -> None:
    """Every cut of an adversarial mix, not just the ones that end on a shape's boundary."""
    mix = b"".join(SHAPES[name](6 * KIB) for name in SHAPES)[: 64 * KIB]
    worst = 0.0
    for cut in range(len(mix) - 64, len(mix) + 1):
        t0 = time.thread_time()
        _scan_head(mix[:cut])
        worst = max(worst, time.thread_time() - t0)
    assert worst < 0.050


# Request paths: a client chooses the path too.
PATHS: dict[str, Callable[[int], str]] = {
    "slashes": lambda n: "/" * n,
    "subscribe suffixes": lambda n: ("/tasks/" + ":subscribe" * n)[:n],
    "cancel suffixes": lambda n: ("/acme/tasks/" + ":cancel" * n)[:n] + ":cancel",
    "tasks segments": lambda n: ("/tasks" * n)[:n],
    "long tenant": lambda n: "/" + "t" * n + "/message:send",
    "long task id": lambda n: "/tasks/" + "x" * n + "/pushNotificationConfigs/p",
    "colons": lambda n: "/" + ":" * n,
    "newlines": lambda n: "/tasks/" + "\n" * n,
}


@pytest.mark.parametrize("shape", list(PATHS), ids=list(PATHS))
def test_path_classification_is_linear(shape: str) -> None:
    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    assert gate is not None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    middlewares = [
        AdmissionMiddleware(app, gate),
        AdmissionMiddleware(app, gate, path_prefix="/a2a"),
    ]
    for middleware in middlewares:
        for method in ("GET", "POST"):
            assert_linear(_path_parser(middleware, method), lambda n: PATHS[shape](n).encode())


def _path_parser(middleware: AdmissionMiddleware, method: str) -> Callable[[bytes], object]:
    def classify(raw: bytes) -> object:
        return middleware._classify(method, raw.decode(), "")

    return classify
