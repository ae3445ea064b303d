"""The fleet protocol's cost per call as waiting tickets grow:
``python benchmarks/fleet_queue.py [--quick] [--json] [--before COMMIT]``.

Standalone, like ``benchmarks/fleet.py`` (whose local ``redis-server`` it uses). It runs the
fleet crate's Lua scripts from redis-py, so only the scripts are measured: the scripts of this
tree ("after") and those of ``--before`` (default ``317640a``, the last commit whose
``grant_waiting`` walked every ticket: ZRANGE of the whole queue and an HGET per ticket), read
with ``git show``, in one run on one server.

For each queue length (100, 1,000, 10,000 waiting tickets behind a cap of 1) it measures one
hand-off after another: the holder's release (which grants the room to the oldest ticket),
then an acquisition that finds no room and queues at the back (so the queue keeps its length),
40 of each, and reports the mean Lua time per call as Redis itself counts it
(``INFO commandstats``, ``usec / calls`` of EVALSHA). The queue is filled with the version's
own acquire script, except that the old one is filled by writing its layout directly (its
acquire walks the queue, so filling 10,000 tickets that way would take minutes).

A third column (issue 23) measures this tree's scripts with priority classes: two classes with
guarantees (0.5 and 0.3 of the cap) and fair queuing across 50 tenants, the waiting tickets
spread over both classes and every tenant, each hand-off's acquisition alternating classes.
A grant then also picks the class (each class's first head, its in-flight count) and moves the
served tenant's virtual time: still O(log n) per call, so the column stays flat as the queue
grows tenfold and a hundredfold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fleet import LocalRedis  # noqa: E402

LUA = "crates/fleet/src/lua"
TTL_MS = 600_000  # nothing expires during a measurement
SIZES = (100, 1_000, 10_000)
# The classes column: two classes with guarantees, fair queuing across tenants.
CLASS_SHARES = "1 0.5 1.0 0.3 1.0"
TENANTS = 50


def _source(name: str, commit: str | None) -> str:
    if commit is None:
        return (ROOT / LUA / name).read_text()
    return subprocess.run(
        ["git", "show", f"{commit}:{LUA}/{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


class Version:
    """One version's acquire and release scripts, with the keys and arguments it takes."""

    def __init__(self, r: Any, key: str, commit: str | None, classed: bool = False):
        self.r = r
        self.old = commit is not None
        common = _source("common.lua", commit)
        # Scripts since issue 23 take the caller's classes (ARGV 5 and 6) and a step per ticket.
        self.takes_classes = "conf_id" in common
        self.classed = classed
        assert self.takes_classes or not classed, "these scripts have no classes"
        self.acquire = r.register_script(common + "\n" + _source("acquire.lua", commit))
        self.release = r.register_script(common + "\n" + _source("release.lua", commit))
        tag = "{" + key + "}"
        names = ["holders", "tickets", "ticket_expiry", "ticket_info", "borrowed"]
        if not self.old:
            names += ["granted", "replicas", "classes"]
        self.keys = [f"{tag}:{n}" for n in names]
        self.head = [f"{tag}:scope:", f"{tag}:grants"] if self.old else [f"{tag}:", f"{tag}:grants"]
        self.tag = tag

    def _common(self, instance: str) -> list[Any]:
        if self.old:
            return self.head
        args = [*self.head, instance, TTL_MS]
        if self.takes_classes:
            args += [CLASS_SHARES, "bench"] if self.classed else ["", "plain"]
        return args

    def ticket(self, replica: int, n: int) -> tuple[str, str]:
        """A ticket's id and scope: with classes, its class and tenant follow from ``n``."""
        if not self.classed:
            return f"queue#{replica}#{n}", ""
        return f"queue#{replica}#{n}:{n % 2}", f"t{n % TENANTS}"

    def take(self, id_: str, wait: bool, pipe: Any = None, scope: str = "") -> Any:
        instance = id_.rsplit("#", 1)[0]
        args = [*self._common(instance), id_, scope, 1, 0, TTL_MS, "1" if wait else "0"]
        if not self.old:
            args.append(TTL_MS)  # the claim window
        if self.takes_classes:
            args.append(1 << 20)  # the tenant's step under fair queuing
        return self.acquire(keys=self.keys, args=args, client=pipe or self.r)

    def give_back(self, id_: str) -> Any:
        instance = id_.rsplit("#", 1)[0]
        # The tenant is the id's number's (see `ticket`); the holder has none.
        scope = ""
        if self.classed and id_.startswith("queue#"):
            scope = f"t{int(id_.rsplit('#', 1)[1].split(':')[0]) % TENANTS}"
        return self.release(keys=self.keys, args=[*self._common(instance), id_, scope])

    def fill(self, n: int) -> None:
        """A holder, then ``n`` waiting tickets."""
        holder = "holder#0#0:0" if self.classed else "holder#0#0"
        assert self.take(holder, wait=False)[-2] == 1  # the code, then the arrival
        if self.old:
            now_us = int(time.time() * 1_000_000)
            pipe = self.r.pipeline(transaction=False)
            for i in range(n):
                id_ = f"queue#0#{i}"
                pipe.zadd(f"{self.tag}:tickets", {id_: now_us + i})
                pipe.zadd(f"{self.tag}:ticket_expiry", {id_: now_us // 1000 + TTL_MS})
                pipe.hset(f"{self.tag}:ticket_info", id_, f"1 {TTL_MS} 0 ")
            pipe.execute()
            return
        for start in range(0, n, 500):
            pipe = self.r.pipeline(transaction=False)
            for i in range(start, min(n, start + 500)):
                id_, scope = self.ticket(0, i)
                self.take(id_, wait=True, pipe=pipe, scope=scope)
            pipe.execute()

    def holder(self) -> str:
        return str(self.r.zrange(self.keys[0], 0, 0)[0])


def measure(
    server: LocalRedis, n: int, commit: str | None, rounds: int, classed: bool = False
) -> float:
    """Mean µs of Lua per call over ``rounds`` hand-offs with ``n`` tickets waiting."""
    import redis

    r = redis.Redis.from_url(server.url, decode_responses=True)
    r.flushall()
    version = Version(r, f"bench:{n}:{'old' if commit else 'new'}", commit, classed)
    version.fill(n)
    assert r.zcard(version.keys[1]) == n
    r.config_resetstat()
    for i in range(rounds):
        version.give_back(version.holder())  # the room goes to the next ticket in order
        id_, scope = version.ticket(1, i)
        version.take(id_, wait=True, scope=scope)  # no room: queues
    assert r.zcard(version.keys[1]) == n, "the queue kept its length"
    stats = r.info("commandstats")["cmdstat_evalsha"]
    r.close()
    return int(stats["usec"]) / int(stats["calls"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/fleet_queue.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="10 hand-offs per size, not 40")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--before", default="317640a", help="the commit measured as 'before'")
    args = parser.parse_args(argv)
    rounds = 10 if args.quick else 40
    server = LocalRedis()
    results: dict[str, dict[str, float]] = {}
    try:
        # Interleaved: before and after alternate at each size.
        for n in SIZES:
            results[str(n)] = {
                "before": measure(server, n, args.before, rounds),
                "after": measure(server, n, None, rounds),
                "classes": measure(server, n, None, rounds, classed=True),
            }
    finally:
        server.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"µs of Lua per script call, {rounds} hand-offs (release + queued acquire) per size")
    print(f"{'waiting':>8} {'before':>10} {'after':>8} {'ratio':>7} {'classes':>8}")
    for size, row in results.items():
        ratio = row["before"] / row["after"]
        print(
            f"{int(size):>8,} {row['before']:>10,.1f} {row['after']:>8,.1f} {ratio:>6.0f}x"
            f" {row['classes']:>8,.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
