"""Which A2A endpoint a request reaches, decided exactly as Starlette routes the SDK's routes.

:class:`admitgate.asgi.AdmissionMiddleware` must gate a request exactly when the app behind it
would run agent work for it. An approximation of the A2A routes is a bypass wherever it and the
app's router disagree: with the SDK's tenant routes (``Mount("/{tenant}", ...)``) a tenant
named ``tasks`` turns ``POST /tasks/message:send`` into ``SendMessage``, which a "``/tasks/{id}``
is a read" shortcut lets through ungated. So this module does not approximate: it holds the
route table that ``a2a.server.routes.create_jsonrpc_routes`` and ``create_rest_routes`` build
(a2a-sdk 1.x, v0.3 compatibility routes included), in the SDK's order, and matches a path
against it with Starlette's own rules:

- a route's path is a regular expression built as ``starlette.routing.compile_path`` builds
  it: literal text, ``[^/]+`` for a parameter, anchored with ``^`` and ``$`` (so, as in
  Starlette, ``$`` also matches before one final newline: ``/message:send%0A`` is
  ``SendMessage``);
- the first route whose path matches *and* whose methods include the request's wins
  (``GET`` includes ``HEAD``); a route whose path matches with another method (a 405),
  no route at all (a 404) or a trailing-slash redirect runs no endpoint;
- a ``Mount`` matches its path followed by ``/{path:path}`` (``.*``, which stops at a
  newline) and routes the rest below it, with the ``root_path`` and route path that
  ``Mount.matches`` and ``starlette._utils.get_route_path`` compute.

The test ``tests/test_asgi_routes.py`` checks this against the real SDK routes in a real
Starlette router, on generated paths. No Starlette import here: the middleware has no
framework dependency.

Linear time: each route is a regular expression of literals and ``[^/]+`` runs, each followed
by a literal that ``[^/]+`` cannot contain or by a fixed suffix, so a match attempt backtracks
at most the length of the suffix per character; a path is matched against a fixed number of
them.
"""

from __future__ import annotations

import re
from typing import Final

PASS: Final = 0
"""Not an A2A endpoint (or no endpoint at all: 404, 405, a redirect): passes through."""
READ: Final = 1
"""An A2A REST endpoint that reads, cancels or configures."""
WORK: Final = 2
"""An A2A REST endpoint that starts or continues agent work."""
JSONRPC: Final = 3
"""The JSON-RPC endpoint: the body says what it does."""

# The routes of create_rest_routes(path_prefix=P, enable_v0_3_compat=True), in its order:
# the v0.3 routes (REST03Adapter.routes), then the 1.0 routes, each as (path below P, method,
# kind). The 1.0 routes are also mounted under "/{tenant}" (after everything else).
_V03: Final = (
    ("/v1/message:send", "POST", WORK),
    ("/v1/message:stream", "POST", WORK),
    ("/v1/tasks/{id}:cancel", "POST", READ),
    ("/v1/tasks/{id}:subscribe", "GET", WORK),
    ("/v1/tasks/{id}:subscribe", "POST", WORK),
    ("/v1/tasks/{id}", "GET", READ),
    ("/v1/tasks/{id}/pushNotificationConfigs/{push_id}", "GET", READ),
    ("/v1/tasks/{id}/pushNotificationConfigs", "POST", READ),
    ("/v1/tasks/{id}/pushNotificationConfigs", "GET", READ),
    ("/v1/card", "GET", READ),
)
_V10: Final = (
    ("/message:send", "POST", WORK),
    ("/message:stream", "POST", WORK),
    ("/tasks/{id}:cancel", "POST", READ),
    ("/tasks/{id}:subscribe", "GET", WORK),
    ("/tasks/{id}:subscribe", "POST", WORK),
    ("/tasks/{id}", "GET", READ),
    ("/tasks/{id}/pushNotificationConfigs/{push_id}", "GET", READ),
    ("/tasks/{id}/pushNotificationConfigs/{push_id}", "DELETE", READ),
    ("/tasks/{id}/pushNotificationConfigs", "POST", READ),
    ("/tasks/{id}/pushNotificationConfigs", "GET", READ),
    ("/tasks", "GET", READ),
    ("/extendedAgentCard", "GET", READ),
)

_PARAM: Final = re.compile(r"\{[a-z_]+\}")


def _path_regex(path: str) -> str:
    """The body of Starlette's regex for a route path: literals escaped, ``{name}`` as
    ``[^/]+`` (the ``str`` convertor)."""
    literals = _PARAM.split(path)
    return "[^/]+".join(re.escape(literal) for literal in literals)


def route_path(path: str, root_path: str) -> str:
    """The path a Starlette router matches: ``path`` below ``root_path`` (as
    ``starlette._utils.get_route_path``)."""
    if not root_path or not path.startswith(root_path):
        return path
    if path == root_path:
        return ""
    if path[len(root_path)] == "/":
        return path[len(root_path) :]
    return path


class Router:
    """Routes (path template, method, kind) in order, then at most one mount, as Starlette's
    ``Router`` tries them."""

    __slots__ = ("_by_method", "_mount", "_inner")

    def __init__(
        self,
        routes: tuple[tuple[str, str, int], ...],
        mount: tuple[str, Router] | None = None,
    ) -> None:
        # Starlette takes the first route in order whose path matches and whose methods
        # include the request's (Match.FULL); routes of other methods only make 405s. So per
        # method, the routes that accept it, in order, split for speed into:
        # - routes without parameters, whose "^literal$" matches exactly the literal and the
        #   literal plus one final newline: a dict from those paths to (order, kind);
        # - routes with parameters: one alternation in order (the regex engine tries
        #   alternatives in order, so the first group that matched is the first route that
        #   matches), tried only when the path starts with one of their literal heads
        #   (a path that starts with none cannot match any of them).
        # The winner is the earlier of the two candidates.
        methods = {m for _, m, _ in routes}
        if "GET" in methods:
            methods.add("HEAD")  # Starlette: a GET route answers HEAD too
        self._by_method: dict[str, _MethodTable] = {}
        for method in methods:
            exact: dict[str, tuple[int, int]] = {}
            heads: list[str] = []
            alternatives: list[str] = []
            ordered: list[tuple[int, int]] = []
            for order, (path, m, kind) in enumerate(routes):
                if not (m == method or (method == "HEAD" and m == "GET")):
                    continue
                if _PARAM.search(path) is None:
                    for literal in (path, path + "\n"):
                        exact.setdefault(literal, (order, kind))
                else:
                    heads.append(_PARAM.split(path)[0])
                    alternatives.append(f"(^{_path_regex(path)}$)")
                    ordered.append((order, kind))
            pattern = re.compile("|".join(alternatives)) if alternatives else None
            self._by_method[method] = (exact, tuple(dict.fromkeys(heads)), pattern, tuple(ordered))
        self._mount: re.Pattern[str] | None = None
        self._inner: Router | None = None
        if mount is not None:
            # Mount(path) matches path + "/{path:path}"; the "path" convertor is ".*".
            self._mount = re.compile(f"^{_path_regex(mount[0])}/(.*)$")
            self._inner = mount[1]

    def kind(self, method: str, path: str, root_path: str) -> int:
        """What the endpoint this router reaches for ``method path`` does (:data:`PASS` when
        it reaches none)."""
        rpath = route_path(path, root_path) if root_path else path
        table = self._by_method.get(method)
        if table is not None:
            exact, heads, pattern, ordered = table
            best = exact.get(rpath)
            if pattern is not None and rpath.startswith(heads):
                match = pattern.match(rpath)
                if match is not None:
                    found = ordered[match.lastindex - 1]  # type: ignore[operator]
                    if best is None or found[0] < best[0]:
                        best = found
            if best is not None:
                return best[1]
        if self._mount is not None and self._inner is not None:
            match = self._mount.match(rpath)
            if match is not None:
                # As Mount.matches: what the mount consumed joins the root path below it.
                remaining = "/" + match.group(1)
                return self._inner.kind(method, path, root_path + rpath[: -len(remaining)])
        return PASS


# Per method: exact paths -> (order, kind); the literal heads of the routes with parameters;
# their alternation; and (order, kind) of each alternative.
_MethodTable = tuple[
    dict[str, tuple[int, int]],
    tuple[str, ...],
    "re.Pattern[str] | None",
    tuple[tuple[int, int], ...],
]


def _at(prefix: str, routes: tuple[tuple[str, str, int], ...]) -> tuple[tuple[str, str, int], ...]:
    return tuple((prefix + path, method, kind) for path, method, kind in routes)


def _jsonrpc(path: str) -> tuple[tuple[str, str, int], ...]:
    # The endpoint and its trailing-slash twin (Starlette redirects one to the other): an app
    # whose rpc_url differs from jsonrpc_path by that slash is still gated, never bypassed.
    rpc = path.rstrip("/")
    return tuple((p, "POST", JSONRPC) for p in dict.fromkeys((rpc or "/", rpc + "/")))


def sdk_routers(prefix: str, jsonrpc_path: str | None) -> tuple[Router, ...]:
    """The layouts of the SDK's routes for ``path_prefix=prefix`` (no trailing ``/``), with
    JSON-RPC at ``prefix + jsonrpc_path`` (``None``: none) in front of the REST routes:

    - ``create_jsonrpc_routes(rpc_url=prefix + jsonrpc_path)`` and
      ``create_rest_routes(path_prefix=prefix)`` at the app's root: ``prefix/...`` (1.0 and
      v0.3) and the tenant mount ``/{tenant}prefix/...``;
    - with a prefix, also the same routes with no prefix inside ``Mount(prefix, ...)``:
      ``prefix/...`` and ``prefix/{tenant}/...``.

    A request is gated if it is work in either layout: the middleware does not know which
    one the app uses, and gating a request the app would 404 costs a slot for that 404,
    while missing one would be a bypass.
    """
    rpc = () if jsonrpc_path is None else _jsonrpc(prefix + jsonrpc_path)
    routes = rpc + _at(prefix, _V03 + _V10)
    root = Router(routes, ("/{tenant}", Router(_at(prefix, _V10))))
    if not prefix:
        return (root,)
    return (root, Router((), (prefix, sdk_routers("", jsonrpc_path)[0])))
