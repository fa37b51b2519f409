"""How many CPUs this process may really use: its affinity mask and its cgroup's quota.

``os.cpu_count()`` counts the machine's CPUs. In a container or under ``taskset`` a
process may use fewer: the scheduler's affinity mask says which CPUs it may run on, and
a cgroup CPU quota (``docker run --cpus=2``, a Kubernetes limit) how much CPU time it
gets per period. Starting more workers than that only adds processes that take turns.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["available_cpus"]

_CGROUP = Path("/sys/fs/cgroup")


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _quota_v2(root: Path) -> float | None:
    """The tightest ``cpu.max`` quota from this process's cgroup up to the root (v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    rel = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    if rel is None:
        return None
    best: float | None = None
    here = root / rel.lstrip("/")
    while True:
        try:
            quota, period = (here / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            quota = period = ""
        if quota and quota != "max":
            cpus = int(quota) / int(period)
            best = cpus if best is None else min(best, cpus)
        if here == root or root not in here.parents:
            return best
        here = here.parent


def _quota_v1(root: Path) -> float | None:
    for name in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / name / "cpu.cfs_quota_us").read_text())
            period = int((root / name / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            return quota / period
    return None


def available_cpus(root: Path = _CGROUP) -> tuple[int, str]:
    """The CPUs this process may use (at least 1), and how that was worked out."""
    affinity = _affinity()
    quota = _quota_v2(root)
    if quota is None:
        quota = _quota_v1(root)
    if quota is None:
        return max(1, affinity), f"{affinity} CPUs in this process's affinity mask, no cgroup CPU quota"
    n = max(1, min(affinity, math.ceil(quota - 1e-9)))
    return n, f"{affinity} CPUs in the affinity mask, a cgroup CPU quota of {quota:g} CPUs"
