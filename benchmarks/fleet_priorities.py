"""Priority classes across the fleet (issue 23's fleet bar):
``python benchmarks/fleet_priorities.py [--quick] [--json]``.

Standalone, like ``benchmarks/fleet.py`` (whose local ``redis-server`` it starts). Three replica
processes (this script with ``--replica``), each a gate built with ``priorities=`` (interactive
``min_share=0.5``, batch ``min_share=0.3``), ``fairness="tenant"`` and ``fleet=FleetLimit(...,
max_in_flight=10)``, local ceilings far above the fleet's. Every replica starts a burst of both
classes at once, 100 times the fleet cap in all (each turn holds 20-50 ms; 8 tenants per class
per replica); the parent samples each class's live leases in Redis every 5 ms (one Lua call,
by the server's clock) while the replicas stream when each turn starts.

Rows:

* **shares**: per second of the backlog (both classes with more than two caps of turns still
  waiting, from the moment every lease taken before the burst queued was given back: running
  turns are never cancelled), each class's mean, lowest and highest live leases, against its
  target (batch: its guarantee, 3; interactive: the rest, 7), and the highest total (the cap).
* **fault**: the same with a third replica that holds batch's three leases and is killed
  (``SIGKILL``) mid-backlog: how long until the live replicas' batch turns run again (its
  leases expire after ``lease_ttl_s`` = 2 s) and batch's lowest share after that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fleet import LocalRedis  # noqa: E402

CAP = 10
TARGET = {"interactive": 7, "batch": 3}
SAMPLE = """
local t = redis.call('TIME')
local now = '(' .. (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return {redis.call('ZCOUNT', KEYS[1], now, '+inf'), redis.call('ZCOUNT', KEYS[2], now, '+inf'),
        redis.call('ZCOUNT', KEYS[3], now, '+inf')}
"""


# -- the replica process ---------------------------------------------------------------


async def replica(config: dict[str, Any]) -> None:
    """Runs ``config["turns"]`` ({class: n}) at once through a gate with classes and a fleet;
    writes "s <class> <monotonic>" per start, then "done"."""
    import admitgate

    limit = admitgate.FleetLimit(**config["fleet"])
    gate = admitgate.build_admission_gate(
        max_concurrent_runs=1000,
        queue_depth=5000,
        priorities=[
            admitgate.PriorityClass("interactive", min_share=0.5),
            admitgate.PriorityClass("batch", min_share=0.3),
        ],
        fairness="tenant",
        fleet=limit,
    )
    assert gate is not None
    await limit.connect()
    rng = random.Random(config["seed"])
    low, high = config["hold"]
    out = sys.stdout

    async def turn(name: str, n: int) -> None:
        async with gate.admit(session_id=f"{name}-{n % 8}", priority=name):
            out.write(f"s {name} {time.monotonic()}\n")
            out.flush()
            await asyncio.sleep(rng.uniform(low, high))

    print("ready", flush=True)
    sys.stdin.readline()  # go
    await asyncio.gather(
        *(turn(name, n) for name, count in config["turns"].items() for n in range(count))
    )
    print("done", flush=True)
    await limit.shutdown()


# -- the parent ------------------------------------------------------------------------


class Process:
    """One replica process and the starts it reports."""

    def __init__(self, config: dict[str, Any]):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--replica", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.starts: dict[str, list[float]] = {"interactive": [], "batch": []}
        self.ready = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word = line.split()
            if word == ["ready"]:
                self.ready.set()
            elif word == ["done"]:
                self.done.set()
            elif word and word[0] == "s":
                self.starts[word[1]].append(float(word[2]))

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def sample_until(url: str, key: str, stop: threading.Event) -> list[tuple[float, int, int, int]]:
    import redis

    r = redis.Redis.from_url(url, decode_responses=True)
    script = r.register_script(SAMPLE)
    keys = [f"{{{key}}}:cls:0", f"{{{key}}}:cls:1", f"{{{key}}}:holders"]
    samples = []
    while not stop.is_set():
        hi, lo, total = script(keys=keys)
        samples.append((time.monotonic(), int(hi), int(lo), int(total)))
        time.sleep(0.005)
    r.close()
    return samples


def run(url: str, turns: int, kill: bool) -> dict[str, Any]:
    """One burst of ``turns`` per class per live replica; with ``kill``, a doomed third
    replica holding batch's guarantee is killed 0.5 s in."""
    key = f"bench:prio:{uuid.uuid4().hex[:8]}"
    fleet = {"url": url, "key": key, "max_in_flight": CAP, "lease_ttl_s": 2.0}
    fleet["command_timeout_s"] = 0.5
    live_count = 2 if kill else 3
    procs = [
        Process(
            {
                "fleet": fleet,
                "seed": i,
                "hold": [0.02, 0.05],
                "turns": {"interactive": turns * (2 if kill else 1), "batch": turns},
            }
        )
        for i in range(live_count)
    ]
    doomed = None
    if kill:
        doomed = Process({"fleet": fleet, "seed": 9, "hold": [600, 600], "turns": {"batch": 3}})
        procs_all = [*procs, doomed]
    else:
        procs_all = procs
    for p in procs_all:
        assert p.ready.wait(30), "a replica did not start"
    stop = threading.Event()
    box: list[list[tuple[float, int, int, int]]] = []
    sampler = threading.Thread(target=lambda: box.append(sample_until(url, key, stop)))
    killed = None
    try:
        if doomed is not None:
            doomed.go()
            time.sleep(0.5)
        sampler.start()
        for p in procs:
            p.go()
        if doomed is not None:
            time.sleep(0.5)
            os.kill(doomed.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
        for p in procs:
            assert p.done.wait(300), "a replica did not finish its burst"
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join(10)
        for p in procs_all:
            p.close()
    samples = box[0]
    starts = {c: sorted(t for p in procs for t in p.starts[c]) for c in TARGET}
    totals = {c: len(starts[c]) for c in TARGET}
    first = samples[0][0]
    after_first = sorted(t for c in TARGET for t in starts[c] if t > first)
    settled_at = after_first[CAP] if len(after_first) > CAP else float("inf")

    def backlogged(at: float) -> bool:
        return all(totals[c] - sum(1 for t in starts[c] if t <= at) > 2 * CAP for c in TARGET)

    seconds: dict[int, dict[str, list[int]]] = {}
    recovered_at = None
    if killed is not None:
        after = [t for t in starts["batch"] if t > killed]
        recovered_at = after[0] if after else None
    for at, hi, lo, _ in samples:
        if at < settled_at or not backlogged(at):
            continue
        if recovered_at is not None and at < recovered_at + 0.2:
            continue  # the dead replica's leases hold batch's share until they expire
        row = seconds.setdefault(int(at - first), {"interactive": [], "batch": []})
        row["interactive"].append(hi)
        row["batch"].append(lo)
    return {
        "turns": sum(totals.values()) + (3 if kill else 0),
        "max_total": max(s[3] for s in samples),
        "seconds": {
            str(sec): {
                c: {"mean": sum(v) / len(v), "min": min(v), "max": max(v), "n": len(v)}
                for c, v in row.items()
            }
            for sec, row in sorted(seconds.items())
        },
        "recovered_s": None
        if killed is None or recovered_at is None
        else round(recovered_at - killed, 2),
    }


def report(name: str, result: dict[str, Any]) -> bool:
    print(
        f"\n{name}: {result['turns']} turns on a fleet cap of {CAP}; "
        f"highest total held {result['max_total']}"
    )
    if result["recovered_s"] is not None:
        print(
            f"batch's turns on the live replicas ran again {result['recovered_s']} s "
            "after the kill (lease_ttl_s 2.0)"
        )
    print(f"{'second':>6} {'interactive mean/min/max':>26} {'batch mean/min/max':>20} samples")
    ok = result["max_total"] <= CAP and bool(result["seconds"])
    for sec, row in result["seconds"].items():
        hi, lo = row["interactive"], row["batch"]
        print(
            f"{sec:>6} {hi['mean']:>14.2f} {hi['min']:>4} {hi['max']:>4}"
            f" {lo['mean']:>10.2f} {lo['min']:>4} {lo['max']:>4} {hi['n']:>7}"
        )
        for c, v in row.items():
            if abs(v["min"] - TARGET[c]) > 1 or abs(v["max"] - TARGET[c]) > 1:
                ok = False
    print("[OK] " if ok else "[MISS] ", end="")
    print("each class within one lease of its target at every sample of every second")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/fleet_priorities.py", description=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="a burst 34 times the cap")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica:
        asyncio.run(replica(json.loads(args.replica)))
        return 0
    # 3 replicas x 2 classes x 167 turns: 1,002 turns, 100 times the cap of 10.
    turns = 57 if args.quick else 167
    server = LocalRedis()
    try:
        results = {
            "shares": run(server.url, turns, kill=False),
            "fault": run(server.url, turns, kill=True),
        }
    finally:
        server.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    ok = report("shares", results["shares"])
    ok = report("fault (a replica holding batch's guarantee killed)", results["fault"]) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
