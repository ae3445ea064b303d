"""One replica of an agent, for the fleet tests: a process with its own ``FleetLimit``.

Started by ``fleet_support.Replica`` as ``python fleet_replica.py '<json config>'`` with
``{"fleet": {FleetLimit keyword arguments}, "via": "gate", "gate": {build_admission_gate
keyword arguments}}``; ``"priorities"`` in it is a list of ``[name, min_share, max_share]``
(made ``PriorityClass`` objects). Turns go through ``gate.admit()`` of a gate built with ``fleet=``
(``"via": "limit"``: through ``FleetLimit.acquire`` alone). It reads one JSON command per line
on stdin and writes one JSON event per line on stdout:

``{"cmd": "turns", "n": 10, "hold": 0.05, "scope": "", "delay": 0.0, "tag": "a"}``
    starts ``n`` concurrent turns (after ``delay`` seconds), each holding a lease for ``hold``
    seconds; writes ``{"event": "turns", "tag", "turns": [{"scope", "arrive", "start", "end"}]}``
    once all have run (times are ``time.monotonic()``, one clock for every process on a host).
``{"cmd": "hold", "n": 3, "scope": ""}``
    takes ``n`` leases and keeps them (a gate's turns retry ``fleet_unavailable`` for up to
    10 s); answers ``{"event": "held", "n": n}``, or ``{"event": "error"}`` if one was refused.
``{"cmd": "release"}``
    gives back the leases kept by ``hold``; answers ``{"event": "released"}``.
``{"cmd": "load", "clients": 20, "duration": 5.0, "hold": [0.02, 0.08], "seed": 1, "tag": "a"}``
    runs ``clients`` clients, each taking turns back to back for ``duration`` seconds (holds
    drawn from ``hold`` by a generator seeded with ``seed``). Streams ``{"event": "s", "i", "t"}``
    when a turn starts and ``{"event": "e", "i", "t", "o"}`` when it ends (``o``: "ok", or the
    ``AdmissionRejected`` reason of a refused turn), so a test still knows what a replica killed
    mid-run had started; then ``{"event": "loaded", "tag", "stats"}``.
``{"cmd": "burst", "n": 300, "hold": [0.02, 0.08], "retry": 0.05, "seed": 1, "tag": "a",
"priority": null, "tenants": 1}``
    starts ``n`` turns at once (of class ``priority``, spread over ``tenants`` session ids), each retrying a ``fleet_unavailable`` refusal after ``retry``
    seconds until it runs (a client that retries). Streams ``s``/``e`` as ``load`` does; then
    ``{"event": "burst", "tag", "served", "refused", "first", "last"}`` (refusals by reason,
    the times of the first and last refusal, ``null`` without any).
``{"cmd": "stats"}``
    answers ``{"event": "stats", "stats": {...}, "gate": {...}}`` (the limit's and the gate's).
``{"cmd": "exit"}``
    exits.

It writes ``{"event": "ready"}`` once Redis answered. Log records of the ``admitgate`` logger
go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from typing import Any

import admitgate


def emit(event: str, **fields: Any) -> None:
    """Writes one event line on stdout."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class ReplicaProcess:
    """The replica's state: its limit and the leases ``hold`` keeps."""

    def __init__(self, config: dict[str, Any]):
        self.limit = admitgate.FleetLimit(**config["fleet"])
        self.gate: admitgate.AdmissionGate | None = None
        if config.get("via", "gate") == "gate":
            gate = dict(config.get("gate", {}))
            if "priorities" in gate:
                gate["priorities"] = [admitgate.PriorityClass(*c) for c in gate["priorities"]]
            self.gate = admitgate.build_admission_gate(**gate, fleet=self.limit)
        self.kept: list[admitgate.FleetLease] = []
        self.holding: list[asyncio.Task[None]] = []
        self.let_go = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    async def turn(self, scope: str, hold: float) -> dict[str, Any]:
        """One turn: wait for a slot and a lease, run for ``hold`` seconds, give them back."""
        arrive = time.monotonic()
        if self.gate is not None:
            async with self.gate.admit(session_id=scope):
                start = time.monotonic()
                await asyncio.sleep(hold)
                end = time.monotonic()
        else:
            lease = await self.limit.acquire(scope)
            start = time.monotonic()
            await asyncio.sleep(hold)
            end = time.monotonic()
            await lease.release()
        return {"scope": scope, "arrive": arrive, "start": start, "end": end}

    async def load(self, command: dict[str, Any]) -> None:
        """Clients taking turns back to back until the duration is up, streamed as they go."""
        tag = str(command.get("tag", ""))
        until = time.monotonic() + float(command["duration"])
        low, high = (float(h) for h in command.get("hold", [0.02, 0.08]))
        rng = random.Random(command.get("seed", 0))

        async def client(c: int) -> None:
            n = 0
            while time.monotonic() < until:
                turn = f"{tag}:{c}:{n}"
                n += 1
                hold = rng.uniform(low, high)
                # A turn's end is streamed before its lease is given back: once another
                # replica can start on that room, or this one is killed, the end is already
                # in the pipe, so the test never counts a finished turn as still running.
                try:
                    if self.gate is not None:
                        async with self.gate.admit():
                            emit("s", i=turn, t=time.monotonic())
                            await asyncio.sleep(hold)
                            emit("e", i=turn, t=time.monotonic(), o="ok")
                    else:
                        lease = await self.limit.acquire()
                        emit("s", i=turn, t=time.monotonic())
                        await asyncio.sleep(hold)
                        emit("e", i=turn, t=time.monotonic(), o="ok")
                        await lease.release()
                except admitgate.AdmissionRejected as exc:
                    emit("e", i=turn, t=time.monotonic(), o=exc.reason)
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(client(c) for c in range(int(command["clients"]))))
        emit("loaded", tag=tag, stats=self.limit.stats())

    async def burst(self, command: dict[str, Any]) -> None:
        """``n`` turns at once, each retrying ``fleet_unavailable`` until it is served."""
        tag = str(command.get("tag", ""))
        low, high = (float(h) for h in command.get("hold", [0.02, 0.08]))
        retry = float(command.get("retry", 0.05))
        priority = command.get("priority")
        tenants = int(command.get("tenants", 1))
        rng = random.Random(command.get("seed", 0))
        holds = [rng.uniform(low, high) for _ in range(int(command["n"]))]
        refused: dict[str, int] = {}
        window = [float("inf"), float("-inf")]  # the first and last refusal
        served = 0

        async def turn(n: int, hold: float) -> None:
            nonlocal served
            turn_id = f"{tag}:{n}"
            while True:
                try:
                    assert self.gate is not None
                    session = f"{tag}-{n % tenants}" if tenants > 1 else ""
                    async with self.gate.admit(session_id=session, priority=priority):
                        emit("s", i=turn_id, t=time.monotonic())
                        await asyncio.sleep(hold)
                        emit("e", i=turn_id, t=time.monotonic(), o="ok")
                    served += 1
                    return
                except admitgate.AdmissionRejected as exc:
                    # Summed, not streamed: thousands of retries would load the host.
                    now = time.monotonic()
                    window[0] = min(window[0], now)
                    window[1] = max(window[1], now)
                    refused[exc.reason] = refused.get(exc.reason, 0) + 1
                    if exc.reason != "fleet_unavailable":
                        return
                    await asyncio.sleep(retry)

        await asyncio.gather(*(turn(n, hold) for n, hold in enumerate(holds)))
        first, last = window if refused else (None, None)
        emit("burst", tag=tag, served=served, refused=refused, first=first, last=last)

    async def held_turn(self, scope: str, entered: asyncio.Queue[str]) -> None:
        """A gate turn that runs until ``release``."""
        assert self.gate is not None
        # A client that retries a passing outage (a loaded host's replica slow to confirm, with
        # durability="replicated"), for at most 10 s; any other refusal is reported by ``hold``.
        give_up = time.monotonic() + 10.0
        while True:
            try:
                async with self.gate.admit(session_id=scope):
                    await entered.put(scope)
                    await self.let_go.wait()
                return
            except admitgate.AdmissionRejected as exc:
                if exc.reason != "fleet_unavailable" or time.monotonic() > give_up:
                    await entered.put(f"refused: {exc.reason}")
                    return
                await asyncio.sleep(0.05)

    async def turns(self, command: dict[str, Any]) -> None:
        """Runs a batch of concurrent turns and reports them together."""
        await asyncio.sleep(float(command.get("delay", 0.0)))
        scope = str(command.get("scope", ""))
        hold = float(command.get("hold", 0.05))
        try:
            done = await asyncio.gather(*(self.turn(scope, hold) for _ in range(int(command["n"]))))
        except Exception as exc:  # reported to the test, which fails with it
            emit("error", message=repr(exc))
            return
        emit("turns", tag=command.get("tag", ""), turns=list(done))

    async def handle(self, command: dict[str, Any]) -> bool:
        """Acts on one command; ``False`` to exit."""
        cmd = command["cmd"]
        if cmd == "turns":
            task = asyncio.ensure_future(self.turns(command))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif cmd == "burst":
            task = asyncio.ensure_future(self.burst(command))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif cmd == "load":
            task = asyncio.ensure_future(self.load(command))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif cmd == "hold":
            scope = str(command.get("scope", ""))
            n = int(command["n"])
            if self.gate is None:
                leases = [await self.limit.acquire(scope) for _ in range(n)]
                self.kept.extend(leases)
            else:
                self.let_go.clear()
                entered: asyncio.Queue[str] = asyncio.Queue()
                self.holding += [
                    asyncio.ensure_future(self.held_turn(scope, entered)) for _ in range(n)
                ]
                got = [await entered.get() for _ in range(n)]
                refused = [g for g in got if g.startswith("refused: ")]
                if refused:
                    emit("error", message=f"hold: {refused}")
                    return True
            emit("held", n=n)
        elif cmd == "release":
            for lease in self.kept:
                await lease.release()
            self.kept.clear()
            self.let_go.set()
            await asyncio.gather(*self.holding)
            self.holding.clear()
            emit("released")
        elif cmd == "stats":
            gate = self.gate.stats() if self.gate is not None else {}
            emit("stats", stats=self.limit.stats(), gate=gate)
        elif cmd == "exit":
            return False
        else:
            emit("error", message=f"unknown command {cmd!r}")
        return True


async def main(config: dict[str, Any]) -> None:
    """Connects, says ready, then serves commands until ``exit`` or end of input."""
    replica = ReplicaProcess(config)
    # As a service starting beside a slow Redis would: retry the first connection for up to
    # 10 s (with durability="replicated" it fails while no replica confirms a write in time,
    # which a loaded host's just-settled replica sometimes does not).
    give_up = time.monotonic() + 10.0
    while True:
        try:
            await replica.limit.connect()
            break
        except ConnectionError:
            if time.monotonic() > give_up:
                raise
            await asyncio.sleep(0.2)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    emit("ready", replica_id=replica.limit.replica_id)
    while True:
        line = await reader.readline()
        if not line:
            break
        try:
            if not await replica.handle(json.loads(line)):
                break
        except Exception as exc:  # reported to the test, which fails with it
            emit("error", message=repr(exc))
    for task in list(replica.tasks) + replica.holding:
        task.cancel()


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
    asyncio.run(main(json.loads(sys.argv[1])))
