"""The drift verdict: the ranks' last complete windows pooled against the placement's expected
ratio. One function, read by ``smoe:drift`` on /metrics and by the automatic re-placement alike."""

from __future__ import annotations


def pooled_drift(snapshots: list[dict]) -> dict | None:
    """The drift verdict ``smoe:drift`` publishes: the ranks' last complete windows pooled
    (local / activations over all of them) against the placement's expected ratio x threshold.
    snapshots: :func:`~..observe.metrics.read_snapshots`'s; the token order's (source ``order``)
    where there are any, else the sparse all2all's (``a2a``), which both carry a window. Returns
    {"ratio", "expected", "threshold", "drifted" (None: no expected ratio, nothing judged)} or
    None (no window yet)."""
    snapshots = ([s for s in snapshots if s.get("source") == "order"]
                 or [s for s in snapshots if s.get("source") == "a2a"])
    judged = [s["drift"] for s in snapshots if s.get("drift") and s["drift"].get("window")]
    windows = [d["window"] for d in judged]
    if not windows:
        return None
    ratio = sum(w["local"] for w in windows) / max(1, sum(w["activations"] for w in windows))
    expected, threshold = judged[0].get("expected"), judged[0]["threshold"]
    drifted = None if expected is None else ratio < threshold * expected
    return {"ratio": ratio, "expected": expected, "threshold": threshold, "drifted": drifted}
