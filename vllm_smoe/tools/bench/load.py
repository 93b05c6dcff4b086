"""``smoe-bench load``: smoe in production under a workload shift, on one ``vllm serve``.

1. Cost: the same clients and prompts against a speculate server with smoe's metrics off and one
   with metrics on and sampled recording, in ``--cost-rounds`` rounds whose first arm alternates;
   median TPOT of each, and the ratio.
2. Shift: a speculate server (metrics on, sampled recording with a disk budget) serves held-out
   prompts of one domain to ``--clients`` streaming clients; at ``--seconds / 2`` the prompts
   switch to another domain; once ``smoe:drift`` reads 1 and ``--settle`` seconds of the new
   traffic are recorded, ``smoe-place advise`` builds a candidate from the recording made since
   the shift and ``POST /smoe/placement`` swaps it in while the clients keep going, for
   ``--after`` more seconds. /metrics is scraped every ``--scrape`` seconds: the local
   activation ratio of each interval is the plot's line.

The served placement is built here from the fixture's training trace of the first domain
(``smoe-place build``), so it fits the first half and not the second.
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
import urllib.request

import numpy as np

from .common import median_tpot


def domain_prompts(trace_path: str, domain: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` ids of every request of one domain of a trace."""
    from ...formats.trace import read_traces

    _, arr, _ = read_traces([trace_path], ("token_ids", "request_ids", "domain"))
    keep = arr["domain"] == domain
    tok, req = arr["token_ids"][keep], arr["request_ids"][keep]
    return [tok[req == r][:prompt_tokens].tolist() for r in np.unique(req)]


class Clients:
    """``n`` threads streaming greedy completions of the current prompt list until stopped; each
    request's (start, end, TTFT, TPOT, largest inter-token gap, error)."""

    def __init__(self, server, model: str, n: int, max_tokens: int, prompts: list[list[int]]):
        self.server, self.model, self.max_tokens = server, model, max_tokens
        self.prompts = prompts
        self.stop = threading.Event()
        self.done: list[dict] = []
        self.lock = threading.Lock()
        self.next = 0
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]

    def start(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def _prompt(self) -> list[int]:
        with self.lock:
            p = self.prompts[self.next % len(self.prompts)]
            self.next += 1
        return p

    def _loop(self) -> None:
        from .common import stream

        client = self.server.client()
        while not self.stop.is_set():
            prompt = self._prompt()
            t0 = time.perf_counter()
            try:
                start, times, n = stream(client, self.model, prompt, self.max_tokens)
                row = {"start": start, "end": time.perf_counter(), "ttft": times[0] - start if times else None,
                       "tpot": (times[-1] - times[0]) / (n - 1) if len(times) > 1 and n > 1 else None,
                       "max_gap": float(np.max(np.diff(times))) if len(times) > 1 else None,
                       "tokens": n, "error": None if n == self.max_tokens else f"{n} tokens"}
            except Exception as e:  # noqa: BLE001 - a failed request is a result of the load test
                row = {"start": t0, "end": time.perf_counter(), "error": repr(e)}
            with self.lock:
                self.done.append(row)

    def finish(self) -> list[dict]:
        self.stop.set()
        for t in self.threads:
            t.join(600)
        return self.done


_COUNTER = re.compile(r'^smoe:(local_expert_activations_total|expert_activations_total|drift)(?:\{[^}]*\})? (\S+)$')


def scrape(port: int) -> tuple[float, float, float]:
    """(local, all) expert activations served so far, summed over ranks and MoE layers, and
    smoe:drift (1 when the last window fell below the threshold)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    sums = {"local_expert_activations_total": 0.0, "expert_activations_total": 0.0, "drift": 0.0}
    for line in text.splitlines():
        m = _COUNTER.match(line)
        if m:
            sums[m.group(1)] += float(m.group(2))
    return sums["local_expert_activations_total"], sums["expert_activations_total"], min(sums["drift"], 1.0)


def post_placement(server, path: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/smoe/placement",
                                 json.dumps({"placement": path}).encode(), server.headers(), method="POST")
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.load(r)


def _summary(rows: list[dict], t0: float, t1: float) -> dict:
    inside = [r for r in rows if t0 <= r["start"] < t1]
    return {"requests": len(inside), "failed": sum(r["error"] is not None for r in inside), "tpot_s": median_tpot(inside)}


def _plot(path: str, timeline: list[dict], shift_t: float, drift_t: float | None, swap_t: float | None,
          swap_s: float | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ts = [p["t"] for p in timeline if p["ratio"] is not None]
    ax.plot(ts, [p["ratio"] for p in timeline if p["ratio"] is not None], marker=".", label="local activation ratio")
    ax.axvline(shift_t, color="gray", linestyle="--", label="traffic shifts domain")
    if drift_t is not None:
        ax.axvline(drift_t, color="tab:orange", linestyle=":", label="smoe:drift reads 1")
    if swap_t is not None:
        ax.axvspan(swap_t - (swap_s or 0), swap_t, color="tab:red", alpha=0.3)
        ax.axvline(swap_t, color="tab:red", label="live re-placement answered")
    ax.set_xlabel("seconds")
    ax.set_ylabel("share of expert activations local")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_auto(path: str, auto: dict) -> None:
    """The local ratio over time of an automatic re-placement (``result["auto"]``), the build
    shaded before the swap."""
    ev, build = auto["events_s"], auto.get("build_window_s")
    _plot(path, auto["timeline"], ev["shift"], ev["drift"], ev["swap"],
          None if not build or ev["swap"] is None else ev["swap"] - build[0],
          f"automatic re-placement (build_cpu_share {auto['settings'].get('build_cpu_share', 1.0):g}): "
          f"the shaded span is the candidate's build")


def run(a) -> int:
    import tempfile

    from ..cli_util import check_output_file
    from ..place import main as place
    from ..server_process import VllmServer
    from ...testbed import FIXTURE_MODEL, FIXTURE_TRACES
    from ...formats.trace import read_traces, write_trace

    for path, flag in ((a.json, "--json"), (a.plot, "--plot")):
        if path:
            check_output_file(path, flag)
    model = FIXTURE_MODEL
    work = a.work or tempfile.mkdtemp(prefix="smoe-bench-load-")
    os.makedirs(work, exist_ok=True)
    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([FIXTURE_TRACES["train"]], fields)
    keep = tr["domain"] == a.first_domain
    write_trace(os.path.join(work, "first.npz"), meta, **{k: v[keep] for k, v in tr.items()})
    served = os.path.join(work, "served.yaml")
    if place(["build", "--trace", os.path.join(work, "first.npz"), "--ep-size", str(a.tp), "-o", served]) != 0:
        return 1
    first = domain_prompts(FIXTURE_TRACES["heldout"], a.first_domain, a.prompt_tokens)
    then = domain_prompts(FIXTURE_TRACES["heldout"], a.then_domain, a.prompt_tokens)
    # the candidate learns from the first half of the shifted prompts (recorded before the swap);
    # after the swap the clients send the other half: the gain is measured on unseen requests
    then_seen, then_unseen = then[: len(then) // 2], then[len(then) // 2:]
    names = meta.domains
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(a.tp)), "VLLM_PLUGINS": "smoe"}
    base = ("--tensor-parallel-size", str(a.tp), "--enable-expert-parallel", "--plugin", "smoe", "--smoe-mode",
            "speculate", "--smoe-placement", served, "--smoe-log-interval", "1")
    record = os.path.join(work, "live")
    observed = base + ("--smoe-record", record, "--smoe-record-sample", str(a.sample), "--smoe-record-max-mb",
                       str(a.record_max_mb))
    result: dict = {"model": model, "tp": a.tp, "clients": a.clients, "max_tokens": a.max_tokens,
                    "first_domain": names[a.first_domain], "then_domain": names[a.then_domain], "work": work}

    # record_chunk_tokens has no flag: folded in with vLLM's --additional-config
    extra = {"record_chunk_tokens": a.chunk_tokens}
    observed += ("--additional-config", json.dumps({"smoe": extra}))
    # 1. cost of metrics and sampled recording: same clients, same prompts, side by side
    cost: dict = {"off": [], "on": []}
    arms = [("off", base + ("--smoe-metrics", "off")), ("on", observed)]
    for rnd in range(a.cost_rounds):
        for name, flags in arms if rnd % 2 == 0 else arms[::-1]:  # alternate which arm runs first
            with VllmServer(model, *flags, log=os.path.join(work, f"cost-{name}-{rnd}.log"), env=env,
                            api_key=a.api_key) as s:
                s.complete(first[:2], max_tokens=4)
                c = Clients(s, model, a.clients, a.max_tokens, first).start()
                time.sleep(a.cost_seconds)
                rows = c.finish()
            cost[name].append(median_tpot(rows))
            print(f"cost round {rnd}, metrics {name:>3}: TPOT {1e3 * cost[name][-1]:.1f} ms over {len(rows)} "
                  f"requests", flush=True)
    if a.cost_rounds:
        off, on = float(np.median(cost["off"])), float(np.median(cost["on"]))
        ratios = [b / c for b, c in zip(cost["on"], cost["off"])]
        result["cost"] = {"tpot_off_s": cost["off"], "tpot_on_s": cost["on"], "ratio_on_off": on / off,
                          "round_ratios": ratios}
        print(f"metrics + {a.sample:.0%} sampled recording: median TPOT {1e3 * on:.1f} ms vs {1e3 * off:.1f} ms off "
              f"({on / off:.3f}x; per round {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)

    # 2. the shift and the live re-placement
    if a.auto:  # nobody posts: smoe's controller re-places by itself (load_auto.py)
        from .common import write_json
        from .load_auto import auto_settings, shift_auto

        flags = base + ("--smoe-record", record, "--smoe-record-sample", str(a.sample), "--smoe-record-max-mb",
                        str(a.record_max_mb), "--smoe-auto-replace", "on", "--additional-config",
                        json.dumps({"smoe": {**extra, "auto_replace": auto_settings(a)}}))
        with VllmServer(model, *flags, log=os.path.join(work, "auto.log"), env=env, api_key=a.api_key) as s:
            s.complete(first[:2], max_tokens=4)
            result["auto"] = shift_auto(a, s, Clients, scrape, first, then_seen, then_unseen, probe=then_unseen[:4])
        write_json(a.json, result)
        if a.plot:
            plot_auto(a.plot, result["auto"])
        return 0
    timeline: list[dict] = []
    swap: dict = {}
    with VllmServer(model, *observed, log=os.path.join(work, "shift.log"), env=env, api_key=a.api_key) as s:
        s.complete(first[:2], max_tokens=4)
        t0 = time.perf_counter()
        clients = Clients(s, model, a.clients, a.max_tokens, first).start()
        last = scrape(s.port)[:2]
        shift_t = a.seconds / 2
        shifted = False
        drift_t = None
        before_shift: set[str] = set()
        false_drift: list[float] = []
        worker: threading.Thread | None = None

        def replace(files: list[str]) -> None:  # advise from the recording, then the live swap
            cand, js = os.path.join(work, "candidate.yaml"), os.path.join(work, "advise.json")
            tb = time.perf_counter()
            if place(["advise", "--trace", *files, "--placement", served, "-o", cand, "--json", js]) != 0:
                swap["error"] = "smoe-place advise failed"
                return
            built = time.perf_counter() - tb
            answer = post_placement(s, cand)
            with clients.lock:  # requests the candidate never saw
                clients.prompts = then_unseen
            swap.update(t=time.perf_counter() - t0, advise_s=built, answer=answer, advise=json.load(open(js)),
                        files=len(files))
            print(f"t={swap['t']:6.1f} s  swapped to {cand}, built from {len(files)} recorded files (advise "
                  f"{built:.1f} s): {answer['moved_slots']} slots moved, swap took {answer['seconds']:.3f} s "
                  f"(workers' apply {answer['worker_seconds']:.3f} s)", flush=True)

        while True:
            time.sleep(a.scrape)
            cur = scrape(s.port)
            now = time.perf_counter() - t0
            d_local, d_all = cur[0] - last[0], cur[1] - last[1]
            timeline.append({"t": now, "ratio": d_local / d_all if d_all else None, "activations": d_all,
                             "drift": cur[2]})
            last = cur[:2]
            print(f"t={now:6.1f} s  local ratio {timeline[-1]['ratio'] or float('nan'):.3f}  drift {cur[2]:.0f}",
                  flush=True)
            if not shifted and now >= shift_t:
                before_shift = set(glob.glob(os.path.join(record, "trace-*.npz")))
                with clients.lock:
                    clients.prompts = then_seen
                shifted, shift_t = True, now
                print(f"t={now:6.1f} s  traffic shifts to {names[a.then_domain]}", flush=True)
            if not shifted and cur[2] >= 1:
                false_drift.append(now)  # the workload has not changed: a drift here is a false alarm
            if shifted and drift_t is None and cur[2] >= 1:
                drift_t = now
                print(f"t={now:6.1f} s  smoe:drift reads 1", flush=True)
            if worker is None and drift_t is not None and now >= shift_t + a.settle:
                files = sorted(set(glob.glob(os.path.join(record, "trace-*.npz"))) - before_shift)
                if files:  # the shifted traffic, as the recorder kept it
                    worker = threading.Thread(target=replace, args=(files,), daemon=True)
                    worker.start()
            if "t" in swap and now >= swap["t"] + a.after or "error" in swap or now > a.seconds * 4:
                break
        rows = clients.finish()
    end = time.perf_counter() - t0
    if "t" not in swap:
        print(f"no live re-placement happened ({swap.get('error') or 'no drift or no recording after the shift'})")
    for r in rows:
        r["start"] -= t0
        r["end"] -= t0
    swap_t = swap.get("t")

    def mean_ratio(lo, hi):
        pts = [p for p in timeline if lo < p["t"] <= hi and p["ratio"] is not None]
        w = sum(p["activations"] for p in pts)
        return sum(p["ratio"] * p["activations"] for p in pts) / w if w else None

    phases = {"before shift": (0, shift_t), "shifted, old placement": (shift_t, swap_t or end),
              "after live re-placement": (swap_t or end, end)}
    result["phases"] = {name: {**_summary(rows, lo, hi), "local_ratio": mean_ratio(lo + a.scrape, hi)}
                        for name, (lo, hi) in phases.items()}
    spanning = [r for r in rows if swap_t is not None and r["start"] < swap_t < r["end"] and r.get("max_gap")]
    result.update(failed=sum(r["error"] is not None for r in rows), requests=len(rows), swap=swap,
                  api_key=a.api_key is not None, drift_before_shift_t=false_drift,
                  timeline=timeline, shift_t=shift_t, drift_t=drift_t, seconds=end,
                  max_gap_across_swap_s=max((r["max_gap"] for r in spanning), default=None),
                  median_gap_s=float(np.median([r["tpot"] for r in rows if r.get("tpot")])))
    print(f"{len(rows)} requests, {result['failed']} failed; {a.clients} clients, {end:.0f} s"
          f"{' behind an API key' if a.api_key else ''}; smoe:drift read 1 before the shift at "
          f"{len(false_drift)} scrapes")
    for name, p in result["phases"].items():
        ratio = "n/a" if p["local_ratio"] is None else f"{p['local_ratio']:.3f}"
        print(f"{name:>24}: local ratio {ratio}, {p['requests']} requests ({p['failed']} failed), "
              f"TPOT {1e3 * p['tpot_s']:.1f} ms")
    if swap:
        print(f"swap took {swap['answer']['seconds']:.3f} s (prepare + apply, between steps); largest inter-token "
              f"gap of a request across "
              f"it {1e3 * (result['max_gap_across_swap_s'] or float('nan')):.0f} ms vs median TPOT "
              f"{1e3 * result['median_gap_s']:.0f} ms")
    if a.plot:
        _plot(a.plot, timeline, shift_t, drift_t, swap_t, swap.get("answer", {}).get("seconds"),
              f"TP={a.tp} speculate, {a.clients} clients: {names[a.first_domain]} -> {names[a.then_domain]} "
              f"traffic, live re-placement from the recording")
        print(f"plot: {a.plot}")
    from .common import write_json

    write_json(a.json, result)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("load", help="speculate under a workload shift: metrics cost, drift, live re-placement from "
                                    "the live recording, failed requests, swap pause (needs vLLM; plot)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=240.0,
                   help="the traffic shifts at half this many seconds (default 240)")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds of shifted traffic recorded before the candidate is built, once smoe:drift reads 1 "
                        "(default 60)")
    p.add_argument("--after", type=float, default=90.0, help="seconds of load after the swap (default 90)")
    p.add_argument("--scrape", type=float, default=5.0, help="seconds between /metrics scrapes (default 5)")
    p.add_argument("--cost-seconds", type=float, default=45.0)
    p.add_argument("--cost-rounds", type=int, default=3,
                   help="off/on rounds, the first arm alternating (0 = skip; default 3)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--first-domain", type=int, default=0, help="fixture domain index before the shift (0 python)")
    p.add_argument("--then-domain", type=int, default=3, help="after the shift (3 math)")
    p.add_argument("--sample", type=float, default=0.5, help="record_sample of the observed servers")
    p.add_argument("--record-max-mb", type=float, default=64.0)
    p.add_argument("--chunk-tokens", type=int, default=2048, help="record_chunk_tokens (rotation)")
    p.add_argument("--api-key", default=None,
                   help="serve with vLLM's --api-key KEY: clients and the swap send it (smoe's routes need it too)")
    p.add_argument("--work", default=None, help="directory for logs, recordings and placements (default: a temp dir)")
    p.add_argument("--plot", default=None, help="PNG of the local ratio over time")
    p.add_argument("--json", default=None)
    p.add_argument("--auto", action="store_true",
                   help="no operator: the server re-places by itself (--smoe-auto-replace); reports the times from "
                        "the shift to drift, candidate and swap, and the TPOT cost of the candidate's build")
    p.add_argument("--auto-hold", type=float, default=10.0, help="with --auto: auto_replace.hold_s (default 10)")
    p.add_argument("--auto-max-moves", type=float, default=0.25, help="with --auto: auto_replace.max_moves")
    p.add_argument("--auto-margin", type=float, default=0.02, help="with --auto: auto_replace.margin")
    p.add_argument("--auto-build-cpu-share", type=float, default=1.0,
                   help="with --auto: auto_replace.build_cpu_share (default 1: no throttle)")
    p.add_argument("--auto-window-tokens", type=int, default=1 << 16,
                   help="with --auto: auto_replace.window_tokens (default 65536)")
    p.set_defaults(fn=run)
