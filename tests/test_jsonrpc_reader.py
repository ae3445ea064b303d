"""The JSON-RPC reader (``crates/classify``), the one both the HTTP middleware and the broker
read request bodies with, against the real things it mirrors:

- ``json.loads(bytes)``, the parser the A2A SDK reads the body with (Starlette's
  ``request.json()``): on generated request bodies, mutated, cut and re-encoded (UTF-8 with
  and without a BOM, UTF-16, UTF-32, lone surrogates), both see the same ``method`` and ``id``
  (or both no request);
- the A2A SDK's own JSON-RPC handling (``create_jsonrpc_routes`` with its v0.3 adapter, a
  real ``DefaultRequestHandler`` and executor): whenever the SDK runs agent work for a body,
  the middleware's rules gate it, and the ``id`` a refusal would carry is the one the SDK
  echoes in its own answer (ints of any size, strings; ``null`` for floats, booleans and the
  rest);
- a prefix of a body too long to read whole: the ``id`` is found whenever the member that
  holds it ends within the prefix, and is never a wrong one.

Time bounds on adversarial shapes are in ``tests/test_asgi_parsers.py``.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import uuid
from typing import Any

import pytest
from _a2a_app import ControlledExecutor, Latches, build_sdk_app
from admitgate._admitgate import A2ARules, _jsonrpc_request
from hypothesis import given, settings
from hypothesis import strategies as st

# -- what json.loads and the SDK make of a body ------------------------------------------------


def _clean(text: object) -> bool:
    """A str of Unicode scalar values (no lone surrogate): one a response can carry."""
    if not isinstance(text, str):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def sdk_id(value: object) -> object:
    """The id as the A2A SDK echoes it (``JsonRpcDispatcher.handle_requests``: str or int,
    not bool; and a str it can encode)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    if isinstance(value, str) and not _clean(value):
        return None
    return value


def expected(body: bytes) -> Any:
    """What the reader must return for ``body``: ``json.loads`` as the SDK calls it."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if type(value) is not dict:
        return None
    method = value.get("method")
    return (method if _clean(method) else None, sdk_id(value.get("id")))


def same(a: object, b: object) -> bool:
    """Equal, and of the same type (``1 == True == 1.0`` but only ``1`` is an id)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# -- generated bodies ---------------------------------------------------------------------------

_SDK_METHODS = [
    "SendMessage",
    "SendStreamingMessage",
    "SubscribeToTask",
    "GetTask",
    "ListTasks",
    "CancelTask",
    "message/send",
    "message/stream",
    "tasks/resubscribe",
    "tasks/get",
    "tasks/cancel",
]
_METHODS = st.sampled_from([*_SDK_METHODS, "", "sendmessage", "SendMessage\ud800", "x"])
_IDS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, -1, 2**63, -(2**63) - 1, True, False, None, 1.0, 1.5, 1e300, -0.0]),
    st.text(max_size=6),
    st.sampled_from(["\ud800", "a\udc00", "\ud83d\ude00", ""]),
    st.lists(st.integers(), max_size=2),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
# Keys, escaped ones included: "\u006dethod" is "method" once decoded.
_KEYS = st.sampled_from(["method", "id", "params", "jsonrpc", "x", "\\u006dethod", "i\\u0064"])
_ENCODINGS = st.sampled_from(
    ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
)


def _member(key: str, value: object, space: str) -> str:
    name = '"' + key + '"' if "\\" in key else json.dumps(key)
    return f"{space}{name}{space}:{space}{json.dumps(value, allow_nan=True)}"


def _params(method: str, text: str) -> dict[str, Any]:
    """Params the SDK accepts for ``method`` (v0.3 names take the v0.3 message shape)."""
    if "/" in method:
        parts: list[Any] = [{"kind": "text", "text": text}]
        return {"message": {"role": "user", "parts": parts, "messageId": uuid.uuid4().hex}}
    return {"message": {"role": "ROLE_USER", "parts": [{"text": text}], "messageId": "m"}}


def _encode(text: str, encoding: str) -> bytes:
    # surrogatepass: json.loads(bytes) decodes with it, so a lone surrogate may be raw.
    data = text.encode(encoding.removesuffix("-sig"), "surrogatepass")
    return codecs.BOM_UTF8 + data if encoding == "utf-8-sig" else data


@st.composite
def bodies(draw: Any) -> bytes:
    """A request object (often one the SDK runs), then perhaps mutated."""
    method = draw(_METHODS)
    members: list[tuple[str, object]] = [
        ("jsonrpc", draw(st.sampled_from(["2.0", "2.0", "1.0"]))),
        ("id", draw(_IDS)),
        ("method", method),
        ("params", _params(method, "echo x") if draw(st.booleans()) else draw(_VALUES)),
    ]
    members = draw(st.permutations(members))
    extra = draw(st.lists(st.tuples(_KEYS, st.one_of(_METHODS, _IDS, _VALUES)), max_size=3))
    members.extend(extra)
    if draw(st.booleans()):  # a junk member holding a lone surrogate
        members.insert(draw(st.integers(0, len(members))), ("junk", "\udc80"))
    space = draw(st.sampled_from(["", " ", "\n\t", "\r"]))
    text = space + "{" + ",".join(_member(k, v, space) for k, v in members) + "}" + space
    data = _encode(text, draw(_ENCODINGS))
    mutation = draw(st.sampled_from(["none", "none", "cut", "insert"]))
    if mutation == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mutation == "insert":
        at = draw(st.integers(0, len(data)))
        byte = draw(st.sampled_from([b",", b"}", b"\\", b'"', b"\x00", b"\xff", b"\xed\xa0\x80"]))
        data = data[:at] + byte + data[at:]
    return data


@settings(max_examples=300, deadline=None)
@given(bodies())
def test_the_reader_reads_what_json_loads_reads(body: bytes) -> None:
    got = _jsonrpc_request(body)
    want = expected(body)
    assert same(got, want), (body, got, want)


@given(
    value=_VALUES,
    encoding=_ENCODINGS,
    before=st.sampled_from(["", " ", "\n\t"]),
    after=st.binary(max_size=4) | st.sampled_from([b"", b" \r\n", b"\x0b", b"\xa0", b"}"]),
)
@settings(max_examples=200, deadline=None)
def test_any_value_in_any_encoding_with_any_tail(
    value: Any, encoding: str, before: str, after: bytes
) -> None:
    body = _encode(before + json.dumps({"method": value, "id": value}), encoding) + after
    for cut in (len(body), 1, 2, len(body) // 2):
        assert same(_jsonrpc_request(body[:cut]), expected(body[:cut])), body[:cut]


def test_lone_surrogates_are_read_as_json_loads_reads_them() -> None:
    """Fails before the fix: a body in UTF-16 or UTF-32 holding a lone surrogate was "not
    JSON" to the reader while json.loads (the SDK) reads it, so the broker passed a
    SendMessage ungated; in UTF-8 the reader gave up and gated it whatever its method."""
    text = '{"method": "SendMessage", "id": 7, "x": "\udc00"}'
    for encoding in ("utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-be"):
        body = text.encode(encoding, "surrogatepass")
        assert json.loads(body)["method"] == "SendMessage"
        assert _jsonrpc_request(body) == ("SendMessage", 7), encoding
    text = '{"method": "GetTask", "id": 7, "x": "\ud800"}'
    assert _jsonrpc_request(text.encode("utf-8", "surrogatepass")) == ("GetTask", 7)
    # An id holding one cannot be echoed (the SDK's own answer fails to encode): null.
    assert _jsonrpc_request(b'{"method": "SendMessage", "id": "\\ud800"}') == ("SendMessage", None)


# -- the A2A SDK's own JSON-RPC handling ------------------------------------------------------

_RULES = A2ARules("", "/", gate_all=False, max_peek_bytes=1 << 20)


class _SdkApp:
    """The SDK's JSON-RPC routes with a real request handler, called in-process (raw ASGI)."""

    def __init__(self) -> None:
        self.executor = ControlledExecutor(Latches())
        self.app = build_sdk_app(self.executor, "http://testserver")
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def post(self, body: bytes, version: bytes | None) -> tuple[int, bytes, bool]:
        """``(status, body, ran)``: the SDK's answer, and whether the executor ran."""
        try:
            return self.loop.run_until_complete(asyncio.wait_for(self._post(body, version), 10))
        finally:
            self.loop.run_until_complete(self._settle())

    async def _settle(self) -> None:
        """Let the SDK's own tasks for the request finish, then end what is left (a
        watcher of the client's receive), so no request's tasks outlive it."""
        for _ in range(20):
            await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    async def _post(self, body: bytes, version: bytes | None) -> tuple[int, bytes, bool]:
        sent: list[dict[str, Any]] = []
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"content-type", b"application/json")]
        if version is not None:
            headers.append((b"a2a-version", version))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/",
            "raw_path": b"/",
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "server": ("testserver", 80),
            "client": ("127.0.0.1", 1),
        }
        before = self.executor.executions
        try:
            await self.app(scope, receive, send)
        except Exception:  # the SDK's own 500 (ServerErrorMiddleware sent it, then raised)
            pass
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, data, self.executor.executions > before


@pytest.fixture(scope="module")
def sdk() -> Any:
    app = _SdkApp()
    yield app
    app.close()


def _echoed_id(status: int, data: bytes) -> tuple[bool, object]:
    """``(answered, id)``: the id in the SDK's JSON-RPC answer (a JSON body, or the first
    event of an SSE stream); ``answered`` False if it gave no JSON-RPC answer at all."""
    if data.startswith(b"data:"):
        data = data.partition(b"\n")[0].removeprefix(b"data:")
    try:
        answer = json.loads(data)
    except ValueError:
        return False, None
    return status == 200 and isinstance(answer, dict) and "id" in answer, answer.get("id")


def _check_against_sdk(sdk: _SdkApp, body: bytes) -> bool:
    """Checks one body against the SDK; True if the SDK ran work for it."""
    read = _jsonrpc_request(body)
    method = read[0] if read else None
    version = None if method is not None and "/" in method else b"1.0"
    status, data, ran = sdk.post(body, version)
    gated, refusal_id = _RULES.jsonrpc(body, True)
    if ran:  # agent work ran: the middleware must have gated it
        assert gated, (body, data)
    answered, echoed = _echoed_id(status, data)
    if answered:
        assert same(read[1] if read else None, echoed), (body, read, data)
        if gated:
            assert same(refusal_id, echoed), (body, refusal_id, data)
    elif read is not None and gated:
        # No JSON-RPC answer at all: the SDK failed on an id it could not encode (a 500, or
        # a stream that ends empty); a refusal answers that id as null.
        assert refusal_id is None, (body, status, data)
    return ran


@settings(max_examples=150, deadline=None)
@given(bodies())
def test_the_sdk_never_runs_work_the_rules_pass_and_echoes_the_refusals_id(
    sdk: _SdkApp, body: bytes
) -> None:
    _check_against_sdk(sdk, body)


def test_the_sdk_oracle_runs_work(sdk: _SdkApp) -> None:
    """The differential above is not vacuous: these bodies run agent work in the SDK, and
    the rules gate each with the id the SDK echoes."""
    for method in ("SendMessage", "SendStreamingMessage", "message/send", "message/stream"):
        for rpc_id in (7, 10**30, -(2**63) - 1, "a\u00e9", "\ud83d\ude00"):
            request = {"jsonrpc": "2.0", "id": rpc_id, "method": method}
            request["params"] = _params(method, "echo x")
            for encoding in ("utf-8", "utf-8-sig", "utf-16", "utf-32-be"):
                body = _encode(json.dumps(request), encoding)
                assert _check_against_sdk(sdk, body), (method, rpc_id, encoding)
        # A lone surrogate, raw in UTF-16 or UTF-8, where the SDK ignores it (an unknown
        # params field): the SDK runs the work, so it must be gated (the reader once found
        # such a UTF-16 body "not JSON", and the broker passed it).
        request = {"jsonrpc": "2.0", "id": 3, "method": method}
        request["params"] = {**_params(method, "echo x"), "x": "\udc00"}
        for encoding in ("utf-8", "utf-16", "utf-32"):
            body = json.dumps(request, ensure_ascii=False).encode(encoding, "surrogatepass")
            assert _check_against_sdk(sdk, body), (method, encoding)
        # A float id is not echoed (the SDK answers null), nor is the request refused less.
        body = json.dumps(
            {"jsonrpc": "2.0", "id": 1.0, "method": method, "params": _params(method, "echo x")}
        )
        assert _RULES.jsonrpc(body.encode(), True) == (True, None)


# -- a prefix of a body too long to read whole --------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(bodies(), st.data())
def test_a_prefix_gives_the_id_or_none_never_a_wrong_one(body: bytes, data: st.DataObject) -> None:
    limit = data.draw(st.integers(min_value=1, max_value=max(1, len(body))))
    rules = A2ARules("", "/", gate_all=False, max_peek_bytes=limit)
    gated, rpc_id = rules.jsonrpc(body, False)
    assert gated
    whole = expected(body)
    if rpc_id is not None and whole is not None:
        # The id of a top-level member that ended inside the prefix: with duplicate keys an
        # earlier one may be found (the last is past the prefix), never one from inside a value.
        ids = [sdk_id(v) for k, v in _members(body) if k == "id"]
        assert any(same(rpc_id, i) for i in ids), (body[:limit], rpc_id, ids)


def _members(body: bytes) -> list[tuple[str, object]]:
    try:
        return json.loads(body, object_pairs_hook=lambda pairs: pairs)  # type: ignore[no-any-return]
    except (ValueError, RecursionError):
        return []


def test_a_prefix_reads_only_the_top_level() -> None:
    big = "x" * 5000
    rules = A2ARules("", "/", gate_all=False, max_peek_bytes=2000)
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "params": {"method": "GetTask", "id": "inner", "message": {"text": big}},
            "method": "GetTask",
            "id": 42,
        }
    ).encode()
    # Cut inside params: the id is not known yet, and a read past the prefix is gated.
    assert rules.jsonrpc(body, True) == (True, None)
    body = json.dumps({"id": "abc", "method": "GetTask", "params": {"t": big}}).encode()
    assert rules.jsonrpc(body, True) == (True, "abc")
    assert rules.jsonrpc(body[:100], False) == (True, "abc")
    # A number cut by the prefix is not trusted; a float or null id is echoed as null.
    assert rules.jsonrpc(b'{"id": 12', False) == (True, None)
    assert rules.jsonrpc(b'{"id": 12,', False) == (True, 12)
    assert rules.jsonrpc(b'{"id": 1.5,', False) == (True, None)
    assert rules.jsonrpc(b"[1, 2]", False) == (True, None)
    assert rules.jsonrpc(b'{"a": [1, {"b": "]}"}], "id": "z", ', False) == (True, "z")
    assert rules.jsonrpc(b'{"a": "\\"id\\": 1", "id": null, "method": "m"', False) == (True, None)
    # Escaped keys are keys; only JSON whitespace separates tokens.
    assert rules.jsonrpc(b'{"\\u0069d": 7, "params": [', False) == (True, 7)
    assert rules.jsonrpc(b'{\x0b"id": 1, "params": [', False) == (True, None)
    # Every top-level member counts (json.loads keeps the last of duplicate keys).
    many = b'{"id": 1, ' + b'"x": 0, ' * 100 + b'"id": 3, "params": ['
    assert rules.jsonrpc(many, False) == (True, 3)
