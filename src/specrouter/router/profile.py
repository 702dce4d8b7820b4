"""The cost profile: T_M(b, t, L), the seconds of one forward of model M over t new tokens per row
for b rows at context length L (docs/design.md, Pillar 1). Model-free drafters have one too: the
seconds of proposing t = k tokens for b rows at context L.

Representation (our choice; the paper gives none). Per model, a small table over a grid of
batch rows x new tokens x context length, times one speed factor:

    T_M(b, t, L) = speed_M * shape_M(b, t, L)

- `shape` is the start-up sweep's medians on the grid, read by multilinear interpolation in
  (b, t, L); above the grid it extrapolates linearly from the last two points (a forward grows
  about linearly with the rows, the tokens and the attended context), below it it stays at the
  first point (never cheaper than the cheapest measurement, never negative).
- `speed` is a fast multiplicative correction of the whole table, learned online: every
  observed forward moves log(speed) by `ema_alpha` (0.3) of its log ratio to the prediction,
  and a step detector jumps straight to the new level when `jump_after` (2) observations in a
  row are off by more than `jump_ratio` (1.5x) in the same direction. A model that slows down 3x
  (load, thermal, a co-tenant) shows fully after 2 observations, and the slowdown reaches every
  (b, t, L), also those not observed (plain decoding's 1-token target step while the target only
  verifies, say). An outlier's EMA step is clipped at `jump_ratio` and it does not refine the
  grid, so a single stall moves the prediction by 1.5^0.3 ~ 13% at most.
- A model the router stops running keeps its last speed: a draft whose forwards ran in a stall
  (a co-tenant: one 86 ms cycle read the draft at 13.7x its sweep) is priced out of every plan
  and so never read again. Each model also keeps its usual speed (`usual`: a slow EMA,
  `usual_alpha` 0.05, of its observations' log levels, each clipped to `jump_ratio` around
  it, so a stall moves it by 2% at most and a lasting slowdown enters it over some tens of
  observations), what the prober (router/probing.py) expects of a model read slow and not run
  since: it re-tries such a model within its budget, and one probe's forwards set the speed
  anew (the step detector jumps on 2).
- The residual left after the speed update refines the grid cells around the observation
  slowly (`shape_alpha`, 0.05, in log space, weighted by the interpolation weights), so a sweep
  whose shape is off (e.g. t=1 steps relatively slower in the engine than in the sweep) is
  corrected without the fast factor oscillating between cells.

Persistence: one JSON file (`default_profile_path()`, `$SPECROUTER_CACHE/profiles.json`, else
`$XDG_CACHE_HOME/specrouter/...`, else `~/.cache/specrouter/...`) holds the shapes of every
machine it met, keyed by a machine fingerprint (CPU model, torch threads, torch version, linear
kernels) and, per
machine, by model identity (name, parameter count, dtype). The speed factor is not saved: a
transient slowdown should not outlive the process.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specrouter.config import ProfileConfig  # the profile's settings (also importable from here)

PROFILE_FORMAT = 1  # bump when the JSON layout changes (older files are then ignored)
DEFAULT_BATCH_SIZES = (1, 4, 8)  # rows per forward swept at start-up (engine steps batch every row)
DEFAULT_NEW_TOKENS = (1, 2, 4, 8, 16)  # new tokens per row swept (drafting: 1; verifying: n + 1)
# ... and wider, on a machine where they are cheap: a runner's column t = 32 is swept when its
# forward of 32 tokens (1 row, the shortest context) measured at most WIDER_BOUND x its 1-token
# forward (a token tree's verification of up to 31 nodes, engine/tree_policy.py; where T(n) is
# steep such trees never pay, and the column is left out: one probe cell of time)
DEFAULT_WIDER_TOKENS = (32,)
WIDER_BOUND = 3.0
DEFAULT_CONTEXT_LENGTHS = (128, 1024)  # cached positions swept

Shape = tuple[int, int, int]  # (rows b, new tokens t, context length L) of one forward


# ---------------------------------------------------------------------------------------------
# identities


@dataclass(frozen=True)
class ModelIdentity:
    """What makes two profiles of a model interchangeable on one machine."""

    name: str  # pool name
    num_params: int = 0  # parameter count (0: model-free or unknown)
    dtype: str = ""  # compute dtype ("model-free" for n-gram drafters)
    device: str = "cpu"  # models/device.device_label: "cpu" or "cuda:<GPU name>"; a CPU profile is never a GPU's

    def key(self) -> str:
        base = f"{self.name}|{self.num_params}|{self.dtype}"
        return base if self.device == "cpu" else f"{base}|{self.device}"


def identity_of(model) -> ModelIdentity:
    """The identity of a ModelRunner or a model-free drafter."""
    dtype = getattr(model, "dtype", None)
    if getattr(model, "is_model_free", False) or dtype is None:
        return ModelIdentity(str(model.name), 0, "model-free")
    from specrouter.models.device import device_label

    return ModelIdentity(str(model.name), int(getattr(model, "num_params", 0)), str(dtype).replace("torch.", ""),
                         device_label(getattr(model, "device", "cpu")))


def kernel_sources() -> str:
    """A short digest of the native kernels' sources (models/runners/kernels/*.cpp and the
    Python that drives them): a kernel made faster under the same name (`kernels()`) changes
    it, so a profile swept before is not reused. (It was: the AVX-512 kernels' later speed-ups
    kept their name, and the profile swept before them priced a 5-token verification 45%
    above its time, which kept the router at k = 1.)"""
    import hashlib

    from specrouter.models import runners

    root = Path(runners.__file__).parent
    digest = hashlib.sha256()
    for f in sorted([*root.glob("kernels/*.cpp"), *root.glob("kernels/*.py"), root / "linear.py",
                     root / "attention.py", root / "llama.py"]):
        if f.is_file():
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def machine_fingerprint() -> dict[str, object]:
    """CPU model, torch intra-op threads, torch version, the runner's linear kernels and a digest
    of their sources: timings from another fingerprint are not reused."""
    import torch

    from specrouter.models.runners.linear import kernels

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "kernels": kernels(),
            "kernel_sources": kernel_sources()}


def fingerprint_key(fingerprint: Mapping[str, object]) -> str:
    return json.dumps(dict(fingerprint), sort_keys=True)


def default_profile_path() -> Path:
    """`$SPECROUTER_CACHE/profiles.json`, else `$XDG_CACHE_HOME/specrouter/profiles.json`, else
    `~/.cache/specrouter/profiles.json` (the same root as the converted-model cache)."""
    root = os.environ.get("SPECROUTER_CACHE")
    if root:
        return Path(root).expanduser() / "profiles.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specrouter" / "profiles.json"


# ---------------------------------------------------------------------------------------------
# interpolation (pure)


def _axis(grid: Sequence[float], x: float) -> tuple[int, int, float]:
    """Segment (i0, i1) of a sorted grid and the weight of i1; linear extrapolation above the
    grid (weight > 1), constant below it (weight 0). `grid`: a list of floats (bisect on it
    is ~10x cheaper than numpy's searchsorted on a small array; the router predicts and
    observes after every engine step)."""
    n = len(grid)
    if n == 1:
        return 0, 0, 0.0
    i = bisect.bisect_right(grid, x) - 1
    i = min(max(i, 0), n - 2)
    w = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, i + 1, max(float(w), 0.0)


def _corners(model: "_ModelTable", b: float, t: float, L: float):
    """The (up to 8) grid cells around (b, t, L) with their multilinear weights."""
    bs, ts, ls = model.grids
    (b0, b1, wb), (t0, t1, wt), (l0, l1, wl) = _axis(bs, b), _axis(ts, t), _axis(ls, L)
    for ib, fb in ((b0, 1 - wb), (b1, wb)):
        for it, ft in ((t0, 1 - wt), (t1, wt)):
            for il, fl in ((l0, 1 - wl), (l1, wl)):
                if fb * ft * fl != 0.0:
                    yield (ib, it, il), fb * ft * fl


@dataclass
class _ModelTable:
    identity: ModelIdentity
    batch_sizes: np.ndarray  # (nb,) ascending
    new_tokens: np.ndarray  # (nt,) ascending
    context_lengths: np.ndarray  # (nl,) ascending
    seconds: np.ndarray  # (nb, nt, nl) shape of T_M on the grid (speed factor excluded)
    speed: float = 1.0  # fast multiplicative correction (online)
    usual: float = 1.0  # usual speed (slow EMA in log of clipped levels): what a probe expects of it
    streak: list[float] = field(default_factory=list)  # log speed levels of a step in progress
    streak_up: bool | None = None  # its direction
    observations: int = 0

    def __post_init__(self):
        # the three axes as lists of floats, for _axis
        self.grids = tuple(a.tolist() for a in (self.batch_sizes, self.new_tokens, self.context_lengths))
        self._corner_memo: dict[tuple[float, float, float], list] = {}  # corners: they depend on the grid only

    def corners(self, b: float, t: float, L: float) -> list:
        """`_corners` of a point, memoized (the router predicts the same points every step: the
        evidence snapshot's one-token steps, the batch planner's bucketed contexts)."""
        key = (b, t, L)
        memo = self.__dict__.setdefault("_corner_memo", {})  # (a table unpickled from before it: none yet)
        hit = memo.get(key)
        if hit is None:
            if len(memo) >= 4096:
                memo.clear()
            hit = memo[key] = list(_corners(self, b, t, L))
        return hit

    def shape_at(self, b: float, t: float, L: float) -> float:
        return self.at_corners(self.corners(b, t, L))

    def at_corners(self, corners) -> float:
        """The shape at the point whose grid cells and weights are `corners` (`_corners`)."""
        return max(sum(w * self.seconds[c] for c, w in corners), 0.0)

    def shape_row(self, b: float, L: float, t_max: int) -> np.ndarray:
        """(t_max + 1,) shape at t = 0..t_max for fixed (b, L); entry 0 is 0."""
        (b0, b1, wb), (l0, l1, wl) = _axis(self.grids[0], b), _axis(self.grids[2], L)
        s = self.seconds
        by_t = ((1 - wb) * ((1 - wl) * s[b0, :, l0] + wl * s[b0, :, l1])
                + wb * ((1 - wl) * s[b1, :, l0] + wl * s[b1, :, l1]))  # (nt,)
        ts = np.arange(t_max + 1, dtype=np.float64)
        grid = self.new_tokens.astype(np.float64)
        if len(grid) == 1:
            out = np.full(t_max + 1, by_t[0])
        else:
            out = np.interp(ts, grid, by_t)  # constant outside the grid...
            above = ts > grid[-1]  # ...so extrapolate linearly above it
            slope = (by_t[-1] - by_t[-2]) / (grid[-1] - grid[-2])
            out[above] = by_t[-1] + slope * (ts[above] - grid[-1])
        out = np.maximum(out, 0.0)
        out[0] = 0.0
        return out


# ---------------------------------------------------------------------------------------------
# the profile


class CostProfile:
    """T_M(b, t, L) for every pool model: a swept grid times an online speed factor (module
    docstring). `version` increases with every change, for callers that cache predictions."""

    def __init__(self, config: ProfileConfig | None = None):
        self.config = config or ProfileConfig()
        self._models: dict[str, _ModelTable] = {}
        self.version = 0
        self.jumps: dict[str, int] = {}  # per model: times the step detector fired (a regime change)

    # -- content ----------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._models

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def identity(self, name: str) -> ModelIdentity:
        return self._models[name].identity

    def set_table(
        self,
        name: str,
        batch_sizes: Sequence[int],
        new_tokens: Sequence[int],
        context_lengths: Sequence[int],
        seconds,  # (nb, nt, nl) array-like of forward seconds on the grid
        identity: ModelIdentity | None = None,
    ) -> None:
        """Install (or replace) a model's grid; its speed factor restarts at 1."""
        axes = [np.asarray(a, dtype=np.float64) for a in (batch_sizes, new_tokens, context_lengths)]
        table = np.asarray(seconds, dtype=np.float64)
        for a, label in zip(axes, ("batch_sizes", "new_tokens", "context_lengths")):
            if a.ndim != 1 or len(a) == 0 or np.any(np.diff(a) <= 0) or a[0] < 0:
                raise ValueError(f"{label} must be a non-empty strictly increasing list of counts, got {a}")
        if table.shape != tuple(len(a) for a in axes):
            raise ValueError(f"seconds must have shape {tuple(len(a) for a in axes)}, got {table.shape}")
        if not (np.all(np.isfinite(table)) and np.all(table >= 0)):
            raise ValueError("forward seconds must be finite and >= 0")
        self._models[name] = _ModelTable(identity or ModelIdentity(name), *axes, table.copy())
        self.version += 1

    def set_function(
        self,
        name: str,
        fn: Callable[[int, int, int], float],  # (b, t, L) -> seconds
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        new_tokens: Sequence[int] = DEFAULT_NEW_TOKENS,
        context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
        identity: ModelIdentity | None = None,
    ) -> None:
        """Tabulate a known cost function on a grid (tests, simulations, hand-made profiles)."""
        table = [[[fn(b, t, L) for L in context_lengths] for t in new_tokens] for b in batch_sizes]
        self.set_table(name, batch_sizes, new_tokens, context_lengths, table, identity)

    def missing(self, identities: Sequence[ModelIdentity]) -> list[ModelIdentity]:
        """The identities without a profile here (those need a sweep)."""
        return [i for i in identities if i.name not in self._models or self._models[i.name].identity != i]

    # -- prediction -------------------------------------------------------------------------
    def predict(self, name: str, b: int, t: int, L: int) -> float:
        """Seconds of one forward of `name` over t new tokens per row, b rows, context L."""
        m = self._table(name)
        return m.speed * m.shape_at(b, t, L)

    def cost_row(self, name: str, b: int, L: int, t_max: int) -> np.ndarray:
        """(t_max + 1,) seconds at t = 0..t_max (entry 0 is 0): a cost_model CostSpec."""
        m = self._table(name)
        return m.speed * m.shape_row(b, L, t_max)

    def max_new_tokens(self, name: str) -> int:
        """The most new tokens per row swept for `name` (beyond it predictions extrapolate)."""
        return int(self._table(name).new_tokens[-1])

    def max_batch(self, name: str) -> int:
        """The largest batch size (rows) swept for `name`: beyond it predictions extrapolate."""
        return int(self._table(name).batch_sizes[-1])

    def speed(self, name: str) -> float:
        """The online factor over the swept shape (1: as swept; 3: three times slower)."""
        return self._table(name).speed

    def usual(self, name: str) -> float:
        """Its usual speed (module docstring): the speed its observations read over the longer run."""
        return self._table(name).usual

    def _table(self, name: str) -> _ModelTable:
        try:
            return self._models[name]
        except KeyError:
            raise KeyError(f"no cost profile for model {name!r}; profiled: {list(self._models)}") from None

    # -- online refresh ---------------------------------------------------------------------
    def observe(self, name: str, b: int, t: int, L: int, seconds: float, count: int = 1) -> None:
        """`count` forwards of shape (b, t, L) took `seconds` in total."""
        self.observe_many(name, [(b, t, L)] * count, seconds)

    def observe_many(self, name: str, shapes: Sequence[Shape], seconds: float) -> None:
        """Forwards of the given shapes took `seconds` in total (e.g. a drafter's k steps)."""
        m = self._models.get(name)
        if m is None or not shapes or not (math.isfinite(seconds) and seconds > 0):
            return
        # each distinct shape interpolated once, for the base and the residual's cells (they read
        # the same corners; the router observes every forward of every step)
        corners = {s: m.corners(*s) for s in dict.fromkeys(shapes)}
        base = sum(m.at_corners(corners[s]) for s in shapes)
        if base <= 0:
            return
        cfg = self.config
        level = math.log(seconds / base)  # log of the speed this observation alone implies
        log_ratio = level - math.log(m.speed)
        # 1. speed: a step detector (jump to the mean level of the streak), else a fast EMA
        outlier = abs(log_ratio) > math.log(cfg.jump_ratio)
        if outlier:
            if m.streak_up is not None and m.streak_up != (log_ratio > 0):
                m.streak = []
            m.streak.append(level)
            m.streak_up = log_ratio > 0
        else:
            m.streak, m.streak_up = [], None
        if len(m.streak) >= cfg.jump_after:
            m.speed = math.exp(sum(m.streak) / len(m.streak))
            m.streak, m.streak_up = [], None
            self.jumps[name] = self.jumps.get(name, 0) + 1
        else:  # an outlier's EMA step is clipped: one stall moves the speed little
            clip = math.log(cfg.jump_ratio)
            m.speed *= math.exp(cfg.ema_alpha * min(max(log_ratio, -clip), clip))
        if cfg.usual_alpha > 0:  # the usual speed: each level clipped to jump_ratio around it
            clip = math.log(cfg.jump_ratio)
            m.usual *= math.exp(cfg.usual_alpha * min(max(level - math.log(m.usual), -clip), clip))
        # 2. shape: the residual, slowly, into the cells around each observed shape (not an outlier's)
        residual = math.log(seconds / (m.speed * base))
        if cfg.shape_alpha > 0 and residual != 0.0 and not outlier:
            share = cfg.shape_alpha * residual / len(shapes)
            for s in shapes:
                for cell, w in corners[s]:  # extrapolation weights clipped to [0, 1]
                    m.seconds[cell] *= math.exp(share * min(max(w, 0.0), 1.0))
        m.observations += 1
        self.version += 1

    # -- persistence ------------------------------------------------------------------------
    def to_json(self) -> dict[str, dict]:
        """Per model identity key: the grid and its shape (speed factors are not saved)."""
        return {
            m.identity.key(): {
                "identity": asdict(m.identity),
                "batch_sizes": m.batch_sizes.astype(int).tolist(),
                "new_tokens": m.new_tokens.astype(int).tolist(),
                "context_lengths": m.context_lengths.astype(int).tolist(),
                "seconds": m.seconds.tolist(),
            }
            for m in self._models.values()
        }

    def save(self, path: str | Path | None = None, fingerprint: Mapping[str, object] | None = None) -> Path:
        """Merge this machine's entries into the JSON file (other machines' entries are kept;
        the write is atomic). Returns the path."""
        path = Path(path) if path is not None else default_profile_path()
        fp = dict(fingerprint) if fingerprint is not None else machine_fingerprint()
        doc = _read(path)
        machine = doc["machines"].setdefault(fingerprint_key(fp), {"fingerprint": fp, "models": {}})
        machine["models"].update(self.to_json())
        machine["updated"] = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        identities: Sequence[ModelIdentity] | None = None,
        fingerprint: Mapping[str, object] | None = None,
        config: ProfileConfig | None = None,
    ) -> "CostProfile":
        """This machine's profiles from the file (an empty profile when the file, the machine or
        the models are not there). With `identities`, only those models (matched exactly)."""
        path = Path(path) if path is not None else default_profile_path()
        fp = dict(fingerprint) if fingerprint is not None else machine_fingerprint()
        prof = cls(config)
        entries = _read(path)["machines"].get(fingerprint_key(fp), {}).get("models", {})
        wanted = None if identities is None else {i.key() for i in identities}
        for key, e in entries.items():
            if wanted is not None and key not in wanted:
                continue
            ident = ModelIdentity(**e["identity"])
            prof.set_table(ident.name, e["batch_sizes"], e["new_tokens"], e["context_lengths"], e["seconds"], ident)
        return prof


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") == PROFILE_FORMAT and isinstance(doc.get("machines"), dict):
            return doc
    except (OSError, ValueError, AttributeError):
        pass
    return {"format": PROFILE_FORMAT, "machines": {}}


# ---------------------------------------------------------------------------------------------
# the start-up sweep


def sweep(
    runners: Mapping[str, object],
    drafters: Mapping[str, object] | None = None,
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    new_tokens: Sequence[int] = DEFAULT_NEW_TOKENS,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    repeats: int = 3,
    warmup: int = 1,
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    profile: CostProfile | None = None,
    seed: int = 0,
    wider_tokens: Sequence[int] = DEFAULT_WIDER_TOKENS,
    wider_bound: float = WIDER_BOUND,
) -> CostProfile:
    """Time every runner (ModelRunner) and model-free drafter over the grid: `repeats` timed runs
    per cell after `warmup` untimed ones, the fastest kept. Returns `profile` (a new one if None)
    with the swept models set. Call it with no sequence live: it reserves caches and borrows
    `max(batch_sizes)` slots, prefilled once per context length with random tokens (a forward
    then starts at L, so the KV cache is rolled back for free between runs).

    A runner's grid also gets each column of `wider_tokens` (ascending, above `new_tokens`)
    whose probe, 1 row at the shortest context, measured at most `wider_bound` x the first
    column's (t = 1) forward; the first that does not stops the widening (`_widen`)."""
    prof = profile if profile is not None else CostProfile()
    drafters = drafters or {}
    bs, ts = sorted(set(batch_sizes)), sorted(set(new_tokens))
    cells = len(bs) * len(ts) * len(context_lengths)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cells * (len(runners) + len(drafters)), desc="profiling", unit="cell")
    rng = random.Random(seed)
    try:
        for name, runner in runners.items():
            if bar is not None:
                bar.set_postfix_str(name)
            # (a short-context model keeps the grid it had: the widening must not shrink its contexts)
            wide = sorted(t for t in set(wider_tokens) if ts[-1] < t <= runner.max_context // 4)
            Ls, ts_kept, table = _sweep_runner(runner, bs, ts, context_lengths, repeats, warmup, clock, rng, bar,
                                               wide, wider_bound)
            prof.set_table(name, bs, ts_kept, Ls, table, identity_of(runner))
        for name, drafter in drafters.items():
            if bar is not None:
                bar.set_postfix_str(name)
            Ls = sorted(set(context_lengths))
            table = np.zeros((len(bs), len(ts), len(Ls)))
            for il, L in enumerate(Ls):
                for ib, b in enumerate(bs):
                    ctx = [[rng.randrange(1000) for _ in range(L)] for _ in range(b)]
                    for it, t in enumerate(ts):
                        table[ib, it, il] = _min_time(lambda: drafter.propose(ctx, t), repeats, warmup, clock)
                        if bar is not None:
                            bar.update(1)
            prof.set_table(name, bs, ts, Ls, table, identity_of(drafter))
    finally:
        if bar is not None:
            bar.close()
    return prof


def _min_time(fn: Callable[[], object], repeats: int, warmup: int, clock) -> float:
    """The fastest of `repeats` timed runs: the cell's own cost, without the preemptions another
    process on the cores adds (the online speed factor tracks the machine's current state)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(repeats, 1)):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(min(times))


def machine_busy(threads: int | None = None) -> bool:
    """True when other processes load the cores (1-minute load average, less this process's
    `threads`, above half the cores): a sweep then is not worth saving."""
    import torch

    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    threads = torch.get_num_threads() if threads is None else threads
    return load - threads > 0.5 * (os.cpu_count() or 1)


def _sweep_runner(runner, bs, ts, context_lengths, repeats, warmup, clock, rng, bar, wide=(), bound=WIDER_BOUND):
    """One runner over the grid, widened by the columns of `wide` that pass `_widen`'s probe;
    returns (context lengths kept, new tokens kept, (nb, nt, nl) seconds)."""
    from specrouter.models.device import synchronize
    from specrouter.models.runners.base import ForwardBatch

    b_max, t_max = bs[-1], max([*ts, *wide])
    limit = runner.max_context - t_max - 1
    Ls = sorted({min(L, limit) for L in context_lengths if L >= 1})
    if not Ls or Ls[0] < 1:
        raise ValueError(f"model {runner.name!r}: context {runner.max_context} is too short to profile")
    runner.reserve(b_max, Ls[-1] + t_max + 1)
    vocab = int(runner.vocab_size)
    slots = [runner.allocate_slot() for _ in range(b_max)]
    kept = list(ts)
    table = np.zeros((len(bs), len(ts) + len(wide), len(Ls)))

    def cell(b: int, t: int, L: int) -> float:  # (b, t) at start L: logits at every new token
        toks = [[rng.randrange(vocab) for _ in range(t)] for _ in range(b)]
        # slots in reverse order: the gather path that the engine's ragged batches take
        batch = ForwardBatch.build(slots[:b][::-1], [L] * b, toks, [list(range(t))] * b)
        return _min_time(lambda: synchronize(runner.forward(batch).device), repeats, warmup, clock)

    try:
        cached = 0
        for il, L in enumerate(Ls):
            while cached < L:  # 1. prefill every slot up to L (chunks bound the memory)
                n = min(256, L - cached)
                feed = [[rng.randrange(vocab) for _ in range(n)] for _ in slots]
                runner.forward(ForwardBatch.build(slots, [cached] * b_max, feed, [[n - 1]] * b_max))
                cached += n
            if il == 0 and wide:  # 2. which wider columns this machine gets (probed at b = 1, L)
                kept += _widen(lambda t: cell(bs[0], t, L), table, ts, wide, bound, bar)
            for ib, b in enumerate(bs):  # 3. time (b, t) at start L
                for it, t in enumerate(kept):
                    if table[ib, it, il] == 0:  # (not a probe's cell)
                        table[ib, it, il] = cell(b, t, L)
                    if bar is not None:
                        bar.update(1)
            # the runner now holds L + t_max at most; the next prefill restarts from L
    finally:
        for s in slots:
            runner.free_slot(s)
    return Ls, kept, table[:, : len(kept)]


def _widen(time_at: Callable[[int], float], table: np.ndarray, ts, wide, bound: float, bar) -> list[int]:
    """The columns of `wide` kept: each probed (`time_at(t)`, 1 row, the shortest context, into
    `table[0, column, 0]`) while it measures at most `bound` x the first column's cell, itself
    timed first; the first one above stops. `bar` is told the cells the kept columns add."""
    if table[0, 0, 0] <= 0:
        table[0, 0, 0] = time_at(ts[0])  # the base cell, timed again by the grid unless kept here
    kept: list[int] = []
    for j, t in enumerate(wide):
        seconds = time_at(t)
        if seconds > bound * table[0, 0, 0]:
            break
        table[0, len(ts) + j, 0] = seconds
        kept.append(t)
    if bar is not None and kept:
        bar.total += len(kept) * table.shape[0] * table.shape[2]
    return kept
