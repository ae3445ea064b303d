"""What AdmissionInterceptor costs: gRPC calls/s and latency through it against a bare server.

Run: ``.venv/bin/python benchmarks/grpc_interceptor.py [--quick]``

Two ``grpc.aio`` servers (separate processes) serve the same trivial handlers on raw bytes, one
bare and one behind ``admitgate.grpc.AdmissionInterceptor`` with a gate whose ceiling is never
reached (every gated call takes and returns a real slot and costs one ``record_request``). The
handlers sit on the A2A method names, so the interceptor treats them as it treats the SDK's.
For each kind of call the script measures, in interleaved repetitions (bare, then
interceptor, then the other order, ...):

- throughput: ``--concurrency`` concurrent callers on one channel in this process, back to
  back for ``--seconds``; calls/s;
- latency: one caller, one call at a time; the median round trip.

It prints medians over the repetitions, the throughput ratio (interceptor / bare) and the
latency the interceptor adds per call. Last, it times one Prometheus scrape of a gate
exported by ``admitgate.metrics`` (``generate_latest``), in-process.

Kinds: ``unary``, ``SendMessage`` (gated); ``stream``, ``SendStreamingMessage`` with 3
messages (gated, the slot held for the whole stream); ``passthrough``, ``GetTask`` (not gated
by default; one ``record_request``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

SERVICE = "lf.a2a.v1.A2AService"
MODES = ("bare", "noop", "gated")
KINDS = {
    "unary": f"/{SERVICE}/SendMessage",
    "stream": f"/{SERVICE}/SendStreamingMessage",
    "passthrough": f"/{SERVICE}/GetTask",
}


async def _serve(port: int, mode: str) -> None:
    import admitgate
    import grpc
    from admitgate.grpc import AdmissionInterceptor

    async def unary(request: bytes, context: Any) -> bytes:
        return request

    async def stream(request: bytes, context: Any) -> Any:
        for _ in range(3):
            yield request

    class Noop(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            return await continuation(details)

    interceptors: list[Any] = []
    if mode == "noop":
        interceptors.append(Noop())
    if mode == "gated":
        gate = admitgate.build_admission_gate(max_concurrent_runs=100_000, queue_depth=0)
        interceptors.append(AdmissionInterceptor(gate))
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "SendMessage": grpc.unary_unary_rpc_method_handler(unary),
                    "SendStreamingMessage": grpc.unary_stream_rpc_method_handler(stream),
                    "GetTask": grpc.unary_unary_rpc_method_handler(unary),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(mode: str) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", mode, "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("server did not start")
    return proc, f"127.0.0.1:{port}"


async def _call(channel: Any, kind: str) -> None:
    if kind == "stream":
        async for _ in channel.unary_stream(KINDS[kind])(b"hello"):
            pass
    else:
        await channel.unary_unary(KINDS[kind])(b"hello")


async def _throughput(target: str, kind: str, concurrency: int, seconds: float) -> float:
    import grpc

    async with grpc.aio.insecure_channel(target) as channel:
        for _ in range(50):  # warm up
            await _call(channel, kind)
        done = 0
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await _call(channel, kind)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def _latency(target: str, kind: str, calls: int) -> float:
    import grpc

    async with grpc.aio.insecure_channel(target) as channel:
        for _ in range(50):
            await _call(channel, kind)
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            await _call(channel, kind)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


def _scrape_cost(rounds: int) -> float:
    import admitgate
    import admitgate.metrics
    from prometheus_client import CollectorRegistry, generate_latest

    gate = admitgate.build_admission_gate(max_concurrent_runs=20, queue_depth=40)
    assert gate is not None

    async def traffic() -> None:
        for transport in ("grpc", "jsonrpc", "rest"):
            async with gate.admit(transport=transport):
                pass
            gate.record_request(transport, 0.01)
        gate.record_request("passthrough", 0.001)

    asyncio.run(traffic())
    registry = CollectorRegistry()
    admitgate.metrics.register(gate, registry, prefix="broker", name="a2a")
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        generate_latest(registry)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=MODES)
    parser.add_argument("--port", type=int)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repetitions")
    parser.add_argument("--repetitions", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.port, args.serve))
        return
    if args.quick:
        args.repetitions, args.seconds, args.calls = 2, 0.5, 200

    servers = {mode: _start(mode) for mode in MODES}
    try:
        print(
            f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; medians of {args.repetitions}"
        )
        print(
            f"{'kind':12} {'bare/s':>8} {'noop/s':>8} {'gated/s':>8} {'ratio':>6} "
            f"{'bare µs':>8} {'noop µs':>8} {'gated µs':>8} {'added µs':>9}"
        )
        for kind in KINDS:
            rate: dict[str, list[float]] = {mode: [] for mode in MODES}
            lat: dict[str, list[float]] = {mode: [] for mode in MODES}
            for rep in range(args.repetitions):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                for mode in order:
                    target = servers[mode][1]
                    rate[mode].append(
                        asyncio.run(_throughput(target, kind, args.concurrency, args.seconds))
                    )
                    lat[mode].append(asyncio.run(_latency(target, kind, args.calls)))
            r = {mode: statistics.median(rate[mode]) for mode in MODES}
            t = {mode: statistics.median(lat[mode]) * 1e6 for mode in MODES}
            print(
                f"{kind:12} {r['bare']:8.0f} {r['noop']:8.0f} {r['gated']:8.0f} "
                f"{r['gated'] / r['bare']:6.3f} {t['bare']:8.1f} {t['noop']:8.1f} "
                f"{t['gated']:8.1f} {t['gated'] - t['bare']:9.1f}"
            )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(5)
    print(
        f"one scrape of a gate with 4 transports (generate_latest): {_scrape_cost(2000) * 1e6:.0f} µs"
    )


if __name__ == "__main__":
    main()
