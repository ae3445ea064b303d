"""admitgate's benchmark harness: ``python -m benchmarks [--quick] [--json] [--only NAME,...]``.

Runs from a source checkout (the repository root on ``sys.path``); it is not part of the
installed package. ``python -m admitgate bench`` runs the same command when this package is
importable.

Every workload runs, in one process and interleaved (A B C, B C A, C A B, ...), on:

* ``admitgate``: this package;
* ``reference``: PraisonAI BotOS's pure-Python gate (``praisonai_bot.bots._admission``),
  when it is installed;
* ``semaphore``: a bare :class:`asyncio.Semaphore` where the workload makes sense for one;
* ``floor``: the same work with nothing in the way (an empty async context manager, a task
  that does nothing, a task rejected at once).

Each variant is measured over several repetitions; the tables show medians and the ratios
of medians. Absolute times are noise on a shared machine; the ratios of one run are the
result. The garbage collector is paused inside timed regions (and collected between them) so
that a collection triggered by one variant's garbage is not charged to another.

Workloads (``--only`` takes these names, comma separated), one module each:

``uncontended`` and ``uncontended-nobinding`` (:mod:`benchmarks.uncontended`)
    ``async with gate.admit(session_id=...)`` with a free slot and an empty body, with
    praisonaiagents importable (its ``HUMAN_WAIT_SCOPE`` context variable is bound on every
    admission, as inside BotOS), and the same in a child process where praisonaiagents
    cannot be imported (an import blocker on ``sys.meta_path`` installed before admitgate is
    imported), reported back as JSON.
``contended`` (:mod:`benchmarks.contended`)
    2,000 tasks x 20 turns, body ``await asyncio.sleep(0)``, ceiling 32, ``overflow="queue"``.
``overload`` (:mod:`benchmarks.overload`)
    Sustained overload under ``shed_oldest`` with a full queue of 1k / 10k / 100k waiters:
    every arrival evicts the oldest waiter.
``memory`` (:mod:`benchmarks.memory`)
    Bytes per queued waiter beyond a bare suspended task, in a fresh child process.
``memory-aware`` (:mod:`benchmarks.memory_aware`)
    Uncontended turns with memory-aware admission on against the same gate without it.
``threads`` (:mod:`benchmarks.threads`)
    4 threads, each with its own event loop, sharing one gate, against one thread alone.
``asgi-parsers`` (:mod:`benchmarks.asgi_parsers`)
    The HTTP front door's JSON-RPC head scan (issue 15's adversarial 64 KiB head and a
    typical one) and its path classification, against the implementations before issue 15.

Shared pieces: :mod:`benchmarks.harness` (timing, interleaving, medians, :class:`Result` with
its targets and checks, printing), :mod:`benchmarks.subjects` (the gates and the floor),
:mod:`benchmarks.child` (fresh interpreters), :mod:`benchmarks.machine`, and
:mod:`benchmarks.runner` (sizes, the workload registry and the exit code: 1 when a workload
raised or a check failed; a missed performance target is not an error).
"""

from __future__ import annotations

#: Tells ``python -m admitgate bench`` that this ``benchmarks`` package is admitgate's.
HARNESS_FOR = "admitgate"


def main(argv: list[str] | None = None, *, prog: str = "python -m benchmarks") -> int:
    """Runs the benchmark command (see :func:`benchmarks.runner.main`); returns the exit code."""
    from .runner import main as run

    return run(argv, prog=prog)
