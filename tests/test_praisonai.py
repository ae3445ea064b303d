"""admitgate inside a real PraisonAI BotOS (praisonai-bot 0.1.16, praisonaiagents 1.7.17).

No network and no LLM: turns go through the real ``BotSessionManager.chat`` with
stand-in agents (an object with ``chat_history`` and a slow ``chat``, or an
async ``astart`` for the streaming path). Scenarios run twice, with the
reference gate ("reference", nothing installed) and after
``admitgate.praisonai.install()`` ("admitgate"); where admitgate fixes a bug of
the reference, both outcomes are asserted and the reference one is labelled a
known divergence.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import praisonai_bot.bots._admission as reference
import pytest
from conftest import run
from praisonai_bot.bots._session import BotSessionManager
from praisonai_bot.bots.botos import BotOS
from praisonaiagents.approval.registry import HUMAN_WAIT_SCOPE
from praisonaiagents.gateway import AdmissionDecision, ResourceSample

pytestmark = pytest.mark.timeout(5)

BUSY = "Busy right now — please resend in a moment."
# Longest a stand-in agent blocks; a test that forgets to release it still ends.
BLOCK = 3.0
# How long a run keeps its slot after being released, so over-admission shows.
HOLD = 0.02

ORIGINALS = {
    "build_admission_gate": reference.build_admission_gate,
    "build_memory_pressure_policy": reference.build_memory_pressure_policy,
    "AdmissionGate": reference.AdmissionGate,
    "AdmissionRejected": reference.AdmissionRejected,
}


def _integration():
    return importlib.import_module("admitgate.praisonai")


@pytest.fixture(autouse=True)
def _uninstall_after_each_test():
    yield
    module = sys.modules.get("admitgate.praisonai")
    if module is not None:
        module.uninstall()
    for name, original in ORIGINALS.items():
        assert getattr(reference, name) is original, f"{name} leaked past uninstall()"


@pytest.fixture(params=["reference", "admitgate"])
def mode(request):
    """Run the test with praisonai-bot's own gate, then with admitgate installed."""
    if request.param == "admitgate":
        _integration().install()
    return request.param


def assert_gate_kind(mode, gate):
    if mode == "admitgate":
        import admitgate

        assert isinstance(gate, admitgate.AdmissionGate)
    else:
        assert type(gate) is reference.AdmissionGate


def botos_gate(mode, **kwargs):
    """Build a BotOS the way a user does and return its gate."""
    gate = BotOS(**kwargs)._admission_gate
    assert_gate_kind(mode, gate)
    return gate


def run_scenario(scenario, *args):
    """Runs ``scenario(*args)`` with a thread pool big enough for blocked stand-in agents.

    No timeout of its own: the module's pytest-timeout bounds every test.
    """

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=32))
        return await scenario(*args)

    return run(main(), timeout=None)


async def wait_until(predicate, what, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


class Board:
    """Shared record of the stand-in agents' runs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.started = []
        self.go = threading.Event()

    def enter(self, prompt):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.started.append(prompt)

    def leave(self):
        with self.lock:
            self.running -= 1


class StandInAgent:
    """What BotSessionManager.chat needs from an agent: chat_history and chat().

    Use one per turn: the manager holds a per-agent lock for the whole run, so
    turns sharing one agent instance would run one at a time whatever the gate.
    """

    def __init__(self, board):
        self.chat_history = []
        self.board = board

    def chat(self, prompt):
        self.board.enter(prompt)
        try:
            self.board.go.wait(BLOCK)
            time.sleep(HOLD)
            return f"answer to {prompt}"
        finally:
            self.board.leave()


class FixedSampler:
    """A resource sampler reporting whatever RSS the test sets."""

    def __init__(self, rss_mb):
        self.rss_mb = rss_mb
        self.reads = 0

    def read(self):
        self.reads += 1
        return ResourceSample(rss_mb=self.rss_mb)


def answer(prompt):
    return f"answer to {prompt}"


def stats_add_up(stats, turns):
    assert stats["in_flight"] == 0 and stats["queued"] == 0 and stats["awaiting_human"] == 0
    total = stats["admitted"] + stats["rejected"] + stats["shed"] + stats.get("cancelled", 0)
    assert total == turns, stats


# --------------------------------------------------------------------------- install


CONFIGS = {
    "everything": {
        "max_concurrent_runs": 3,
        "queue_depth": 5,
        "overflow_policy": "shed_oldest",
        "max_concurrent_runs_per_scope": 2,
        "max_rss_mb": 512,
    },
    "reliability-preset": {},  # BotOS() picks a CPU-scaled ceiling and a queue
    "production-preset": {"reliability": "production"},
    "memory-only": {"reliability": "off", "max_rss_mb": 100},
    "strings-from-yaml": {"max_concurrent_runs": "3", "queue_depth": "2"},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_botos_builds_an_admitgate_gate_with_the_reference_stats(config):
    import admitgate

    expected_gate = BotOS(**config)._admission_gate
    expected = BotOS(**config).admission_stats
    _integration().install()
    bot = BotOS(**config)
    assert isinstance(bot._admission_gate, admitgate.AdmissionGate)
    assert bot._admission_gate.enabled is expected_gate.enabled is True
    stats = bot.admission_stats
    assert set(stats) - set(expected) == {"cancelled", "limit"} and stats["cancelled"] == 0
    assert stats["limit"] == stats["max_concurrent_runs"]
    for key, value in expected.items():
        assert stats[key] == value and type(stats[key]) is type(value), key


def test_botos_without_admission_still_has_no_gate():
    _integration().install()
    bot = BotOS(reliability="off")
    assert bot._admission_gate is None and bot.admission_stats is None


def test_install_is_idempotent_and_uninstall_restores_the_originals():
    import admitgate
    from admitgate import _admitgate

    integration = _integration()
    default_class = _admitgate._rejection_class()
    assert default_class is admitgate.AdmissionRejected
    integration.install()
    integration.install()
    assert integration.is_installed()
    assert reference.build_admission_gate is admitgate.build_admission_gate
    assert reference.build_memory_pressure_policy is admitgate.build_memory_pressure_policy
    assert reference.AdmissionGate is admitgate.AdmissionGate
    # AdmissionRejected stays praisonai-bot's (gates built earlier still raise it).
    assert reference.AdmissionRejected is ORIGINALS["AdmissionRejected"]
    combined = _admitgate._rejection_class()
    assert combined is integration.BotOSAdmissionRejected
    assert issubclass(combined, admitgate.AdmissionRejected)
    assert issubclass(combined, reference.AdmissionRejected)

    integration.uninstall()
    integration.uninstall()
    assert not integration.is_installed()
    for name, original in ORIGINALS.items():
        assert getattr(reference, name) is original
    assert _admitgate._rejection_class() is default_class
    # Created once: a second install hands out the very same class.
    integration.install()
    assert _admitgate._rejection_class() is combined


def test_by_value_imports_in_praisonai_modules_are_patched_and_restored(monkeypatch):
    import types

    import admitgate

    integration = _integration()
    before = types.ModuleType("praisonai_bot._admitgate_test_before")
    before.build_admission_gate = reference.build_admission_gate
    before.Gate = reference.AdmissionGate  # an alias is a by-value import too
    before.unrelated = len
    monkeypatch.setitem(sys.modules, before.__name__, before)

    integration.install()
    assert before.build_admission_gate is admitgate.build_admission_gate
    assert before.Gate is admitgate.AdmissionGate
    assert before.unrelated is len
    # A module imported while installed binds admitgate's objects by value.
    during = types.ModuleType("praisonai_bot._admitgate_test_during")
    # (what ``from praisonai_bot.bots._admission import ...`` does at its import)
    during.build_memory_pressure_policy = reference.build_memory_pressure_policy
    monkeypatch.setitem(sys.modules, during.__name__, during)
    assert during.build_memory_pressure_policy is admitgate.build_memory_pressure_policy

    integration.uninstall()
    assert before.build_admission_gate is ORIGINALS["build_admission_gate"]
    assert before.Gate is ORIGINALS["AdmissionGate"]
    assert during.build_memory_pressure_policy is ORIGINALS["build_memory_pressure_policy"]


@pytest.mark.timeout(10)  # a fresh interpreter; slow on a loaded CI box
@pytest.mark.parametrize("order", ["install-then-import", "import-then-install"])
def test_install_works_whether_praisonai_bot_is_imported_before_or_after(order):
    script = textwrap.dedent(
        """
        import sys
        import admitgate, admitgate.praisonai
        if ORDER == "import-then-install":
            from praisonai_bot.bots.botos import BotOS
        else:
            assert "praisonai_bot" not in sys.modules
        admitgate.praisonai.install()
        from praisonai_bot.bots.botos import BotOS
        gate = BotOS(max_concurrent_runs=2)._admission_gate
        print(type(gate) is admitgate.AdmissionGate)
        """
    ).replace("ORDER", repr(order))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=8,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_clear_import_error_when_praisonai_bot_is_missing(monkeypatch):
    integration = _integration()
    monkeypatch.setitem(sys.modules, "praisonai_bot.bots._admission", None)
    with pytest.raises(ImportError, match="praisonai-bot") as info:
        integration.install()
    assert info.value.name == "praisonai_bot"
    assert not integration.is_installed()


def test_a_rejection_is_caught_as_either_packages_admission_rejected():
    import admitgate

    _integration().install()
    gate = BotOS(max_concurrent_runs=1)._admission_gate

    async def scenario():
        async with gate.admit(session_id="a"):
            try:
                async with gate.admit(session_id="b"):
                    raise AssertionError("admitted past the ceiling")
            # praisonai-bot's own class, as its except clauses name it:
            except reference.AdmissionRejected as rejected:
                assert isinstance(rejected, admitgate.AdmissionRejected)
                assert rejected.message == BUSY and str(rejected) == BUSY
                assert rejected.reason == "queue_full"

    run_scenario(scenario)
    assert gate.rejected == 1


# ----------------------------------------------------------------- turns through BotOS


def test_reject_overflow_holds_the_ceiling_and_sheds_with_the_busy_reply(mode):
    gate = botos_gate(mode, max_concurrent_runs=2, queue_depth=1, overflow_policy="reject")
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        turns = [
            asyncio.create_task(manager.chat(StandInAgent(board), f"u{i}", f"p{i}"))
            for i in range(5)
        ]
        try:
            await wait_until(lambda: board.running == 2 and gate.rejected == 2, "two runs")
            assert (gate.in_flight, gate.queued) == (2, 1)
            assert sorted(board.started) == ["p0", "p1"]
        finally:
            board.go.set()
        return await asyncio.gather(*turns)

    results = run_scenario(scenario)
    assert results == [answer("p0"), answer("p1"), answer("p2"), BUSY, BUSY]
    assert board.peak == 2
    stats = gate.stats()
    assert (stats["admitted"], stats["rejected"], stats["shed"]) == (3, 2, 0)
    stats_add_up(stats, 5)


def test_shed_oldest_evicts_the_oldest_waiter_with_the_busy_reply(mode):
    gate = botos_gate(mode, max_concurrent_runs=1, queue_depth=1, overflow_policy="shed_oldest")
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        turns = []
        for i in range(3):
            turns.append(asyncio.create_task(manager.chat(StandInAgent(board), f"u{i}", f"p{i}")))
            await asyncio.sleep(0.01)
        try:
            await wait_until(lambda: gate.shed == 1 and gate.queued == 1, "one eviction")
            assert turns[1].done() and turns[1].result() == BUSY
        finally:
            board.go.set()
        return await asyncio.gather(*turns)

    results = run_scenario(scenario)
    assert results == [answer("p0"), BUSY, answer("p2")]
    assert board.started == ["p0", "p2"] and board.peak == 1
    stats = gate.stats()
    assert (stats["admitted"], stats["rejected"], stats["shed"]) == (2, 0, 1)
    stats_add_up(stats, 3)


def test_queue_overflow_waits_beyond_the_depth_and_never_exceeds_the_ceiling(mode):
    gate = botos_gate(mode, max_concurrent_runs=2, queue_depth=1, overflow_policy="queue")
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        turns = [
            asyncio.create_task(manager.chat(StandInAgent(board), f"u{i}", f"p{i}"))
            for i in range(6)
        ]
        try:
            await wait_until(lambda: board.running == 2 and gate.queued == 4, "four waiting")
        finally:
            board.go.set()
        return await asyncio.gather(*turns)

    results = run_scenario(scenario)
    assert results == [answer(f"p{i}") for i in range(6)]
    assert board.peak == 2
    stats = gate.stats()
    assert (stats["admitted"], stats["rejected"], stats["shed"]) == (6, 0, 0)
    stats_add_up(stats, 6)


class Resolver:
    """Identity resolver: every "alice-<device>" is the one unified user "alice"."""

    def resolve(self, platform, user_id):
        return user_id.split("-")[0]


def test_per_scope_limit_applies_to_botos_session_keys(mode):
    gate = botos_gate(
        mode,
        max_concurrent_runs=4,
        queue_depth=8,
        overflow_policy="queue",
        max_concurrent_runs_per_scope=2,
    )
    # The gate's scope is the session manager's storage key: the unified id.
    manager = BotSessionManager(
        admission_gate=gate, platform="telegram", identity_resolver=Resolver()
    )
    alice, bob = Board(), Board()

    async def scenario():
        devices = ["phone", "desktop", "web", "watch"]
        turns = [
            asyncio.create_task(manager.chat(StandInAgent(alice), f"alice-{d}", f"a-{d}"))
            for d in devices
        ]
        try:
            await wait_until(lambda: gate.in_flight + gate.queued == 4, "alice's burst at the gate")
            await asyncio.sleep(0.02)
            # Known divergence: the reference gives all four a global slot.
            assert (gate.in_flight, gate.queued) == ((2, 2) if mode == "admitgate" else (4, 0))
            turns.append(asyncio.create_task(manager.chat(StandInAgent(bob), "bob-phone", "b")))
            await wait_until(lambda: gate.in_flight + gate.queued == 5, "bob at the gate")
            if mode == "admitgate":
                # alice holds her two slots, her other two wait in her own queue,
                # and bob runs at once although the global ceiling is 4.
                await wait_until(lambda: bob.started == ["b"], "bob's run")
                assert (gate.in_flight, gate.queued) == (3, 2)
            else:
                # ... so bob waits behind alice's burst.
                await asyncio.sleep(0.05)
                assert (gate.in_flight, gate.queued) == (4, 1)
                assert bob.started == []
        finally:
            alice.go.set()
            bob.go.set()
        return await asyncio.gather(*turns)

    results = run_scenario(scenario)
    assert results == [answer(f"a-{d}") for d in ["phone", "desktop", "web", "watch"]] + [
        answer("b")
    ]
    stats = gate.stats()
    assert stats["max_concurrent_runs_per_scope"] == 2
    assert (stats["admitted"], stats["rejected"]) == (5, 0)
    stats_add_up(stats, 5)


def test_per_scope_queue_is_bounded_per_tenant(mode):
    gate = botos_gate(
        mode,
        max_concurrent_runs=4,
        queue_depth=1,
        overflow_policy="reject",
        max_concurrent_runs_per_scope=1,
    )
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        turns = [
            asyncio.create_task(manager.chat(StandInAgent(board), "alice", f"p{i}"))
            for i in range(3)
        ]
        try:
            await wait_until(lambda: board.running == 1, "alice's first run")
            await asyncio.sleep(0.02)
            snapshot = (gate.in_flight, gate.queued, gate.rejected)
        finally:
            board.go.set()
        return snapshot, await asyncio.gather(*turns)

    snapshot, results = run_scenario(scenario)
    # Known divergence: the reference gives the second turn a global slot, so
    # the tenant holds two although its sub-limit is one.
    assert snapshot == ((1, 1, 1) if mode == "admitgate" else (2, 0, 1))
    assert results == [answer("p0"), answer("p1"), BUSY]
    stats_add_up(gate.stats(), 3)


def test_turn_cancelled_while_queued_does_not_leak_its_slot(mode):
    gate = botos_gate(mode, max_concurrent_runs=1, queue_depth=2, overflow_policy="reject")
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        first = asyncio.create_task(manager.chat(StandInAgent(board), "u0", "p0"))
        waiting = asyncio.create_task(manager.chat(StandInAgent(board), "u1", "p1"))
        await wait_until(lambda: gate.queued == 1, "a waiter")
        waiting.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiting
        board.go.set()
        assert await first == answer("p0")
        later = asyncio.create_task(manager.chat(StandInAgent(board), "u2", "p2"))
        done, _ = await asyncio.wait({later}, timeout=0.5)
        if not done:
            later.cancel()
            return None
        return later.result()

    result = run_scenario(scenario)
    if mode == "admitgate":
        assert result == answer("p2")
        stats = gate.stats()
        assert stats["cancelled"] == 1
        stats_add_up(stats, 3)
    else:
        # Known divergence: the cancelled waiter's orphaned acquire keeps the
        # only slot, so the ceiling-1 gateway is dead.
        assert result is None
        assert gate.in_flight == 0


def test_soft_memory_pressure_queues_while_something_runs(mode):
    gate = botos_gate(mode, max_concurrent_runs=4, queue_depth=4, max_rss_mb=100)
    gate._resource_sampler = FixedSampler(95.0)  # soft threshold is 90
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        first = asyncio.create_task(manager.chat(StandInAgent(board), "u0", "p0"))
        # Nothing is running yet, so the first turn is admitted at once.
        await wait_until(lambda: board.running == 1, "the first run")
        second = asyncio.create_task(manager.chat(StandInAgent(board), "u1", "p1"))
        await wait_until(lambda: gate.in_flight + gate.queued == 2, "the second turn")
        await asyncio.sleep(0.02)
        snapshot = (gate.in_flight, gate.queued)
        board.go.set()
        return snapshot, await asyncio.gather(first, second)

    snapshot, results = run_scenario(scenario)
    # Known divergence: the reference lets soft pressure take a free slot.
    assert snapshot == ((1, 1) if mode == "admitgate" else (2, 0))
    assert results == [answer("p0"), answer("p1")]
    assert board.peak == (1 if mode == "admitgate" else 2)
    stats_add_up(gate.stats(), 2)


def test_negative_max_rss_mb_fails_fast(mode):
    if mode == "admitgate":
        with pytest.raises(ValueError, match="max_rss_mb"):
            BotOS(max_concurrent_runs=2, max_rss_mb=-1)
    else:
        # Known divergence: the reference silently turns memory protection off.
        assert BotOS(max_concurrent_runs=2, max_rss_mb=-1).admission_stats["max_rss_mb"] == 0.0


def test_gateway_api_turns_are_gated_and_shed_with_the_busy_reply(mode):
    # The gateway server and the CLI import the builder inside the function
    # that uses it, so they read the module attribute install() replaced.
    from praisonai_bot.bots._admission import build_admission_gate
    from praisonai_bot.bots._reliability import resolve_reliability
    from praisonai_bot.gateway.api_endpoints import GatewayApiEndpoints

    preset = resolve_reliability(None, bind_host="127.0.0.1")  # as the CLI does
    assert_gate_kind(
        mode,
        build_admission_gate(
            max_concurrent_runs=preset.max_concurrent_runs,
            queue_depth=preset.queue_depth,
            overflow_policy=preset.overflow_policy,
        ),
    )
    gate = build_admission_gate(max_concurrent_runs=1)
    assert_gate_kind(mode, gate)

    class Session:
        def __init__(self, session_id):
            self.session_id = session_id

    class Gateway:
        """The slice of the gateway server that GatewayApiEndpoints._dispatch uses."""

        _admission_gate = gate

        def __init__(self):
            self.release = asyncio.Event()

        async def _dispatch_agent_turn(self, agent, content, on_complete=None, **extra):
            await self.release.wait()
            return f"answer to {content}"

    async def scenario():
        gateway = Gateway()
        endpoints = GatewayApiEndpoints(gateway)
        first = asyncio.create_task(endpoints._dispatch(Session("s1"), None, "p1"))
        await wait_until(lambda: gate.in_flight == 1, "the first turn")
        rejected = {}
        busy, usage = await endpoints._dispatch(Session("s2"), None, "p2", rejected=rejected)
        gateway.release.set()
        return (await first)[0], busy, rejected, usage

    reply, busy, rejected, usage = run_scenario(scenario)
    assert reply == answer("p1")
    assert busy == BUSY and rejected == {"rejected": True, "message": BUSY}
    assert usage["total_tokens"] == 0
    stats_add_up(gate.stats(), 2)


# ------------------------------------------------------------------ human approval waits


class ApprovalAgent:
    """A stand-in agent whose run parks on a human approval, sync or async."""

    def __init__(self):
        self.chat_history = []
        self.parked = threading.Event()
        self.approve = threading.Event()
        self.resumed = threading.Event()
        self.finish = threading.Event()

    def chat(self, prompt):  # BotSessionManager runs this on a worker thread
        factory = HUMAN_WAIT_SCOPE.get()
        assert factory is not None, "no human-wait scope bound for the turn"
        with factory():
            self.parked.set()
            self.approve.wait(BLOCK)
        self.resumed.set()
        self.finish.wait(BLOCK)
        return f"answer to {prompt}"

    async def astart(self, prompt, **kwargs):  # the streaming path: on the loop
        factory = HUMAN_WAIT_SCOPE.get()
        assert factory is not None, "no human-wait scope bound for the turn"
        async with factory():
            self.parked.set()
            await asyncio.get_running_loop().run_in_executor(None, self.approve.wait, BLOCK)
        self.resumed.set()
        await asyncio.get_running_loop().run_in_executor(None, self.finish.wait, BLOCK)
        return f"answer to {prompt}"

    def release(self):
        self.approve.set()
        self.finish.set()


@pytest.mark.parametrize("how", ["sync-in-worker-thread", "async-on-loop"])
def test_human_approval_wait_lends_the_slot_through_botos(mode, how):
    gate = botos_gate(mode, max_concurrent_runs=1, queue_depth=0)
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()
    board.go.set()
    waiting = ApprovalAgent()
    extra = {"stream_callback": lambda event: None} if how == "async-on-loop" else {}

    async def scenario():
        parked = asyncio.create_task(manager.chat(waiting, "a", "pa", **extra))
        try:
            await wait_until(waiting.parked.is_set, "the approval wait")
            await wait_until(lambda: gate.awaiting_human == 1, "the slot lent back")
            assert gate.in_flight == 0
            # The lent slot lets another turn run while the person decides.
            assert await manager.chat(StandInAgent(board), "b", "pb") == answer("pb")
            waiting.approve.set()
            await wait_until(waiting.resumed.is_set, "the resume")
            assert (gate.in_flight, gate.awaiting_human) == (1, 0)
            # The resumed turn holds the slot again.
            assert await manager.chat(StandInAgent(board), "c", "pc") == BUSY
        finally:
            waiting.release()
        return await parked

    assert run_scenario(scenario) == answer("pa")
    stats = gate.stats()
    assert (stats["admitted"], stats["rejected"]) == (2, 1)
    stats_add_up(stats, 3)


async def _human_wait(how, factory, approve, body=None):
    """Enter the human-wait scope as an approval backend would."""
    if how == "async":
        async with factory():
            await approve.wait()
            if body:
                body()
    else:

        def blocking():
            with factory():
                asyncio.run_coroutine_threadsafe(approve.wait(), loop).result(BLOCK)
                if body:
                    body()

        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, blocking)


@pytest.mark.parametrize("how", ["async", "thread"])
def test_resume_without_a_free_slot_borrows_one_the_next_release_repays(mode, how):
    gate = botos_gate(mode, max_concurrent_runs=1, queue_depth=0)

    async def scenario():
        approve, a_done, b_done, b_in, resumed = (asyncio.Event() for _ in range(5))
        rejected = reference.AdmissionRejected

        async def turn_a():
            async with gate.admit(session_id="a"):
                await _human_wait(how, HUMAN_WAIT_SCOPE.get(), approve)
                resumed.set()
                await a_done.wait()

        async def turn_b():
            async with gate.admit(session_id="b"):
                b_in.set()
                await b_done.wait()

        async def try_turn(session):
            try:
                async with gate.admit(session_id=session):
                    return True
            except rejected:
                return False

        a = asyncio.create_task(turn_a())
        await wait_until(lambda: gate.awaiting_human == 1, "a parked")
        b = asyncio.create_task(turn_b())
        await asyncio.wait_for(b_in.wait(), 0.5)
        approve.set()
        await asyncio.wait_for(resumed.wait(), 0.5)  # never blocks, slot or not
        assert (gate.in_flight, gate.awaiting_human) == (2, 0)
        assert await try_turn("c") is False
        b_done.set()
        await b
        assert gate.in_flight == 1
        assert await try_turn("d") is False  # b's release repaid the borrow
        a_done.set()
        await a
        assert gate.in_flight == 0
        assert await try_turn("e") is True

    run_scenario(scenario)
    stats = gate.stats()
    assert (stats["admitted"], stats["rejected"]) == (3, 2)
    stats_add_up(stats, 5)


@pytest.mark.parametrize("how", ["async", "thread"])
def test_resume_never_blocks_when_the_tenant_is_at_its_sub_limit(mode, how):
    gate = botos_gate(
        mode,
        max_concurrent_runs=4,
        queue_depth=4,
        overflow_policy="queue",
        max_concurrent_runs_per_scope=1,
    )

    async def scenario():
        approve, a_done, b_done, b_in, resumed = (asyncio.Event() for _ in range(5))

        async def turn_a():
            async with gate.admit(session_id="tenant"):
                await _human_wait(how, HUMAN_WAIT_SCOPE.get(), approve)
                resumed.set()
                await a_done.wait()

        async def turn_b():
            async with gate.admit(session_id="tenant"):
                b_in.set()
                await b_done.wait()

        a = asyncio.create_task(turn_a())
        await wait_until(lambda: gate.awaiting_human == 1, "a parked")
        b = asyncio.create_task(turn_b())
        await asyncio.wait_for(b_in.wait(), 0.5)  # the tenant's lent slot
        approve.set()
        await asyncio.wait_for(resumed.wait(), 0.5)
        assert (gate.in_flight, gate.awaiting_human) == (2, 0)
        b_done.set()
        a_done.set()
        await asyncio.gather(a, b)
        assert gate.in_flight == 0

        async def later():
            async with gate.admit(session_id="tenant"):
                pass

        await asyncio.wait_for(later(), 0.5)  # no per-tenant debt left behind

    run_scenario(scenario)
    stats_add_up(gate.stats(), 3)


def test_nested_and_parallel_human_waits_count_once(mode):
    gate = botos_gate(mode, max_concurrent_runs=1)

    async def scenario():
        seen = []

        def note(label):
            seen.append((label, gate.in_flight, gate.awaiting_human))

        async with gate.admit(session_id="a"):
            factory = HUMAN_WAIT_SCOPE.get()
            async with factory():
                note("outer")
                async with factory():
                    note("inner")
                note("inner done")  # the first resume takes the slot back
            note("outer done")

            async def branch(approved):
                async with factory():
                    await approved.wait()

            first, second = asyncio.Event(), asyncio.Event()
            branches = [asyncio.create_task(branch(e)) for e in (first, second)]
            await wait_until(lambda: gate.awaiting_human == 1, "both branches parked")
            await asyncio.sleep(0.01)
            note("both parked")
            first.set()
            await branches[0]
            note("one approved")
            second.set()
            await branches[1]
            note("both approved")
        note("turn over")
        return seen

    assert run_scenario(scenario) == [
        ("outer", 0, 1),
        ("inner", 0, 1),
        ("inner done", 1, 0),
        ("outer done", 1, 0),
        ("both parked", 0, 1),
        ("one approved", 1, 0),
        ("both approved", 1, 0),
        ("turn over", 0, 0),
    ]
    stats_add_up(gate.stats(), 1)


def test_capacity_is_exact_after_errors_and_cancellation_in_human_waits(mode):
    gate = botos_gate(mode, max_concurrent_runs=1, queue_depth=1)

    def boom():
        raise RuntimeError("approval backend failed")

    async def scenario():
        opened = asyncio.Event()
        opened.set()
        for how in ("async", "thread"):
            with pytest.raises(RuntimeError):
                async with gate.admit(session_id="a"):
                    await _human_wait(how, HUMAN_WAIT_SCOPE.get(), opened, body=boom)
            assert (gate.in_flight, gate.awaiting_human) == (0, 0)

        never = asyncio.Event()

        async def parked_forever():
            async with gate.admit(session_id="a"):
                await _human_wait("async", HUMAN_WAIT_SCOPE.get(), never)

        task = asyncio.create_task(parked_forever())
        await wait_until(lambda: gate.awaiting_human == 1, "the approval wait")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (gate.in_flight, gate.awaiting_human, gate.queued) == (0, 0, 0)

        # Exactly one slot and one queue place are left.
        release = asyncio.Event()

        async def hold(session):
            async with gate.admit(session_id=session):
                await release.wait()

        x = asyncio.create_task(hold("x"))
        y = asyncio.create_task(hold("y"))
        await wait_until(
            lambda: (gate.in_flight, gate.queued) == (1, 1), "one running, one waiting"
        )
        with pytest.raises(reference.AdmissionRejected):
            async with gate.admit(session_id="z"):
                pass
        release.set()
        await asyncio.gather(x, y)

    run_scenario(scenario)
    stats = gate.stats()
    assert (stats["admitted"], stats["rejected"]) == (5, 1)
    stats_add_up(stats, 6)


# ------------------------------------------------------------------------------ interop


def test_admitgate_decisions_are_praisonaiagents_enum_members():
    import admitgate

    assert admitgate.AdmissionDecision is AdmissionDecision
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=1, queue_depth=1)
    assert policy.decide(in_flight=0, queued=0) is AdmissionDecision.ADMIT
    assert policy.decide(in_flight=1, queued=0) is AdmissionDecision.QUEUE
    assert policy.decide(in_flight=1, queued=1) is AdmissionDecision.REJECT
    memory = admitgate.MemoryPressurePolicy(soft_rss_mb=10, hard_rss_mb=20)
    assert memory.evaluate(ResourceSample(rss_mb=30.0)) is AdmissionDecision.REJECT


def test_admitgate_policy_overloads_the_original_gate():
    import admitgate

    gate = reference.AdmissionGate(
        admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=1, queue_depth=1)
    )

    async def scenario():
        release = asyncio.Event()
        inside = []

        async def hold(session):
            async with gate.admit(session_id=session):
                inside.append(session)
                await release.wait()

        a = asyncio.create_task(hold("a"))
        b = asyncio.create_task(hold("b"))
        await wait_until(
            lambda: (gate.in_flight, gate.queued) == (1, 1), "one running, one waiting"
        )

        async def third():
            async with gate.admit(session_id="c"):
                pass

        # Were REJECT not the enum member itself, this would wait for a slot.
        with pytest.raises(reference.AdmissionRejected):
            await asyncio.wait_for(third(), 0.5)
        release.set()
        await asyncio.gather(a, b)
        return inside

    assert run_scenario(scenario) == ["a", "b"]
    assert (gate.admitted, gate.rejected) == (2, 1)


@pytest.mark.parametrize("history", ["never-installed", "after-uninstall"])
def test_botos_admission_policy_from_admitgate_with_the_original_gate(history):
    import admitgate

    if history == "after-uninstall":
        _integration().install()
        _integration().uninstall()
    policy = admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=1)
    gate = botos_gate("reference", admission_policy=policy)
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        turns = [
            asyncio.create_task(manager.chat(StandInAgent(board), f"u{i}", f"p{i}"))
            for i in range(3)
        ]
        try:
            await wait_until(lambda: gate.rejected == 2, "two rejections", timeout=0.5)
        finally:
            board.go.set()
        return await asyncio.gather(*turns)

    assert run_scenario(scenario) == [answer("p0"), BUSY, BUSY]
    assert board.peak == 1


def test_admitgate_memory_policy_sheds_on_the_original_gate():
    import admitgate

    sampler = FixedSampler(30.0)
    gate = reference.AdmissionGate(
        None,
        resource_policy=admitgate.MemoryPressurePolicy(soft_rss_mb=10, hard_rss_mb=20),
        resource_sampler=sampler,
    )

    async def scenario():
        with pytest.raises(reference.AdmissionRejected):
            async with gate.admit(session_id="a"):
                pass

    run_scenario(scenario)
    assert gate.rejected == 1 and sampler.reads == 1


# ------------------------------------------------------------------------- compat hooks


def test_resource_sampler_can_be_replaced_after_construction(mode):
    gate = botos_gate(mode, max_concurrent_runs=2, max_rss_mb=100)
    sampler = FixedSampler(150.0)
    gate._resource_sampler = sampler
    assert gate._resource_sampler is sampler
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()
    board.go.set()

    async def scenario():
        over = await manager.chat(StandInAgent(board), "u0", "p0")
        sampler.rss_mb = 10.0
        under = await manager.chat(StandInAgent(board), "u1", "p1")
        return over, under

    assert run_scenario(scenario) == (BUSY, answer("p1"))
    assert sampler.reads >= 2
    stats = gate.stats()
    assert stats["max_rss_mb"] == 100.0
    assert (stats["admitted"], stats["rejected"]) == (1, 1)
    stats_add_up(stats, 2)


def test_shed_oldest_waiter_can_be_triggered_directly(mode):
    gate = botos_gate(mode, max_concurrent_runs=1, queue_depth=2, overflow_policy="shed_oldest")
    manager = BotSessionManager(admission_gate=gate, platform="test")
    board = Board()

    async def scenario():
        assert gate._shed_oldest_waiter() is False  # nobody waiting
        turns = []
        for i in range(3):
            turns.append(asyncio.create_task(manager.chat(StandInAgent(board), f"u{i}", f"p{i}")))
            await asyncio.sleep(0.01)
        try:
            await wait_until(lambda: gate.queued == 2, "two waiters")
            assert gate._shed_oldest_waiter() is True
            await wait_until(lambda: turns[1].done(), "the evicted turn's reply")
            assert turns[1].result() == BUSY
            assert (gate.queued, gate.shed) == (1, 1)
        finally:
            board.go.set()
        results = await asyncio.gather(*turns)
        assert gate._shed_oldest_waiter() is False
        return results

    assert run_scenario(scenario) == [answer("p0"), BUSY, answer("p2")]
    stats = gate.stats()
    assert (stats["admitted"], stats["shed"]) == (2, 1)
    stats_add_up(stats, 3)


def test_botos_hands_its_gate_to_every_bot(mode):
    from praisonai_bot.bots import Bot

    bot = Bot("telegram", agent=StandInAgent(Board()), token="123:abc")
    botos = BotOS(bots=[bot], max_concurrent_runs=2)
    botos._wire_admission_gate()
    assert bot._admission_gate is botos._admission_gate
    assert_gate_kind(mode, botos._admission_gate)


def test_sync_human_wait_from_a_plain_worker_thread_is_exact(mode):
    """loop.run_in_executor without BotSessionManager: the factory travels in the context."""
    gate = botos_gate(mode, max_concurrent_runs=1)

    async def scenario():
        seen = []

        def approval():
            with HUMAN_WAIT_SCOPE.get()():
                seen.append((gate.in_flight, gate.awaiting_human))
            seen.append((gate.in_flight, gate.awaiting_human))

        async with gate.admit(session_id="a"):
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, contextvars.copy_context().run, approval)
        return seen

    assert run_scenario(scenario) == [(0, 1), (1, 0)]
    stats_add_up(gate.stats(), 1)
