"""The broker's JSON-RPC reader (``crates/classify``, via ``_admitgate._jsonrpc_request``)
against ``json.loads``, the parser the A2A SDK reads the body with: on generated request
bodies, mutated and cut, both see the same ``method`` and ``id`` (or both no request).

The route table needs no test here: ``admitgate.asgi`` classifies paths with the same Rust
code, checked against the SDK's real Starlette router in ``tests/test_asgi_routes.py``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from admitgate._admitgate import _jsonrpc_request
from hypothesis import given, settings
from hypothesis import strategies as st

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_methods = st.sampled_from(["SendMessage", "GetTask", "message/send", "tasks/resubscribe", ""])
_keys = st.sampled_from(["method", "id", "params", "jsonrpc", "\u006dethod", "x"])


def expected(body: bytes) -> Any:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if type(value) is not dict:
        return None
    method = value.get("method")
    rpc_id = value.get("id")
    if isinstance(rpc_id, bool) or not isinstance(rpc_id, str | int):
        rpc_id = None
    return (method if isinstance(method, str) else None, rpc_id)


@st.composite
def bodies(draw: Any) -> bytes:
    members = draw(st.lists(st.tuples(_keys, st.one_of(_methods, _values)), min_size=0, max_size=5))
    space = draw(st.sampled_from(["", " ", "\n\t", "\r"]))
    text = (
        "{"
        + ",".join(f"{space}{json.dumps(k)}{space}:{space}{json.dumps(v)}" for k, v in members)
        + "}"
    )
    data = (space + text + space).encode("utf-8")
    mutation = draw(st.sampled_from(["none", "cut", "insert", "utf16"]))
    if mutation == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mutation == "insert":
        at = draw(st.integers(0, len(data)))
        data = (
            data[:at]
            + draw(st.sampled_from([b",", b"}", b"\\", b'"', b"\x00", b"\xff"]))
            + data[at:]
        )
    elif mutation == "utf16":
        data = data.decode("utf-8").encode(
            draw(st.sampled_from(["utf-16-le", "utf-16-be", "utf-32"]))
        )
    return data


@settings(max_examples=400, deadline=None)
@given(bodies())
def test_the_broker_reads_what_json_loads_reads(body: bytes) -> None:
    got = _jsonrpc_request(body)
    if got is False:  # encoded surrogates: the broker gates rather than guesses
        return
    assert got == expected(body), body


def test_adversarial_bodies_are_read_in_linear_time() -> None:
    for body in (
        b'{"a":' + b"[" * 200_000,
        b'{"a":"' + b'\\"' * 200_000,
        b"{" + b'"a":1,' * 50_000,
        b'{"method":"SendMessage","x":' + b"[" * 3000 + b"]" * 3000 + b"}",
    ):
        started = time.perf_counter()
        _jsonrpc_request(body)
        assert time.perf_counter() - started < 0.5
