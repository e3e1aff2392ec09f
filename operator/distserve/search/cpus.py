"""How many CPUs this process may really use: the size of the search's process pool.

`os.cpu_count()` is the host's core count; in a container limited to 4 CPUs on a
96-core node, a pool of 96 processes would be throttled by the CFS quota and hold 96
copies of the sampled workload. The usable count is the smallest of:
- the CPUs this process may be scheduled on (`os.sched_getaffinity`: cpusets, taskset);
- the cgroup's CPU quota, rounded up: cgroup v2 `cpu.max` ("max 100000" or
  "400000 100000"), else cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`
  (-1: no limit).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs this process may run on (the host's count where affinity is not supported)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    """A file's stripped text, or None when it is not there or not readable."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup_dirs(root: Path, proc_cgroup: str | None) -> list[Path]:
    """The folders that may hold this process's CPU controller files, most specific first.

    Inside a container the cgroup namespace makes the own cgroup the root; outside, the
    path comes from /proc/self/cgroup ("0::/kubepods/pod.../x" for v2,
    "4:cpu,cpuacct:/docker/x" for v1).
    """
    dirs: list[Path] = []
    for line in (proc_cgroup or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        relative = path.lstrip("/")
        if controllers == "":
            dirs.append(root / relative)
        elif "cpu" in controllers.split(","):
            for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                dirs.append(root / mount / relative)
    dirs += [root, root / "cpu,cpuacct", root / "cpu"]
    return [d for d in dirs if d.is_dir()]


def quota_cpus(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The cgroup's CPU limit in CPUs (e.g. 2.5), or None when unlimited or unknown."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup"))
    for folder in _own_cgroup_dirs(root, proc_cgroup):
        v2 = _read(folder / "cpu.max")
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            if quota == "max":
                return None
            return _ratio(quota, period or "100000")
        v1 = _read(folder / "cpu.cfs_quota_us")
        if v1 is not None:
            if v1.startswith("-"):
                return None
            return _ratio(v1, _read(folder / "cpu.cfs_period_us") or "100000")
    return None


def _ratio(quota: str, period: str) -> float | None:
    """quota / period, or None when either is not a positive number."""
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int:
    """CPUs the search may keep busy: affinity, capped by the cgroup quota (at least 1)."""
    count = affinity_cpus()
    quota = quota_cpus(root, proc_cgroup)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)
