"""The broker's priority classes (``--priority``, ``--priority-from``) in front of a real A2A
SDK agent on uvicorn: who runs first, what a refusal says, what is counted, and a generated
suite of mixed classes, tenants and unknown values checking the invariants the docs promise
(executions at the agent <= the cap; each class's outcomes add up to what was sent in it;
the classes add up to the totals; every missing or unknown value counted, in the default
class).
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from _a2a_app import A2A_HEADERS, ControlledExecutor, Latches, ServerThread, build_sdk_app
from _a2a_app import send_params as params
from _broker import BrokerProcess, build_broker, key, wait_until
from _grpc_a2a import A2AServer, LoopThread, user_message
from a2a.types import a2a_pb2_grpc
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CAP = 2
CLASSES = ("interactive", "batch")
OUTCOMES = ("admitted", "rejected", "shed", "cancelled")


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    latches = Latches()
    executor = ControlledExecutor(latches)
    agent = ServerThread()
    agent.start(build_sdk_app(executor, agent.url))
    broker = BrokerProcess(
        build_broker(),
        "--upstream",
        agent.url,
        "--max-in-flight",
        str(CAP),
        "--queue-depth",
        "3",
        "--priority",
        "interactive:min=0.5",
        "--priority",
        "batch",
        "--priority-from",
        "header:x-priority",
        "--tenant-from",
        "header:x-tenant",
    )
    client = httpx.Client(headers=A2A_HEADERS, timeout=30, limits=httpx.Limits(max_connections=64))
    yield latches, executor, broker, client
    client.close()
    latches.release_all()
    assert broker.stop() == 0
    agent.stop()


def send(
    client: httpx.Client,
    broker: BrokerProcess,
    text: str,
    priority: str | bytes | None,
    tenant: str = "",
    path: str = "/message:send",
) -> httpx.Response:
    headers: dict[str, Any] = {"x-tenant": tenant}
    if priority is not None:
        headers["x-priority"] = priority
    if path == "/":
        body = {"jsonrpc": "2.0", "id": 7, "method": "SendMessage", "params": params(text)}
        return client.post(broker.url + "/", json=body, headers=headers)
    return client.post(broker.url + path, json=params(text), headers=headers)


def settled(broker: BrokerProcess) -> dict[str, float]:
    """``/metrics`` once nothing runs or waits."""
    wait_until(
        lambda: (
            sum(
                v
                for k, v in broker.metrics().items()
                if k.startswith(("broker_class_inflight_requests", "broker_class_queued_requests"))
            )
            == 0
        ),
        10,
    )
    return broker.metrics()


def class_figure(metrics: dict[str, float], outcome: str, name: str) -> float:
    return metrics.get(f'broker_class_{outcome}_total{{class="{name}"}}', 0.0)


def test_a_waiting_interactive_turn_runs_before_older_batch_waiters(env: Any) -> None:
    latches, executor, broker, client = env
    runs = [key(), key()]
    queued = [key(), key()]
    chat = key()
    results: dict[str, int] = {}
    started: list[str] = []

    def hold(name: str, priority: str) -> None:
        results[name] = send(client, broker, f"hold {name}", priority).status_code

    threads = []
    try:
        for name in runs:
            threads.append(threading.Thread(target=hold, args=(name, "batch")))
            threads[-1].start()
        wait_until(lambda: all(latches[n].started.is_set() for n in runs), 10)
        for name in queued:
            threads.append(threading.Thread(target=hold, args=(name, "batch")))
            threads[-1].start()
        broker.wait_for('broker_class_queued_requests{class="batch"}', 2)
        threads.append(threading.Thread(target=hold, args=(chat, "interactive")))
        threads[-1].start()
        broker.wait_for('broker_class_queued_requests{class="interactive"}', 1)
        # One slot frees: the interactive turn (below its guarantee) takes it, not the
        # batch waiters that queued before it.
        latches[runs[0]].release()
        wait_until(lambda: latches[chat].started.is_set(), 10)
        started = [n for n in queued if latches[n].started.is_set()]
        assert started == []
        assert executor.peak_running <= CAP
    finally:
        for name in runs + queued + [chat]:
            latches[name].release()
        for thread in threads:
            thread.join(15)
    assert all(code == 200 for code in results.values()), results


def test_a_full_queue_sheds_batch_for_interactive_and_refusals_name_the_class(env: Any) -> None:
    latches, executor, broker, client = env
    before = settled(broker)
    holds = [key() for _ in range(CAP + 3)]
    results: dict[str, httpx.Response] = {}

    def hold(name: str) -> None:
        results[name] = send(client, broker, f"hold {name}", "batch")

    threads = [threading.Thread(target=hold, args=(n,)) for n in holds]
    try:
        for thread in threads:
            thread.start()
        broker.wait_for('broker_class_queued_requests{class="batch"}', 3)
        # The queue is full of batch: an interactive newcomer sheds the oldest batch waiter.
        chat = key()
        results_chat: dict[str, httpx.Response] = {}

        def chat_hold() -> None:
            results_chat["r"] = send(client, broker, f"hold {chat}", "interactive")

        chat_thread = threading.Thread(target=chat_hold)
        chat_thread.start()
        wait_until(lambda: len(results) == 1, 10)
        (shed,) = results.values()
        assert shed.status_code == 429
        assert shed.headers["admitgate-reason"] == "shed"
        info = shed.json()["error"]["details"][0]
        assert info["metadata"]["priority"] == "batch"
        # A batch newcomer now meets a full queue with nothing less important to shed.
        refused = send(client, broker, "echo no", "batch", path="/")
        assert refused.status_code == 429
        assert refused.json()["error"]["data"] == {
            "reason": "queue_full",
            "retryAfter": refused.json()["error"]["data"]["retryAfter"],
            "priority": "batch",
        }
    finally:
        for name in holds:
            latches[name].release()
        latches[chat].release()
        for thread in threads:
            thread.join(15)
        chat_thread.join(15)
    after = settled(broker)
    assert class_figure(after, "shed", "batch") - class_figure(before, "shed", "batch") == 1
    assert results_chat["r"].status_code == 200


def test_missing_and_unknown_classes_run_in_the_default_class_and_are_counted(env: Any) -> None:
    _, _, broker, client = env
    before = settled(broker)
    for value in (None, "", "urgent", b"\xe9t\xe9", "interactive"):
        assert send(client, broker, "echo x", value).status_code == 200
    after = settled(broker)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('broker_priority_defaulted_total{cause="missing"}') == 2
    assert delta('broker_priority_defaulted_total{cause="unknown"}') == 2
    assert delta('broker_class_admitted_total{class="batch"}') == 4
    assert delta('broker_class_admitted_total{class="interactive"}') == 1


# -- generated: mixed classes, tenants and unknown values ---------------------------------

VALUES = st.sampled_from(["interactive", "batch", None, "", "urgent", b"\xff"])
REQUESTS = st.lists(
    st.tuples(
        VALUES,
        st.sampled_from(["", "acme", "globex", "initech"]),
        st.sampled_from(["hold", "echo"]),
        st.sampled_from(["/message:send", "/"]),
    ),
    min_size=1,
    max_size=10,
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(requests=REQUESTS, release_after=st.integers(0, 10))
def test_generated_mixed_classes_keep_the_cap_and_add_up(
    env: Any, requests: list[tuple[Any, str, str, str]], release_after: int
) -> None:
    latches, executor, broker, client = env
    before = settled(broker)
    names = [key() for _ in requests]
    codes: list[int] = [0] * len(requests)

    def one(i: int) -> None:
        value, tenant, command, path = requests[i]
        text = f"hold {names[i]}" if command == "hold" else f"echo {names[i]}"
        codes[i] = send(client, broker, text, value, tenant, path).status_code

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    try:
        for i, thread in enumerate(threads):
            thread.start()
            if i == release_after:
                time.sleep(0.05)
                for name in names[: i + 1]:
                    latches[name].release()
        time.sleep(0.05)
        assert executor.peak_running <= CAP
    finally:
        for name in names:
            latches[name].release()
        for thread in threads:
            thread.join(20)
    assert executor.peak_running <= CAP
    assert all(code in (200, 429) for code in codes), codes
    after = settled(broker)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    sent = {"interactive": 0, "batch": 0}
    missing = unknown = 0
    for value, *_ in requests:
        if value == "interactive":
            sent["interactive"] += 1
        else:
            sent["batch"] += 1  # the default class: named, missing or unknown
            missing += value is None or value == ""
            unknown += value in ("urgent", b"\xff")
    # Every request sent in a class ended in exactly one of its outcomes.
    for name in CLASSES:
        ended = sum(delta(f'broker_class_{o}_total{{class="{name}"}}') for o in OUTCOMES)
        assert ended == sent[name], (name, ended, sent)
    assert delta('broker_priority_defaulted_total{cause="missing"}') == missing
    assert delta('broker_priority_defaulted_total{cause="unknown"}') == unknown
    # The classes add up to the totals (by transport).
    transports = ("jsonrpc", "rest", "grpc")
    admitted = sum(delta(f'broker_admitted_total{{transport="{t}"}}') for t in transports)
    refused = sum(delta(f'broker_rejected_total{{transport="{t}"}}') for t in transports)
    by_class = {
        o: sum(delta(f'broker_class_{o}_total{{class="{c}"}}') for c in CLASSES) for o in OUTCOMES
    }
    assert by_class["admitted"] == admitted == codes.count(200)
    assert by_class["rejected"] + by_class["shed"] == refused == codes.count(429)


def test_bad_priority_flags_exit_2_with_one_line_naming_them() -> None:
    binary = build_broker()
    for args, needle in [
        (["--priority", "a:min=1.5"], "--priority: min_share of priority class 'a'"),
        (["--priority", "a", "--priority-from", "cookie:x"], "--priority-from must be"),
        (["--priority-from", "header:x-priority"], "--priority-from needs priority classes"),
        (
            ["--priority", "a", "--fairness", "fair"],
            '--fairness must be tenant or none, got "fair"',
        ),
    ]:
        done = subprocess.run(
            [str(binary), "--upstream", "http://127.0.0.1:9", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, done
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], done.stderr


def test_grpc_calls_take_their_class_from_metadata_and_refusals_name_it() -> None:
    """``--priority-from metadata:x-priority`` through the broker to a real grpc.aio A2A
    server: an interactive call queued behind running batch calls runs first at the next
    release; a refusal carries the ``admitgate-priority`` trailer and the class in
    ``grpc-status-details-bin``."""
    loop = LoopThread()
    server = A2AServer([])
    loop.run(server.start())
    broker = BrokerProcess(
        build_broker(),
        "--upstream",
        "http://127.0.0.1:9",
        "--grpc-upstream",
        f"http://{server.target}",
        "--max-in-flight",
        "1",
        "--queue-depth",
        "1",
        "--priority",
        "interactive:min=0.5",
        "--priority",
        "batch",
        "--priority-from",
        "metadata:x-priority",
    )
    executor = server.executor

    def call(stub: Any, text: str, priority: str) -> Any:
        return stub.SendMessage(
            user_message(text), metadata=(("x-priority", priority),), timeout=20
        )

    async def main() -> None:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            running = asyncio.ensure_future(call(stub, "hold:b1", "batch"))
            await executor.started("b1")
            waiting = asyncio.ensure_future(call(stub, "hold:b2", "batch"))
            await asyncio.to_thread(
                broker.wait_for, 'broker_class_queued_requests{class="batch"}', 1
            )
            # The queue (depth 1) holds a batch call: the interactive call sheds it.
            chat = asyncio.ensure_future(call(stub, "hold:i1", "interactive"))
            with pytest.raises(grpc.aio.AioRpcError) as shed:
                await waiting
            trailers = dict(shed.value.trailing_metadata() or ())
            assert trailers["admitgate-reason"] == "shed"
            assert trailers["admitgate-priority"] == "batch"
            status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
            info = error_details_pb2.ErrorInfo()
            assert status.details[0].Unpack(info)
            assert dict(info.metadata) == {"reason": "shed", "priority": "batch"}
            executor.release("b1")
            await running
            await executor.started("i1")
            executor.release("i1")
            await chat

    try:
        loop.run(main(), timeout=30)
        broker.wait_for('broker_class_inflight_requests{class="interactive"}', 0)
        m = broker.metrics()
        assert m['broker_class_admitted_total{class="interactive"}'] == 1
        assert m['broker_class_shed_total{class="batch"}'] == 1
        assert m['broker_admitted_total{transport="grpc"}'] == 2
    finally:
        loop.run(_release(server))
        assert broker.stop() == 0
        loop.run(server.stop())


async def _release(server: Any) -> None:
    server.executor.release_all()


def test_serve_keywords_take_the_classes_and_name_bad_ones() -> None:
    import admitgate.broker

    with pytest.raises(
        TypeError, match=r"priority must be a list of str \(one per class\), got 'a'"
    ):
        admitgate.broker.serve(upstream="http://127.0.0.1:9", priority="a")
    with pytest.raises(ValueError, match=r"^priority: min_share of priority class 'a'"):
        admitgate.broker.serve(upstream="http://127.0.0.1:9", priority=["a:min=2"])
    with pytest.raises(ValueError, match=r"^priority_from needs priority classes"):
        admitgate.broker.serve(upstream="http://127.0.0.1:9", priority_from="header:x")
