"""Command line: ``python -m admitgate demo`` (the main job), ``python -m admitgate bench`` and
``python -m admitgate check-config gateway.yaml``."""

from __future__ import annotations

import importlib
import sys
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


def _bench(argv: list[str]) -> int:
    """Runs the benchmark harness of a source checkout; exit code 2 where there is none."""
    harness = _harness()
    if harness is None:
        print(_NO_HARNESS, file=sys.stderr)
        return 2
    return int(harness.main(argv, prog="python -m admitgate bench"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "demo"
    if command == "demo":
        from ._demo import main as demo

        demo(argv)
        return 0
    if command == "bench":
        return _bench(argv)
    if command == "check-config":
        from .config import main as check_config

        return check_config(argv)
    print(
        "usage: python -m admitgate [demo|bench|check-config] [options]"
        f"  (unknown command {command!r})",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
