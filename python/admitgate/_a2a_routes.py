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

The table and the matching live in Rust (``crates/classify``, exposed as
``admitgate._admitgate.A2ARules`` with the rest of the rules: the JSON-RPC body's reader and
the method rule): the broker (``crates/broker``) classifies with the same
code, so the rules exist once. The test ``tests/test_asgi_routes.py`` checks them against the
real SDK routes in a real Starlette router, on generated paths. No Starlette import here:
the middleware has no framework dependency.

Linear time: each route is a regular expression of literals and ``[^/]+`` runs, each followed
by a literal that ``[^/]+`` cannot contain or by a fixed suffix, so a match attempt backtracks
at most the length of the suffix per character; a path is matched against a fixed number of
them.
"""

from __future__ import annotations

from typing import Final

from ._admitgate import A2ARules

PASS: Final = 0
"""Not an A2A endpoint (or no endpoint at all: 404, 405, a redirect): passes through."""
READ: Final = 1
"""An A2A REST endpoint that reads, cancels or configures."""
WORK: Final = 2
"""An A2A REST endpoint that starts or continues agent work."""
JSONRPC: Final = 3
"""The JSON-RPC endpoint: the body says what it does."""


def sdk_rules(
    prefix: str, jsonrpc_path: str | None, *, gate_all: bool, max_peek_bytes: int
) -> A2ARules:
    """The rules for the SDK's routes for ``path_prefix=prefix`` (no trailing ``/``) with
    JSON-RPC at ``prefix + jsonrpc_path`` (``None``: none), in every layout the SDK builds:

    - ``create_jsonrpc_routes(rpc_url=prefix + jsonrpc_path)`` and
      ``create_rest_routes(path_prefix=prefix)`` at the app's root: ``prefix/...`` (1.0 and
      v0.3) and the tenant mount ``/{tenant}prefix/...``;
    - with a prefix, also the same routes with no prefix inside ``Mount(prefix, ...)``:
      ``prefix/...`` and ``prefix/{tenant}/...``.

    ``kind(method, path, root_path)`` gives the strongest verdict of every layout: the
    middleware does not know which one the app uses, and gating a request the app would 404
    costs a slot for that 404, while missing one would be a bypass.

    ``jsonrpc(body, complete)`` gives ``(gated, id)`` for a JSON-RPC body: gated when its
    ``method`` starts or continues work (or with ``gate_all``, ``gate_methods="all"``), or
    when it does not end within ``max_peek_bytes``; ``id`` is what a refusal echoes.
    """
    return A2ARules(prefix, jsonrpc_path, gate_all=gate_all, max_peek_bytes=max_peek_bytes)
