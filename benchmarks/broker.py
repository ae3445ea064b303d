"""The broker's cost as a proxy, against HAProxy: ``python benchmarks/broker.py [--quick]``.

Standalone (not one of ``python -m benchmarks``' workloads). Everything runs on loopback in
one run, interleaved (each round runs every subject once, in a rotated order), and prints one
table:

* the **upstream**: nginx (Debian's package) answering every request with a fixed 3-byte body
  (``return 200``), HTTP/1.1 on one port and h2c (prior knowledge) on another, and a slow
  stream (1 KB/s) at ``POST /message:stream`` for the memory rows;
* the **subjects**: ``direct`` (oha to nginx), ``haproxy`` (Debian's package, 2.6 on
  bookworm: a backend server with ``maxconn`` and a queue, the closest existing peer) and
  ``broker`` (the standalone binary, ``target/release/admitgate-broker``, built here with
  ``cargo build --release`` when it is missing or stale); ``--baseline PATH`` adds another
  broker binary (an earlier build) and ``--python`` the broker in the Python process
  (``python -m admitgate broker``: build the extension with ``maturin develop --release``);
* the **load**: oha at a fixed rate with ``--latency-correction``, a gated request
  (``POST /message:send``; the broker's cap far above the load, so nothing is refused).

Every client protocol (HTTP/1.1, h2c) meets every upstream protocol (HTTP/1.1, h2c): HAProxy
has a frontend per pair, the broker a process per upstream protocol (``--upstream-protocol``)
serving both client protocols on its port.

**Pinning.** On 2 or more CPUs the subjects (broker, HAProxy) are pinned with ``taskset`` to
one CPU of their own and oha and nginx to the others, so a subject gets one core (a sidecar's
usual quota; HAProxy runs ``nbthread 1``, the broker sizes its runtime to its affinity) and
never competes with the load generator for it: this is what makes p99 repeatable on 2 vCPUs.
``--no-pin`` turns it off.

Rows:

* added p50 / p99 latency over ``direct`` (same client protocol) at each rate, medians of the
  rounds, with the spread of the added p99 across rounds (max - min: how repeatable it is);
* CPU seconds of the subject per 1,000 requests answered (from ``/proc/PID/stat``);
* peak throughput on one core (oha unthrottled, 64 connections) and how busy the subject's
  core was meanwhile (below ~95% the load generator, not the subject, was the limit);
* memory (fresh processes, one figure each): RSS idle, per connection that never sent a byte,
  per idle keep-alive connection (each answered once), and per open stream with 1,000 gated
  SSE streams held open (HTTP/1.1 client and upstream, then h2c client and upstream: 10
  connections of 100 streams).

Needs nginx and haproxy (installed with ``apt-get`` when missing and run as root), oha
(``cargo install oha --locked`` when missing) and, for the h2c memory row, the ``h2``
package (hypercorn's dependency, in the test group). ``--quick`` covers every row with fewer
and shorter rounds (about 6 minutes on 2 vCPUs). Absolute numbers depend on the machine; the
comparisons within one run are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BROKER = ROOT / "target" / "release" / "admitgate-broker"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROTOCOLS = ("http/1.1", "h2c")
GATED_BODY = b'{"message":{"role":"ROLE_USER","parts":[{"text":"x"}]}}'
STREAMS = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the whole process (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Pinning:
    """Which CPUs the subjects get, and which the load generator and nginx share."""

    def __init__(self, enabled: bool) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        self.enabled = enabled and len(cpus) >= 2
        self.subject = cpus[:1] if self.enabled else cpus
        self.load = cpus[1:] if self.enabled else cpus

    def prefix(self, cpus: list[int]) -> list[str]:
        if not self.enabled:
            return []
        return ["taskset", "-c", ",".join(map(str, cpus))]

    def describe(self) -> str:
        if not self.enabled:
            return "not pinned"
        return f"subjects on CPU {self.subject}, oha and nginx on CPUs {self.load}"


class Upstream:
    """nginx: a fixed response on HTTP/1.1 and h2c, a slow stream at /message:stream."""

    def __init__(self, workdir: Path, pin: Pinning) -> None:
        self.h1 = free_port()
        self.h2 = free_port()
        (workdir / "big").write_bytes(b"data: x\n\n" * (1 << 19))
        conf = workdir / "nginx.conf"
        conf.write_text(
            f"""
daemon off;
worker_processes {len(pin.load)};
pid {workdir}/nginx.pid;
error_log {workdir}/nginx.err warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
    http2_max_concurrent_streams 4096;
    client_body_temp_path {workdir};
    server {{
        listen 127.0.0.1:{self.h1};
        listen 127.0.0.1:{self.h2} http2;
        # A gated A2A stream (POST): the static file answers the 405 nginx gives a POST.
        location = /message:stream {{
            alias {workdir}/big;
            default_type text/event-stream;
            limit_rate 1k;
            error_page 405 =200 $uri;
        }}
        location / {{ return 200 "ok\\n"; }}
    }}
}}
"""
        )
        self.process = subprocess.Popen(
            [*pin.prefix(pin.load), "nginx", "-c", str(conf), "-p", str(workdir)],
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.h1)
        wait_port(self.h2)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


Pair = tuple[str, str]  # (client protocol, upstream protocol)
PAIRS: list[Pair] = [(c, u) for c in PROTOCOLS for u in PROTOCOLS]


class Subject:
    """A proxy (or nothing) in front of the upstream: the port and pid serving each pair."""

    name: str
    ports: dict[Pair, int]
    pids: dict[Pair, int | None]

    def stop(self) -> None: ...


class Direct(Subject):
    def __init__(self, upstream: Upstream) -> None:
        self.name = "direct"
        self.ports = {(c, u): upstream.h1 if c == "http/1.1" else upstream.h2 for c, u in PAIRS}
        self.pids = dict.fromkeys(PAIRS)


class HAProxy(Subject):
    def __init__(self, upstream: Upstream, workdir: Path, pin: Pinning) -> None:
        self.name = "haproxy"
        self.ports = {pair: free_port() for pair in PAIRS}
        frontends = "".join(
            f"""
frontend {c[:2]}_{u[:2]}
    bind 127.0.0.1:{self.ports[(c, u)]}{" proto h2" if c == "h2c" else ""}
    default_backend {u[:2]}
"""
            for c, u in PAIRS
        )
        conf = workdir / "haproxy.cfg"
        conf.write_text(
            f"""
global
    maxconn 8000
    nbthread {len(pin.subject)}
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout queue 10s
    option http-keep-alive
{frontends}
backend ht
    server nginx 127.0.0.1:{upstream.h1} maxconn 10000
backend h2
    server nginx 127.0.0.1:{upstream.h2} proto h2 maxconn 10000
"""
        )
        self.process = subprocess.Popen(
            [*pin.prefix(pin.subject), "haproxy", "-f", str(conf)],
            stderr=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        for port in self.ports.values():
            wait_port(port)
        self.pids = dict.fromkeys(PAIRS, self.process.pid)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class BrokerProcess:
    """One broker process in front of ``upstream_port``: HTTP/1.1 and h2c clients on one port."""

    def __init__(self, command: list[str], upstream_port: int, protocol: str) -> None:
        self.port = free_port()
        flags = [
            "--listen",
            f"127.0.0.1:{self.port}",
            "--upstream",
            f"http://127.0.0.1:{upstream_port}",
            "--upstream-protocol",
            "h2" if protocol == "h2c" else "http1",
            "--max-in-flight",
            "100000",
            "--upstream-idle-timeout",
            "30",
        ]
        self.process = subprocess.Popen([*command, *flags], stderr=subprocess.DEVNULL)
        wait_port(self.port)
        # The Python broker runs in the interpreter: its RSS and CPU are the process's.
        self.pid = self.process.pid

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(20)


class Broker(Subject):
    """The broker as HAProxy is set up: one process per upstream protocol, each serving both
    client protocols."""

    def __init__(self, name: str, command: list[str], upstream: Upstream) -> None:
        self.name = name
        self.processes = {
            "http/1.1": BrokerProcess(command, upstream.h1, "http/1.1"),
            "h2c": BrokerProcess(command, upstream.h2, "h2c"),
        }
        self.ports = {(c, u): self.processes[u].port for c, u in PAIRS}
        self.pids = {(c, u): self.processes[u].pid for c, u in PAIRS}

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop()


def broker_maker(name: str, command: list[str], upstream: Upstream) -> Callable[[], Subject]:
    """Starts a fresh :class:`Broker` each time it is called (one per memory figure)."""
    return lambda: Broker(name, command, upstream)


def oha(
    pin: Pinning,
    port: int,
    *,
    rate: int | None,
    seconds: float,
    http2: bool,
    connections: int,
) -> dict[str, Any]:
    command = [
        *pin.prefix(pin.load),
        "oha",
        "--no-tui",
        "--output-format",
        "json",
        "-z",
        f"{seconds}s",
        "-c",
        str(connections),
        "-m",
        "POST",
        "-H",
        "content-type: application/json",
        "-d",
        GATED_BODY.decode(),
    ]
    if rate is not None:
        command += ["-q", str(rate), "--latency-correction"]
    if http2:
        command += ["--http2", "-p", "8"]
    command.append(f"http://127.0.0.1:{port}/message:send")
    out = subprocess.run(command, capture_output=True, check=True, timeout=seconds + 60).stdout
    return json.loads(out)


def answered(result: dict[str, Any]) -> int:
    return int(result.get("statusCodeDistribution", {}).get("200", 0))


def errors(result: dict[str, Any]) -> int:
    return sum(
        v
        for k, v in result.get("errorDistribution", {}).items()
        # Requests still in flight when -z ends: not failures.
        if k != "aborted due to deadline"
    )


# --- memory -------------------------------------------------------------------------------


def silent_connections(port: int, pid: int, count: int) -> float:
    """RSS added per connection that connected and never sent a byte, in KB."""
    before = rss_kb(pid)
    sockets = []
    try:
        for _ in range(count):
            sockets.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(1.0)
        return (rss_kb(pid) - before) / count
    finally:
        for s in sockets:
            s.close()


def idle_connections(port: int, pid: int, count: int) -> float:
    """RSS added per idle keep-alive connection, each answered once (one after another, so the
    figure is what an idle connection holds, not a burst's peak), in KB."""
    before = rss_kb(pid)
    sockets = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(4096)
            sockets.append(s)
        time.sleep(1.0)
        return (rss_kb(pid) - before) / count
    finally:
        for s in sockets:
            s.close()


def h1_streams(port: int, pid: int, count: int) -> float:
    """RSS added per open gated stream, HTTP/1.1 clients (one stream each), in KB."""
    before = rss_kb(pid)
    request = (
        b"POST /message:stream HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"accept: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(GATED_BODY), GATED_BODY)
    )
    sockets = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(request)
            sockets.append(s)
        for s in sockets:
            s.settimeout(30)
            head = s.recv(256)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"a stream was answered {head[:40]!r}")
        time.sleep(1.0)
        return (rss_kb(pid) - before) / count
    finally:
        for s in sockets:
            s.close()


def h2_streams(port: int, pid: int, count: int, per_connection: int = 100) -> float | None:
    """RSS added per open gated stream, h2c clients (``per_connection`` streams on each
    connection), in KB; ``None`` without the ``h2`` package."""
    try:
        import h2.config
        import h2.connection
        import h2.events
        import h2.settings
    except ImportError:
        return None
    before = rss_kb(pid)
    connections = []
    try:
        for _ in range(count // per_connection):
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
            # The connection's window too: 100 streams at 1 KB/s would fill 64 KiB in a second.
            conn.increment_flow_control_window(1 << 30)
            s = socket.create_connection(("127.0.0.1", port))
            for _ in range(per_connection):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(
                    sid,
                    [
                        (":method", "POST"),
                        (":path", "/message:stream"),
                        (":scheme", "http"),
                        (":authority", "x"),
                        ("content-type", "application/json"),
                        ("accept", "text/event-stream"),
                        ("content-length", str(len(GATED_BODY))),
                    ],
                )
                conn.send_data(sid, GATED_BODY, end_stream=True)
            s.sendall(conn.data_to_send())
            connections.append((s, conn))
        deadline = time.monotonic() + 30
        for s, conn in connections:
            heads = 0
            s.settimeout(max(0.1, deadline - time.monotonic()))
            while heads < per_connection:
                data = s.recv(65536)
                if not data:
                    raise RuntimeError("an h2c connection closed before its streams opened")
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers).get(b":status")
                        if status != b"200":
                            raise RuntimeError(f"a stream was answered {status!r}")
                        heads += 1
                    elif isinstance(event, h2.events.StreamReset):
                        raise RuntimeError("a stream was reset")
                s.sendall(conn.data_to_send())
        time.sleep(1.0)
        return (rss_kb(pid) - before) / count
    finally:
        for s, _ in connections:
            s.close()


# --- the run ------------------------------------------------------------------------------


def ensure_tools() -> str | None:
    """Installs what is missing (nginx and haproxy with apt-get, oha with cargo); returns what
    could not be had."""
    missing = [tool for tool in ("nginx", "haproxy") if shutil.which(tool) is None]
    if missing:
        if os.geteuid() != 0:
            return f"{', '.join(missing)} missing: apt-get install -y nginx haproxy (as root)"
        print(f"installing {', '.join(missing)} with apt-get", file=sys.stderr)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=False, env=env)
        subprocess.run(["apt-get", "install", "-y", "-q", "nginx", "haproxy"], check=True, env=env)
        # The packages start their system services: stop them, this run starts its own.
        for service in ("nginx", "haproxy"):
            subprocess.run(["service", service, "stop"], check=False, capture_output=True)
    cargo_bin = Path.home() / ".cargo" / "bin"
    if shutil.which("oha") is None and (cargo_bin / "oha").is_file():
        os.environ["PATH"] = f"{cargo_bin}{os.pathsep}{os.environ['PATH']}"
    if shutil.which("oha") is None:
        print("installing oha with cargo install (a few minutes)", file=sys.stderr)
        subprocess.run(["cargo", "install", "oha", "--locked"], check=True)
        os.environ["PATH"] = f"{cargo_bin}{os.pathsep}{os.environ['PATH']}"
    if shutil.which("taskset") is None:
        return "taskset missing (util-linux)"
    return None


def build_broker() -> None:
    """``cargo build --release -p admitgate-broker`` (a no-op when up to date)."""
    print("cargo build --release -p admitgate-broker", file=sys.stderr)
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "admitgate-broker"], check=True, cwd=ROOT
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/broker.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="every row, 2 rounds of 3 s")
    parser.add_argument("--json", type=Path, help="also write the raw figures to this file")
    parser.add_argument("--rates", default="1000,5000", help="comma-separated requests/s")
    parser.add_argument("--seconds", type=float, help="seconds per run (default 8, --quick 3)")
    parser.add_argument("--rounds", type=int, help="rounds (default 5, --quick 2)")
    parser.add_argument(
        "--pairs",
        default="all",
        help="client>upstream pairs, comma-separated (e.g. 'http/1.1>http/1.1,h2c>h2c'); "
        "default all four",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory rows")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak throughput rows")
    parser.add_argument("--no-latency", action="store_true", help="skip the latency rows")
    parser.add_argument("--no-haproxy", action="store_true", help="leave HAProxy out")
    parser.add_argument("--no-pin", action="store_true", help="do not pin with taskset")
    parser.add_argument(
        "--python", action="store_true", help="add `python -m admitgate broker` as a subject"
    )
    parser.add_argument(
        "--broker", type=Path, help="the broker binary (default: build target/release's)"
    )
    parser.add_argument("--broker-args", default="", help="extra flags for the broker")
    parser.add_argument(
        "--baseline", type=Path, help="another broker binary as a further subject, `baseline`"
    )
    parser.add_argument("--baseline-args", default="", help="extra flags for the baseline")
    args = parser.parse_args(argv)
    try:
        rates = [int(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates must be comma-separated integers, got {args.rates!r}")
    if not rates or min(rates) <= 0:
        parser.error(f"--rates must be positive, got {args.rates!r}")
    if args.pairs == "all":
        pairs = PAIRS
    else:
        pairs = [tuple(p.split(">", 1)) for p in args.pairs.split(",")]  # type: ignore[misc]
        if any(pair not in PAIRS for pair in pairs):
            parser.error(f"--pairs: each must be one of {PAIRS}, got {args.pairs!r}")
    seconds = args.seconds or (3.0 if args.quick else 8.0)
    rounds = args.rounds or (2 if args.quick else 5)
    if seconds <= 0 or rounds <= 0:
        parser.error("--seconds and --rounds must be positive")
    problem = ensure_tools()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    binary: Path = args.broker or BROKER
    if args.broker is None:
        build_broker()
    if not binary.is_file():
        print(f"--broker {binary}: no such file", file=sys.stderr)
        return 2
    pin = Pinning(not args.no_pin)
    started = time.monotonic()
    results: dict[str, Any] = {
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "pinning": pin.describe(),
            "load_average_at_start": os.getloadavg(),
            "seconds": seconds,
            "rounds": rounds,
        }
    }
    commands: dict[str, list[str]] = {
        "broker": [*pin.prefix(pin.subject), str(binary), *shlex.split(args.broker_args)]
    }
    if args.baseline is not None:
        commands["baseline"] = [
            *pin.prefix(pin.subject),
            str(args.baseline),
            *shlex.split(args.baseline_args),
        ]
    if args.python:
        commands["python -m admitgate broker"] = [
            *pin.prefix(pin.subject),
            sys.executable,
            "-m",
            "admitgate",
            "broker",
            *shlex.split(args.broker_args),
        ]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        upstream = Upstream(workdir, pin)
        try:
            makers: dict[str, Callable[[], Subject]] = {}
            if not args.no_haproxy:
                makers["haproxy"] = lambda: HAProxy(upstream, workdir, pin)
            for name, command in commands.items():
                makers[name] = broker_maker(name, command, upstream)
            if not args.no_memory:
                memory(results, makers)
            subjects: list[Subject] = [Direct(upstream)]
            try:
                subjects += [make() for make in makers.values()]
                if not args.no_latency:
                    latency(results, subjects, pin, pairs, rates, seconds, rounds)
                if not args.no_peak:
                    peak(results, subjects, pin, pairs, seconds)
            finally:
                for s in subjects:
                    s.stop()
        finally:
            upstream.stop()
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["machine"]["wall_seconds"] = round(time.monotonic() - started)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    report(results)
    return 0


def memory(results: dict[str, Any], makers: dict[str, Callable[[], Subject]]) -> None:
    """The memory rows, each on a fresh process (after load, allocators keep what they grew
    to, which would hide what a connection costs)."""
    h1 = ("http/1.1", "http/1.1")
    h2 = ("h2c", "h2c")
    measures: dict[str, Callable[[Subject], float | None]] = {
        "idle_mb": lambda s: rss_kb(pid(s, h1)) / 1024,
        "per_silent_connection_kb": lambda s: silent_connections(s.ports[h1], pid(s, h1), 1000),
        "per_idle_connection_kb": lambda s: idle_connections(s.ports[h1], pid(s, h1), 1000),
        "per_stream_h1_kb": lambda s: h1_streams(s.ports[h1], pid(s, h1), STREAMS),
        "per_stream_h2c_kb": lambda s: h2_streams(s.ports[h2], pid(s, h2), STREAMS),
    }
    for name, make in makers.items():
        for key, measure in measures.items():
            fresh = make()
            try:
                time.sleep(0.5)
                results.setdefault(name, {})[key] = measure(fresh)
            finally:
                fresh.stop()
            print(f"  memory {name} {key}: {results[name][key]}", file=sys.stderr)


def pid(subject: Subject, pair: Pair) -> int:
    found = subject.pids[pair]
    assert found is not None
    return found


def latency(
    results: dict[str, Any],
    subjects: list[Subject],
    pin: Pinning,
    pairs: list[Pair],
    rates: list[int],
    seconds: float,
    rounds: int,
) -> None:
    for s in subjects:  # warm-up: connections opened, pools filled
        for c in {c for c, _ in pairs}:
            for u in {u for cc, u in pairs if cc == c}:
                oha(pin, s.ports[(c, u)], rate=None, seconds=1, http2=c == "h2c", connections=50)
    for pair in pairs:
        client, up = pair
        for rate in rates:
            key = f"{client}>{up} {rate}/s"
            for round_ in range(rounds):
                shift = round_ % len(subjects)
                for s in subjects[shift:] + subjects[:shift]:
                    process = s.pids[pair]
                    cpu0 = cpu_seconds(process) if process else 0.0
                    result = oha(
                        pin,
                        s.ports[pair],
                        rate=rate,
                        seconds=seconds,
                        http2=client == "h2c",
                        connections=50,
                    )
                    cpu = (cpu_seconds(process) - cpu0) if process else 0.0
                    p = result["latencyPercentiles"]
                    results.setdefault(s.name, {}).setdefault(key, []).append(
                        {
                            "p50": p["p50"],
                            "p99": p["p99"],
                            "p99.9": p["p99.9"],
                            "cpu_per_1k": cpu / max(answered(result), 1) * 1000,
                            "ok": answered(result),
                            "errors": errors(result),
                        }
                    )
            print(f"  latency {key} done", file=sys.stderr)


def peak(
    results: dict[str, Any],
    subjects: list[Subject],
    pin: Pinning,
    pairs: list[Pair],
    seconds: float,
) -> None:
    for pair in pairs:
        client, up = pair
        for s in subjects:
            process = s.pids[pair]
            cpu0 = cpu_seconds(process) if process else 0.0
            t0 = time.monotonic()
            result = oha(
                pin,
                s.ports[pair],
                rate=None,
                seconds=seconds,
                http2=client == "h2c",
                connections=64,
            )
            busy = (cpu_seconds(process) - cpu0) / (time.monotonic() - t0) if process else None
            results.setdefault(s.name, {})[f"{client}>{up} peak"] = {
                "rps": result["summary"]["requestsPerSec"],
                "core_busy": busy,
                "errors": errors(result),
            }


def report(results: dict[str, Any]) -> None:
    machine = results["machine"]
    print(
        f"\n{machine['cpus']} CPUs, {machine['pinning']}; {machine['rounds']} rounds of "
        f"{machine['seconds']} s; load average {machine['load_average_at_start'][0]:.1f} at "
        f"start, {machine['load_average_at_end'][0]:.1f} at end; {machine['wall_seconds']} s"
    )
    names = [n for n in results if n not in ("machine", "direct")]
    direct = results.get("direct", {})
    keys = [k for k in direct if k.endswith("/s")]
    if keys:
        print(
            "\nadded latency over direct (same client protocol), us: median of rounds "
            "[p99 spread across rounds]; CPU s per 1,000 requests"
        )
        header = f"  {'client>upstream rate':28}" + "".join(f"{n[:26]:>40}" for n in names)
        print(header)
        for key in keys:
            base = {q: statistics.median(r[q] for r in direct[key]) for q in ("p50", "p99")}
            cells = []
            for name in names:
                rows = results[name].get(key)
                if not rows:
                    cells.append(f"{'-':>40}")
                    continue
                p50 = (statistics.median(r["p50"] for r in rows) - base["p50"]) * 1e6
                p99s = [(r["p99"] - base["p99"]) * 1e6 for r in rows]
                p99 = statistics.median(p99s)
                spread = max(p99s) - min(p99s)
                cpu = statistics.median(r["cpu_per_1k"] for r in rows)
                bad = sum(r["errors"] for r in rows)
                cell = f"+{p50:4.0f} +{p99:5.0f} [{spread:5.0f}] {cpu:.3f}s"
                cells.append(f"{cell + (f' E{bad}' if bad else ''):>40}")
            direct_cell = f"(direct p50 {base['p50'] * 1e6:.0f} p99 {base['p99'] * 1e6:.0f})"
            print(f"  {key:28}" + "".join(cells) + f"  {direct_cell}")
    peaks = [k for k in direct if k.endswith(" peak")]
    if peaks:
        print("\npeak throughput, req/s (subject's core busy %), one core per subject")
        print(f"  {'client>upstream':28}" + "".join(f"{n[:26]:>28}" for n in ["direct", *names]))
        for key in peaks:
            cells = []
            for name in ["direct", *names]:
                row = results[name].get(key)
                if row is None:
                    cells.append(f"{'-':>28}")
                    continue
                busy = f" ({row['core_busy'] * 100:3.0f}%)" if row["core_busy"] is not None else ""
                cells.append(f"{row['rps']:>21.0f}{busy:>7}")
            print(f"  {key:28}" + "".join(cells))
    mem = [n for n in names if "idle_mb" in results[n]]
    if mem:
        print("\nmemory (RSS, fresh process each)")
        labels = {
            "idle_mb": "idle, MB",
            "per_silent_connection_kb": "per silent connection, KB",
            "per_idle_connection_kb": "per idle keep-alive connection, KB",
            "per_stream_h1_kb": f"per open stream, {STREAMS} gated SSE, HTTP/1.1, KB",
            "per_stream_h2c_kb": f"per open stream, {STREAMS} gated SSE, h2c, KB",
        }
        print(f"  {'':50}" + "".join(f"{n[:26]:>28}" for n in mem))
        for key, label in labels.items():
            values = [results[n].get(key) for n in mem]
            print(
                f"  {label:50}"
                + "".join(f"{v:>28.1f}" if v is not None else f"{'-':>28}" for v in values)
            )


if __name__ == "__main__":
    sys.exit(main())
