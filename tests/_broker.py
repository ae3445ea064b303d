"""The admitgate broker as the tests run it: the standalone binary (``cargo build -p
admitgate-broker``, debug), or Python running it in-process (``python -m admitgate broker``,
``admitgate.broker.serve()``), started on loopback ports chosen by the OS.

:class:`BrokerProcess` starts the broker with ``--listen 127.0.0.1:0 --metrics-listen
127.0.0.1:0``, reads its structured stderr (one JSON object per line) on a thread, learns its
addresses from the ``listening`` line, and reads ``/metrics`` into a dict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def key() -> str:
    """A fresh key for one test's latch or tenant."""
    return uuid.uuid4().hex[:12]


def wait_until(condition: Any, timeout: float = 5.0) -> None:
    """Polls ``condition`` every 5 ms; an ``AssertionError`` if it is not true within
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def build_broker() -> Path:
    """Builds the broker binary (incremental; a no-op when it is up to date) and returns it;
    ``ADMITGATE_BROKER_BINARY`` names another one to run instead (an older build, to see a
    regression test fail without the fix)."""
    other = os.environ.get("ADMITGATE_BROKER_BINARY")
    if other:
        return Path(other)
    subprocess.run(
        ["cargo", "build", "-q", "-p", "admitgate-broker"], cwd=ROOT, check=True, timeout=900
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug" / "admitgate-broker"


class BrokerProcess:
    """One broker process; ``args`` are its flags beyond the listen addresses. ``binary`` is
    the program run with ``prefix`` before the flags: the broker binary, or the Python
    interpreter with ``("-m", "admitgate", "broker")`` or a script; what it prints on stdout
    is :attr:`output` once it has stopped."""

    def __init__(
        self, binary: Path | str, *args: str, metrics: bool = True, prefix: Sequence[str] = ()
    ) -> None:
        command = [str(binary), *prefix, "--listen", "127.0.0.1:0", *args]
        if metrics:
            command += ["--metrics-listen", "127.0.0.1:0"]
        self.output = ""
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._listening.wait(15):
            self.kill()
            raise RuntimeError(f"broker did not start: {self.raw}")
        listening = next(line for line in self.lines if line.get("event") == "listening")
        self.address: str = listening["listen"]
        self.url = f"http://{self.address}"
        self.metrics_url = (
            f"http://{listening['metrics_listen']}" if "metrics_listen" in listening else None
        )

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            text = raw.decode("utf-8", "replace").rstrip("\n")
            self.raw.append(text)
            try:
                line = json.loads(text)
            except ValueError:
                continue
            self.lines.append(line)
            if line.get("event") == "listening":
                self._listening.set()

    def events(self, name: str) -> list[dict[str, Any]]:
        """The log lines of event ``name``."""
        return [line for line in self.lines if line.get("event") == name]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{labels}": value}``."""
        assert self.metrics_url is not None
        text = httpx.get(self.metrics_url + "/metrics", timeout=5).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def gauge(self, name: str) -> float:
        """One sample of ``/metrics`` (0 when absent)."""
        return self.metrics().get(name, 0.0)

    def wait_for(self, name: str, value: float, timeout: float = 5.0) -> None:
        """Polls ``/metrics`` until sample ``name`` equals ``value``."""
        deadline = time.monotonic() + timeout
        while self.gauge(name) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed {self.gauge(name)}, expected {value}")
            time.sleep(0.01)

    def stop(self, sig: int | None = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Sends ``sig`` (``None``: none, it is ending by itself) and waits for the exit
        code."""
        if sig is not None and self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout)
        finally:
            self.kill()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.output = self.process.stdout.read().decode("utf-8", "replace")
            self.process.stdout.close()
        if self.process.stderr is not None:
            self.process.stderr.close()
        return code

    def kill(self) -> None:
        """Ends the process if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
