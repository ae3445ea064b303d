"""The admitgate broker from Python: :func:`serve` and ``python -m admitgate broker``.

The broker (``crates/broker``) is a sidecar proxy that gates A2A traffic in front of an agent
written in any language (see the docs page "Broker"). Both entry points here run it inside
this process, on its own Rust runtime, with the GIL released: other Python threads keep
running while it serves. The standalone ``admitgate-broker`` binary (``cargo build --release
-p admitgate-broker``) is the same broker for images without Python; it takes the same flags.

Signals: the broker drains (stops accepting, refuses queued requests with ``closing``, lets
running ones finish for up to ``drain_timeout``) when

* SIGTERM arrives and its handler is the default one: :func:`serve` handles it for its
  duration and returns ``None`` after the drain (Python's default would kill the process
  without a drain);
* a signal handler raises: SIGINT's default raises ``KeyboardInterrupt``, which is raised
  after the drain; so is an exception from a handler the caller installed.

A second exception during the drain cuts it short. The previous handlers are put back when
:func:`serve` ends. :func:`serve` must be called from the main thread (Python runs signal
handlers there only), one broker at a time.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._admitgate import _broker_main
from ._admitgate import serve_broker as serve

__all__ = ["main", "serve"]


def main(argv: Sequence[str] | None = None, *, prog: str = "admitgate-broker") -> int:
    """Runs the broker with ``argv`` (its flags, as ``--help`` lists them) until SIGTERM or
    SIGINT and the drain; returns the exit code: 0 after the drain, 0 for ``--help``, 2 for a
    bad flag (with the binary's message on stderr) or an address that cannot be bound (one
    line). ``prog`` is the name usage and errors
    give the command."""
    args = list(sys.argv[1:] if argv is None else argv)
    # The broker's own usage and errors go straight to the process's stdout and stderr.
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return _broker_main([prog, *args])
    except KeyboardInterrupt:
        # SIGINT drained the broker, as it does the binary, which exits 0.
        return 0
    except (OSError, ValueError) as exc:
        # A port that cannot be bound (in use, not this host's) or a setting only the start
        # can check (the fleet's URL or CA file): one line naming it, as for a bad flag.
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        for setting in ("listen", "metrics_listen"):  # named as the flag that was typed
            if why.startswith(f"{setting} "):
                why = f"--{setting.replace('_', '-')}{why[len(setting) :]}"
        print(f"{prog}: error: {why}", file=sys.stderr)
        return 2
