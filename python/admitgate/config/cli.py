"""The ``python -m admitgate check-config`` command: flags, the printed report, exit codes.

Every setting has a flag that overrides the file (``--queue-depth 64``); ``--json`` prints
:meth:`GateSettings.to_dict` (or the problems of an invalid file), ``--strict`` fails on
warnings and ``--ignore CODE`` leaves a warning out. See :func:`main` and ``EXIT_*``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from .loader import load
from .settings import SETTING_NAMES, ConfigError, ConfigProblem, ConfigWarning, show_value

#: Exit codes of ``python -m admitgate check-config``.
EXIT_OK = 0
EXIT_WARNINGS = 1  # only with --strict
EXIT_INVALID = 2  # invalid config or invalid flag value (argparse usage errors exit 2 too)
EXIT_UNREADABLE = 3  # the file cannot be read, or PyYAML is missing

# The value name each flag shows in --help; the counts take "N".
_METAVARS = {
    "overflow_policy": "P",
    "max_rss_mb": "MIB",
    "reliability": "PROFILE",
    "drain_timeout": "SECONDS",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m admitgate check-config",
        description=(
            "Print the admission settings praisonai-bot 0.1.16 applies from a gateway YAML "
            "file (value and source), what they mean, and warnings for risky combinations. "
            "Flags override the file. Exit codes: 0 valid, 1 warnings with --strict, "
            "2 invalid config, 3 file unreadable."
        ),
    )
    parser.add_argument("path", help="the gateway YAML file (gateway.yaml, praisonai.yaml)")
    for name in SETTING_NAMES:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=_METAVARS.get(name, "N"),
            help=f"override {name}",
        )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="CODE",
        help="leave out warnings with this code (repeatable), e.g. unbounded-queue",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m admitgate check-config``: returns the exit code (see ``EXIT_*``)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    overrides = {name: getattr(args, name) for name in SETTING_NAMES}

    def fail(
        code: int,
        kind: str,
        message: str,
        problems: Sequence[ConfigProblem] = (),
        warnings: Sequence[ConfigWarning] = (),
    ) -> int:
        warnings = [w for w in warnings if w.code not in set(args.ignore or ())]
        if args.json:
            report: dict[str, Any] = {
                "path": args.path,
                "valid": False,
                "error": kind,
                "message": message,
            }
            report["problems"] = [
                {
                    "key": p.key,
                    "value": show_value(p.value),
                    "source": p.source,
                    "line": p.line,
                    "reason": p.reason,
                }
                for p in problems
            ]
            report["warnings"] = [
                {"code": w.code, "message": w.message, "keys": list(w.keys)} for w in warnings
            ]
            print(json.dumps(report, indent=2))
        else:
            print(f"check-config: {message}", file=sys.stderr)
            for w in warnings:  # a misspelt key may be why a value is missing or wrong
                print(f"check-config: warning [{w.code}] {w.message}", file=sys.stderr)
        return code

    try:
        settings = load(args.path, **overrides)
    except ConfigError as exc:
        return fail(EXIT_INVALID, "invalid", str(exc), exc.problems, exc.warnings)
    except OSError as exc:
        return fail(
            EXIT_UNREADABLE, "unreadable", f"cannot read {args.path}: {exc.strerror or exc}"
        )
    except ImportError as exc:
        return fail(EXIT_UNREADABLE, "missing-dependency", str(exc))

    if args.ignore:
        kept = tuple(w for w in settings.warnings if w.code not in set(args.ignore))
        settings = dataclasses.replace(settings, warnings=kept)
    strict_failure = args.strict and bool(settings.warnings)
    if args.json:
        print(json.dumps(settings.to_dict(), indent=2))
    else:
        print(settings.format_text())
        count = len(settings.warnings)
        verdict = "valid" if not count else f"valid, {count} warning{'s' if count > 1 else ''}"
        print(f"\n{verdict}" + (" (--strict: failing)" if strict_failure else ""))
    return EXIT_WARNINGS if strict_failure else EXIT_OK
