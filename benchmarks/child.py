"""Workloads that need a fresh interpreter: run a function there and read back its JSON.

The child imports this package from the same checkout as the parent, and admitgate from
wherever the parent found it. With ``block_praisonai`` an import blocker on
``sys.meta_path`` is installed before anything else, so praisonaiagents (and with it the
``HUMAN_WAIT_SCOPE`` binding) cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import admitgate

_BLOCKER = """
import sys
class _NoPraisonAI:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('praisonaiagents', 'praisonai_bot', 'praisonai'):
            raise ModuleNotFoundError('blocked by the admitgate benchmark: ' + name, name=name)
        return None
sys.meta_path.insert(0, _NoPraisonAI())
"""

_BOOT = (
    "import sys, json\n"
    "from benchmarks.child import child_main\n"
    "print(json.dumps(child_main(sys.argv[1:])), flush=True)\n"
    # Skip the teardown of thousands of parked tasks: only the answer matters.
    "import os; os._exit(0)\n"
)


def _parent_dir(module_file: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(module_file)))


def run_child(args: list[str], *, block_praisonai: bool) -> Any:
    """Runs ``child_main(args)`` in a fresh interpreter and returns its JSON answer."""
    boot = (_BLOCKER if block_praisonai else "") + _BOOT
    env = dict(os.environ)
    # The checkout holding this package, and the directory admitgate came from.
    paths = [_parent_dir(__file__), _parent_dir(admitgate.__file__)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*paths, env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run(
        [sys.executable, "-c", boot, *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {args} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(args: list[str]) -> Any:
    """The child's side: dispatches on ``args[0]`` to the workload that asked for a child."""
    kind = args[0]
    if kind == "uncontended":
        from .uncontended import nobinding_child

        return nobinding_child(int(args[1]), int(args[2]))
    if kind == "memory":
        from .memory import memory_child

        return memory_child(args[1], int(args[2]), args[3])
    raise ValueError(f"unknown benchmark child kind {kind!r}")
