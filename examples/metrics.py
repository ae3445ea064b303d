"""A gate exported to Prometheus with the mesh broker's metric names, served on
http://127.0.0.1:9464/metrics (or $ADMITGATE_EXAMPLE_PORT); the example scrapes it once and
stops. Add `--serve` to keep serving until Ctrl-C."""

import asyncio
import os
import sys
import urllib.request

from prometheus_client import CollectorRegistry, start_http_server

import admitgate
import admitgate.metrics


async def main() -> None:
    chat_gate = admitgate.build_admission_gate(max_concurrent_runs=20, queue_depth=40)
    a2a_gate = admitgate.build_admission_gate(max_concurrent_runs=4, queue_depth=0)
    assert chat_gate is not None and a2a_gate is not None
    registry = CollectorRegistry()  # or leave registry= out for prometheus_client's REGISTRY
    # Every figure is read from the gate when Prometheus scrapes; name= tells gates apart.
    admitgate.metrics.register(chat_gate, registry, prefix="broker", name="chat")
    admitgate.metrics.register(a2a_gate, registry, prefix="broker", name="a2a")

    async def turn(gate: admitgate.AdmissionGate) -> None:
        try:
            async with gate.admit(session_id="tenant"):
                await asyncio.sleep(0.05)  # stands in for your agent's run
        except admitgate.AdmissionRejected:
            pass

    await asyncio.gather(*(turn(chat_gate) for _ in range(30)), *(turn(a2a_gate) for _ in range(6)))

    port = int(os.environ.get("ADMITGATE_EXAMPLE_PORT", "9464"))
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
        for line in body.splitlines():
            if line.startswith(("broker_admitted_total", "broker_rejected_total{", "broker_limit")):
                if not line.endswith(" 0.0"):
                    print(line)
        if "--serve" in sys.argv:
            print(f"serving {url} until Ctrl-C")
            await asyncio.to_thread(thread.join)
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
