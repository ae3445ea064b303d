"""What AdmissionMiddleware costs: requests/s and latency through it against the bare app.

Run: ``.venv/bin/python benchmarks/asgi_middleware.py [--quick]``

Three uvicorn servers (separate processes) serve the same trivial ASGI handler: two bare
(the second is a control) and one behind ``admitgate.asgi.AdmissionMiddleware``
with a gate whose ceiling is never reached (so every gated request takes and returns a real
slot). For each kind of request the script measures, in interleaved repetitions (bare, then
middleware, then the other order, ...):

- throughput: ``--concurrency`` httpx keep-alive clients in this process send requests
  back to back for ``--seconds``; requests/s;
- latency: one keep-alive client sends requests one at a time; the median round trip;
- raw throughput: the same number of raw HTTP/1.1 keep-alive sockets, one thread each,
  which cost the client so little that the server is the bottleneck. On a small machine the
  httpx clients share the cores with the server and are themselves the bottleneck, so their
  requests/s mostly measure the client; the raw ratio is what the middleware costs a
  saturated server;
- the A/A ratio: the raw throughput of a second, identical bare server against the first,
  measured the same way. It should be 1.000; how far it is from that is the machine's noise,
  against which the raw ratio has to be read.

It prints medians over the repetitions, the throughput ratios (middleware / bare) and the
latency the middleware adds per request. Last, it times the middleware in-process (ASGI
calls with no server or network) to give its CPU cost per request directly, split into the
gate's own calls (the native ``admit`` / ``record_request``, timed alone) and the rest, the
middleware's Python.

Kinds of request: ``jsonrpc``, a small ``SendMessage`` POSTed to ``/`` (gated: body peeked
and parsed, slot taken and returned); ``rest``, ``POST /message:send`` (gated);
``passthrough``, ``GET /custom`` (not gated; one ``record_request``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

RPC_BODY = json.dumps(
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {
            "message": {"role": "ROLE_USER", "messageId": "m-1", "parts": [{"text": "hello"}]}
        },
    }
).encode()
REST_BODY = json.dumps(
    {"message": {"role": "ROLE_USER", "messageId": "m-1", "parts": [{"text": "hello"}]}}
).encode()
KINDS: dict[str, tuple[str, str, bytes | None]] = {
    "jsonrpc": ("POST", "/", RPC_BODY),
    "rest": ("POST", "/message:send", REST_BODY),
    "passthrough": ("GET", "/custom", None),
}
VARIANTS = ("bare", "gated", "control")
REPLY = b'{"jsonrpc":"2.0","id":1,"result":{}}'
REPLY_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(REPLY)).encode()),
]


async def trivial_app(scope: Any, receive: Any, send: Any) -> None:
    """The handler under test: read the body, answer a fixed small JSON."""
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": REPLY_HEADERS})
    await send({"type": "http.response.body", "body": REPLY})


def gated_app() -> Any:
    """The same handler behind the middleware, with a gate that never refuses."""
    import admitgate
    from admitgate.asgi import AdmissionMiddleware

    gate = admitgate.AdmissionGate(admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=100_000))
    return AdmissionMiddleware(trivial_app, gate)


# -- server side --------------------------------------------------------------------------------


def serve(variant: str, fd: int) -> None:
    """Run uvicorn on the inherited listening socket ``fd`` until killed."""
    import uvicorn

    app = trivial_app if variant == "bare" else gated_app()
    # socket(fileno=) keeps the socket's family (AF_INET), so asyncio sets TCP_NODELAY on each
    # connection; uvicorn's own fd= would wrap it as AF_UNIX and Nagle would add ~40 ms.
    sock = socket.socket(fileno=fd)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", loop="asyncio"
    )
    uvicorn.Server(config).run(sockets=[sock])


class Server:
    """A uvicorn server process for one variant, on a socket bound here (port 0)."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        fd = self.sock.fileno()
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", variant, "--fd", str(fd)],
            pass_fds=[fd],
        )

    def stop(self) -> None:
        """Stop the process and close the socket."""
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.sock.close()


# -- client side --------------------------------------------------------------------------------


async def wait_ready(server: Server) -> None:
    """Return once ``server`` answers; fail if its process died or it stays silent."""
    import httpx

    deadline = time.monotonic() + 20
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"the {server.variant} server exited")
            try:
                await client.get(server.url + "/custom")
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)


async def throughput(url: str, kind: str, concurrency: int, seconds: float) -> float:
    """Requests/s with ``concurrency`` httpx keep-alive clients sending back to back."""
    import httpx

    method, path, body = KINDS[kind]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        # Warm up: open every connection.
        await asyncio.gather(
            *(client.request(method, path, content=body) for _ in range(concurrency))
        )
        done = 0
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                response = await client.request(method, path, content=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{kind}: HTTP {response.status_code}")
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


def raw_throughput(server: Server, kind: str, connections: int, seconds: float) -> float:
    """Requests/s with ``connections`` raw HTTP/1.1 keep-alive sockets, one thread each.

    A thread costs little CPU per request (a send and a recv; the GIL is released while it
    waits), so the server, not the client, is the bottleneck: this is the server's capacity.
    """
    import threading

    method, path, body = KINDS[kind]
    payload = body or b""
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    host, port = server.sock.getsockname()
    counts = [0] * connections
    start = threading.Barrier(connections + 1)
    stop_at = [0.0]

    def client(index: int) -> None:
        with socket.create_connection((host, port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start.wait()
            done = 0
            while time.perf_counter() < stop_at[0]:
                conn.sendall(request)
                data = b""
                while not data.endswith(REPLY):  # the reply is fixed: its end marks the end
                    chunk = conn.recv(65536)
                    if not chunk:
                        raise RuntimeError("the server closed the connection")
                    data += chunk
                done += 1
            counts[index] = done

    threads = [threading.Thread(target=client, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    stop_at[0] = time.perf_counter() + seconds
    started = time.perf_counter()
    start.wait()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


async def latency(url: str, kind: str, count: int) -> float:
    """Median round trip (seconds) of ``count`` sequential requests on one connection."""
    import httpx

    method, path, body = KINDS[kind]
    samples = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(20):
            await client.request(method, path, content=body)
        for _ in range(count):
            t0 = time.perf_counter()
            response = await client.request(method, path, content=body)
            samples.append(time.perf_counter() - t0)
            if response.status_code != 200:
                raise RuntimeError(f"{kind}: HTTP {response.status_code}")
    return statistics.median(samples)


def in_process(kind: str, calls: int) -> tuple[float, float, float]:
    """Mean seconds per request, in-process: the bare app, the app behind the middleware, and
    the gate calls the middleware makes for that request alone (``admit`` in and out plus
    ``record_request`` when gated, ``record_request`` otherwise)."""
    import admitgate

    method, path, body = KINDS[kind]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }
    request = {"type": "http.request", "body": body or b"", "more_body": False}
    gated = kind != "passthrough"

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: Any) -> None:
        return None

    async def timed(app: Any) -> float:
        for _ in range(1000):
            await app(dict(scope), receive, send)
        t0 = time.perf_counter()
        for _ in range(calls):
            await app(dict(scope), receive, send)
        return (time.perf_counter() - t0) / calls

    async def gate_only(gate: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            if gated:
                admission = gate.admit(session_id="", transport=kind)
                await admission.__aenter__()
                await admission.__aexit__(None, None, None)
            gate.record_request(kind if gated else "passthrough", 0.0001)
        return (time.perf_counter() - t0) / calls

    async def all_three() -> tuple[float, float, float]:
        middleware = gated_app()
        gate = admitgate.AdmissionGate(
            admitgate.ConcurrencyLimitPolicy(max_concurrent_runs=100_000)
        )
        runs: list[tuple[float, float, float]] = []
        for _ in range(5):
            runs.append((await timed(trivial_app), await timed(middleware), await gate_only(gate)))
        return (
            statistics.median(r[0] for r in runs),
            statistics.median(r[1] for r in runs),
            statistics.median(r[2] for r in runs),
        )

    return asyncio.run(all_three())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter repetitions")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (default 9; quick 3)")
    parser.add_argument("--seconds", type=float, help="seconds per throughput run (1; quick 0.5)")
    parser.add_argument("--concurrency", type=int, default=8, help="keep-alive clients (8)")
    parser.add_argument("--kinds", default="jsonrpc,rest,passthrough", help="comma-separated")
    parser.add_argument("--serve", choices=("bare", "gated"), help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.fd)
        return
    reps = args.reps or (3 if args.quick else 9)
    seconds = args.seconds or (0.5 if args.quick else 1.0)
    lat_count = 300 if args.quick else 2000
    kinds = [k for k in args.kinds.split(",") if k]
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")

    # "control" is a second bare server: bare vs control shows the machine's noise floor.
    servers = {name: Server("bare" if name == "control" else name) for name in VARIANTS}
    try:
        for server in servers.values():
            asyncio.run(wait_ready(server))
        print(
            f"uvicorn (h11, asyncio) on loopback; trivial handler; {reps} interleaved reps; "
            f"throughput: {args.concurrency} httpx keep-alive clients (raw: {args.concurrency} "
            f"sockets) x {seconds} s; "
            f"latency: median of {lat_count} sequential requests; CPUs: {os.cpu_count()}"
        )
        header = (
            f"{'request':<12} {'bare req/s':>11} {'mw req/s':>10} {'ratio':>7} "
            f"{'bare lat us':>12} {'mw lat us':>10} {'added us':>9} "
            f"{'raw bare req/s':>15} {'raw mw req/s':>13} {'raw ratio':>10} {'A/A ratio':>10}"
        )
        print(header)
        print("-" * len(header))
        for kind in kinds:
            runs: dict[str, dict[str, list[float]]] = {
                name: {v: [] for v in VARIANTS} for name in ("rps", "lat", "raw")
            }
            for rep in range(reps):
                order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    server = servers[variant]
                    runs["raw"][variant].append(
                        raw_throughput(server, kind, args.concurrency, seconds)
                    )
                    if variant == "control":
                        continue
                    runs["rps"][variant].append(
                        asyncio.run(throughput(server.url, kind, args.concurrency, seconds))
                    )
                    runs["lat"][variant].append(
                        asyncio.run(latency(server.url, kind, lat_count // reps + 1))
                    )
            med = {
                name: {v: statistics.median(xs) for v, xs in by_variant.items() if xs}
                for name, by_variant in runs.items()
            }
            rps, lat, raw = med["rps"], med["lat"], med["raw"]
            print(
                f"{kind:<12} {rps['bare']:>11.0f} {rps['gated']:>10.0f} "
                f"{rps['gated'] / rps['bare']:>7.3f} {lat['bare'] * 1e6:>12.0f} "
                f"{lat['gated'] * 1e6:>10.0f} {(lat['gated'] - lat['bare']) * 1e6:>9.0f} "
                f"{raw['bare']:>15.0f} {raw['gated']:>13.0f} {raw['gated'] / raw['bare']:>10.3f} "
                f"{raw['control'] / raw['bare']:>10.3f}"
            )
    finally:
        for server in servers.values():
            server.stop()

    print()
    print("in-process (ASGI calls, no server, no network): microseconds per request")
    print(
        f"{'request':<12} {'bare':>8} {'mw':>8} {'added':>8} "
        f"{'of which gate':>14} {'middleware itself':>18}"
    )
    calls = 5_000 if args.quick else 50_000
    for kind in kinds:
        bare, gated, gate = in_process(kind, calls)
        added = gated - bare
        print(
            f"{kind:<12} {bare * 1e6:>8.2f} {gated * 1e6:>8.2f} {added * 1e6:>8.2f} "
            f"{gate * 1e6:>14.2f} {(added - gate) * 1e6:>18.2f}"
        )


if __name__ == "__main__":
    main()
