"""Goodput under latency targets: per-request attainment, the targets from unloaded latencies,
the rate search, and the spread across starts. Pure: lists and numbers in, numbers out.

Goodput (DistServe's definition) is the highest request rate at which at least ``goal`` (0.9)
of the requests meet their targets. A request's TTFT is its first streamed chunk's arrival less
its send time; its TPOT is (last chunk - first chunk) / (tokens - 1). A failed request meets
nothing.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

CRITERIA = ("ttft", "tpot", "both")


def request_latencies(outs: list) -> list[dict]:
    """outs: per request (start s, [arrival s of each streamed chunk], completion tokens, error
    or None) as :func:`.client.drive` returns them. Per request {"ttft_s", "tpot_s"}: None where
    the request failed (or, for TPOT, streamed a single token: it has none and meets any TPOT)."""
    rows = []
    for st, ts, n, err in outs:
        if err is not None or not ts:
            rows.append({"ttft_s": None, "tpot_s": None, "failed": True})
            continue
        tpot = (ts[-1] - ts[0]) / (n - 1) if n > 1 and len(ts) > 1 else 0.0
        rows.append({"ttft_s": ts[0] - st, "tpot_s": tpot, "failed": False})
    return rows


def attainment(lat: list[dict], targets: dict) -> dict:
    """The share of requests meeting the TTFT target, the TPOT target and both.
    lat: :func:`request_latencies`' rows; targets: {"ttft_s": s, "tpot_s": s}."""
    if not lat:
        return {c: 0.0 for c in CRITERIA}
    ttft = [not r["failed"] and r["ttft_s"] <= targets["ttft_s"] for r in lat]
    tpot = [not r["failed"] and r["tpot_s"] <= targets["tpot_s"] for r in lat]
    return {"ttft": float(np.mean(ttft)), "tpot": float(np.mean(tpot)),
            "both": float(np.mean([a and b for a, b in zip(ttft, tpot)]))}


def unloaded_targets(lat: list[dict], outputs: list[int], scale: float) -> dict:
    """Targets ``scale`` x the median TTFT and TPOT of requests sent one at a time (``outputs``:
    their output tokens), and S, the median time of one request (TTFT + TPOT x (tokens - 1)),
    the unit of the search's rate range."""
    ok = [(r, n) for r, n in zip(lat, outputs) if not r["failed"]]
    if not ok:
        raise RuntimeError("every unloaded request failed: no latency to set the targets from")
    ttft = float(np.median([r["ttft_s"] for r, _ in ok]))
    tpot = float(np.median([r["tpot_s"] for r, _ in ok]))
    return {"ttft_s": scale * ttft, "tpot_s": scale * tpot, "scale": scale, "unloaded_ttft_s": ttft,
            "unloaded_tpot_s": tpot,
            "unloaded_request_s": float(np.median([r["ttft_s"] + r["tpot_s"] * (n - 1) for r, n in ok]))}


def search_rate(measure: Callable[[float], float], lo: float, hi: float, steps: int,
                goal: float = 0.9) -> dict:
    """Bisection on a log scale for the highest rate in [lo, hi] whose attainment ``measure(rate)``
    is at least ``goal``, in ``steps`` measurements; attainment is taken to fall with the rate.

    The first rate is the geometric middle; a met rate raises the lower end, a missed one lowers
    the upper end. When no rate met the goal, ``lo`` itself is measured once more (an extra step)
    so that a goodput of 0 means even ``lo`` missed. Returns {"goodput": the highest rate met
    (0.0 when none), "bracket": [met, missed] (None where not measured), "tried": [[rate,
    attainment], ...] in order}."""
    if not 0 < lo < hi:
        raise ValueError(f"rate range [{lo}, {hi}]: need 0 < lo < hi")
    if steps < 1:
        raise ValueError(f"steps {steps}: need at least 1")
    met, missed, tried = None, None, []
    a, b = lo, hi
    for _ in range(steps):
        r = math.sqrt(a * b)
        att = measure(r)
        tried.append([r, att])
        if att >= goal:
            met, a = r, r
        else:
            missed, b = r, r
    if met is None:
        att = measure(lo)
        tried.append([lo, att])
        if att >= goal:
            met = lo
        else:
            missed = lo
    return {"goodput": met or 0.0, "bracket": [met, missed], "tried": tried}


def spread(values: list[float]) -> float | None:
    """(max - min) / median of the starts' values; None with fewer than two or a zero median."""
    v = [x for x in values if x is not None and np.isfinite(x)]
    if len(v) < 2 or np.median(v) == 0:
        return None
    return float((max(v) - min(v)) / np.median(v))


def crossing(tried: list, goal: float = 0.9) -> tuple[float, bool]:
    """The rate where attainment crosses ``goal``, interpolated on a log scale between the
    highest rate met and the lowest rate missed above it (the bisection's grid alone would make
    every start's goodput one of a few values). tried: [[rate, attainment], ...]. Returns (rate,
    open): open when no rate above the highest met one missed (the goodput is at least that
    rate); (0.0, False) when no rate met the goal."""
    met = [(r, a) for r, a in tried if a >= goal]
    if not met:
        return 0.0, False
    r1, a1 = max(met)
    above = [(r, a) for r, a in tried if r > r1 and a < goal]
    if not above:
        return r1, True
    r2, a2 = min(above)
    f = (a1 - goal) / (a1 - a2)
    return float(math.exp(math.log(r1) + f * (math.log(r2) - math.log(r1)))), False
