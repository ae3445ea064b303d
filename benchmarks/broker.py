"""The broker's cost as a proxy: ``python benchmarks/broker.py [--quick] [--json]``.

Standalone (not one of ``python -m benchmarks``' workloads). Everything runs on loopback in
one run, interleaved (each round runs every subject once, in a rotated order):

* the **upstream**: nginx (Debian's package) answering every request with a fixed 3-byte body
  (``return 200``), HTTP/1.1 on one port and h2c (prior knowledge) on another;
* the **subjects**: ``direct`` (oha to nginx), ``haproxy`` (Debian's package: a backend
  server with ``maxconn`` and a queue, the closest existing peer), ``broker`` (the standalone
  binary, ``target/release/admitgate-broker``) and ``python -m admitgate broker`` (the same
  broker in the Python process, through the extension module: build it with ``maturin
  develop --release`` to measure it);
* the **load**: oha at a fixed rate with ``--latency-correction``, HTTP/1.1 and h2c, a gated
  request (``POST /message:send``, the broker's cap far above the load so nothing is refused).

Rows: added p50 / p99 / p99.9 latency over ``direct`` at 1,000 and 5,000 requests/s, CPU of
the proxy process per 1,000 requests/s, maximum throughput (oha unthrottled), RSS idle, per
idle keep-alive connection (1,000 of them) and with 1,000 open streams (slow nginx responses
through the proxy).

Needs: nginx, haproxy (``apt-get install nginx haproxy``), oha (``cargo install oha``), and
``cargo build --release -p admitgate-broker``. Absolute numbers depend on the machine; the
comparisons within one run are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BROKER = ROOT / "target" / "release" / "admitgate-broker"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


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
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Upstream:
    """nginx with a fixed response on HTTP/1.1 and h2c, and a slow stream at /stream."""

    def __init__(self, workdir: Path) -> None:
        self.h1 = free_port()
        self.h2 = free_port()
        (workdir / "big").write_bytes(b"x" * (4 << 20))
        conf = workdir / "nginx.conf"
        conf.write_text(
            f"""
daemon off;
worker_processes 2;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx.err warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
    client_body_temp_path {workdir};
    server {{
        listen 127.0.0.1:{self.h1};
        listen 127.0.0.1:{self.h2} http2;
        location /stream {{ alias {workdir}/big; limit_rate 1k; }}
        location / {{ return 200 "ok\\n"; }}
    }}
}}
"""
        )
        self.process = subprocess.Popen(
            ["nginx", "-c", str(conf), "-p", str(workdir)], stderr=subprocess.DEVNULL
        )
        wait_port(self.h1)
        wait_port(self.h2)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class Subject:
    """A proxy (or nothing) in front of the upstream, with its pid for CPU and RSS."""

    name: str
    h1: int
    h2: int
    pid: int | None

    def stop(self) -> None: ...


class Direct(Subject):
    def __init__(self, upstream: Upstream) -> None:
        self.name, self.h1, self.h2, self.pid = "direct", upstream.h1, upstream.h2, None


class HAProxy(Subject):
    def __init__(self, upstream: Upstream, workdir: Path) -> None:
        self.name = "haproxy"
        self.h1, self.h2 = free_port(), free_port()
        conf = workdir / "haproxy.cfg"
        conf.write_text(
            f"""
global
    maxconn 8000
    nbthread 2
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout queue 10s
    option http-keep-alive
frontend h1
    bind 127.0.0.1:{self.h1}
    default_backend app
frontend h2
    bind 127.0.0.1:{self.h2} proto h2
    default_backend app_h2
backend app
    server nginx 127.0.0.1:{upstream.h1} maxconn 10000
backend app_h2
    server nginx 127.0.0.1:{upstream.h2} proto h2 maxconn 10000
"""
        )
        self.process = subprocess.Popen(
            ["haproxy", "-f", str(conf)], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        wait_port(self.h1)
        wait_port(self.h2)
        self.pid = self.process.pid

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class Broker(Subject):
    """The broker, one process per protocol (HTTP/1.1 upstream; h2c goes to the h2c port as
    gRPC would, so the h2c run is plain HTTP/2 through the broker to nginx over HTTP/1.1)."""

    def __init__(self, upstream: Upstream, via_python: bool) -> None:
        self.name = "python -m admitgate broker" if via_python else "broker"
        self.h1 = free_port()
        self.h2 = self.h1  # one port: HTTP/1.1 and h2c
        flags = [
            "--listen",
            f"127.0.0.1:{self.h1}",
            "--upstream",
            f"http://127.0.0.1:{upstream.h1}",
            "--max-in-flight",
            "100000",
            "--upstream-idle-timeout",
            "30",
        ]
        if via_python:
            command = [sys.executable, "-m", "admitgate", "broker", *flags]
        else:
            command = [str(BROKER), *flags]
        self.process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        wait_port(self.h1)
        # In-process either way: the interpreter's own RSS and CPU count for the Python one.
        self.pid = self.process.pid

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(20)


def oha(
    url: str, *, rate: int | None, seconds: float, http2: bool, connections: int
) -> dict[str, Any]:
    command = [
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
        '{"message":{"role":"ROLE_USER","parts":[{"text":"x"}]}}',
    ]
    if rate is not None:
        command += ["-q", str(rate), "--latency-correction"]
    if http2:
        command += ["--http2", "-p", "8"]
    command.append(url + "/message:send")
    out = subprocess.run(command, capture_output=True, check=True, timeout=seconds + 60).stdout
    return json.loads(out)


def percentiles(result: dict[str, Any]) -> dict[str, float]:
    p = result["latencyPercentiles"]
    return {"p50": p["p50"], "p99": p["p99"], "p99.9": p["p99.9"]}


def idle_connections(port: int, pid: int, count: int) -> float:
    """RSS added per idle keep-alive connection (each has sent one request), in KB."""
    before = rss_kb(pid)
    sockets = []
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(request)
            sockets.append(s)
        for s in sockets:
            s.recv(4096)
        time.sleep(1.0)
        return (rss_kb(pid) - before) / count
    finally:
        for s in sockets:
            s.close()


def open_streams(port: int, pid: int, count: int) -> int:
    """RSS (KB) with ``count`` slow responses in flight through the subject."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            sockets.append(s)
        for s in sockets:
            s.recv(256)
        time.sleep(1.0)
        return rss_kb(pid)
    finally:
        for s in sockets:
            s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/broker.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 s runs, one round")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args(argv)
    for tool in ("nginx", "haproxy", "oha"):
        if shutil.which(tool) is None:
            print(f"{tool} is needed (see the module docstring)", file=sys.stderr)
            return 2
    if not BROKER.is_file():
        print("build the broker first: cargo build --release -p admitgate-broker", file=sys.stderr)
        return 2
    seconds = 2.0 if args.quick else 8.0
    rounds = 1 if args.quick else 2
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        upstream = Upstream(workdir)
        subjects: list[Subject] = []
        try:
            # Memory first, on fresh processes one at a time: after a load run the allocators
            # keep what they grew to, which would hide what an idle connection costs.
            for make in (
                lambda: HAProxy(upstream, workdir),
                lambda: Broker(upstream, via_python=False),
                lambda: Broker(upstream, via_python=True),
            ):
                fresh = make()
                try:
                    assert fresh.pid is not None
                    time.sleep(0.5)
                    row = results.setdefault(fresh.name, {})
                    row["rss_idle_kb"] = rss_kb(fresh.pid)
                    row["per_idle_connection_kb"] = idle_connections(fresh.h1, fresh.pid, 1000)
                    row["rss_1000_streams_kb"] = open_streams(fresh.h1, fresh.pid, 1000)
                finally:
                    fresh.stop()
            subjects = [
                Direct(upstream),
                HAProxy(upstream, workdir),
                Broker(upstream, via_python=False),
                Broker(upstream, via_python=True),
            ]
            for s in subjects:  # warm-up: connections opened, pools filled
                oha(f"http://127.0.0.1:{s.h1}", rate=None, seconds=1, http2=False, connections=50)
                oha(f"http://127.0.0.1:{s.h2}", rate=None, seconds=1, http2=True, connections=50)
            for http2 in (False, True):
                proto = "h2c" if http2 else "http/1.1"
                for rate in (1000, 5000):
                    for round_ in range(rounds):
                        shift = round_ % len(subjects)
                        order = subjects[shift:] + subjects[:shift]
                        for s in order:
                            port = s.h2 if http2 else s.h1
                            cpu0 = cpu_seconds(s.pid) if s.pid else 0.0
                            result = oha(
                                f"http://127.0.0.1:{port}",
                                rate=rate,
                                seconds=seconds,
                                http2=http2,
                                connections=50,
                            )
                            cpu = (cpu_seconds(s.pid) - cpu0) if s.pid else 0.0
                            key = f"{proto} {rate}/s"
                            row = results.setdefault(s.name, {}).setdefault(key, [])
                            errors = {
                                k: v
                                for k, v in result.get("errorDistribution", {}).items()
                                # Requests still in flight when -z ends: not failures.
                                if k != "aborted due to deadline"
                            }
                            row.append(
                                {
                                    **percentiles(result),
                                    "cpu_per_1k": cpu / seconds / (rate / 1000),
                                    "ok": result.get("statusCodeDistribution", {}).get("200", 0),
                                    "errors": sum(errors.values()),
                                }
                            )
                for s in subjects:
                    port = s.h2 if http2 else s.h1
                    result = oha(
                        f"http://127.0.0.1:{port}",
                        rate=None,
                        seconds=seconds,
                        http2=http2,
                        connections=64,
                    )
                    results[s.name][f"{proto} max/s"] = result["summary"]["requestsPerSec"]
        finally:
            for s in subjects:
                s.stop()
            upstream.stop()
    if args.json:
        print(json.dumps(results, indent=2))
    report(results)
    return 0


def report(results: dict[str, Any]) -> None:
    direct = results["direct"]
    print("\nadded latency over direct (median of rounds), microseconds; CPU s per 1k req/s")
    for key in [k for k in direct if "/s" in k and "max" not in k]:
        base = {p: statistics.median(r[p] for r in direct[key]) for p in ("p50", "p99", "p99.9")}
        print(f"  {key}")
        for name, rows in results.items():
            if name == "direct":
                continue
            med = {p: statistics.median(r[p] for r in rows[key]) for p in ("p50", "p99", "p99.9")}
            cpu = statistics.median(r["cpu_per_1k"] for r in rows[key])
            errors = sum(r["errors"] for r in rows[key])
            added = "  ".join(f"{p} +{(med[p] - base[p]) * 1e6:7.0f}" for p in med)
            print(f"    {name:28} {added}   cpu {cpu:.3f}   errors {errors}")
    print("\nmax throughput (req/s), RSS")
    for name, row in results.items():
        maxes = "  ".join(f"{k} {v:8.0f}" for k, v in row.items() if k.endswith("max/s"))
        mem = ""
        if "rss_idle_kb" in row:
            mem = (
                f"  idle {row['rss_idle_kb'] / 1024:.1f} MB, per idle conn "
                f"{row['per_idle_connection_kb']:.1f} KB, 1k streams "
                f"{row['rss_1000_streams_kb'] / 1024:.1f} MB"
            )
        print(f"  {name:28} {maxes}{mem}")


if __name__ == "__main__":
    sys.exit(main())
