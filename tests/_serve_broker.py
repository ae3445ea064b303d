"""Runs ``admitgate.broker.serve()`` with the broker's flags given as keywords (``--max-in-flight
2`` is ``max_in_flight="2"``: numbers as strings, which serve() accepts as the flags do), then
prints how it ended as one JSON line on stdout: ``{"returned": repr(value)}`` or ``{"raised":
class name, "message": str(exception)}``.

``--then-serve-again`` (first) calls serve() a second time with the same keywords once the
first call has ended, and prints the second outcome too. ``--reenter-on-sigusr1`` installs a
SIGUSR1 handler that calls serve() while it serves. ``--own-sigterm-handler`` installs a
SIGTERM handler that returns the first time and raises ``SystemExit(3)`` the second.
"""

from __future__ import annotations

import json
import signal
import sys
from types import FrameType
from typing import Any

import admitgate.broker


def outcome(keywords: dict[str, Any]) -> dict[str, str]:
    try:
        value = admitgate.broker.serve(**keywords)
    except BaseException as exc:  # what the caller of serve() gets, whatever it is
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"returned": repr(value)}


def main(argv: list[str]) -> int:
    switches = ("--then-serve-again", "--reenter-on-sigusr1", "--own-sigterm-handler")
    again, reenter, own_sigterm = (switch in argv for switch in switches)
    flags = [a for a in argv if a not in switches]
    keywords = {
        flag.removeprefix("--").replace("-", "_"): value
        for flag, value in zip(flags[::2], flags[1::2], strict=True)
    }
    if reenter:

        def serve_again(signum: int, frame: FrameType | None) -> None:
            admitgate.broker.serve(**keywords)

        signal.signal(signal.SIGUSR1, serve_again)
    if own_sigterm:
        seen: list[int] = []

        def second_time_exit(signum: int, frame: FrameType | None) -> None:
            seen.append(signum)
            if len(seen) == 2:
                raise SystemExit(3)

        signal.signal(signal.SIGTERM, second_time_exit)
    print(json.dumps(outcome(keywords)), flush=True)
    if again:
        print(json.dumps(outcome(keywords)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
