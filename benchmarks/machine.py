"""The machine a run measured: printed in the header and kept in the JSON document."""

from __future__ import annotations

import os
import platform
from typing import Any

import admitgate


def machine() -> dict[str, Any]:
    """Python, admitgate version, CPU count and model, platform."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover - not Linux
        pass
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "admitgate": getattr(admitgate, "__version__", "?"),
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
    }
