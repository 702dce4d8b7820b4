"""Where a figure came from: every benchmark result (bench.json, serve.json) records the code
(git commit, and whether the tree had uncommitted changes), the machine (CPU model, its SIMD
flags, cores), the software (torch, threads, the runner's kernels) and the load average, so a
number in a README or an issue can be traced to the run that produced it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# the flags that decide which kernels run (and how fast): the rest of /proc/cpuinfo's list is noise
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


def git_revision(root: str | Path | None = None) -> dict[str, object]:
    """{"commit": sha or None, "dirty": bool or None} of the checkout holding this package; where
    it is not a git checkout, the commit a `git archive` copy of it was made from, else None."""
    package = root is None
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": archived_commit() if package else None, "dirty": None}
    return {"commit": sha, "dirty": bool(status.strip())}


def archived_commit(stamp: Path = Path(__file__).resolve().parent / "commit.txt") -> str | None:
    """The commit a `git archive` copy was made from: git writes it into commit.txt (marked
    `export-subst` in .gitattributes); in a checkout the file holds the unexpanded placeholder."""
    try:
        text = stamp.read_text().strip()
    except OSError:
        return None
    return text if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else None


def cpu_description() -> dict[str, object]:
    """{"cpu": model name, "simd": the SIMD flags of SIMD_FLAGS it has, "cores": logical CPUs}."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in (platform.processor(), platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {"cpu": model, "simd": [f for f in SIMD_FLAGS if f in flags], "cores": os.cpu_count()}


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def provenance() -> dict[str, object]:
    """Everything a figure needs to be traceable, in one dict (JSON-ready)."""
    import torch

    from specrouter.models.runners.linear import kernels

    return {**git_revision(), **cpu_description(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "kernels": kernels(), "python": platform.python_version(),
            "load_average": load_average()}


def describe(p: dict) -> str:
    """One line for a report: commit, CPU and SIMD, threads, torch, load."""
    commit = (p.get("commit") or "unknown")[:10] + (" (dirty tree)" if p.get("dirty") else "")
    simd = "/".join(p.get("simd") or []) or "no SIMD flags read"
    load = p.get("load_average")
    return (f"commit {commit}; {p.get('cpu')} ({simd}), {p.get('cores')} cores, {p.get('threads')} torch threads, "
            f"torch {p.get('torch')}, kernels {p.get('kernels')}; load average "
            f"{'n/a' if load is None else f'{load:.2f}'}")
