"""Command line: ``python -m admitgate demo`` (the main job) and ``python -m admitgate bench``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "demo"
    if command == "demo":
        from ._demo import main as demo

        demo(argv)
        return 0
    if command == "bench":
        from ._bench import main as bench

        return bench(argv) or 0
    print(
        f"usage: python -m admitgate [demo|bench] [options]  (unknown command {command!r})",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
