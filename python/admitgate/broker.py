"""The admitgate broker from Python: ``python -m admitgate broker`` and :func:`serve`.

The broker (``crates/broker``) is a standalone Rust binary, ``admitgate-broker``: a sidecar
proxy that gates A2A traffic in front of an agent written in any language (see the docs page
"Broker"). This module runs that binary with the same flags and waits for it; signals sent to
this process (SIGTERM, SIGINT) are passed on, so the broker drains and exits as it would
standalone, and this process exits with its code.

The binary is looked up in this order: ``$ADMITGATE_BROKER`` (a path), ``admitgate-broker``
on ``PATH``, then the ``target/release`` and ``target/debug`` builds of a source checkout
(``cargo build --release -p admitgate-broker``).

Why a child process rather than the broker inside the extension module: the broker used to
link the core through the root crate, which is the extension module itself, so the module
could not link the broker back (a dependency cycle). The core is now its own crate
(``crates/core``), so that cycle is gone; linking the broker in has not been done yet.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

__all__ = ["find_binary", "main", "serve"]

_NOT_FOUND = (
    "admitgate-broker was not found: set ADMITGATE_BROKER to its path, put it on PATH, or build "
    "it in a source checkout with `cargo build --release -p admitgate-broker`"
)


def find_binary() -> Path:
    """The ``admitgate-broker`` executable to run; ``FileNotFoundError`` naming where it was
    looked for when there is none."""
    explicit = os.environ.get("ADMITGATE_BROKER")
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(
                f"ADMITGATE_BROKER must name an executable file, got {explicit!r}"
            )
        return path
    on_path = shutil.which("admitgate-broker")
    if on_path:
        return Path(on_path)
    checkout = Path(__file__).resolve().parents[2]
    for profile in ("release", "debug"):
        candidate = checkout / "target" / profile / "admitgate-broker"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(_NOT_FOUND)


def main(argv: Sequence[str] | None = None, *, prog: str = "admitgate-broker") -> int:
    """Runs the broker with ``argv`` (its flags, as ``admitgate-broker --help`` lists them)
    until it exits; returns its exit code (0 after a drain, 2 for a bad flag). ``prog`` is the
    name its usage and errors give the command (``python -m admitgate broker`` from there)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        binary = find_binary()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    # The broker names itself after its argv[0] in usage and errors.
    child = subprocess.Popen([prog, *args], executable=str(binary))

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    previous = {
        sig: signal.signal(sig, forward)
        for sig in (signal.SIGTERM, signal.SIGINT)
        # Signal handlers can only be set from the main thread; elsewhere the caller's own
        # handling applies.
        if threading.current_thread() is threading.main_thread()
    }
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.kill()
            child.wait()


def serve(
    *,
    upstream: str,
    listen: str = "127.0.0.1:8080",
    max_in_flight: int = 0,
    **settings: object,
) -> int:
    """Runs the broker in front of ``upstream`` until SIGTERM/SIGINT and its drain; blocks
    (waiting on the child releases the GIL) and returns the exit code.

    Every other broker flag is a keyword with ``_`` for ``-`` (``queue_depth=4``,
    ``grpc_upstream="http://127.0.0.1:9001"``, ``tenant_from="header:x-tenant"``,
    ``metrics_listen="127.0.0.1:9464"``); ``None`` leaves a setting to the YAML file or the
    default. Raises ``TypeError`` for a value that is not a str, int or float.
    """
    argv = ["--upstream", upstream, "--listen", listen, "--max-in-flight", str(max_in_flight)]
    for name, value in settings.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, str | int | float | os.PathLike):
            raise TypeError(f"{name} must be a str, int or float, got {value!r}")
        text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
        argv += ["--" + name.replace("_", "-"), text]
    return main(argv)
