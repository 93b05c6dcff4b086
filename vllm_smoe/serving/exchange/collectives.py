"""Collectives a worker's communicators issue per served step, counted (CPU build).

Why: at decode batch sizes every collective waits on the link's latency, so how many a MoE layer
makes decides more than its bytes. smoe's CPU communicator (:class:`~.cpu_ep.SmoeCpuCommunicator`,
every group of a worker with smoe's settings) and its sparse exchange's point-to-point all-to-alls
count here, by group and kind, only inside a served step (between the runner hooks' before and
after: no profile run, no warm-up, no DP dummy batch), each call once (:class:`CollectiveCounts`).

Not counted: what vLLM issues on a group's CPU process group directly instead of its communicator
(under DP, the batch-size all-reduce of each step, once per step and not per layer). On CUDA the
communicators are vLLM's own and nothing is counted.

One :class:`CollectiveCounts` per process (:func:`counts`); it publishes a snapshot (source
``collectives``) into the metrics directory once per log interval, from the step's after hook.
History: docs/history.md#vllm_smoeservingexchangecollectivespy."""

from __future__ import annotations

import contextlib
import logging
import time

logger = logging.getLogger("vllm.smoe")

KINDS = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "all_to_all", "gather",
         "broadcast", "send", "recv")


def group_of(unique_name: str) -> str:
    """vLLM's group name without its instance suffix: ``"tp:0"`` -> ``"tp"``."""
    return unique_name.split(":", 1)[0]


class CollectiveCounts:
    """Counts since start: ``by[(group, kind)]`` collectives in ``steps`` served steps. A call
    counts once at its outermost communicator method (a shared-memory reduce-scatter is an
    all-reduce plus a slice underneath; it counts as one reduce_scatter)."""

    def __init__(self, rank: int, log_interval: float, metrics_dir: str | None):
        self.rank = rank  # the worker's global rank (its snapshot's name)
        self.log_interval = log_interval
        self.metrics_dir = metrics_dir
        self.by: dict[tuple[str, str], int] = {}
        self.steps = 0
        self._inside = False  # within a served step
        self._depth = 0  # nested communicator calls count once, at the outermost
        self._last = time.monotonic()

    @contextlib.contextmanager
    def call(self, group: str, kind: str):
        """Around one communicator method: counted when it is the outermost one in a served step."""
        if self._inside and self._depth == 0:
            key = (group, kind)
            self.by[key] = self.by.get(key, 0) + 1
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def before_step(self, runner, scheduler_output) -> None:
        self._inside = True

    def after_step(self, runner, scheduler_output, step) -> None:
        self._inside = False
        if step is None:  # no forward ran
            return
        self.steps += 1
        now = time.monotonic()
        if now - self._last >= self.log_interval:
            self._last = now
            self._report()

    def snapshot(self) -> dict:
        return {"steps": self.steps, "counts": [[g, k, n] for (g, k), n in sorted(self.by.items())]}

    def _report(self) -> None:
        if self.metrics_dir is not None:
            from ..observe.metrics import publish

            try:
                publish(self.metrics_dir, "collectives", self.rank, self.snapshot())
            except OSError as e:  # the server is shutting down and took its directory along
                logger.warning("smoe: metrics not published any more: %s", e)
                self.metrics_dir = None
        if self.steps:
            per = ", ".join(f"{g} {k} {n / self.steps:.2f}" for (g, k), n in sorted(self.by.items()))
            logger.info("smoe: collectives (rank %d) per served step over %d steps: %s", self.rank, self.steps,
                        per or "none")


def per_step(counts: list, steps: int, layers: int = 1) -> dict[str, float]:
    """``{"group kind": collectives per step / layers}`` from a snapshot's ``counts``
    ([[group, kind, n], ...]) over ``steps`` served steps."""
    if steps <= 0:
        return {}
    return {f"{g} {k}": n / steps / layers for g, k, n in counts}


_COUNTS: list[CollectiveCounts | None] = [None]


def counts(rank: int | None = None, cfg=None) -> CollectiveCounts | None:
    """This process's counts; the first call with ``rank`` and smoe's settings ``cfg`` starts
    them (and hooks the served steps). None where nothing counts (no smoe settings)."""
    if _COUNTS[0] is None and cfg is not None and rank is not None:
        from .. import runner_hooks
        from ..observe.metrics import metrics_dir

        c = CollectiveCounts(rank, cfg.log_interval, metrics_dir(cfg))
        runner_hooks.attach(before=c.before_step, after=c.after_step)
        _COUNTS[0] = c
    return _COUNTS[0]
