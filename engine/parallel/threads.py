"""Threads per rank: the cores this process may use, shared out among the ranks that use them.

A rank is a process with its own torch intra-op thread pool. C ranks with T threads each on
fewer than C·T cores take turns on the cores, and a collective then waits for the rank that is
off-CPU: every rank runs at the pace of the slowest. So the default is cores ÷ ranks (at least
one), and more than that is reported as oversubscribed.

"Cores this process may use": its CPU affinity (``os.sched_getaffinity``: taskset, cpusets,
Kubernetes' static CPU manager), capped by a cgroup v2 CPU quota (``cpu.max``: docker
``--cpus``, Kubernetes CPU limits), rounded down, at least 1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may run on: its affinity, capped by the cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.floor(int(quota) / int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return max(1, cores)


@dataclass(frozen=True)
class ThreadPlan:
    """``ranks`` rank processes on ``cores`` usable cores, ``threads`` torch threads each;
    ``given``: the thread count was set by the user (else picked)."""

    ranks: int
    threads: int
    cores: int
    given: bool

    @property
    def oversubscribed(self) -> bool:
        return self.ranks * self.threads > self.cores

    def describe(self) -> str:
        how = "set" if self.given else "picked: cores ÷ ranks"
        line = (f"{self.ranks} rank(s) × {self.threads} thread(s) per rank on {self.cores} usable core(s) "
                f"({how})")
        if self.oversubscribed:
            line += (f"; warning: oversubscribed — {self.ranks * self.threads} threads on {self.cores} core(s), "
                     f"ranks will take turns on the cores and wait for each other in collectives")
        return line


def plan_threads(ranks: int, threads: int | None = None, cores: int | None = None) -> ThreadPlan:
    """Threads per rank for ``ranks`` ranks sharing this machine's usable cores; ``threads``
    (``--threads-per-rank``) overrides the pick."""
    if ranks < 1:
        raise ValueError(f"ranks: must be >= 1, got {ranks}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads_per_rank: must be >= 1, got {threads}")
    cores = usable_cores() if cores is None else cores
    if threads is not None:
        return ThreadPlan(ranks, threads, cores, True)
    return ThreadPlan(ranks, max(1, cores // ranks), cores, False)
