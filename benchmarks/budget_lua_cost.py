"""The fleet budget's server cost per decision: ``python benchmarks/budget_lua_cost.py``.

What one budget decision (``crates/fleet/src/lua/budget.lua``) costs the redis-server, measured
without the client in the way: its own redis-server on a free loopback port, the script loaded
once, then ``--calls`` reserves sent pipelined (so the server is never idle waiting for the
client) exactly as ``FleetBudget`` sends them (the same keys, hash tags and arguments; 2,000
identities in turn, or ``--identities N``: 5 keeps every log hot, its cell fresh, and 0 takes a
new identity each call; a new reservation id each, a limit no identity reaches). Reports, per
shape (two limits, requests and tokens, as ``fleet_decision_cost`` asks; one request limit, as
a ``RateLimit(requests=...)`` asks):

* ``usec_per_call`` of ``evalsha`` from ``INFO commandstats`` (wall time inside the server, so
  a loaded host inflates it), and the decisions per second that makes for one server thread;
* with ``--callgrind``: the redis-server runs under ``valgrind --tool=callgrind`` and the
  instructions it executed per decision are counted (independent of the host's load).

``--script PATH`` measures another version of the script (a before and after in one run:
``git show REV:crates/fleet/src/lua/budget.lua > /tmp/old.lua``); ``--keep DIR`` keeps the
callgrind profiles for ``callgrind_annotate --inclusive=yes``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from admitgate._cli import OneLineParser, integer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "crates" / "fleet" / "src" / "lua" / "budget.lua"
WINDOW_US = 60_000_000
SHAPES = {
    "requests+tokens": [("r", 1_000_000), ("t", 1 << 40)],
    "requests": [("r", 1_000_000)],
}


def resp(*args: str | int | bytes) -> bytes:
    """One command in the Redis protocol."""
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


class Server:
    def __init__(self, callgrind: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="admitgate-lua-cost-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        command = [
            shutil.which("redis-server") or "/usr/bin/redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
        ]
        self.callgrind_out = os.path.join(self.dir, "callgrind.out")
        if callgrind:
            command = [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={self.callgrind_out}",
                *command,
            ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", self.port))
                if self.call("PING") == b"+PONG":
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.buffer = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("redis-server closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def _read(self) -> object:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"*":
            return [self._read() for _ in range(int(rest))]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buffer) < n + 2:
                self.buffer += self.sock.recv(1 << 16)
            value, self.buffer = self.buffer[:n], self.buffer[n + 2 :]
            return value
        if kind == b"-":
            raise RuntimeError(line.decode())
        return line

    def call(self, *args: str | int | bytes) -> object:
        self.buffer = getattr(self, "buffer", b"")
        self.sock.sendall(resp(*args))
        return self._read()

    def pipelined(self, commands: list[bytes], check: bool) -> None:
        self.sock.sendall(b"".join(commands))
        for _ in commands:
            reply = self._read()
            if check and not (isinstance(reply, list) and reply[0] == b":1"):
                raise RuntimeError(f"not allowed: {reply!r}")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def reserves(
    sha: bytes, limits: list[tuple[str, int]], calls: int, start: int, identities: int
) -> list[bytes]:
    out = []
    for n in range(start, start + calls):
        # identities 0: a new identity every call (its keys made, never read again).
        which = n % identities if identities else n
        who = hashlib.sha1(f"identity-{which}".encode()).hexdigest()[:32]
        tag = f"{{cost:{who}}}"
        keys = [k for i in range(len(limits)) for k in (f"{tag}:{i}", f"{tag}:{i}:t")]
        args: list[str | int] = ["reserve", f"replica#0000000000000000#{n}", 100, 0, len(limits)]
        for kind, amount in limits:
            args += [kind, amount, WINDOW_US]
        out.append(resp("EVALSHA", sha, len(keys), *keys, *args))
    return out


def commandstats(server: Server) -> tuple[int, float]:
    info = server.call("INFO", "commandstats")
    assert isinstance(info, bytes)
    m = re.search(rb"cmdstat_evalsha:calls=(\d+),usec=\d+,usec_per_call=([\d.]+)", info)
    assert m, info
    return int(m.group(1)), float(m.group(2))


def measure(script: Path, calls: int, callgrind: bool, identities: int, keep: Path | None) -> None:
    source = script.read_bytes()
    for shape, limits in SHAPES.items():
        server = Server(callgrind)
        try:
            sha = server.call("SCRIPT", "LOAD", source)
            assert isinstance(sha, bytes)
            # Warm: every identity's keys exist, as in a steady state.
            for i in range(0, 2000, 500):
                server.pipelined(reserves(sha, limits, 500, i, identities), check=True)
            server.call("CONFIG", "RESETSTAT")
            if callgrind:
                subprocess.run(
                    ["callgrind_control", "-z", str(server.process.pid)],
                    check=True,
                    capture_output=True,
                )
            done = 2000
            while done < 2000 + calls:
                batch = min(500, 2000 + calls - done)
                server.pipelined(reserves(sha, limits, batch, done, identities), check=True)
                done += batch
            n, usec = commandstats(server)
            line = f"{script.name} {shape}, identities {identities or 'new'}: {n} calls, evalsha usec_per_call {usec:.2f}"
            line += f" ({1e6 / usec:,.0f}/s on one server thread)"
            if callgrind:
                subprocess.run(
                    ["callgrind_control", "-d", str(server.process.pid)],
                    check=True,
                    capture_output=True,
                )
                total = 0
                for path in Path(server.dir).glob("callgrind.out.*"):
                    if keep is not None:
                        keep.mkdir(parents=True, exist_ok=True)
                        shutil.copy(path, keep / f"{script.stem}.{shape}.{path.name}")
                    for row in path.read_text().splitlines():
                        if row.startswith("summary:") or row.startswith("totals:"):
                            total += int(row.split()[1])
                            break
                line += f", {total / n:,.0f} instructions per decision (callgrind)"
            print(line, flush=True)
        finally:
            server.close()


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", type=Path, action="append", help="budget.lua to measure")
    parser.add_argument("--calls", type=integer(1, 10_000_000), default=20_000)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument(
        "--identities",
        type=integer(0, 10_000_000),
        default=2000,
        help="identities taken in turn (5: hot logs, fresh cells; 0: a new identity each call)",
    )
    parser.add_argument(
        "--keep", type=Path, help="copy the callgrind profiles here (for callgrind_annotate)"
    )
    args = parser.parse_args()
    for script in args.script or []:
        if not script.is_file():
            parser.error(f"argument --script: no such file: {str(script)!r}")
    print(f"host load (1 min) at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for script in args.script or [SCRIPT]:
        measure(script, args.calls, args.callgrind, args.identities, args.keep)


if __name__ == "__main__":
    main()
