"""Check a gateway config: the admission settings praisonai-bot would apply, and what is risky.

    import admitgate.config

    settings = admitgate.config.load("gateway.yaml", max_concurrent_runs=16)
    for warning in settings.warnings:
        print(warning.code, warning.message)
    gate = settings.build_gate()   # admitgate.build_admission_gate(**settings.gate_kwargs())

The command line is ``python -m admitgate check-config gateway.yaml`` (see :func:`main`).

One module per concept:

- :mod:`.loader`: :func:`load`, which resolves the settings as praisonai-bot 0.1.16's
  ``BotOS.from_config`` does (its module docstring describes how) and validates them as
  admitgate's gate does;
- :mod:`.document`: the YAML file as written (values, lines, duplicate keys);
- :mod:`.settings`: the result, :class:`GateSettings`, with :class:`Setting`,
  :class:`ConfigWarning`, :class:`ConfigProblem` and :class:`ConfigError`, and its report;
- :mod:`.warnings`: the rules that find risky or surprising settings;
- :mod:`.memory`: this machine's RAM and cgroup memory limit (:func:`read_memory_limits`);
- :mod:`.cli`: ``check-config`` (flags, printing, exit codes).

Importing this package imports only the standard library and admitgate; PyYAML (the
``admitgate[config]`` extra) is imported by the first :func:`load`.
"""

from __future__ import annotations

# The exit codes, main, SETTING_NAMES and Source are public too, but stay out of __all__
# (the redundant aliases re-export them) as they were before the package was split.
from .cli import EXIT_INVALID as EXIT_INVALID
from .cli import EXIT_OK as EXIT_OK
from .cli import EXIT_UNREADABLE as EXIT_UNREADABLE
from .cli import EXIT_WARNINGS as EXIT_WARNINGS
from .cli import main as main
from .loader import load, preset_ceiling
from .memory import MemoryLimits, read_memory_limits
from .settings import SETTING_NAMES as SETTING_NAMES
from .settings import (
    ConfigError,
    ConfigProblem,
    ConfigWarning,
    GateSettings,
    Setting,
)
from .settings import Source as Source

__all__ = [
    "ConfigError",
    "ConfigProblem",
    "ConfigWarning",
    "GateSettings",
    "MemoryLimits",
    "Setting",
    "load",
    "preset_ceiling",
    "read_memory_limits",
]
