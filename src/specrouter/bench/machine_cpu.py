"""What else ran on the machine while a bench side was measured (`specrouter bench --serve
--fresh-rounds`, issue 34).

On this project's 2-core VM a decode step's speed is shared: another process that takes a core
for seconds (a job outside the CPU lock) turns a 2-thread OpenMP team's 50 ms steps into 300-900
ms ones (docs/serving-performance.md, twelfth round: the process ran 1.05 of its 2 cores while the
machine stayed busy), and the host can take the vCPUs themselves (steal). A side measured beside
either is not comparable with one measured without. `MachineCpu` reads, over a span, the machine's
busy, idle and host-stolen CPU seconds (/proc/stat, all cores) and the CPU seconds of the bench's
own processes (the bench, its server(s), its library worker: /proc/<pid>/stat); `others` is the
rest of the busy time: CPU that other processes took.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class MachineCpu:
    """CPU seconds, all cores: the machine's busy, idle (+ iowait) and host-stolen time, and the part
    of `busy` that the bench's own processes ran. Subtract two readings for a span."""

    busy: float = 0.0
    idle: float = 0.0
    steal: float = 0.0
    ours: float = 0.0
    span: float = 0.0  # wall seconds between the readings (a reading: its clock time)

    @property
    def others(self) -> float:
        """Busy CPU seconds of processes other than the bench's own."""
        return max(0.0, self.busy - self.ours)

    @property
    def others_cores(self) -> float:
        """Cores other processes took on average over the span."""
        return self.others / self.span if self.span > 0 else 0.0

    def __sub__(self, other: "MachineCpu") -> "MachineCpu":
        return MachineCpu(self.busy - other.busy, self.idle - other.idle, self.steal - other.steal,
                          self.ours - other.ours, self.span - other.span)

    def __add__(self, other: "MachineCpu") -> "MachineCpu":
        return MachineCpu(self.busy + other.busy, self.idle + other.idle, self.steal + other.steal,
                          self.ours + other.ours, self.span + other.span)


def read(pids: Iterable[int], stat: str = "/proc/stat", proc: str = "/proc") -> MachineCpu | None:
    """The machine's CPU seconds so far and those of processes `pids` (every thread; one that has
    exited counts 0); None where /proc/stat cannot be read (not Linux)."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with open(stat) as f:
            f_ = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    ours = 0
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ours += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    busy = f_[0] + f_[1] + f_[2] + f_[5] + f_[6]
    return MachineCpu(busy / hz, (f_[3] + f_[4]) / hz, (f_[7] if len(f_) > 7 else 0) / hz, ours / hz,
                      time.monotonic())


def over(fn: Callable[[], T], pids: Callable[[], Iterable[int]]) -> tuple[T, MachineCpu | None]:
    """`fn()` and the machine's CPU over it (`read` before and after, of the processes `pids()`)."""
    m0 = read(pids())
    out = fn()
    m1 = read(pids())
    return out, (m1 - m0 if m0 is not None and m1 is not None else None)
