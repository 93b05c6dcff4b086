"""Device counters read back once per log interval, judged for drift and published: the one
observer the token order and the sparse all2all each hold for their counters.

Nothing here runs on a step's path: :meth:`Observer.due` gates every read on the log interval
and never reads during a CUDA graph capture."""

from __future__ import annotations

import logging
import time

import torch

from .metrics import Drift, publish

logger = logging.getLogger("vllm.smoe")


class Observer:
    """One source's counters (:mod:`.metrics`' sources ``order``, ``a2a``) on one rank.

    source, rank: the snapshot's name; interval: seconds between reads; metrics_dir: where snapshots go (None:
    not published); drift: the window judged against the placement's ratio; who: how a drift
    warning names this rank ("rank 3", "dp rank 0"), None = no warning; hint: appended to it."""

    def __init__(self, source: str, rank: int, interval: float, metrics_dir: str | None,
                 drift: Drift, who: str | None = None, hint: str = ""):
        self.source, self.rank = source, rank
        self.interval, self.metrics_dir, self.drift = interval, metrics_dir, drift
        self.who, self.hint = who, hint
        self._last = time.monotonic()
        self._pending = None  # (pinned host copy, event) started at the last read (CUDA)

    def due(self) -> bool:
        """Has the log interval passed (and is no CUDA graph being captured)? Starts the next one."""
        now = time.monotonic()
        if now - self._last < self.interval:
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False  # reading device counters would break a CUDA graph capture
        self._last = now
        return True

    def read(self, counts: torch.Tensor) -> list | None:
        """``counts`` (the device tensor the source adds to, int64, any shape) as (nested) lists.
        On CUDA without waiting for the device: a pinned copy started at one read is returned
        at the next (so values lag one interval; None until the first copy has landed)."""
        if counts.device.type != "cuda":
            return counts.tolist()
        pending = self._pending
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)
        if pending is None or not pending[1].query():
            return None
        return pending[0].tolist()

    def judge(self, local: int, activations: int, tokens: int) -> None:
        """Cumulative counters into the drift window; a warning naming ``who`` when it drifted."""
        window = self.drift.update(local, activations, tokens)
        if self.who is not None and window is not None and window["drifted"]:
            logger.warning("smoe: drift: %s kept %.3f of its last %d tokens' expert activations local, below %.2f x "
                           "the placement's %.3f: the workload may have moved%s", self.who, window["ratio"],
                           window["tokens"], self.drift.threshold, self.drift.expected, self.hint)

    def restart(self, expected: float | None, local: int, activations: int, tokens: int) -> None:
        """A new placement: drift against its own ratio, the window starting at these counters."""
        self.drift = Drift(expected, self.drift.threshold)
        self.drift.restart(local, activations, tokens)

    def publish(self, counters: dict) -> None:
        """A snapshot of ``counters`` plus the drift window (nothing without a metrics directory)."""
        if self.metrics_dir is None:
            return
        try:
            publish(self.metrics_dir, self.source, self.rank, {**counters, "drift": self.drift.snapshot()})
        except OSError as e:  # the server is shutting down and took its directory along
            logger.warning("smoe: metrics not published any more: %s", e)
            self.metrics_dir = None
