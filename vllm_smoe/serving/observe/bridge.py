"""smoe's families on /metrics with several API servers, without smoe's endpoint plugin.

With several API servers (vLLM's default under ``--data-parallel-size``) vLLM serves ``/metrics``
in each from a registry it builds itself, whose only collector is prometheus_client's
multiprocess collector: it reads the ``*.db`` files in ``PROMETHEUS_MULTIPROC_DIR`` that every
process of the server writes its metrics into. smoe's endpoint plugin replaces that route with
one that adds smoe's collector, but vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names
them. Without it, this bridge, a daemon thread of ``vllm serve``'s parent process (which lives as
long as the server), writes smoe's families (:func:`.metrics.families` of the workers' snapshots,
the same numbers the collector gives) into that directory as one more process's metrics, through
prometheus_client's own multiprocess values: counters as counters, gauges as gauges read as the
maximum over processes (this one is their only writer). It refreshes every ``interval`` seconds,
reading a few small JSON files; nothing here runs in a worker.
"""

from __future__ import annotations

import logging
import threading
import time

from .metrics import families, read_snapshots

logger = logging.getLogger("vllm.smoe")


class MultiprocessBridge:
    """metrics_dir: the workers' snapshots; the multiprocess files go where
    ``PROMETHEUS_MULTIPROC_DIR`` says (read by prometheus_client when a value is first set)."""

    def __init__(self, metrics_dir: str):
        from prometheus_client.values import MultiProcessValue

        self.metrics_dir = metrics_dir
        self.value_class = MultiProcessValue()  # this process's own files, not the global value class
        self.values: dict[tuple, object] = {}  # (family, sample, labels) -> its multiprocess value

    def once(self) -> int:
        """Every sample of smoe's families written once; returns how many."""
        n = 0
        for fam in families(read_snapshots(self.metrics_dir)):
            for s in fam.samples:
                names = tuple(sorted(s.labels))
                key = (fam.name, s.name, names, tuple(s.labels[k] for k in names))
                v = self.values.get(key)
                if v is None:
                    v = self.values[key] = self.value_class(fam.type, fam.name, s.name, names, key[3],
                                                            fam.documentation,
                                                            multiprocess_mode="max" if fam.type == "gauge" else "")
                v.set(s.value)
                n += 1
        return n

    def run(self, interval: float) -> None:
        while True:
            try:
                self.once()
            except Exception:  # noqa: BLE001 - logged once; serving goes on without smoe's families
                logger.exception("smoe: smoe's metrics no longer reach the API servers' /metrics")
                return
            time.sleep(interval)


def start_bridge(metrics_dir: str, interval: float) -> MultiprocessBridge:
    bridge = MultiprocessBridge(metrics_dir)
    threading.Thread(target=bridge.run, args=(interval,), name="smoe-metrics-bridge", daemon=True).start()
    return bridge
