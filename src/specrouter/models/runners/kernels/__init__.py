"""The native CPU kernels, compiled on first use and cached: the runner's row-invariant ops
(rowinv.cpp: `rope_attention`, `rms_norm`, `silu_mul`, `decoder_layers` (the stack in one OpenMP
region; `set_stack_schedule` and `stack_profile` steer and time it); linear256.cpp:
`linear`, the AVX2 linear; linear512.cpp: `linear512`, the AVX-512 and AVX-512-BF16 linears;
linearamx.cpp: `linear_amx`, the bfloat16 linear on AMX tiles) and the sampling noise
(noise.cpp: `coupled_argmax`, decoding/noise.py's lazy Gumbel-max in one call) and the router's
similarity signal (tv.cpp: `tv_rows`, decoding/tv.py's D_TV in one call), the sampler's
top-k / top-p / min-p cut (cut.h, shared by noise.cpp's `top_k_top_p_mask` / `choose_tokens` and
tv.cpp) and the penalties (penalty.cpp: `penalize`, decoding/processors.py's in one call) and a
token tree's host work (tree.cpp: `topk_rows`, torch.topk bit for bit, ties included, and `move_kv`,
the accepted branch's KV move in one call; noise.cpp's `token_uniforms`: the tree drafter's
noise hashes); bf16.h holds
the bfloat16 widening and rounding both linears and the other ops share.

`rowinv()` returns `torch.ops.specrouter_rowinv` (all of those ops) or None where
they cannot run: a CPU without AVX2/FMA, no C++ compiler, a torch without the extension
tooling, or `SPECROUTER_KERNELS=torch` in the environment (the portable torch kernels then
serve, see runners/linear.py). `kernel_path()` is the path of PATHS the linears take: the
fastest this CPU has the flags of, or the one SPECROUTER_KERNELS forces. The first call compiles rowinv.cpp and noise.cpp with torch's C++ extension
builder (about 25 s on 2 cores, once per machine and torch version: the build is cached under
~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import signal
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(f) for f in ("rowinv.cpp", "linear256.cpp", "linear512.cpp", "linearamx.cpp",
                                                 "noise.cpp", "tv.cpp", "penalty.cpp", "tree.cpp")]
HEADERS = [Path(__file__).with_name(f) for f in ("bf16.h", "finish16.h", "cut.h")]  # included by rowinv.cpp and the linears (cut.h: noise.cpp and tv.cpp)
ENV = "SPECROUTER_KERNELS"  # a path of PATHS: force it ("torch": never build or use the native kernels)
# the kernel paths, fastest first, and the CPU flags (Linux's names) each needs; the native
# ops other than the linear (attention, norms, silu) are AVX2 + FMA on every native path
PATHS = ("amx", "avx512bf16", "avx512", "avx2", "torch")
PATH_FLAGS = {
    "amx": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"),
    "avx512bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma"),
    "torch": (),
}
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # OpenMP: torch's own runtime (libgomp) serves


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); elsewhere what torch's
    dispatcher reports, mapped onto those names."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()
    flags = {"avx2", "fma"} if cap in ("AVX2", "AVX512", "AVX512_BF16", "AMX") else set()
    return frozenset(flags | ({"avx512f", "avx512bw", "avx512vl"} if cap.startswith(("AVX512", "AMX")) else set()))


NATIVE_FLAGS = PATH_FLAGS["avx2"]  # what every native path needs


def missing_flags(path: str) -> list[str]:
    """The flags `path` needs that this CPU lacks."""
    return [f for f in PATH_FLAGS[path] if f not in cpu_flags()]


def why_not(path: str) -> str | None:
    """Why kernel path `path` cannot run here ("the CPU lacks avx512_bf16"; for amx also the
    OS's refusal of the tile state, `amx_permission`), or None."""
    missing = missing_flags(path)
    if missing:
        return f"the CPU lacks {', '.join(missing)} (kernel path {path})"
    if path == "amx" and amx_permission():
        return f"{amx_permission()} (kernel path amx)"
    return None


SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1022, 0x1023, 18


@functools.cache
def amx_permission() -> str | None:
    """Linux hands a process AMX's tile data state (8 KiB of registers a thread) only on request,
    once per process: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); until then every tile
    instruction is SIGILL. Requested here; None where granted (the grant read back with
    ARCH_GET_XCOMP_PERM as well as the request's return value: an old kernel, or a VM without
    the state, refuses), else why not. linearamx.cpp checks the same before any tile
    instruction."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "AMX tile state needs Linux on x86-64 (arch_prctl ARCH_REQ_XCOMP_PERM)"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                        ctypes.c_long(XFEATURE_XTILEDATA)) != 0:
            return f"the OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(ctypes.get_errno())})"
        perm = ctypes.c_uint64(0)
        if (libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_PERM), ctypes.byref(perm)) != 0
                or not perm.value >> XFEATURE_XTILEDATA & 1):
            return "the OS did not grant the AMX tile state (ARCH_GET_XCOMP_PERM lacks XTILEDATA)"
    except (OSError, AttributeError) as e:
        return f"AMX tile state: arch_prctl unavailable ({e})"
    return None


@functools.cache
def kernel_path() -> str:
    """The kernel path of this process: SPECROUTER_KERNELS if set (an unknown or unsupported
    path is an error, never a silent substitute), else the fastest path of PATHS this CPU has
    the flags of (and, for amx, the OS's tile state). (Whether the native kernels then build is
    `rowinv()`'s business.)"""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced:
        if forced not in PATHS:
            raise ValueError(f"{ENV}={forced!r}: not a kernel path (choose one of {', '.join(PATHS)})")
        if why_not(forced):
            raise RuntimeError(f"{ENV}={forced}: {why_not(forced)}")
        return forced
    return next(p for p in PATHS if not why_not(p))


def why_not_native() -> str | None:
    """Why the native kernels are not expected to run here (the CPU lacks a flag, or
    SPECROUTER_KERNELS=torch), or None: then they are claimed, and `rowinv()` returning None
    (a failed build) is a defect the tests report, not a skip."""
    if os.environ.get(ENV, "").strip().lower() == "torch":
        return f"{ENV}=torch"
    return why_not("avx2")


def _cpu_supported() -> bool:
    return why_not_native() is None


def _ninja_on_path() -> None:
    """torch's builder runs `ninja`; the `ninja` package ships one beside the interpreter."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def auto_dtype() -> torch.dtype:
    """The precision of dtype "auto": the fastest one that is exact here. bfloat16 on the native
    kernels (half the bytes of float32; on the 135M target a 1-token step costs ~0.7x
    float32's), float32 on torch's (whose bfloat16 GEMM is slower than float32 on AVX2 CPUs)."""
    return torch.bfloat16 if rowinv() is not None else torch.float32


class _InterruptNoted:
    """Notes a Ctrl-C (SIGINT) that arrives while the kernels load: on the main thread the SIGINT
    handler in place is wrapped for the duration (and still runs); elsewhere the signal goes to the
    main thread, which raises it there.

    Why: the first load imports torch's extension builder (setuptools and the rest), runs ninja
    and loads the library, and CPython can turn a KeyboardInterrupt into another error on its way
    up: a failing `from m import name` (which libraries catch as ImportError) formats its message
    with PyObject_Repr, which runs a pending signal's handler; the handler's KeyboardInterrupt
    leaves the message NULL, and PyErr_SetImportError(NULL) raises TypeError("expected a message
    argument") in its place, which no `except ImportError` stops. `rowinv`'s `except Exception`
    took it for a broken toolchain and the command ran on to exit 0 (tests/test_cli.py's Ctrl-C
    during start-up, seen once while the kernels rebuilt; the conversion reproduced with a loop of
    failing from-imports under repeated SIGINTs: 10 of 351 interrupts, Python 3.11.7)."""

    def __init__(self):
        self.seen = False
        self._prev = self._mine = None

    def __enter__(self) -> _InterruptNoted:
        prev = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread() and callable(prev):
            def note(signum, frame):
                self.seen = True
                return prev(signum, frame)

            self._prev, self._mine = prev, note
            signal.signal(signal.SIGINT, note)
        return self

    def __exit__(self, *exc) -> None:
        if self._mine is not None and signal.getsignal(signal.SIGINT) is self._mine:
            signal.signal(signal.SIGINT, self._prev)


@functools.cache
def rowinv():
    """torch.ops.specrouter_rowinv, built on first use; None where it cannot run here. A Ctrl-C
    during the build stays an interrupt, whatever error it became on its way up
    (`_InterruptNoted`)."""
    if kernel_path() == "torch" or not _cpu_supported():
        return None
    interrupt = _InterruptNoted()
    try:
        with interrupt:
            return _build_and_load()
    except Exception as e:  # noqa: BLE001 (no compiler, no ninja, a broken toolchain: torch kernels serve)
        if interrupt.seen:
            raise KeyboardInterrupt from e
        log.warning("row-invariant CPU kernels unavailable (%s); using torch's kernels", str(e).splitlines()[0][:200])
        return None


def _build_and_load():
    """Build the kernels (once per source, flags and checkout) and load them: torch.ops.specrouter_rowinv."""
    from torch.utils.cpp_extension import _get_build_directory, load

    # one build folder per source, flags and checkout: torch's builder re-runs ninja in
    # every new process, and ninja rebuilds when the source paths change, so two checkouts
    # sharing a folder would rebuild over each other (and wait on each other's lock)
    digest = hashlib.sha1(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(FLAGS).encode()
                          + str(SOURCES[0].resolve().parent).encode()).hexdigest()[:12]
    name = f"specrouter_rowinv_{digest}"
    build = Path(_get_build_directory(name, verbose=False))
    if not any(build.glob("*.so")):
        log.warning("compiling SpecRouter's row-invariant CPU kernels (first use only, about 30 s)")
    _ninja_on_path()
    load(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.specrouter_rowinv
