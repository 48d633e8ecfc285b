"""CPU time the hypervisor takes from a virtual machine (``steal`` in Linux's ``/proc/stat``) during a measurement.

On a VM of a shared host, the host at times runs the vCPUs only part of the wall-clock time, and every step then
takes longer, most of all in configurations that block and wake often (small collectives). The calibration reports
the stolen share (its timings are then less reliable), and the benchmarks record it beside their timings, so that a
slow measurement can be told apart from a slow configuration. Not a library's job: psutil has
``cpu_times().steal`` but is not a dependency; the counter is one line of ``/proc/stat``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuTimes:
    steal: int
    total: int


def cpu_times(path: str = "/proc/stat") -> CpuTimes:
    """The machine's cumulative CPU times in jiffies (all CPUs): stolen, and all states together (zeros where
    there is no such file: not Linux)."""
    try:
        with open(path) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return CpuTimes(0, 0)
    return CpuTimes(fields[7] if len(fields) > 7 else 0, sum(fields[:8]))


def stolen_share(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the machine's CPU capacity the host took between two readings (0 where unknown)."""
    total = after.total - before.total
    return round((after.steal - before.steal) / total, 4) if total > 0 else 0.0
