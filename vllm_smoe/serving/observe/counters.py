"""Device counters read back once per log interval, judged for drift and published: the one
observer the token order and the sparse all2all each hold for their counters.

Two readers, one at a time (the observer's lock): the step path (:meth:`Observer.step`, once per
log interval, never during a CUDA graph capture, never waiting for the device: on CUDA it returns
the copy started one interval earlier) and an idle reader, a daemon thread that reads once no
served step has run for half an interval and some ran since its last read, so what the last
steps of a burst counted is published (and logged) within one interval, not at the next burst.

Why the idle read is safe off the step path: it runs only once serving (after vLLM's warm-up,
where every CUDA graph is captured: no capture is in progress for its copy to break) and between
steps (:func:`..runner_hooks.activity`); its copy is synchronous on the idle thread's own stream,
so only that thread waits; the counters only grow, so a step that starts during the copy leaves
every value between two true ones; and the step path never waits for it (it skips its read while
the idle reader holds the lock)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

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
        self.lock = threading.Lock()  # one reader at a time: the step path's or the idle reader's
        self._counts: Callable | None = None  # -> the device tensor the source adds to (see watch)
        self._report: Callable | None = None  # rows -> None: judge, publish, log
        self._idle_read_at = 0  # served steps (runner_hooks.activity) when the idle reader last read

    def watch(self, counts: Callable, report: Callable, idle: bool = True) -> None:
        """Read ``counts()`` (the source's device tensor, int64) once per interval and hand its
        rows to ``report``; ``idle``: start the idle reader too (see the module)."""
        self._counts, self._report = counts, report
        if idle:
            threading.Thread(target=self._idle_loop, name=f"smoe-observe-{self.source}", daemon=True).start()

    def unwatch(self) -> None:
        """Stop reading (the idle reader ends at its next tick)."""
        with self.lock:
            self._counts = self._report = None

    def step(self) -> None:
        """The step path, after a served step (or in the forward, the sparse all2all): once per
        interval, the counters read (without waiting on CUDA) and reported."""
        if not self.due() or not self.lock.acquire(blocking=False):
            return  # not due, or the idle reader is reading: this interval's read is its
        try:
            if self._counts is None:
                return
            rows = self.read(self._counts())
            if rows is not None:
                self._report(rows)
        finally:
            self.lock.release()

    def idle_read(self, steps: int) -> None:
        """The idle reader: the counters now (a synchronous copy on this thread), reported.
        ``steps``: served steps so far. A copy the step path started is dropped: it is older."""
        with self.lock:
            if self._counts is None:
                return
            rows = self._counts().cpu().tolist()
            self._pending = None
            self._last = time.monotonic()
            self._idle_read_at = steps
            self._report(rows)

    def _idle_loop(self) -> None:
        from .. import runner_hooks

        tick = min(max(self.interval / 4, 0.05), 1.0)
        while self._report is not None:
            time.sleep(tick)
            steps, last, busy = runner_hooks.activity()
            if busy or steps == self._idle_read_at or time.monotonic() - last < self.interval / 2:
                continue
            try:
                self.idle_read(steps)
            except Exception:  # noqa: BLE001 - logged; serving goes on without idle reads
                logger.exception("smoe: idle read of %s counters failed; they are read with the steps only",
                                 self.source)
                return

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


def counts_clause(local: int, activations: int, local_metric: str, activations_metric: str, rank: int) -> str:
    """What a log line's ratio is, in /metrics' terms: the same read of the same counters (every
    served token since start, all MoE layers), so the line's share is ``local / activations``
    of these two counters' samples for ``rank`` summed over layers, and the share over all ranks
    (``smoe:local_activation_ratio{layer="all"}``, ``smoe:a2a_*`` alike) is the ranks' locals
    summed over their activations summed, not the mean of the ranks' shares."""
    return (f"; counters: {local_metric} {local} / {activations_metric} {activations} (rank {rank}, every served "
            f"token since start, all MoE layers)")


def order_line(predictor: str, rank: int, layers: list, wire: str = "") -> str:
    """Speculate's log line of one rank. layers: [L][4] the rows the token order publishes
    (metrics.ORDER_FIELDS: local, activations, tokens, hits, each summed over steps); tokens in
    the line: rows per MoE layer; wire: the sparse all2all's and small steps' clauses."""
    local, acts, tokens = (sum(row[i] for row in layers) for i in range(3))
    return (f"smoe: speculate (predictor {predictor}): rank {rank} served {local / acts:.3f} of its expert "
            f"activations locally ({tokens // len(layers)} tokens){wire}"
            + counts_clause(local, acts, "smoe:local_expert_activations", "smoe:expert_activations", rank))
