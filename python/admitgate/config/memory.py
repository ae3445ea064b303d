"""The memory this machine offers a gateway: total RAM and the tightest cgroup limit.

Reads ``/proc/meminfo`` and the cgroup v1 and v2 limit files of this process's cgroup and
its ancestors; :func:`read_memory_limits` never raises (missing files mean unknown).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as a page-rounded 2**63-1.
_CGROUP_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimits:
    """The memory this machine offers: total RAM and the tightest cgroup limit (MiB).

    ``None`` means unknown (RAM) or no limit (cgroup). ``cgroup_file`` is the file the
    limit was read from.
    """

    ram_mb: float | None
    cgroup_limit_mb: float | None
    cgroup_file: str | None = None

    @property
    def limit_mb(self) -> float | None:
        """The tighter of RAM and the cgroup limit, or ``None`` when neither is known."""
        known = [v for v in (self.ram_mb, self.cgroup_limit_mb) if v is not None]
        return min(known) if known else None

    def describe(self) -> str:
        """``RAM 24106 MiB, cgroup limit 2048 MiB (/sys/fs/cgroup/memory.max)``."""
        ram = f"RAM {self.ram_mb:.0f} MiB" if self.ram_mb is not None else "RAM unknown"
        if self.cgroup_limit_mb is None:
            return f"{ram}, no cgroup memory limit"
        return f"{ram}, cgroup limit {self.cgroup_limit_mb:.0f} MiB ({self.cgroup_file})"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def _cgroup_bytes(path: Path) -> int | None:
    """A cgroup memory limit file's value in bytes; ``None`` for no limit or unreadable."""
    text = _read_text(path)
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():
        return None  # "max" (v2: no limit) or garbage
    value = int(text)
    return None if value >= _CGROUP_V1_UNLIMITED else value


def _ram_mb(base: Path, root: str | os.PathLike[str]) -> float | None:
    """``MemTotal`` of ``/proc/meminfo``; on this machine, the page count as a fallback."""
    ram_mb = None
    for row in (_read_text(base / "proc/meminfo") or "").splitlines():
        parts = row.split()
        if len(parts) >= 2 and parts[0] == "MemTotal:" and parts[1].isdigit():
            ram_mb = int(parts[1]) / 1024
    if ram_mb is None and os.fspath(root) == "/" and hasattr(os, "sysconf"):
        try:
            ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError):
            ram_mb = None
    return ram_mb


def _cgroup_limit_files(base: Path) -> list[Path]:
    """The limit files that may apply to this process: the two well-known ones, then its
    own cgroup's and each ancestor's (from ``/proc/self/cgroup``), without repeats."""
    cgroup_root = base / "sys/fs/cgroup"
    v2_mount = cgroup_root if (cgroup_root / "cgroup.controllers").exists() else None
    if v2_mount is None and (cgroup_root / "unified/cgroup.controllers").exists():
        v2_mount = cgroup_root / "unified"
    candidates = [cgroup_root / "memory.max", cgroup_root / "memory/memory.limit_in_bytes"]
    for row in (_read_text(base / "proc/self/cgroup") or "").splitlines():
        parts = row.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        if controllers == "" and v2_mount is not None:
            mount, name = v2_mount, "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        relative = Path(group.strip().lstrip("/"))
        for directory in [relative, *relative.parents]:
            candidates.append(mount / directory / name)
    return list(dict.fromkeys(candidates))


def read_memory_limits(root: str | os.PathLike[str] = "/") -> MemoryLimits:
    """Total RAM (``/proc/meminfo``) and the tightest cgroup memory limit of this process.

    Reads ``memory.max`` (cgroup v2) and ``memory.limit_in_bytes`` (cgroup v1) of the
    process's own cgroup (from ``/proc/self/cgroup``) and of each ancestor, including
    ``/sys/fs/cgroup/memory.max`` and ``/sys/fs/cgroup/memory/memory.limit_in_bytes``.
    ``root`` prefixes every path. Missing files mean unknown or no limit; never raises.
    """
    base = Path(root)
    ram_mb = _ram_mb(base, root)
    limit: tuple[int, str] | None = None
    for candidate in _cgroup_limit_files(base):
        value = _cgroup_bytes(candidate)
        if value is not None and (limit is None or value < limit[0]):
            limit = (value, str(candidate))
    if limit is None:
        return MemoryLimits(ram_mb, None, None)
    return MemoryLimits(ram_mb, limit[0] / 2**20, limit[1])
