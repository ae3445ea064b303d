"""AdmissionMiddleware's classification against the A2A SDK's real routes in Starlette's router.

The middleware must gate a request exactly when the app behind it would run agent work for it,
so its verdict is checked against the endpoint the real router reaches: the SDK's own routes
(``create_agent_card_routes``, ``create_jsonrpc_routes``, ``create_rest_routes`` with v0.3
compatibility) in a real ``Starlette`` app, each endpoint replaced by a recorder (the route
table, matching, mounts, 405s and redirects are Starlette's own; only the endpoints' bodies are
not run). Which endpoint is which verdict is the one thing the test states: the SDK's handler
names for SendMessage, SendStreamingMessage and SubscribeToTask are work, the other A2A
handlers are reads, and everything else (the agent card, custom routes, 404, 405, redirects)
is not A2A.

Paths are generated from an alphabet of the route names (every one of them as a tenant), ``:``,
``%``, ``/``, empty segments, newlines and non-ASCII text, plus an exhaustive sweep of every
route under every such tenant.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Iterator
from typing import Any

import admitgate
import pytest
from _a2a_app import ControlledExecutor, Latches, agent_card, build_sdk_app
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore
from admitgate.asgi import _JSONRPC, _PASS, _REST_READ, _REST_WORK, AdmissionMiddleware
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette._utils import get_route_path
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Mount, Route

# The SDK handlers that start or continue agent work (REST dispatcher and v0.3 adapter names).
WORK_HANDLERS = frozenset({"on_message_send", "on_message_send_stream", "on_subscribe_to_task"})
JSONRPC_HANDLERS = frozenset({"handle_requests"})

TOKENS = (
    "message:send",
    "message:stream",
    "tasks",
    "v1",
    "card",
    "extendedAgentCard",
    "pushNotificationConfigs",
    "a2a",
    "t1",
    ":subscribe",
    ":cancel",
    "x:subscribe",
    "x:cancel",
    "message",
    ":",
    "%",
    "%2F",
    "",
    "\n",
    "\u00e9",
    "\u4e2d",
    ".well-known",
    "agent-card.json",
    "custom",
)
METHODS = ("GET", "HEAD", "POST", "DELETE", "PUT", "get")


def _verdict(route: Route) -> int:
    endpoint: Any = route.endpoint
    if isinstance(endpoint, functools.partial):  # the v0.3 adapter: partial(_handle, handler)
        endpoint = endpoint.args[0]
    name = getattr(endpoint, "__name__", "")
    if name in JSONRPC_HANDLERS:
        return _JSONRPC
    if name in WORK_HANDLERS:
        return _REST_WORK
    module = getattr(endpoint, "__module__", "") or ""
    if name.startswith(("on_", "get_", "set_", "list_", "delete_", "handle_")) and (
        module.startswith("a2a.") and "card_routes" not in module
    ):
        return _REST_READ
    return _PASS


class Oracle:
    """A Starlette app with the SDK's routes whose endpoints only record that they were hit."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.hit: list[int] = []
        # What the reached endpoint saw as path_params["tenant"] (None: no tenant route).
        self.tenants: list[str | None] = []
        self.loop = asyncio.new_event_loop()
        seen: set[int] = set()
        self.route_paths: list[str] = []
        self._instrument(app.router.routes, seen, "")

    def _instrument(self, routes: list[BaseRoute], seen: set[int], prefix: str) -> None:
        for route in routes:
            if isinstance(route, Mount):
                self._instrument(route.routes, seen, prefix + route.path)
            elif isinstance(route, Route) and id(route) not in seen:
                seen.add(id(route))
                self.route_paths.append(route.path)
                route.app = self._recorder(_verdict(route))

    def _recorder(self, verdict: int) -> Any:
        async def endpoint(scope: Any, receive: Any, send: Any) -> None:
            self.hit.append(verdict)
            self.tenants.append(scope.get("path_params", {}).get("tenant"))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        return endpoint

    def verdict(self, method: str, path: str, root_path: str = "") -> int:
        """What the endpoint Starlette reaches for this request does (_PASS: none reached)."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "server": ("testserver", 80),
            "path": path,
            "raw_path": path.encode("utf-8", "surrogateescape"),
            "root_path": root_path,
            "query_string": b"",
            "headers": [(b"host", b"testserver")],
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Any) -> None:
            return None

        self.hit.clear()
        self.tenants.clear()
        self.loop.run_until_complete(self.app(scope, receive, send))
        assert len(self.hit) <= 1
        return self.hit[0] if self.hit else _PASS

    def close(self) -> None:
        self.loop.close()


def _handler() -> DefaultRequestHandler:
    card = agent_card("http://testserver")
    return DefaultRequestHandler(
        agent_executor=ControlledExecutor(Latches()),
        task_store=InMemoryTaskStore(),
        agent_card=card,
    )


def _middleware(**kwargs: Any) -> AdmissionMiddleware:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    gate = admitgate.build_admission_gate(max_concurrent_runs=1)
    return AdmissionMiddleware(app, gate, **kwargs)


@pytest.fixture(scope="module")
def root() -> Iterator[Oracle]:
    """The test suite's SDK app (tests/_a2a_app.py): card, JSON-RPC at /, REST with v0.3."""
    oracle = Oracle(build_sdk_app(ControlledExecutor(Latches()), "http://testserver"))
    yield oracle
    oracle.close()


@pytest.fixture(scope="module")
def no_compat() -> Iterator[Oracle]:
    """The SDK's routes without the v0.3 compatibility routes."""
    handler = _handler()
    app = Starlette(
        routes=[
            *create_agent_card_routes(handler._agent_card),  # type: ignore[attr-defined]
            *create_jsonrpc_routes(handler, "/"),
            *create_rest_routes(handler),
        ]
    )
    oracle = Oracle(app)
    yield oracle
    oracle.close()


@pytest.fixture(scope="module")
def prefixed() -> Iterator[tuple[Oracle, Oracle]]:
    """The two layouts of A2A under /a2a: the SDK's path_prefix, and a Starlette Mount."""
    handler = _handler()
    card = create_agent_card_routes(agent_card("http://testserver"))
    sdk_prefix = Starlette(
        routes=[
            *card,
            *create_jsonrpc_routes(handler, "/a2a/", enable_v0_3_compat=True),
            *create_rest_routes(handler, enable_v0_3_compat=True, path_prefix="/a2a"),
        ]
    )
    mounted = Starlette(
        routes=[
            *card,
            Mount(
                "/a2a",
                routes=[
                    *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True),
                    *create_rest_routes(handler, enable_v0_3_compat=True),
                ],
            ),
        ]
    )
    oracles = (Oracle(sdk_prefix), Oracle(mounted))
    yield oracles
    for oracle in oracles:
        oracle.close()


_SEGMENT = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=3).map("".join)
_PATHS = st.tuples(
    st.lists(_SEGMENT, max_size=5).map(lambda segs: "/" + "/".join(segs)),
    st.sampled_from(["", "", "", "/", "\n", "/\n", "\n\n"]),
).map("".join)
_ROOTS = st.sampled_from(["", "", "", "/r", "/tasks"])


def _rooted(root_path: str, path: str, under: bool) -> str:
    return root_path + path if under and root_path else path


@given(method=st.sampled_from(METHODS), path=_PATHS, root_path=_ROOTS, under=st.booleans())
@settings(max_examples=150, deadline=None)
def test_classification_matches_the_sdk_router(
    root: Oracle, method: str, path: str, root_path: str, under: bool
) -> None:
    """Fails before the fix: e.g. POST /tasks/message:send was taken for GET /tasks/{id}."""
    path = _rooted(root_path, path, under)
    expected = root.verdict(method, path, root_path)
    assert _middleware()._classify(method, path, root_path) == expected, (method, path)


def _route_tenant(oracle: Oracle, method: str, path: str, root_path: str = "") -> str | None:
    """The tenant Starlette's router handed the SDK endpoint it reached (None: no endpoint,
    or one outside the tenant mount)."""
    oracle.verdict(method, path, root_path)
    return oracle.tenants[0] if oracle.tenants else None


@given(method=st.sampled_from(METHODS), path=_PATHS, root_path=_ROOTS, under=st.booleans())
@settings(max_examples=150, deadline=None)
def test_the_tenant_is_the_sdk_routers(
    root: Oracle, method: str, path: str, root_path: str, under: bool
) -> None:
    """The tenant crates/classify takes from a path (the broker's ``--tenant-from path``)
    is ``path_params["tenant"]`` of the endpoint the real router reaches."""
    path = _rooted(root_path, path, under)
    expected = _route_tenant(root, method, path, root_path)
    rules = _middleware()._rules
    assert rules.tenant(method, path, root_path) == expected, (method, path, root_path)


def _sweep(route_paths: list[str]) -> Iterator[str]:
    """Every SDK route path with {id} and {push_id} filled from TOKENS, alone and under every
    token as a tenant."""
    ids = ("t1", "message:send", "tasks", ":subscribe", "")
    paths = set()
    for template in route_paths:
        for value in ids:
            paths.add(template.replace("{id}", value).replace("{push_id}", value))
    for path in sorted(paths):
        yield path
        for tenant in TOKENS:
            yield "/" + tenant + path


def test_every_route_under_every_tenant(root: Oracle) -> None:
    """Exhaustive over tenants: ``tasks``, ``message:send``, ``v1``, ``extendedAgentCard``,
    ``%2F``, empty... in front of every route of the SDK."""
    middleware = _middleware()
    mismatches = []
    for path in _sweep(root.route_paths):
        for method in ("GET", "POST", "DELETE"):
            expected = root.verdict(method, path)
            got = middleware._classify(method, path, "")
            if got != expected:
                mismatches.append((method, path, got, expected))
            tenant = root.tenants[0] if root.tenants else None
            if middleware._rules.tenant(method, path, "") != tenant:
                mismatches.append((method, path, "tenant", tenant))
    assert not mismatches, mismatches[:20]


@given(method=st.sampled_from(METHODS), path=_PATHS)
@settings(max_examples=100, deadline=None)
def test_without_v03_routes_work_is_still_exactly_work(
    no_compat: Oracle, method: str, path: str
) -> None:
    """The middleware assumes the v0.3 routes exist. Without them the SDK routes /v1/... to
    the tenant "v1" instead, which can only turn a read into a 404 (/v1/card): what is work
    is the same either way."""
    expected = no_compat.verdict(method, path)
    got = _middleware()._classify(method, path, "")
    assert (got in (_REST_WORK, _JSONRPC)) == (expected in (_REST_WORK, _JSONRPC)), (method, path)
    if got != expected:
        assert (got, expected) == (_REST_READ, _PASS) and "/v1/" in path, (method, path)


# Under a prefix the JSON-RPC endpoint "/a2a/" is also recognised as "/a2a" (the redirect to
# it, and the endpoint of an app whose rpc_url is "/a2a"), so a mismatch between rpc_url and
# jsonrpc_path never lets SendMessage through ungated; "/a2a" and "/a2a\n" are gated although
# these two layouts answer them with a redirect or a 404.
PREFIX_RPC_TWINS = frozenset({"/a2a", "/a2a\n"})


@given(method=st.sampled_from(METHODS), path=_PATHS, prefix=st.booleans())
@settings(max_examples=100, deadline=None)
def test_under_a_prefix_work_in_either_layout_is_gated(
    prefixed: tuple[Oracle, Oracle], method: str, path: str, prefix: bool
) -> None:
    """With ``path_prefix="/a2a"`` the verdict is the strongest of the two layouts."""
    if prefix:
        path = "/a2a" + path
    expected = max(oracle.verdict(method, path) for oracle in prefixed)
    got = _middleware(path_prefix="/a2a")._classify(method, path, "")
    if got != expected and got == _JSONRPC and expected == _PASS:
        assert method == "POST" and get_route_path({"path": path}) in PREFIX_RPC_TWINS
        return
    assert got == expected, (method, path)


def test_the_known_bypasses() -> None:
    """The requests issue 15 reported, and the ones the generated tests found, by name."""
    middleware = _middleware()
    assert middleware._classify("POST", "/tasks/message:send", "") == _REST_WORK
    assert middleware._classify("POST", "/tasks/message:stream", "") == _REST_WORK
    assert middleware._classify("GET", "/tasks/message:send", "") == _REST_READ
    assert middleware._classify("POST", "/message:send\n", "") == _REST_WORK
    assert middleware._classify("POST", "/\n", "") == _JSONRPC
    assert middleware._classify("POST", "/v1/message:send", "") == _REST_WORK
    assert middleware._classify("POST", "/message:send/message:send", "") == _REST_WORK


def test_jsonrpc_work_methods_are_the_sdks_work_methods() -> None:
    """The JSON-RPC side of the same rule: the methods the middleware gates are exactly the
    ones the SDK's dispatchers (1.0 and the v0.3 adapter) route to SendMessage,
    SendStreamingMessage, SubscribeToTask and their v0.3 forms."""
    from a2a.compat.v0_3.jsonrpc_adapter import JSONRPC03Adapter
    from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher

    work_models = {
        "SendMessageRequest",
        "SendStreamingMessageRequest",
        "SubscribeToTaskRequest",
        "TaskResubscriptionRequest",
    }
    tables = {**JsonRpcDispatcher.METHOD_TO_MODEL, **JSONRPC03Adapter.METHOD_TO_MODEL}
    sdk_work = {method for method, model in tables.items() if model.__name__ in work_models}
    assert len(sdk_work) == 6
    rules = _middleware()._rules
    for method in tables:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method}).encode()
        assert rules.jsonrpc(body, True)[0] == (method in sdk_work), method
