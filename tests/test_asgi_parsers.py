"""The parsers AdmissionMiddleware runs on untrusted bytes: right, and linear in their input.

Before admission the middleware reads the start of a JSON-RPC body and classifies the request
path, both with the rules in ``crates/classify`` (``A2ARules``, which the broker runs too): a
body that fits ``max_peek_bytes`` is read whole, one that does not only for its ``id``, from
the prefix. A client chooses every byte of both, and the middleware runs on the server's
event loop, so a parse that is slower than linear on some shape stalls every other request on
that server.

Checked here (what the reader reads is checked against ``json.loads`` and the A2A SDK in
``tests/test_jsonrpc_reader.py``):

- every parser, on every adversarial shape, scans 64 KiB within a bound and scales linearly
  (64 KiB against eight times 8 KiB);
- nesting deeper than ``json`` follows is read, not an exception out of the middleware, and
  the request is classified by its ``method``.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from typing import Any

import admitgate
import pytest
from admitgate._admitgate import A2ARules
from admitgate.asgi import AdmissionMiddleware

KIB = 1024

# A body read whole (it fits the peek limit), and one read only for its id from the prefix.
_WHOLE = A2ARules("", "/", gate_all=False, max_peek_bytes=1 << 20)
_HEAD = A2ARules("", "/", gate_all=False, max_peek_bytes=64 * KIB)


def _parse(body: bytes) -> tuple[bool, object]:
    return _WHOLE.jsonrpc(body, True)


def _scan_head(head: bytes) -> tuple[bool, object]:
    return _HEAD.jsonrpc(head, False)


# -- nesting deeper than json follows ---------------------------------------------------------


def test_nesting_deeper_than_json_follows_is_read_by_its_method() -> None:
    """Once json raised RecursionError out of the middleware (a 500); the reader follows
    nesting with a counter, not the stack, so the method decides as for any body (a body the
    app cannot parse runs no work, and one it can is what the method says)."""
    # Deeper than any CPython's json follows: 3.10-3.12 stop near 1,000, 3.13's C stack
    # guard allows 5,000 and stops before 20,000.
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(RecursionError):
        json.loads(deep)
    assert _parse(b'{"method": "SendMessage", "id": 3, "params": ' + deep + b"}") == (True, 3)
    assert _parse(b'{"method": "GetTask", "id": 3, "params": ' + deep + b"}") == (False, None)
    assert _parse(b"[" * 5000) == (False, None)  # not JSON: no request
    assert _scan_head(b'{"id": 5, "params": ' + b"[" * 5000) == (True, 5)
    assert _scan_head(b'{"id": ' + b"[" * 5000) == (True, None)


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
