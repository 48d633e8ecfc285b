"""CPU time the hypervisor takes from this virtual machine (``steal`` in ``/proc/stat``) during a measurement.

This machine is a VM on a shared host: at times the host runs its vCPUs only part of the wall-clock time, and every
step then takes longer, most of all in configurations that block and wake often (small collectives). Measured on
loopback, 2026-12-02: hybrid tp=2 fits of the demo model whose steps took 340-380 ms had 30-35% of the machine's
CPU time stolen, those at 220-250 ms 5-9% (benchmarks/RESULTS.md). The benchmarks record the stolen share beside
their timings so that a slow measurement can be told apart from a slow configuration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuTimes:
    steal: int
    total: int


def cpu_times() -> CpuTimes:
    """The machine's cumulative CPU times in jiffies (all CPUs): stolen, and all states together."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return CpuTimes(0, 0)
    return CpuTimes(fields[7] if len(fields) > 7 else 0, sum(fields[:8]))


def stolen_share(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the machine's CPU capacity the host took between two readings (0 where unknown)."""
    total = after.total - before.total
    return round((after.steal - before.steal) / total, 4) if total > 0 else 0.0
