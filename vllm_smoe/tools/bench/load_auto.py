"""``smoe-bench load --auto``: the workload shift of ``smoe-bench load`` with nobody posting a
placement. The server runs smoe's automatic re-placement (``--smoe-auto-replace``); this side
only streams requests, shifts the prompts at ``--seconds / 2`` and reads ``/metrics``: the
times from the shift to ``smoe:drift``, to the controller's first candidate, to its swap; the
local activation ratio before and after; failed requests; greedy tokens of fixed probe prompts
before the shift and after the swap; and what the candidate's build cost serving: the median
TPOT of requests that ran while it built against those of the same shifted traffic that did not,
with the build's share of the host's CPU.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request

from .common import median_tpot  # the same median the manual shift reports

_AUTO = re.compile(r"^smoe:auto_(candidates|swaps|build_seconds|build_cpu_seconds|moved_slots|moved_bytes|"
                   r"swap_seconds|failures)_total (\S+)$")
_REJECTED = re.compile(r'^smoe:auto_rejected_total\{reason="(\w+)"\} (\S+)$')


def scrape_auto(port: int, headers: dict | None = None) -> dict:
    """The controller's counters on /metrics (zeros before it published)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out = {k: 0.0 for k in ("candidates", "swaps", "build_seconds", "build_cpu_seconds", "moved_slots",
                            "moved_bytes", "swap_seconds", "failures")}
    out["rejected"] = {}
    for line in text.splitlines():
        m = _AUTO.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
        m = _REJECTED.match(line)
        if m:
            out["rejected"][m.group(1)] = float(m.group(2))
    return out


def auto_settings(a) -> dict:
    """The controller's settings for this run: one swap (a cool-down longer than the run)."""
    return {"hold_s": a.auto_hold, "cooldown_s": 10 * a.seconds, "max_moves": a.auto_max_moves,
            "margin": a.auto_margin, "window_tokens": a.auto_window_tokens, "build_cpu_share": a.auto_build_cpu_share}


def shift_auto(a, s, clients_cls, scrape, first: list, then_seen: list, then_unseen: list, probe: list) -> dict:
    """Runs the shift on the started server ``s`` (``--smoe-auto-replace`` on): the result's
    ``auto`` part. ``scrape``: load.scrape (local, all, drift)."""
    before = [p[0] for p in s.complete(probe, max_tokens=a.max_tokens)]  # greedy text of the probes
    t0 = time.perf_counter()
    clients = clients_cls(s, s.model, a.clients, a.max_tokens, first).start()
    last = scrape(s.port)[:2]
    timeline, events = [], {"shift": None, "drift": None, "candidate": None, "swap": None}
    while True:
        time.sleep(a.scrape)
        cur, auto = scrape(s.port), scrape_auto(s.port, s.headers())
        now = time.perf_counter() - t0
        d_local, d_all = cur[0] - last[0], cur[1] - last[1]
        last = cur[:2]
        timeline.append({"t": now, "ratio": d_local / d_all if d_all else None, "activations": d_all,
                         "drift": cur[2], **{k: auto[k] for k in ("candidates", "swaps", "build_seconds",
                                                                   "build_cpu_seconds")},
                         "rejected": sum(auto["rejected"].values())})
        if events["shift"] is None and now >= a.seconds / 2:
            with clients.lock:
                clients.prompts = then_seen
            events["shift"] = now
            print(f"t={now:6.1f} s  traffic shifts", flush=True)
        for name, hit in (("drift", cur[2] >= 1), ("candidate", auto["candidates"] >= 1), ("swap", auto["swaps"] >= 1)):
            if events["shift"] is not None and events[name] is None and hit:
                events[name] = now
                print(f"t={now:6.1f} s  {name}", flush=True)
                if name == "swap":
                    with clients.lock:  # requests the candidate never saw
                        clients.prompts = then_unseen
        print(f"t={now:6.1f} s  local ratio {timeline[-1]['ratio'] or float('nan'):.3f}  drift {cur[2]:.0f}  "
              f"candidates {auto['candidates']:.0f}  swaps {auto['swaps']:.0f}", flush=True)
        if events["swap"] is not None and now >= events["swap"] + a.after or now > a.seconds * 4:
            break
    rows = clients.finish()
    end = time.perf_counter() - t0
    after = [p[0] for p in s.complete(probe, max_tokens=a.max_tokens)]
    final = scrape_auto(s.port, s.headers())
    for r in rows:
        r["start"] -= t0
        r["end"] -= t0
    shift, swap = events["shift"] or end, events["swap"]
    # the build ran in the interval before the scrape that first counted it, for build_seconds
    built_at = events["candidate"]
    build = None if built_at is None else (built_at - final["build_seconds"], built_at)
    shifted = [r for r in rows if shift <= r["start"] and (swap is None or r["end"] <= swap)]
    during = [r for r in shifted if build and r["start"] < build[1] and r["end"] > build[0]]
    outside = [r for r in shifted if not (build and r["start"] < build[1] and r["end"] > build[0])]

    def windows(lo, hi):  # TPOT medians of build-long windows of shifted traffic outside the build: its noise
        if not build:
            return []
        span, out = build[1] - build[0], []
        for a0, a1 in ((lo, build[0]), (build[1], hi)):
            t = a0
            while t + span <= a1:
                inside = [r for r in outside if r["start"] < t + span and r["end"] > t]
                if inside:
                    out.append(median_tpot(inside))
                t += span
        return out

    def ratio(lo, hi):
        pts = [p for p in timeline if lo < p["t"] <= hi and p["ratio"] is not None]
        w = sum(p["activations"] for p in pts)
        return sum(p["ratio"] * p["activations"] for p in pts) / w if w else None

    cores = os.cpu_count() or 1
    out = {"settings": auto_settings(a), "events_s": events, "seconds": end, "requests": len(rows),
           "failed": sum(r["error"] is not None for r in rows), "counters": final,
           "local_ratio": {"before shift": ratio(a.scrape, shift), "shifted, old placement": ratio(shift, swap or end),
                           "after the automatic swap": None if swap is None else ratio(swap + a.scrape, end)},
           "tokens_equal_before_after": before == after, "build_window_s": build,
           "tpot_during_build_s": median_tpot(during), "tpot_shifted_outside_build_s": median_tpot(outside),
           "requests_during_build": len(during), "requests_shifted_outside_build": len(outside),
           "tpot_outside_windows_s": windows(shift, swap or end),
           "build_cpu_share": (final["build_cpu_seconds"] / final["build_seconds"] / cores
                               if final["build_seconds"] else None), "host_cores": cores, "timeline": timeline}
    out["tpot_ratio_during_build"] = out["tpot_during_build_s"] / out["tpot_shifted_outside_build_s"]
    for k in ("drift", "candidate", "swap"):
        at = events[k]
        print(f"shift -> {k}: " + ("n/a" if at is None or events["shift"] is None else f"{at - events['shift']:.1f} s"))
    lr = out["local_ratio"]
    print(f"{out['requests']} requests, {out['failed']} failed; local ratio "
          + ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in lr.items())
          + f"; probe tokens equal before and after: {out['tokens_equal_before_after']}")
    share = out["build_cpu_share"]
    print(f"TPOT while the candidate built {1e3 * out['tpot_during_build_s']:.1f} ms ({len(during)} requests) vs "
          f"{1e3 * out['tpot_shifted_outside_build_s']:.1f} ms otherwise on the shifted traffic ({len(outside)}): "
          f"{out['tpot_ratio_during_build']:.3f}x; the build used "
          + ("n/a" if share is None else f"{share:.1%}") + f" of the host's {cores} cores")
    if out["tpot_outside_windows_s"]:
        w = [x / out["tpot_shifted_outside_build_s"] for x in out["tpot_outside_windows_s"]]
        print(f"TPOT of {len(w)} windows as long as the build outside it: {min(w):.3f}-{max(w):.3f}x the median outside")
    return out
