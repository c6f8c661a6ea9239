"""The CPUs a process may use: its affinity capped by a container's CPU quota, and Linux
CPU lists (``"0-3,8"``) as ``taskset -c`` reads them."""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["cpu_set", "usable_cpus"]


def usable_cpus() -> int:
    """How many CPUs this process can keep busy: its CPU affinity, capped by a cgroup CPU
    quota (a container's ``resources.limits.cpu``: cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), rounded up, at least 1."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(count, math.ceil(quota))) if quota else count


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())  # v1: -1 without a quota
        period = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cpu_set(cpus: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list such as ``"0-3,8,10-11"`` (as ``taskset -c`` reads it)."""
    result: set[int] = set()
    for part in cpus.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"not a CPU list: {cpus!r} (e.g. \"0-3,8\")")
        result.update(range(int(first), int(last if dash else first) + 1))
    return frozenset(result)
