"""``python -m benchmarks``: admitgate's benchmark command, from a source checkout."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
