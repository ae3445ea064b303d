"""Draws deploy/grafana/admitgate.json from a recorded run, for the docs (Grafana does not run
on the project's machine: it is not packaged in Debian).

    python scripts/dashboard_png.py [--out docs/images/dashboard.png] [--seconds 75]

The run: an agent on loopback whose turns take 1-3 s (a threaded HTTP server answering JSON-RPC
and REST, in its own process), two brokers in front of it with the Kubernetes ConfigMap's
broker.yaml and one fleet cap of 12 on a real redis-server (Debian's, found or installed by
``scripts/redis-server``), and a load that rises past the cap and falls, half JSON-RPC, half
REST, each client waiting 0.5 s after a refusal; Redis is down for 3 s in the middle. Both
brokers' ``/metrics`` are scraped every second. Each panel is then the dashboard's own
queries, evaluated over those scrapes by the small PromQL subset they use (instant vectors,
``rate``/``increase`` over 5 s, ``sum``/``max``/``min by``, ``histogram_quantile``, ``/``,
``> 0``), drawn where the dashboard puts it. Needs the broker built (``cargo build -p
admitgate-broker``), matplotlib, httpx and PyYAML.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import math
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "admitgate.json"
WINDOW = 5  # scrapes (seconds) that $__rate_interval stands for
Labels = tuple[tuple[str, str], ...]
Vector = list[tuple[dict[str, str], float]]


# -- the run -------------------------------------------------------------------------------------


class Agent(http.server.BaseHTTPRequestHandler):
    """A stand-in agent: every POST takes 1-3 s (an LLM turn) and answers 200 with a JSON
    result."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(random.uniform(1.0, 3.0))
        self._answer(b'{"jsonrpc": "2.0", "id": "1", "result": {}}')

    def do_GET(self) -> None:  # noqa: N802
        self._answer(b"{}")

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    binary = subprocess.run(
        [str(ROOT / "scripts" / "redis-server")], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    process = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for_port(port)
    return process


def wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def start_broker(
    binary: Path, config: Path, agent: str, fleet: str, key: str
) -> tuple[Any, str, str]:
    process = subprocess.Popen(
        [str(binary), "--config", str(config), "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--upstream", agent, "--max-in-flight", str(CAP),
         "--queue-timeout", "2", "--fleet", fleet, "--fleet-key", key],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    for line in process.stderr:
        event = json.loads(line)
        if event.get("event") == "listening":
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()  # type: ignore[union-attr]
            return process, event["listen"], event["metrics_listen"]
    raise RuntimeError("broker did not start")


PEAK = 60  # clients at the peak of the load
CAP = 12  # the fleet cap the two brokers share


def clients_at(t: float, seconds: float) -> int:
    """The load: 10 clients, rising to PEAK (past the fleet cap and the queues), then
    falling to 8."""
    f = t / seconds
    if f < 0.12:
        return 10
    if f < 0.35:
        return int(10 + (PEAK - 10) * (f - 0.12) / 0.23)
    if f < 0.6:
        return PEAK
    if f < 0.8:
        return 25
    return 8


async def load(brokers: list[str], seconds: float, start: float) -> None:
    limits = httpx.Limits(max_connections=PEAK * 2, max_keepalive_connections=PEAK * 2)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:

        async def client(n: int) -> None:
            url = f"http://{brokers[n % len(brokers)]}"
            while (t := time.monotonic() - start) < seconds:
                if n >= clients_at(t, seconds):
                    await asyncio.sleep(0.1)
                    continue
                message = {"role": "ROLE_USER", "messageId": str(uuid.uuid4()),
                           "parts": [{"text": "hi"}]}  # fmt: skip
                headers = {"A2A-Version": "1.0"}
                if n % 4 >= 2:
                    r = await http.post(url + "/message:send", json={"message": message},
                                        headers=headers)  # fmt: skip
                else:
                    body = {"jsonrpc": "2.0", "id": n, "method": "SendMessage",
                            "params": {"message": message}}  # fmt: skip
                    r = await http.post(url + "/", json=body, headers=headers)
                if r.status_code != 200:
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(client(n) for n in range(PEAK)))


def record(seconds: float, binary: Path) -> list[tuple[float, Vector]]:
    """Runs the scenario; returns (unix time, samples of both brokers) per second."""
    # The agent in its own process: it must not share a GIL with the load and the scrapes.
    agent_port = free_port()
    agent = subprocess.Popen([sys.executable, __file__, "--agent", str(agent_port)])
    wait_for_port(agent_port)
    workdir = Path(tempfile.mkdtemp(prefix="admitgate-dashboard-"))
    configmap = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text())
    config = workdir / "broker.yaml"
    config.write_text(configmap["data"]["broker.yaml"])
    redis_port = free_port()
    redis = start_redis(redis_port, workdir)
    fleet = f"redis://127.0.0.1:{redis_port}/0"
    key = f"dashboard:{uuid.uuid4().hex[:8]}"
    upstream = f"http://127.0.0.1:{agent_port}"
    brokers = [start_broker(binary, config, upstream, fleet, key) for _ in range(2)]
    scrapes: list[tuple[float, Vector]] = []
    start = time.monotonic()
    done = threading.Event()

    def scrape() -> None:
        tick = start
        while not done.is_set():
            samples: Vector = []
            for n, (_, _, metrics) in enumerate(brokers):
                text = httpx.get(f"http://{metrics}/metrics", timeout=5).text
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        labels = {**s.labels, "job": "agent", "instance": f"broker-{'ab'[n]}"}
                        samples.append(({"__name__": s.name, **labels}, float(s.value)))
            scrapes.append((time.time(), samples))
            tick += 1
            time.sleep(max(0.0, tick - time.monotonic()))

    def outage() -> None:
        nonlocal redis
        time.sleep(seconds * 0.47)
        redis.kill()
        time.sleep(3)
        redis = start_redis(redis_port, workdir)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    threading.Thread(target=outage, daemon=True).start()
    asyncio.run(load([address for _, address, _ in brokers], seconds, start))
    time.sleep(WINDOW)
    done.set()
    scraper.join(10)
    for process, _, _ in brokers:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    redis.kill()
    agent.kill()
    return scrapes


# -- the PromQL subset the dashboard uses --------------------------------------------------------


def matches(labels: dict[str, str], matchers: str) -> bool:
    for name, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
        if "$" in value:
            continue  # a dashboard variable: every job and instance
        have = labels.get(name, "")
        if (op == "=" and have != value) or (op == "!=" and have == value):
            return False
    return True


def evaluate(expr: str, scrapes: list[tuple[float, Vector]], i: int) -> Vector:
    expr = expr.strip()
    if expr.endswith("> 0"):
        return [(lab, v) for lab, v in evaluate(expr[:-3], scrapes, i) if v > 0]
    if " / " in expr:
        left, right = expr.split(" / ")
        denominators = {key(lab): v for lab, v in evaluate(right, scrapes, i)}
        return [
            (lab, v / denominators[key(lab)])
            for lab, v in evaluate(left, scrapes, i)
            if denominators.get(key(lab))
        ]
    if m := re.fullmatch(r"histogram_quantile\(([\d.]+),\s*(.*)\)", expr, re.S):
        return quantiles(float(m[1]), evaluate(m[2], scrapes, i))
    if m := re.fullmatch(r"(sum|max|min)(?:\s+by\s*\(([^)]*)\))?\s*\((.*)\)", expr, re.S):
        by = [label.strip() for label in (m[2] or "").split(",") if label.strip()]
        groups: dict[Labels, list[float]] = defaultdict(list)
        for lab, v in evaluate(m[3], scrapes, i):
            groups[tuple((b, lab.get(b, "")) for b in by)].append(v)
        reduce = {"sum": sum, "max": max, "min": min}[m[1]]
        return [(dict(k), float(reduce(vs))) for k, vs in groups.items()]
    if m := re.fullmatch(r"(rate|increase)\((\w+)(?:\{(.*)\})?\[[^\]]+\]\)", expr):
        j = max(0, i - WINDOW)
        then = {key(lab): v for lab, v in select(m[2], m[3] or "", scrapes[j][1])}
        span = scrapes[i][0] - scrapes[j][0]
        out: Vector = []
        for lab, v in select(m[2], m[3] or "", scrapes[i][1]):
            if span > 0 and key(lab) in then:
                rate = max(0.0, v - then[key(lab)]) / span
                out.append((lab, rate * span if m[1] == "increase" else rate))
        return out
    if m := re.fullmatch(r"(\w+)(?:\{(.*)\})?", expr):
        return select(m[1], m[2] or "", scrapes[i][1])
    raise ValueError(f"not in the subset: {expr}")


def key(labels: dict[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def select(name: str, matchers: str, samples: Vector) -> Vector:
    return [
        ({k: v for k, v in lab.items() if k != "__name__"}, value)
        for lab, value in samples
        if lab["__name__"] == name and matches(lab, matchers)
    ]


def quantiles(q: float, buckets: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for lab, v in buckets:
        rest = tuple((k, x) for k, x in sorted(lab.items()) if k != "le")
        groups[rest].append((float(lab["le"]), v))
    out: Vector = []
    for rest, pairs in groups.items():
        pairs.sort()
        total = pairs[-1][1]
        if total <= 0:
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for bound, count in pairs:
            if count >= rank:
                if math.isinf(bound):
                    out.append((dict(rest), lower))
                else:
                    share = (rank - below) / (count - below) if count > below else 1.0
                    out.append((dict(rest), lower + (bound - lower) * share))
                break
            lower, below = bound, count
    return out


# -- the picture ---------------------------------------------------------------------------------

# Grafana's classic palette, reordered so neighbours differ in hue.
COLORS = ["#73BF69", "#F2CC0C", "#5794F2", "#FF780A", "#F2495C", "#B877D9", "#4FD6D3", "#FF99C3"]
UNITS = {"reqps": "req/s", "s": "seconds", "bool": "", "short": ""}


def legend(form: str, labels: dict[str, str]) -> str:
    """A series' name, as Grafana fills a legendFormat: {{label}} by its value."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m[1], ""), form)


def draw(scrapes: list[tuple[float, Vector]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    board = json.loads(DASHBOARD.read_text())
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    fig = plt.figure(figsize=(20, bottom * 0.42), facecolor="#111217")
    times = [datetime.fromtimestamp(t, timezone.utc) for t, _ in scrapes]
    fig.text(0.01, 1 - 0.4 / bottom, board["title"], color="#d8d9da", fontsize=15, va="center")
    for panel in board["panels"]:
        g = panel["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        top = 1 - g["y"] / (bottom + 1) - 0.5 / (bottom + 1)
        height = g["h"] / (bottom + 1)
        if panel["type"] == "row":
            fig.text(left + 0.005, top - height / 2, panel["title"], color="#d8d9da",
                     fontsize=12, fontweight="bold", va="center")  # fmt: skip
            continue
        ax = fig.add_axes((left + 0.03, top - height + 0.035, width - 0.04, height - 0.06))
        ax.set_facecolor("#181b1f")
        for side in ax.spines.values():
            side.set_color("#2c3235")
        ax.tick_params(colors="#9fa7b3", labelsize=7)
        ax.set_title(panel["title"], color="#d8d9da", fontsize=9, loc="left")
        series: dict[str, list[float]] = {}
        for target in panel["targets"]:
            for i in range(len(scrapes)):
                for lab, v in evaluate(target["expr"], scrapes, i):
                    name = legend(target["legendFormat"], lab)
                    series.setdefault(name, [math.nan] * len(scrapes))[i] = v
        if panel["type"] == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            for n, (name, values) in enumerate(sorted(series.items())):
                last = next((v for v in reversed(values) if not math.isnan(v)), math.nan)
                good = (
                    last == 1
                    if "up" in panel["title"].lower() or "answering" in panel["title"].lower()
                    else last == 0
                )
                x0 = n / max(1, len(series))
                ax.add_patch(plt.Rectangle((x0 + 0.02, 0.1), 1 / max(1, len(series)) - 0.04, 0.8,
                             color="#37872D" if good else "#C4162A"))  # fmt: skip
                ax.text(x0 + 0.5 / max(1, len(series)), 0.5, f"{name}\n{last:g}", ha="center",
                        va="center", color="white", fontsize=10)  # fmt: skip
            continue
        dashed = {}
        for override in panel["fieldConfig"]["overrides"]:
            props = {p["id"]: p["value"] for p in override["properties"]}
            dashed[override["matcher"]["options"]] = props.get("color", {}).get("fixedColor")
        for n, (name, values) in enumerate(sorted(series.items())):
            style = next((c for pattern, c in dashed.items() if re.fullmatch(pattern, name)), None)
            # Limits dashed and on top; alternate widths, so equal series stay visible.
            ax.plot(times, values, label=name, linewidth=2.4 if n % 2 == 0 else 1.3,
                    color=style or COLORS[n % len(COLORS)], linestyle="--" if style else "-",
                    zorder=3 if style else 2)  # fmt: skip
        if panel["fieldConfig"]["defaults"].get("unit") == "bool":
            ax.set_ylim(-0.05, 1.1)
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlim(times[0], times[-1])
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
        ax.grid(color="#2c3235", linewidth=0.5)
        unit = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", ""), "")
        if unit:
            ax.set_ylabel(unit, color="#9fa7b3", fontsize=7)
        if series:
            ax.legend(fontsize=6.5, loc="upper left", ncol=2, facecolor="#181b1f",
                      edgecolor="#2c3235", labelcolor="#d8d9da")  # fmt: skip
        else:
            ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", color="#9fa7b3")
            ax.set_xlim(times[0], times[-1])
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "dashboard.png")
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument(
        "--broker", type=Path, default=ROOT / "target" / "debug" / "admitgate-broker"
    )
    parser.add_argument(
        "--scrapes", type=Path, help="a JSON file: read the run from it if it exists, else save it"
    )
    parser.add_argument("--agent", type=int, help=argparse.SUPPRESS)  # the agent process
    args = parser.parse_args()
    random.seed(7)
    if args.agent:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.agent), Agent)
        server.daemon_threads = True
        server.serve_forever()
        return
    if args.scrapes and args.scrapes.exists():
        scrapes = [
            (t, [(lab, v) for lab, v in samples])
            for t, samples in json.loads(args.scrapes.read_text())
        ]
    else:
        scrapes = record(args.seconds, args.broker)
        if args.scrapes:
            args.scrapes.write_text(json.dumps(scrapes))
    draw(scrapes, args.out)


if __name__ == "__main__":
    main()
