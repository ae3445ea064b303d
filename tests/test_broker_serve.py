"""``admitgate.broker.serve()``: the broker in this process, the GIL released, signals kept.

The servers are real (the A2A SDK app on uvicorn in this process, the broker in a child
Python so signals can be sent to it) and the clients are httpx. What fails fast (a bad
argument, a port in use, a thread other than the main one, a panic) is called in this
process.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _broker
import admitgate
import admitgate.broker
import httpx
import pytest
from _a2a_app import (
    A2A_HEADERS,
    ControlledExecutor,
    Latches,
    ServerThread,
    build_sdk_app,
    jsonrpc,
    send_params,
)
from _broker import BrokerProcess

SERVE = str(Path(__file__).with_name("_serve_broker.py"))


@pytest.fixture(scope="module")
def agent() -> Iterator[types.SimpleNamespace]:
    """The SDK app on uvicorn; ``hold <key>`` runs until the test releases latch ``key``."""
    latches = Latches()
    server = ServerThread()
    server.start(build_sdk_app(ControlledExecutor(latches), server.url))
    yield types.SimpleNamespace(latches=latches, url=server.url)
    latches.release_all()
    server.stop()


def serve(*args: str, metrics: bool = True) -> BrokerProcess:
    """``admitgate.broker.serve()`` in a child Python, with these flags as keywords."""
    return BrokerProcess(sys.executable, *args, metrics=metrics, prefix=[SERVE])


def ended(broker: BrokerProcess) -> list[dict[str, str]]:
    """How each serve() call of the child ended (its stdout lines)."""
    return [json.loads(line) for line in broker.output.splitlines()]


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    _broker.wait_until(condition, timeout)  # this file's waits allow 10 s


class Call(threading.Thread):
    """A blocking JSON-RPC or REST SendMessage through the broker, on a thread."""

    def __init__(self, broker: BrokerProcess, text: str, *, rest: bool = False) -> None:
        super().__init__(daemon=True)
        self.url = broker.url + ("/message:send" if rest else "/")
        self.body = send_params(text) if rest else jsonrpc("SendMessage", send_params(text))
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, headers=A2A_HEADERS, timeout=30)
        except httpx.HTTPError as exc:
            self.error = exc


def hold(agent: Any, broker: BrokerProcess, *, rest: bool = False) -> tuple[str, Call]:
    """A call the agent holds until latch ``key`` is released; returns once it runs."""
    key = uuid.uuid4().hex[:12]
    call = Call(broker, f"hold {key}", rest=rest)
    wait_until(agent.latches[key].started.is_set)
    return key, call


def test_serve_gates_a2a_traffic_as_the_binary_does_and_sigterm_drains(agent: Any) -> None:
    """Cap 2 and a queue of 1 in front of the SDK app: of 2 + 3 calls, 2 run, 1 queues and 2
    are refused; SIGTERM refuses the queued one with `closing`, lets the running ones finish,
    and serve() returns None (the SIGTERM handler it installed is gone again)."""
    broker = serve(
        "--upstream", agent.url, "--max-in-flight", "2", "--queue-depth", "1",
        "--drain-timeout", "10",
    )  # fmt: skip
    try:
        (k1, a), (k2, b) = hold(agent, broker), hold(agent, broker, rest=True)
        queued = Call(broker, "echo later")
        broker.wait_for('broker_queued_requests{transport="jsonrpc"}', 1)
        refused = [Call(broker, "echo no"), Call(broker, "echo no", rest=True)]
        for call in refused:
            call.join(10)
            assert call.response is not None and call.response.status_code == 429
            assert call.response.headers["admitgate-reason"] == "queue_full"
        metrics = broker.metrics()
        assert metrics["broker_gate_in_flight"] == 2
        assert metrics['broker_rejected_total{transport="jsonrpc"}'] == 1
        assert metrics['broker_rejected_total{transport="rest"}'] == 1
        broker.process.send_signal(signal.SIGTERM)
        queued.join(10)
        assert queued.response is not None and queued.response.status_code == 503
        assert queued.response.json()["error"]["data"]["reason"] == "closing"
        assert broker.process.poll() is None  # draining: the running calls may finish
        for key, call in ((k1, a), (k2, b)):
            agent.latches[key].release()
            call.join(10)
            assert call.response is not None and call.response.status_code == 200
        assert broker.stop(None) == 0
    finally:
        broker.kill()
    assert ended(broker) == [{"returned": "None"}]
    assert broker.events("drained")[0]["all_requests_finished"] is True


def test_sigint_drains_then_raises_keyboard_interrupt(agent: Any) -> None:
    broker = serve("--upstream", agent.url, "--max-in-flight", "1", "--drain-timeout", "10")
    try:
        key, call = hold(agent, broker)
        broker.process.send_signal(signal.SIGINT)
        broker.wait_for("broker_draining", 1)
        assert broker.process.poll() is None
        agent.latches[key].release()
        call.join(10)
        assert call.response is not None and call.response.status_code == 200
        assert broker.stop(None) == 0
    finally:
        broker.kill()
    assert ended(broker) == [{"raised": "KeyboardInterrupt", "message": ""}]
    assert broker.events("drained")[0]["all_requests_finished"] is True


def test_a_second_interrupt_cuts_the_drain(agent: Any) -> None:
    broker = serve("--upstream", agent.url, "--max-in-flight", "1", "--drain-timeout", "30")
    try:
        key, call = hold(agent, broker)
        broker.process.send_signal(signal.SIGINT)
        broker.wait_for("broker_draining", 1)
        started = time.monotonic()
        assert broker.stop(signal.SIGINT) == 0
        assert time.monotonic() - started < 5  # not the 30 s drain
        call.join(10)
        assert call.error is not None  # its connection was cut
    finally:
        agent.latches[key].release()
        broker.kill()
    assert ended(broker) == [{"raised": "KeyboardInterrupt", "message": ""}]
    assert broker.events("drained") == [] and len(broker.events("drain_cut")) == 1


def python(code: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a child Python; it must exit 0."""
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=False
    )
    assert child.returncode == 0, child.stderr
    return child


def test_a_handler_of_the_callers_own_decides(agent: Any) -> None:
    """serve() leaves a SIGTERM handler the caller installed in place: while it returns, the
    broker serves on; when it raises, the broker drains and the exception comes out."""
    broker = serve("--own-sigterm-handler", "--upstream", agent.url)
    try:
        broker.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # three signal checks
        assert broker.gauge("broker_draining") == 0
        key, call = hold(agent, broker)  # still admitting
        agent.latches[key].release()
        call.join(10)
        assert broker.stop(signal.SIGTERM) == 0
    finally:
        broker.kill()
    assert ended(broker) == [{"raised": "SystemExit", "message": "3"}]
    assert broker.events("drained")[0]["all_requests_finished"] is True


def test_other_python_threads_run_while_serve_blocks(agent: Any) -> None:
    """A thread counting in pure Python makes progress while serve() blocks the main thread,
    then stops the broker with SIGTERM. If serve() held the GIL, the thread would never wake
    from its sleep and the child would not end."""
    code = f"""
import os, signal, threading, time
import admitgate.broker

counted = []

def count():
    time.sleep(0.5)  # serve() is blocking by now
    n, until = 0, time.monotonic() + 0.3
    while time.monotonic() < until:
        n += 1
    counted.append(n)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=count).start()
result = admitgate.broker.serve(upstream={agent.url!r}, listen="127.0.0.1:0")
print(result, counted[0])
"""
    child = python(code)
    result, counted = child.stdout.split()
    assert result == "None"
    # Pure Python counts millions per second; a few hundred thousand in 0.3 s even on a
    # loaded machine. Only the 100 ms signal checks take the GIL from it.
    assert int(counted) > 100_000, counted


def test_a_child_forked_while_serving_gets_its_handlers_back_and_may_serve(agent: Any) -> None:
    """A thread forks while serve() blocks the main thread. The child has no broker: SIGTERM
    is at its default again (it would be ignored otherwise) and serve() there gets as far as
    binding (a port in use: OSError), not "already running"."""
    code = f"""
import os, signal, socket, threading, time
import admitgate.broker

def fork_then_stop():
    time.sleep(0.5)
    pid = os.fork()
    if pid == 0:
        default = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            try:
                admitgate.broker.serve(upstream="http://127.0.0.1:9",
                                       listen="%s:%d" % taken.getsockname())
                outcome = "returned"
            except Exception as exc:
                outcome = type(exc).__name__
        os.write(1, f"child {{default}} {{outcome}}\\n".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=fork_then_stop).start()
print("parent", admitgate.broker.serve(upstream={agent.url!r}, listen="127.0.0.1:0"))
"""
    assert python(code).stdout.splitlines() == ["child True OSError", "parent None"]


def test_serve_twice_in_a_row_and_never_twice_at_once(agent: Any) -> None:
    """A SIGUSR1 handler calling serve() while it serves gets RuntimeError, which (raised by
    a handler) drains the first broker and is raised from it; serve() then runs again."""
    broker = serve("--reenter-on-sigusr1", "--then-serve-again", "--upstream", agent.url)
    try:
        broker.process.send_signal(signal.SIGUSR1)
        wait_until(lambda: len(broker.events("listening")) == 2)
        assert broker.stop() == 0
    finally:
        broker.kill()
    first, second = ended(broker)
    assert first["raised"] == "RuntimeError"
    assert "already running" in first["message"]
    assert second == {"returned": "None"}
    assert len(broker.events("drained")) == 2


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"upstream": "https://x:1"}, ValueError, "upstream must be an http://host:port URL"),
        ({"upstream": 7}, TypeError, "upstream must be a str, got 7"),
        ({"queue_depth": -1}, ValueError, "queue_depth must be >= 0, got -1"),
        ({"max_in_flight": True}, ValueError, "max_in_flight must be an integer, got True"),
        ({"max_in_flight": [1]}, ValueError, "max_in_flight must be an integer, got [1]"),
        ({"overflow_policy": "drop"}, ValueError, "overflow_policy must be one of"),
        ({"drain_timeout": -1}, ValueError, "drain_timeout must be a number of seconds >= 0"),
        ({"drain_timeout": "soon"}, ValueError, "drain_timeout must be a number, got 'soon'"),
        ({"memory_hard_ratio": 2}, ValueError, "memory_hard_ratio must be a fraction"),
        ({"listen": "localhost:80"}, ValueError, "listen must be an IP:port address"),
        ({"metrics_listen": 9464}, TypeError, "metrics_listen must be a str, got 9464"),
        ({"tenant_from": "cookie:x"}, ValueError, "tenant_from must be header:NAME or path"),
        ({"threads": 0}, ValueError, "threads must be between 1 and 1024, got 0"),
        ({"threads": 1.5}, ValueError, "threads must be an integer, got 1.5"),
        ({"max_in_flight_per_tenant": 2}, ValueError, "max_in_flight_per_tenant needs"),
        ({"config": 3.5}, TypeError, "config must be a path (str or os.PathLike), got 3.5"),
        ({"config": "/nonexistent.yaml"}, ValueError, "config /nonexistent.yaml"),
        ({"fleet": "http://127.0.0.1:6379"}, ValueError, "fleet"),
    ],
)
def test_a_bad_argument_is_named_with_its_value(
    keywords: dict[str, Any], error: type[Exception], message: str
) -> None:
    keywords = {"upstream": "http://127.0.0.1:9", "listen": "127.0.0.1:0", **keywords}
    with pytest.raises(error) as raised:
        admitgate.broker.serve(**keywords)
    assert message in str(raised.value)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_upstream_is_required_and_the_fleet_password_never_shown() -> None:
    with pytest.raises(ValueError, match="upstream is required"):
        admitgate.broker.serve(listen="127.0.0.1:0")
    with pytest.raises(TypeError) as raised:
        admitgate.broker.serve(upstream="http://127.0.0.1:9", fleet=b"redis://:hunter2@x:6379")
    assert "fleet must be a str" in str(raised.value) and "hunter2" not in str(raised.value)
    with pytest.raises(ValueError) as bad_url:
        admitgate.broker.serve(
            upstream="http://127.0.0.1:9", listen="127.0.0.1:0", fleet="redis://:hunter2@"
        )
    assert "hunter2" not in str(bad_url.value)


def test_a_port_in_use_is_an_oserror_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "{}:{}".format(*taken.getsockname())
        with pytest.raises(OSError) as raised:
            admitgate.broker.serve(upstream="http://127.0.0.1:9", listen=address)
        assert raised.value.errno == errno.EADDRINUSE
        assert f"listen {address}: " in str(raised.value)
        with pytest.raises(OSError, match=f"metrics_listen {address}: "):
            admitgate.broker.serve(
                upstream="http://127.0.0.1:9", listen="127.0.0.1:0", metrics_listen=address
            )
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_serve_outside_the_main_thread_is_refused() -> None:
    raised: list[BaseException] = []

    def call() -> None:
        try:
            admitgate.broker.serve(upstream="http://127.0.0.1:9", listen="127.0.0.1:0")
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(10)
    assert isinstance(raised[0], RuntimeError)
    assert "main thread" in str(raised[0])


def test_a_panic_inside_the_broker_is_an_internal_error_not_an_abort() -> None:
    admitgate._admitgate._panic_in_next_broker()
    with pytest.raises(admitgate.InternalError, match="deliberate panic in the broker"):
        admitgate.broker.serve(upstream="http://127.0.0.1:9", listen="127.0.0.1:0")
    # The interpreter, the handlers and the next call are as before.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with pytest.raises(ValueError, match="queue_depth"):
        admitgate.broker.serve(upstream="http://127.0.0.1:9", queue_depth=-1)
    assert os.getpid() > 0
