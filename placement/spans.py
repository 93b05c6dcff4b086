"""Which rows of a trace a placement is learned and judged on: [start, stop) row spans.

A span is a pair of ints, rows ``start`` .. ``stop - 1`` of the trace's rows counted over all of
its files in order.
"""

from __future__ import annotations

import numpy as np

EVAL_WINDOWS = 16  # evenly spaced windows a bounded evaluation sample is cut into


def eval_windows(total: int, max_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges to evaluate: everything, or ``EVAL_WINDOWS`` (fewer for tiny
    bounds) evenly spaced contiguous windows totalling about ``max_tokens`` (0 = no bound)."""
    if max_tokens == 0 or total <= max_tokens:
        return [(0, total)]
    n = min(EVAL_WINDOWS, max_tokens)
    return [(s, s + max_tokens // n) for s in (i * total // n for i in range(n))]


def judge_windows(total: int, metrics_tokens: int, instance_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of the rows --method auto judges its candidates on: about
    ``metrics_tokens`` rows in evenly spaced windows (a recording made one workload after another
    still shows every workload) past the leading ``instance_tokens`` rows the bytes objective is
    scored on, where at least a quarter of the trace lies there; else over the whole trace."""
    lo = instance_tokens if total - instance_tokens >= total // 4 and total > instance_tokens else 0
    return [(lo + a, lo + b) for a, b in eval_windows(total - lo, metrics_tokens)]


def union_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged [start, stop) ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def span_positions(kept: list[tuple[int, int]], rows: np.ndarray) -> np.ndarray:
    """Indices into the concatenation of the merged ranges ``kept`` of the trace rows ``rows``
    ([n] int, each inside one of them); returns [n] int64."""
    starts = np.array([lo for lo, _ in kept])
    offsets = np.cumsum([0] + [hi - lo for lo, hi in kept])[:-1]
    k = np.searchsorted(starts, rows, side="right") - 1
    return offsets[k] + rows - starts[k]


def late_half(batch: np.ndarray, engine: np.ndarray | None, request_ids: np.ndarray | None = None) -> np.ndarray:
    """[n] bool: the rows of each DP engine's second half of engine steps (batch: [n] step ids,
    sorted, one engine's recordings one after another; engine: [n] int, or None for one). An
    engine of one step stays whole in the first half. With request_ids ([n] int, distinct
    across recordings) every request goes whole to the half its first row is in (--mode dp
    judges whole requests, routed by their prompts)."""
    rec = np.zeros(batch.size, dtype=np.int64) if engine is None else engine
    late = np.zeros(batch.size, dtype=bool)
    for r in np.unique(rec):
        mine = rec == r
        steps = np.unique(batch[mine])
        late |= mine & (batch >= steps[steps.size // 2]) if steps.size >= 2 else False
    if request_ids is not None:
        _, first, q = np.unique(request_ids, return_index=True, return_inverse=True)
        late = late[first][q.ravel()]
    return late
