"""The benchmark's PNG plots (matplotlib, Agg backend: no display needed).

- tokens_per_second.png: tokens/s of every system category per scenario;
- router_<scenario>.png (mixed-stream scenarios): the router's chain and k at every decision,
  against the request type (background) and the injected slowdown (red line), with each
  request's tokens/s for SpecRouter, target-only and the best static chain below.
"""

from __future__ import annotations

import re
from pathlib import Path

KIND_COLORS = {"code": "#cfe2f3", "prose": "#fce5cd", "chat": "#d9ead3", "extraction": "#ead1dc"}
BARS = [  # (label, how to read it from a scenario)
    ("target-only", lambda s: _tps(s, "target-only")),
    ("HF generate", lambda s: _tps(s, "HF generate")),
    ("HF assisted", lambda s: _tps(s, "HF assisted")),
    ("best static", lambda s: s["best_static"]["tokens_per_second"]),
    ("best 3-level", lambda s: s["best_three_level"]["tokens_per_second"] if s["best_three_level"] else None),
    ("oracle", lambda s: s["oracle"]["tokens_per_second"]),
    ("SpecRouter", lambda s: _tps(s, "SpecRouter")),
]


def _tps(s: dict, name: str) -> float | None:
    e = s["systems"].get(name)
    return e["tokens_per_second"] if e else None


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tokens_per_second(result: dict, path: Path) -> Path:
    plt = _pyplot()
    scenarios = result["scenarios"]
    n, width = len(BARS), 0.8 / len(BARS)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(scenarios) + 3), 4.5))
    for j, (label, get) in enumerate(BARS):
        xs, ys = [], []
        for i, s in enumerate(scenarios):
            v = get(s)
            if v is not None:
                xs.append(i - 0.4 + (j + 0.5) * width)
                ys.append(v)
        if ys:
            ax.bar(xs, ys, width, label=label, color=plt.cm.tab10(j),
                   edgecolor="black" if label == "SpecRouter" else None)
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels([s["name"] for s in scenarios], rotation=20, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title("Tokens/s per system (batch 1)")
    top = max((get(s) or 0.0) for _, get in BARS for s in scenarios)
    ax.set_ylim(0, 1.3 * top if top > 0 else 1.0)  # room for the legend
    ax.legend(fontsize=8, ncol=min(n, 4), loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_router(s: dict, path: Path) -> Path | None:
    """The router's choices over time in one scenario (None when it logged no decision)."""
    events = s["decisions"]
    if not events:
        return None
    plt = _pyplot()
    xs = list(range(len(events)))
    chains = sorted({e["chain"] for e in events}, key=lambda c: (c.count(">"), c))
    fig, (ax_c, ax_k, ax_t) = plt.subplots(3, 1, figsize=(11, 7), sharex=True,
                                          gridspec_kw={"height_ratios": [2, 1, 1.4]})
    # request spans: background by request type
    spans = {}
    for x, e in zip(xs, events):
        a, b = spans.get(e["request"], (x, x))
        spans[e["request"]] = (min(a, x), max(b, x))
    kinds = {r["index"]: r["kind"] for r in s["requests"]}
    for ax in (ax_c, ax_k, ax_t):
        for i, (a, b) in spans.items():
            ax.axvspan(a - 0.5, b + 0.5, color=KIND_COLORS.get(kinds.get(i), "#eeeeee"), lw=0)
    if s["slowdown"]:
        start = s["slowdown"]["start_request"]
        x0 = spans[start][0] - 0.5 if start in spans else None
        if x0 is not None:
            for ax in (ax_c, ax_k, ax_t):
                ax.axvline(x0, color="red", ls="--", lw=1.5)
            ax_c.text(x0, len(chains) - 0.5, " slowdown", color="red", va="top", fontsize=9)
    probe = [e["reason"] == "probe" for e in events]
    ys = [chains.index(e["chain"]) for e in events]
    ax_c.scatter([x for x, p in zip(xs, probe) if not p], [y for y, p in zip(ys, probe) if not p],
                 s=10, color="black", label="plan")
    ax_c.scatter([x for x, p in zip(xs, probe) if p], [y for y, p in zip(ys, probe) if p],
                 s=18, marker="x", color="tab:orange", label="probe")
    ax_c.set_yticks(range(len(chains)))
    ax_c.set_yticklabels(chains, fontsize=8)
    ax_c.set_ylim(-0.5, len(chains) - 0.5)
    ax_c.set_title(f"SpecRouter decisions: {s['name']}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    leg = ax_c.legend(loc="upper left", fontsize=7)
    ax_c.add_artist(leg)
    ax_c.legend(handles, list(KIND_COLORS), loc="upper right", fontsize=7, title="request type",
                title_fontsize=7)
    ax_k.step(xs, [e["k"] for e in events], where="mid", color="black", lw=1)
    ax_k.set_ylabel("k")
    # per-request tokens/s over each request's span
    best = s["best_static"]["system"]
    lines = [("SpecRouter", "SpecRouter", "black"), ("target-only", "target-only", "tab:blue")]
    if best != "target-only":
        lines.append((best, f"best static: {best}", "tab:green"))
    for name, label, color in lines:
        for r in s["requests"]:
            if r["index"] not in spans or not r["seconds"].get(name):
                continue
            a, b = spans[r["index"]]
            ax_t.hlines(r["tokens"][name] / r["seconds"][name], a - 0.5, b + 0.5, color=color, lw=2,
                        label=label)
            label = None  # one legend entry per system
    ax_t.set_ylabel("tokens/s")
    ax_t.set_xlabel("decision (one per cycle)")
    ax_t.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """Every PNG of a bench result into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_tokens_per_second(result, out / "tokens_per_second.png")]
    for s in result["scenarios"]:
        if s["workload"] == "mixed":
            p = plot_router(s, out / f"router_{slug(s['name'])}.png")
            if p is not None:
                paths.append(p)
    return paths
