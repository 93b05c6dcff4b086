"""A load's latencies and the SLO throughput of a Poisson ladder."""

from __future__ import annotations

import numpy as np


def slo_rate(ladder: list[dict], key: str, bound_ms: float) -> float:
    """The highest offered request rate of a Poisson ladder whose ``key`` (e.g. p90_itl_ms)
    stays under ``bound_ms`` with no failed request, every lower rate meeting it too (a
    configuration that misses the SLO at a low rate does not count a lucky higher one).
    ladder: [{"rate": req/s, key: ms, "failed": int}, ...]. 0.0 when even the lowest misses."""
    def meets(row):
        v = row.get(key)
        return v is not None and np.isfinite(v) and v <= bound_ms and not row.get("failed", 0)
    best = 0.0
    for rate in sorted({r["rate"] for r in ladder}):
        if not all(meets(r) for r in ladder if r["rate"] == rate):
            break
        best = rate
    return best


def latency_summary(outs: list, seconds: float) -> dict:
    """outs: per request (start s, [arrival s of each streamed chunk], completion tokens, error
    or None). Median TPOT and TTFT, p90 inter-token latency (TBT), output tok/s."""
    ok = [o for o in outs if o[3] is None]
    tpot = [(ts[-1] - ts[0]) / (n - 1) for _, ts, n, _ in ok if len(ts) > 1 and n > 1]
    ttft = [ts[0] - st for st, ts, _, _ in ok if ts]
    itl = [d for _, ts, _, _ in ok for d in np.diff(ts)]
    tokens = sum(n for _, _, n, _ in ok)

    def ms(v, f):
        return 1e3 * float(f(v)) if v else None
    return {"tpot_ms": ms(tpot, np.median), "ttft_ms": ms(ttft, np.median),
            "p90_itl_ms": ms(itl, lambda v: np.percentile(v, 90)), "p90_ttft_ms": ms(ttft, lambda v: np.percentile(v, 90)),
            "tok_s": tokens / seconds if seconds > 0 else None, "tokens": tokens, "requests": len(ok),
            "failed": len(outs) - len(ok), "seconds": seconds}
