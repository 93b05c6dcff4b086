"""smoe's counters on vLLM's ``/metrics`` (Prometheus), served steps only.

Workers keep their counters on the device and read them back once per log interval (never per
step); each then publishes a snapshot, a small JSON file per worker and source, into the
server's metrics directory (written atomically: a reader sees the old snapshot or the new one).
The API server process registers :class:`SmoeCollector` on prometheus_client's default
registry, which vLLM's ``/metrics`` serves; it reads the snapshots at scrape time. Nothing here
runs on a step's path.

Sources: ``order`` (speculate's token order: per MoE layer, the rows each rank served) and
``a2a`` (smoe's sparse all2all: the rows that crossed, whatever orders the tokens). With vLLM's
multiprocess Prometheus mode (several API servers) the default registry is not the one served,
so the smoe families are missing there.
"""

from __future__ import annotations

import json
import os
import tempfile

# the device counters of each source, in the order the workers keep them
ORDER_FIELDS = ("local", "activations", "tokens", "hits")  # per MoE layer
A2A_FIELDS = ("tokens", "pairs", "bytes", "local", "activations")


def publish(directory: str, source: str, rank: int, counters: dict) -> None:
    """Replace ``{directory}/{source}-rank{rank}.json`` with ``counters`` (atomic rename)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{source}-rank{rank}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"source": source, "rank": rank, **counters}, f)
    os.replace(tmp, os.path.join(directory, f"{source}-rank{rank}.json"))


def read_snapshots(directory: str) -> list[dict]:
    """Every worker's latest snapshot (unreadable or half-gone files are skipped: the next
    scrape sees them)."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            try:
                with open(os.path.join(directory, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return out


def families(snapshots: list[dict]):
    """The Prometheus metric families of a set of snapshots (see the README's metric list)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    order = [s for s in snapshots if s.get("source") == "order"]
    a2a = [s for s in snapshots if s.get("source") == "a2a"]
    if order:
        names = {"local": ("smoe:local_expert_activations", "expert activations served by a copy on the token's rank"),
                 "activations": ("smoe:expert_activations", "expert activations of served tokens"),
                 "tokens": ("smoe:tokens", "served tokens per rank (rows of each MoE layer)"),
                 "hits": ("smoe:predictor_hits", "served tokens whose rank holds at least one of their experts")}
        counters = {k: CounterMetricFamily(n, h, labels=["rank", "layer"]) for k, (n, h) in names.items()}
        L = max(len(s["layers"]) for s in order)
        sums = [[0] * len(ORDER_FIELDS) for _ in range(L)]
        for s in order:
            for layer, row in enumerate(s["layers"]):
                for i, k in enumerate(ORDER_FIELDS):
                    counters[k].add_metric([str(s["rank"]), str(layer)], row[i])
                    sums[layer][i] += row[i]
        yield from counters.values()
        ratio = GaugeMetricFamily("smoe:local_activation_ratio", "share of served expert activations on the "
                                  "token's own rank, over all ranks (layer 'all': every MoE layer)", labels=["layer"])
        hit = GaugeMetricFamily("smoe:predictor_hit_rate", "share of served tokens whose rank holds at least one "
                                "of their experts, over all ranks", labels=["layer"])
        for layer, row in enumerate(sums):
            if row[1]:
                ratio.add_metric([str(layer)], row[0] / row[1])
            if row[2]:
                hit.add_metric([str(layer)], row[3] / row[2])
        total = [sum(r[i] for r in sums) for i in range(len(ORDER_FIELDS))]
        if total[1]:
            ratio.add_metric(["all"], total[0] / total[1])
        if total[2]:
            hit.add_metric(["all"], total[3] / total[2])
        yield ratio
        yield hit
    if a2a:
        names = {"tokens": ("smoe:a2a_tokens", "served tokens through the sparse all2all (rows x MoE layers)"),
                 "pairs": ("smoe:a2a_remote_pairs", "(token, remote rank) rows the sparse all2all sent"),
                 "bytes": ("smoe:a2a_bytes", "bytes a point-to-point transport carries for those rows, both ways"),
                 "local": ("smoe:a2a_local_expert_activations", "expert activations on the token's rank"),
                 "activations": ("smoe:a2a_expert_activations", "expert activations")}
        counters = {k: CounterMetricFamily(n, h, labels=["rank"]) for k, (n, h) in names.items()}
        for s in a2a:
            for k in A2A_FIELDS:
                counters[k].add_metric([str(s["rank"])], s[k])
        yield from counters.values()
        tok = sum(s["tokens"] for s in a2a)
        per = GaugeMetricFamily("smoe:a2a_bytes_per_token", "sparse all2all bytes per served token and MoE layer, "
                                "over all ranks")
        if tok:
            per.add_metric([], sum(s["bytes"] for s in a2a) / tok)
        yield per


class SmoeCollector:
    """A prometheus_client collector over one metrics directory."""

    def __init__(self, directory: str):
        self.directory = directory

    def collect(self):
        yield from families(read_snapshots(self.directory))

    def describe(self):
        return []  # unknown until workers publish: registered without a name check


_registered: set[str] = set()


def register_collector(directory: str) -> None:
    """Serve ``directory``'s snapshots on prometheus_client's default registry (idempotent)."""
    if directory in _registered:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(SmoeCollector(directory))
    _registered.add(directory)
