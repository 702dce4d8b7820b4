"""The native linears' weights on huge pages.

A 1-token step of the native runner streams every packed weight once (the 135M target: 540 MB
in float32, 270 MB in bfloat16). torch allocates them on 4 KiB pages, and on this kind of
machine a stream over 4 KiB pages runs well below the memory's bandwidth: a TLB miss every 4
KiB, and the hardware prefetchers stop at every page boundary. `huge_page_copies` lays the
weights out, in the order a forward reads them, in one private anonymous mapping advised
MADV_HUGEPAGE (transparent huge pages, 2 MiB): on a 2-core Zen 4 the float32 1-token step of
the 135M target went from 14.7 to 9.8 ms (docs/kernels.md). The bytes, the kernels and so every
result bit are those of the 4 KiB copies; only the addresses change.

Where the kernel has no transparent huge pages for the mapping (THP "never", not Linux) the
copies still serve, on whatever pages the kernel gives; HUGE_PAGES = False keeps torch's own
allocations (side-by-side benchmarks).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGES = True  # False: the weights stay where torch allocated them (4 KiB pages)
HUGE = 2 << 20  # bytes of a transparent huge page (x86-64 PMD)
_PAGE = 4096


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU tensors `tensors` (any dtypes and shapes, contiguous), in order, each
    on its own 4 KiB boundary, in one 2 MiB-aligned private anonymous mapping advised
    MADV_HUGEPAGE; the mapping lives as long as any copy. `tensors` themselves where
    HUGE_PAGES is False, the platform has no madvise, or a tensor is not a plain CPU one."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if not HUGE_PAGES or advise is None or not tensors or any(
        t.device.type != "cpu" or t.is_mkldnn or t.layout != torch.strided for t in tensors
    ):
        return tensors
    sizes = [-(-t.numel() * t.element_size() // _PAGE) * _PAGE for t in tensors]
    area = mmap.mmap(-1, sum(sizes) + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(advise)
    except OSError:  # THP not built in: the copies still serve, on 4 KiB pages
        pass
    raw = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` alive
    off = -raw.data_ptr() % HUGE  # the first copy starts on a huge page boundary
    out = []
    for t, size in zip(tensors, sizes):
        n = t.numel() * t.element_size()
        copy = raw[off : off + n].view(t.dtype).view(t.shape)
        copy.copy_(t)  # the first touch: the kernel backs the range with huge pages here
        out.append(copy)
        off += size
    return out


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding `t`'s data that huge pages back (/proc/self/smaps's
    AnonHugePages of that mapping); 0 where that is unknown (not Linux)."""
    addr = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
