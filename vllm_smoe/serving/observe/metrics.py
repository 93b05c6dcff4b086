"""smoe's counters on vLLM's ``/metrics`` (Prometheus), served steps only.

Workers keep their counters on the device and read them back once per log interval (never per
step); each then publishes a snapshot, a small JSON file per worker and source, into the
server's metrics directory (written atomically: a reader sees the old snapshot or the new one).
The API server process registers :class:`SmoeCollector` on prometheus_client's default
registry, which vLLM's ``/metrics`` serves; it reads the snapshots at scrape time (their sources:
:class:`SmoeCollector`; with several API servers, vLLM's default under DP, the registry is
another: :func:`multiprocess_registry`). Nothing here runs on a step's path.

The directory: ``metrics_dir`` when the settings give one, else a fresh temporary directory the
API server process makes and hands to the engine and worker processes it starts through the
environment (``SMOE_METRICS_DIR``, as vLLM hands over ``PROMETHEUS_MULTIPROC_DIR``): kept out of
``additional_config``, whose hash keys vLLM's compile caches."""

from __future__ import annotations

import json
import logging
import os
import tempfile

logger = logging.getLogger("vllm.smoe")

ENV = "SMOE_METRICS_DIR"

# the device counters of each source, in the order the workers keep them
ORDER_FIELDS = ("local", "activations", "tokens", "hits")  # per MoE layer
A2A_FIELDS = ("tokens", "pairs", "bytes", "local", "activations", "node_bytes")  # SparseExchange's COUNTERS
# the automatic re-placement's counters (serving/place/auto.py; one API server publishes them)
AUTO_FIELDS = ("checks", "drifted_checks", "candidates", "swaps", "moved_slots", "moved_bytes", "build_seconds",
               "build_cpu_seconds", "swap_seconds", "failures")
RECORD_FIELDS = ("written", "behind", "failed", "unrecordable")  # tokens: written, lost (queue full, disk, no ids or a layer's rows)


class Drift:
    """Local activation ratio over a window of served tokens against the placement's expected one.

    expected: the placement's ratio (its YAML's ``metrics.lar``, in-sample when built), None =
    unknown; threshold: the share of ``expected`` below which the window counts as drifted;
    min_tokens: tokens a window needs before it is judged. :meth:`update` takes the cumulative
    counters (host ints, read once per log interval) and returns the last complete window."""

    def __init__(self, expected: float | None, threshold: float, min_tokens: int = 2048):
        ok = isinstance(expected, (int, float)) and not isinstance(expected, bool) and expected > 0
        self.expected = float(expected) if ok else None  # a YAML without (or with a bad) metrics.lar
        self.threshold, self.min_tokens = threshold, min_tokens
        self._start = (0, 0, 0)  # cumulative (local, activations, tokens) where the window began
        self.window: dict | None = None

    def update(self, local: int, activations: int, tokens: int) -> dict | None:
        """The window just completed ({"local", "activations", "tokens", "ratio", "drifted"}),
        or None while the current one is still short of ``min_tokens``."""
        l0, a0, t0 = self._start
        if tokens - t0 < self.min_tokens or activations <= a0:
            return None
        ratio = (local - l0) / (activations - a0)
        drifted = self.expected is not None and ratio < self.threshold * self.expected
        self.window = {"local": local - l0, "activations": activations - a0, "tokens": tokens - t0,
                       "ratio": ratio, "drifted": drifted}
        self._start = (local, activations, tokens)
        return self.window

    def restart(self, local: int, activations: int, tokens: int) -> None:
        """Start the next window at these cumulative counters (a new placement)."""
        self._start = (local, activations, tokens)
        self.window = None

    def snapshot(self) -> dict:
        """What a published snapshot carries about drift."""
        return {"expected": self.expected, "threshold": self.threshold, "window": self.window}


def metrics_dir(cfg) -> str | None:
    """Where this process publishes: the settings' ``metrics_dir``, else the directory its API
    server made (read once, when a publisher is set up); None with metrics off."""
    if not cfg.metrics:
        return None
    return cfg.metrics_dir if cfg.metrics_dir is not None else os.environ.get(ENV)


def server_metrics_dir(cfg) -> str | None:
    """In the API server process, before it starts engines: the directory to serve, made (and
    exported to the processes it starts) when the settings give none; None with metrics off."""
    if not cfg.metrics:
        return None
    path = metrics_dir(cfg)
    if path is None:
        import atexit
        import shutil

        path = tempfile.mkdtemp(prefix="smoe-metrics-")
        atexit.register(shutil.rmtree, path, True)
        os.environ[ENV] = path
    return path


def publish(directory: str, source: str, rank: int, counters: dict) -> None:
    """Replace ``{directory}/{source}-rank{rank}.json`` with ``counters`` (atomic rename)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{source}-rank{rank}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"source": source, "rank": rank, **counters}, f)
        os.replace(tmp, os.path.join(directory, f"{source}-rank{rank}.json"))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _counts(x, n: int) -> bool:
    return isinstance(x, list) and len(x) == n and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _valid(s: object) -> bool:
    """A snapshot as :func:`publish` writes them (anything else in the directory is ignored)."""
    if not isinstance(s, dict) or not isinstance(s.get("rank"), int):
        return False
    d = s.get("drift")
    if d is not None:
        num = (int, float)
        w = d.get("window") if isinstance(d, dict) else None
        if not (isinstance(d, dict) and isinstance(d.get("threshold"), num)
                and (d.get("expected") is None or isinstance(d["expected"], num))
                and (w is None or (isinstance(w, dict) and _counts([w.get(k) for k in ("local", "activations",
                                                                                       "tokens")], 3)))):
            return False
    if s.get("source") == "order":
        layers = s.get("layers")
        return isinstance(layers, list) and bool(layers) and all(_counts(r, len(ORDER_FIELDS)) for r in layers)
    if s.get("source") == "a2a":
        return _counts([s.get(k) for k in A2A_FIELDS], len(A2A_FIELDS))
    if s.get("source") == "record":
        return _counts([s.get(k) for k in RECORD_FIELDS], len(RECORD_FIELDS))
    if s.get("source") == "auto":
        num = (int, float)
        rejected = s.get("rejected")
        return (all(isinstance(s.get(k), num) and not isinstance(s.get(k), bool) for k in AUTO_FIELDS)
                and isinstance(rejected, dict) and all(isinstance(k, str) and isinstance(v, int)
                                                       for k, v in rejected.items()))
    if s.get("source") == "collectives":
        rows = s.get("counts")
        return (_counts([s.get("steps")], 1) and isinstance(rows, list)
                and all(isinstance(r, list) and len(r) == 3 and all(isinstance(v, str) for v in r[:2])
                        and _counts(r[2:], 1) for r in rows))
    return False


def read_snapshots(directory: str) -> list[dict]:
    """Every worker's latest snapshot. Files that do not read as one are skipped (a file being
    replaced, or something else in the directory) and logged."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            path = os.path.join(directory, name)
            try:
                with open(path) as f:
                    s = json.load(f)
            except (OSError, ValueError) as e:
                logger.warning("smoe metrics: skipping %s: %s", path, e)
                continue
            if _valid(s):
                out.append(s)
            else:
                logger.warning("smoe metrics: skipping %s: not a snapshot smoe wrote", path)
    return out


def families(snapshots: list[dict]):
    """The Prometheus metric families of a set of snapshots (docs/metrics.md lists them)."""
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
    yield from _drift_families(order or a2a)
    record = [s for s in snapshots if s.get("source") == "record"]
    if record:
        written = CounterMetricFamily("smoe:record_tokens", "served tokens the recorder wrote to trace files",
                                      labels=["rank"])
        lost = CounterMetricFamily("smoe:record_lost_tokens", "served tokens the recorder did not write, by reason "
                                   "(behind: its queue was full; failed: a write failed, e.g. a full disk, and the "
                                   "step was dropped whole; unrecordable: rows without token ids, a step some MoE layer "
                                   "wrote no rows for, or a speculative step whose kept drafts vLLM did not say, each "
                                   "dropped whole)",
                                   labels=["rank", "reason"])
        for s in record:
            written.add_metric([str(s["rank"])], s["written"])
            for k in RECORD_FIELDS[1:]:
                lost.add_metric([str(s["rank"]), k], s[k])
        yield written
        yield lost
    yield from _auto_families([s for s in snapshots if s.get("source") == "auto"])
    coll = [s for s in snapshots if s.get("source") == "collectives"]
    if coll:
        n = CounterMetricFamily("smoe:collectives", "collectives a worker's communicators issued in served steps "
                                "(CPU build), by group and kind", labels=["rank", "group", "kind"])
        steps = CounterMetricFamily("smoe:collective_steps", "served steps those collectives were counted in",
                                    labels=["rank"])
        for s in coll:
            for g, k, v in s["counts"]:
                n.add_metric([str(s["rank"]), g, k], v)
            steps.add_metric([str(s["rank"])], s["steps"])
        yield n
        yield steps
    if a2a:
        names = {"tokens": ("smoe:a2a_tokens", "served tokens through the sparse all2all (rows x MoE layers)"),
                 "pairs": ("smoe:a2a_remote_pairs", "(token, remote rank) rows the sparse all2all sent"),
                 "bytes": ("smoe:a2a_bytes", "bytes a point-to-point transport carries for those rows, both ways"),
                 "local": ("smoe:a2a_local_expert_activations", "expert activations on the token's rank"),
                 "activations": ("smoe:a2a_expert_activations", "expert activations"),
                 "node_bytes": ("smoe:a2a_node_bytes", "those bytes that cross between nodes")}
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


def _drift_families(snapshots: list[dict]):
    """The window ratio over the ranks' last complete windows, the placement's expected ratio,
    and whether the window fell below threshold x expected."""
    from prometheus_client.core import GaugeMetricFamily

    from .drift import pooled_drift

    drift = pooled_drift(snapshots)  # the automatic re-placement reads this same verdict
    if drift is None:
        return
    ratio = drift["ratio"]
    g = GaugeMetricFamily("smoe:window_local_activation_ratio", "local activation ratio over each rank's last "
                          "complete window of served tokens, over all ranks")
    g.add_metric([], ratio)
    yield g
    if drift.get("expected") is not None:
        e = GaugeMetricFamily("smoe:expected_local_activation_ratio", "the placement's own ratio (its YAML's "
                              "metrics.lar)")
        e.add_metric([], drift["expected"])
        yield e
        d = GaugeMetricFamily("smoe:drift", "1 when the window ratio is below drift_threshold x expected, else 0")
        d.add_metric([], float(drift["drifted"]))
        yield d


_AUTO_HELP = {
    "checks": "intervals the automatic re-placement read the drift verdict",
    "drifted_checks": "of those, intervals that read drifted",
    "candidates": "candidate placements built from the recording",
    "swaps": "candidates swapped in live",
    "moved_slots": "expert slots those swaps moved",
    "moved_bytes": "expert weight bytes those swaps moved, all ranks",
    "build_seconds": "wall-clock seconds of the candidate builds",
    "build_cpu_seconds": "CPU seconds of the candidate builds (their processes)",
    "swap_seconds": "seconds serving waited for those swaps",
    "failures": "failures of the controller itself (serving went on)",
}


def _auto_families(snapshots: list[dict]):
    """The automatic re-placement's counters (``smoe:auto_*``), from the API server's snapshot."""
    from prometheus_client.core import CounterMetricFamily

    if not snapshots:
        return
    s = snapshots[0]  # one API server runs it (live swaps are refused with several)
    for k in AUTO_FIELDS:
        c = CounterMetricFamily(f"smoe:auto_{k}", _AUTO_HELP[k])
        c.add_metric([], s[k])
        yield c
    r = CounterMetricFamily("smoe:auto_rejected", "candidates not swapped in, by reason", labels=["reason"])
    for reason, v in sorted(s["rejected"].items()):
        r.add_metric([reason], v)
    yield r


class SmoeCollector:
    """A prometheus_client collector over one metrics directory (None: not known yet).

    Sources: ``order`` (speculate's token order: per MoE layer, the rows each rank served),
    ``a2a`` (smoe's sparse all2all: the rows that crossed, whatever orders the tokens),
    ``record`` (the recorder: tokens written and tokens lost, by reason) and ``collectives``
    (:mod:`.collectives`: each worker's collectives by group and kind, and its served steps)."""

    def __init__(self, directory: str | None):
        self.directory = directory

    def collect(self):
        if self.directory is not None:
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



def multiprocess_registry(collector: "SmoeCollector"):
    """With ``PROMETHEUS_MULTIPROC_DIR`` set (several API servers), vLLM serves ``/metrics`` in
    each API server process from a registry of its own (``get_prometheus_registry``: a fresh
    one with prometheus_client's multiprocess collector), which a collector on the default
    registry never reaches. This returns a registry of that kind with ``collector`` added (the
    route smoe's endpoint plugin serves in place of vLLM's), or None outside multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None:
        return None
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(collector)
    return registry
