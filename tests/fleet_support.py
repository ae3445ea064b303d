"""Real redis-server instances and replica processes for the fleet tests.

``RedisServer`` runs Debian's ``redis-server`` (found or installed by ``scripts/redis-server``)
on a free loopback port without persistence, optionally TLS-only with a throwaway CA made by
the openssl CLI and a password. ``Replica`` drives ``tests/fleet_replica.py`` in a subprocess:
one JSON command per line on its stdin, one JSON event per line on its stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The TLS instance's password (a test secret: it must never show in a repr, error or log).
TLS_PASSWORD = "fl33t-S3cret-pa55word"
REPLICA_SCRIPT = Path(__file__).resolve().parent / "fleet_replica.py"


def redis_server_binary() -> str:
    """The redis-server binary ``scripts/redis-server`` finds (installing it when missing)."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "redis-server")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not path:
        raise RuntimeError(
            f"scripts/redis-server failed ({done.returncode}): {done.stderr.strip()}"
        )
    return path


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost, valid for a day."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    # keyUsage on the CA and the key identifiers on the server certificate: CPython 3.13's
    # ssl verifies strictly (VERIFY_X509_STRICT) and refuses a chain without them.
    _openssl(directory, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "1", "-subj", "/CN=admitgate fleet test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    _openssl(directory, "req", *ec, "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost")  # fmt: skip
    (directory / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(directory, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey",
             "ca.key", "-CAcreateserial", "-out", "server.crt", "-days", "1",
             "-extfile", "server.ext")  # fmt: skip


class RedisServer:
    """One redis-server on 127.0.0.1, without persistence: a restart forgets everything."""

    def __init__(
        self,
        binary: str,
        *,
        name: str,
        tls: bool = False,
        password: str | None = None,
        extra_args: list[str] | None = None,
    ):
        self.binary = binary
        self.tls = tls
        self.password = password
        self.extra_args = list(extra_args or [])
        self.dir = Path(tempfile.mkdtemp(prefix=f"admitgate-redis-{name}-"))
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        if tls:
            make_certificates(self.dir)

    @property
    def ca_file(self) -> str:
        """The CA that signed a TLS instance's certificate."""
        return str(self.dir / "ca.crt")

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` (``rediss://:<password>@...`` for a TLS instance)."""
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def _args(self, log: Path) -> list[str]:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--protected-mode", "no", "--logfile", str(log)]  # fmt: skip
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.dir / "server.crt"),
                     "--tls-key-file", str(self.dir / "server.key"),
                     "--tls-ca-cert-file", str(self.dir / "ca.crt"),
                     "--tls-auth-clients", "no"]  # fmt: skip
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra_args

    def start(self) -> None:
        """Starts the server and waits (bounded) until it accepts connections."""
        self.starts += 1
        log = self.dir / f"redis-{self.starts}.log"
        self.process = subprocess.Popen(
            self._args(log),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            if "Ready to accept connections" in text:
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{text}")
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        """Whether the process is alive (not killed)."""
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Kills the server (SIGKILL: nothing is saved) and waits for it to exit."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        """Kills and starts again on the same port, with an empty dataset."""
        self.stop()
        self.start()

    def client(self) -> Any:
        """A redis-py client (decoding replies to str)."""
        import redis

        if self.tls:
            return redis.Redis(
                host="127.0.0.1",
                port=self.port,
                password=self.password,
                ssl=True,
                ssl_ca_certs=self.ca_file,
                decode_responses=True,
            )
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, decode_responses=True
        )

    def close(self) -> None:
        """Stops the server and removes its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_sentinel_binary() -> str:
    """Debian's ``redis-sentinel``, installed with ``apt-get`` when missing (needs root)."""
    found = shutil.which("redis-sentinel") or (
        "/usr/bin/redis-sentinel" if os.path.exists("/usr/bin/redis-sentinel") else None
    )
    if found:
        return found
    if os.geteuid() != 0:
        raise RuntimeError("redis-sentinel is missing: install Debian's package redis-sentinel")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-sentinel"],
    ):
        subprocess.run(command, check=True, capture_output=True, timeout=600, env=env)
    return shutil.which("redis-sentinel") or "/usr/bin/redis-sentinel"


class RedisSentinel:
    """One ``redis-sentinel`` on 127.0.0.1 monitoring ``mymaster`` (quorum 2,
    ``down-after-milliseconds 1000``)."""

    def __init__(self, binary: str, primary_port: int):
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="admitgate-sentinel-"))
        self.port = free_port()
        (self.dir / "sentinel.conf").write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.dir}\n"
            f"sentinel monitor mymaster 127.0.0.1 {primary_port} 2\n"
            "sentinel down-after-milliseconds mymaster 1000\n"
            "sentinel failover-timeout mymaster 4000\n"
            "sentinel parallel-syncs mymaster 1\n"
        )
        self.process: subprocess.Popen[bytes] | None = None
        log = self.dir / "sentinel.log"
        self.process = subprocess.Popen(
            [binary, str(self.dir / "sentinel.conf"), "--logfile", str(log)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while "+monitor master" not in (log.read_text(errors="replace") if log.exists() else ""):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-sentinel did not start on port {self.port}")
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.process is not None and self.process.poll() is None

    def client(self) -> Any:
        """A redis-py client of this sentinel."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def close(self) -> None:
        """Kills the sentinel and removes its directory."""
        if self.running:
            assert self.process is not None
            self.process.kill()
            self.process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelSet:
    """A Sentinel deployment on loopback: a primary, a replica, three sentinels."""

    def __init__(self) -> None:
        server = redis_server_binary()
        sentinel = redis_sentinel_binary()
        # A replica's first sync starts at once (Redis 7 waits 5 s for more replicas).
        quick = ["--repl-diskless-sync-delay", "0"]
        primary = RedisServer(server, name="primary", extra_args=quick)
        primary.start()
        replica = RedisServer(
            server,
            name="replica",
            extra_args=[*quick, "--replicaof", "127.0.0.1", str(primary.port)],
        )
        replica.start()
        self.nodes = [primary, replica]
        self.sentinels = [RedisSentinel(sentinel, primary.port) for _ in range(3)]
        self.wait_settled()

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<s1>,.../mymaster/0``."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/mymaster/0"

    def master(self) -> dict[str, Any]:
        """What a live sentinel says about ``mymaster``."""
        for sentinel in self.sentinels:
            if sentinel.running:
                return dict(sentinel.client().sentinel_master("mymaster"))
        raise AssertionError("no sentinel runs")

    def primary_port(self) -> int:
        """The port of the primary the sentinels name now."""
        for sentinel in self.sentinels:
            if sentinel.running:
                _, port = sentinel.client().sentinel_get_master_addr_by_name("mymaster")
                return int(port)
        raise AssertionError("no sentinel runs")

    def node(self, port: int) -> RedisServer:
        """The data node on ``port``."""
        return next(n for n in self.nodes if n.port == port)

    def wait_settled(self, timeout: float = 30.0) -> None:
        """Until every live sentinel knows the others and a replica that is up, and the named
        primary has a connected replica."""
        deadline = time.monotonic() + timeout
        while True:
            live = [s for s in self.sentinels if s.running]
            try:
                settled = all(
                    int(m["num-other-sentinels"]) == len(live) - 1
                    and int(m["num-slaves"]) >= 1
                    and m["flags"] == "master"
                    for m in (s.client().sentinel_master("mymaster") for s in live)
                )
                primary = self.node(self.primary_port())
                settled = (
                    settled
                    and primary.running
                    and primary.client().info("replication").get("slave0", {}).get("state")
                    == "online"
                )
                if settled:
                    # What durability="replicated" needs: a write the replica confirms in time.
                    client = primary.client()
                    client.set("test:settled", "1")
                    settled = int(client.execute_command("WAIT", 1, 500)) >= 1
            except Exception:  # a node restarting: not settled yet
                settled = False
            if settled:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the sentinels did not settle within {timeout} s")
            time.sleep(0.1)

    def close(self) -> None:
        """Stops every process."""
        for sentinel in self.sentinels:
            sentinel.close()
        for node in self.nodes:
            node.close()


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Polls ``check`` on the running loop until it holds (bounded)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.01)


def union_peak(intervals: list[tuple[float, float]]) -> int:
    """The most intervals ``(start, end)`` that overlap at any instant (touching is not
    overlapping: an end at t frees its place for a start at t)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = level = 0
    for _, step in points:
        level += step
        peak = max(peak, level)
    return peak


class Replica:
    """One replica process (``tests/fleet_replica.py``) with its own ``FleetLimit``; its turns
    go through a gate built with ``build_admission_gate(**gate, fleet=...)`` (``via="limit"``:
    through ``FleetLimit.acquire`` alone)."""

    def __init__(
        self, fleet: dict[str, Any], *, via: str = "gate", gate: dict[str, Any] | None = None
    ):
        config = {"fleet": fleet, "via": via, "gate": gate or {}}
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.process = subprocess.Popen(
            [sys.executable, str(REPLICA_SCRIPT), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.strip()
            if line:
                self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr.append(line)

    @property
    def pid(self) -> int:
        """The replica's process id."""
        return self.process.pid

    def send(self, command: dict[str, Any]) -> None:
        """Sends one command."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, timeout: float = 20.0) -> dict[str, Any]:
        """The next event named ``event`` (others before it are collected in ``seen``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                got = self.events.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise AssertionError(
                    f"replica {self.pid}: no {event!r} within {timeout} s; stderr:\n"
                    + "".join(self.stderr[-30:])
                ) from None
            if got.get("event") == event:
                return got
            if got.get("event") in ("exited", "error"):
                raise AssertionError(
                    f"replica {self.pid} {got}; stderr:\n" + "".join(self.stderr[-30:])
                )
            self.seen.append(got)

    def drain(self) -> list[dict[str, Any]]:
        """Every event received so far (``seen`` first), emptying both."""
        got, self.seen = self.seen, []
        while True:
            try:
                got.append(self.events.get_nowait())
            except queue.Empty:
                return got

    def ask(self, command: dict[str, Any], event: str, timeout: float = 20.0) -> dict[str, Any]:
        """Sends ``command`` and returns the event it answers with."""
        self.send(command)
        return self.expect(event, timeout)

    def signal(self, sig: signal.Signals) -> None:
        """Sends a signal to the replica."""
        os.kill(self.pid, sig)

    def close(self) -> None:
        """Asks the replica to exit, killing it if it does not within a few seconds."""
        if self.process.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=5)
        # The readers end at EOF; closing the pipes under them would raise in their threads.
        for reader in self.readers:
            reader.join(timeout=5)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
