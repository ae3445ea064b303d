"""Shared fixtures: admitgate and the reference gate behind one namespace.

The reference is PraisonAI BotOS's pure-Python gate (``praisonai_bot.bots._admission``)
with its policies from ``praisonaiagents.gateway``. Tests that take the ``impl`` fixture
run once per implementation, with ids ``admitgate`` and ``reference``, so
``pytest -k reference`` runs the reference half on its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import types
import warnings
from typing import Any

import pytest

IMPLEMENTATIONS = ("admitgate", "reference")

_PUBLIC_NAMES = (
    "AdmissionGate",
    "AdmissionRejected",
    "AdmissionDecision",
    "ConcurrencyLimitPolicy",
    "MemoryPressurePolicy",
    "ResourceSample",
    "build_admission_gate",
    "build_memory_pressure_policy",
)


def load_impl(name: str) -> types.SimpleNamespace:
    """Return the public names of one implementation as a namespace.

    ``name`` is ``"admitgate"`` or ``"reference"``. The namespace also carries
    ``name`` and ``is_reference``. An admitgate that fails to import fails the
    test (it is never skipped), so a broken build cannot pass the suite.
    """
    if name == "reference":
        from praisonai_bot.bots import _admission as bot
        from praisonaiagents import gateway as core

        return types.SimpleNamespace(
            name=name,
            is_reference=True,
            AdmissionGate=bot.AdmissionGate,
            AdmissionRejected=bot.AdmissionRejected,
            AdmissionDecision=core.AdmissionDecision,
            ConcurrencyLimitPolicy=core.ConcurrencyLimitPolicy,
            MemoryPressurePolicy=core.MemoryPressurePolicy,
            ResourceSample=core.ResourceSample,
            build_admission_gate=bot.build_admission_gate,
            build_memory_pressure_policy=bot.build_memory_pressure_policy,
        )
    if name == "admitgate":
        try:
            import admitgate
        except ImportError as exc:  # pragma: no cover - only before the first build
            pytest.fail(f"admitgate is not importable: {exc!r}", pytrace=False)
        ns = types.SimpleNamespace(name=name, is_reference=False)
        for attr in _PUBLIC_NAMES:
            setattr(ns, attr, getattr(admitgate, attr))
        return ns
    raise ValueError(f"unknown implementation {name!r}")


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> types.SimpleNamespace:
    """Each implementation in turn (ids ``admitgate`` and ``reference``)."""
    return load_impl(request.param)


@pytest.fixture
def ag() -> types.SimpleNamespace:
    """admitgate alone, for tests that compare it with the reference."""
    return load_impl("admitgate")


@pytest.fixture
def ref() -> types.SimpleNamespace:
    """The reference alone."""
    return load_impl("reference")


class FakeSampler:
    """A resource sampler whose RSS the test sets by hand.

    ``read()`` returns ``sample_cls(rss_mb=self.rss_mb)`` (the reference's
    ``ResourceSample`` unless told otherwise) and counts the calls in ``reads``.
    """

    def __init__(self, rss_mb: float | None = None, sample_cls: Any = None):
        if sample_cls is None:
            from praisonaiagents.gateway import ResourceSample as sample_cls
        self.rss_mb = rss_mb
        self.sample_cls = sample_cls
        self.reads = 0

    def read(self) -> Any:
        self.reads += 1
        return self.sample_cls(rss_mb=self.rss_mb)


@pytest.fixture
def fake_sampler_cls() -> type:
    """The :class:`FakeSampler` class, for test modules that prefer a fixture."""
    return FakeSampler


@pytest.fixture
def sampler(impl: types.SimpleNamespace) -> FakeSampler:
    """A :class:`FakeSampler` (rss_mb None) producing ``impl``'s ResourceSample."""
    return FakeSampler(None, sample_cls=impl.ResourceSample)


def run(coro: Any, timeout: float | None = 5.0) -> Any:
    """``asyncio.run`` with a guard, so a wedged gate fails instead of hanging.

    ``timeout=None`` runs without a guard of its own (the test's pytest-timeout still applies).
    """

    async def guarded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


def reap_child(pid: int, timeout: float, poll: float = 0.05) -> int:
    """Waits for the forked child ``pid`` and returns its exit code; a child still running
    after ``timeout`` seconds is killed and the test fails ("forked child hung")."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("forked child hung")
        time.sleep(poll)


async def settle(rounds: int = 30) -> None:
    """Let every ready callback and task run (waiters wake, losers clean up)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def in_forked_child(check: Any) -> tuple[int, str]:
    """Runs check() in a forked child; returns (exit code, message)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code, message = 0, "ok"
        try:
            os.close(read_end)
            check()
        except BaseException as exc:  # reported to the parent
            code, message = 1, f"{type(exc).__name__}: {exc}"
        try:
            os.write(write_end, message.encode()[:4000])
        finally:
            os._exit(code)
    os.close(write_end)
    code = reap_child(pid, 20, poll=0.01)
    with os.fdopen(read_end, "rb") as f:
        message = f.read().decode(errors="replace")
    return code, message


@pytest.fixture
def replicas() -> Any:
    """Fleet replica processes (``fleet_support.Replica``) a test starts: all are stopped,
    and resumed first if paused, afterwards."""
    import contextlib

    started: list[Any] = []
    yield started
    for replica in started:
        with contextlib.suppress(ProcessLookupError):
            replica.signal(signal.SIGCONT)
        replica.close()


@pytest.fixture(scope="session")
def redis_server() -> Any:
    """A real redis-server for the session: Debian's package (``scripts/redis-server`` installs
    it when missing) on a free loopback port, without persistence. Yields a
    ``fleet_support.RedisServer`` (``.url``, ``.client()``, ``.restart()``)."""
    from fleet_support import RedisServer, redis_server_binary

    server = RedisServer(redis_server_binary(), name="plain")
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_tls_server() -> Any:
    """A TLS-only redis-server with a throwaway CA (``.ca_file``, made with the openssl CLI)
    and a password (``.password``, in ``.url``)."""
    from fleet_support import TLS_PASSWORD, RedisServer, redis_server_binary

    server = RedisServer(redis_server_binary(), name="tls", tls=True, password=TLS_PASSWORD)
    server.start()
    yield server
    server.close()
