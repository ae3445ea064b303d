"""Command line: ``python -m admitgate COMMAND [options]``; ``--help`` lists the commands and
``python -m admitgate COMMAND --help`` describes one. Each command parses its own options."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NO_HARNESS = (
    "python -m admitgate bench runs the benchmark harness in the benchmarks/ folder of a source "
    "checkout; it is not part of the installed package. Run it from the root of an admitgate "
    "checkout (or run `python -m benchmarks` there)."
)


def _harness() -> Any | None:
    """The checkout's ``benchmarks`` package, or None where there is none to import."""
    # `python -m` puts the working directory on sys.path; a development install
    # (`maturin develop`) also finds the checkout it was built from.
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "benchmarks" / "__main__.py").is_file() and str(checkout) not in sys.path:
        sys.path.append(str(checkout))
    try:
        module = importlib.import_module("benchmarks")
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks":
            raise
        return None
    if getattr(module, "HARNESS_FOR", None) != "admitgate":
        where = getattr(module, "__file__", None) or module
        print(f"found a different `benchmarks` package ({where}).", file=sys.stderr)
        return None
    return module


def _demo(argv: list[str]) -> int:
    from ._demo import main as demo

    demo(argv)
    return 0


def _bench(argv: list[str]) -> int:
    """Runs the benchmark harness of a source checkout; exit code 2 where there is none."""
    harness = _harness()
    if harness is None:
        if "-h" in argv or "--help" in argv:  # help is an answer, not a failure
            print(f"usage: python -m admitgate bench [options]\n\n{_NO_HARNESS}")
            return 0
        print(_NO_HARNESS, file=sys.stderr)
        return 2
    return int(harness.main(argv, prog="python -m admitgate bench"))


def _simulate(argv: list[str]) -> int:
    from ._simulate import main as simulate

    return simulate(argv)


def _check_config(argv: list[str]) -> int:
    from .config import main as check_config

    return check_config(argv)


def _broker(argv: list[str]) -> int:
    from .broker import main as broker

    return broker(argv, prog="python -m admitgate broker")


#: Each command: what it does (one line, for the list) and the function that runs it.
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "demo": ("a simulated multi-tenant burst through a production-shaped gate", _demo),
    "check-config": (
        "show the admission settings praisonai-bot would apply from a gateway YAML, and warnings",
        _check_config,
    ),
    "simulate": (
        "your gate settings against a described LLM provider, beside the adaptive gate",
        _simulate,
    ),
    "bench": ("run the benchmark harness (from a source checkout)", _bench),
    "broker": (
        "gate A2A traffic in front of an agent as a sidecar proxy (admitgate-broker)",
        _broker,
    ),
}


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    listing = "\n".join(f"  {name:<14}{summary}" for name, (summary, _) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="python -m admitgate",
        usage="python -m admitgate [-h] [--version] COMMAND [options]",
        description="admitgate: the admission gate for AI-agent gateways.",
        epilog=f"commands:\n{listing}\n\n"
        "`python -m admitgate COMMAND --help` describes a command and its options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"admitgate {__version__}")
    parser.add_argument("command", metavar="COMMAND", choices=COMMANDS, help=argparse.SUPPRESS)
    parser.add_argument("options", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (0 for ``--help``, 2 for a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv:  # nothing asked for: say what there is rather than run something
        parser.print_help()
        return 0
    try:
        if argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
            parser.error(f"unrecognized option {argv[0]!r}: options go after the COMMAND")
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a usage error (argparse printed it)
        return int(exit_.code or 0)
    _, run = COMMANDS[args.command]
    try:
        return run(args.options)
    except SystemExit as exit_:  # the command's own parser: its --help or a usage error
        if isinstance(exit_.code, int):
            return exit_.code
        if exit_.code:  # SystemExit("message"): Python prints it and exits 1; so do we
            print(exit_.code, file=sys.stderr)
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main())
