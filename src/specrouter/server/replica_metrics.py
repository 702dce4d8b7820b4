"""The Prometheus metrics of several replicas as ONE exposition (scale-out on Ray Serve).

Each replica keeps its own `ServerMetrics` registry. `snapshot` turns it into plain tuples
(picklable, sent between Ray processes) with the replica's identity added as labels
(`replica`, `node`); `render` merges the snapshots of every replica family by family, so a
scrape of any replica shows all of them: `sum without (replica, node) (rate(...))` gives the
cluster, the label gives one replica.

Needs only prometheus-client; no Ray here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

# (name, documentation, type, unit, [(sample name, labels, value), ...])
Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]


def snapshot(registry: CollectorRegistry, labels: Mapping[str, str]) -> list[Family]:
    """Every family of `registry` with `labels` added to each sample."""
    out = []
    for fam in registry.collect():
        samples = [(s.name, {**s.labels, **labels}, float(s.value)) for s in fam.samples]
        out.append((fam.name, fam.documentation, fam.type, fam.unit, samples))
    return out


class _Families:
    """A prometheus_client collector that yields fixed families."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        yield from self.families


def render(snapshots: Iterable[list[Family]], extra: Iterable[Family] = ()) -> bytes:
    """One text exposition of several snapshots (families merged by name, HELP/TYPE once)."""
    merged: dict[str, Metric] = {}
    for fams in [*snapshots, list(extra)]:
        for name, doc, typ, unit, samples in fams:
            m = merged.get(name)
            if m is None:
                m = merged[name] = Metric(name, doc, typ, unit)
            for sample_name, labels, value in samples:
                m.add_sample(sample_name, labels, value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
