"""What the commands of ``python -m admitgate`` share: a parser whose usage errors are one
line, and argument types that name their range."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (``PROG: error: argument --flag: why``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def integer(least: int, most: int) -> Callable[[str], int]:
    """An argument type: an integer in ``[least, most]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(
                f"must be an integer from {least} to {most}, got {text!r}"
            )
        return value

    return parse
