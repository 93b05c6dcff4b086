"""``smoe-bench``: benchmarks that are not unit tests (results go to BENCHMARKS.md).

  smoe-bench ilp     -- every placement method against the exact ILP bound on small instances
  smoe-bench plugin  -- start-up time and throughput of plain vLLM vs --plugin smoe (place, record)
  smoe-bench serve   -- vllm serve at TP=2: plain vs mode speculate (tok/s, TTFT, TPOT, p90 ITL)
  smoe-bench comm    -- one EP MoE layer on N gloo ranks: baseline EP vs speculative shuffling
  smoe-bench kernels -- on a CUDA GPU: speculate's assignment + permutation kernel vs the torch ops
  smoe-bench place-scale -- smoe-place build/evaluate on a large trace: wall time, peak memory of all its processes
  smoe-bench load    -- speculate under a workload shift: metrics cost, live re-placement from the recording, plot
  smoe-bench cluster -- vLLM nodes in network namespaces over a link at a real cluster's proportions (needs root)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _ilp(a) -> int:
    from .placement.counts import layer_counts
    from .placement.ilp import solve_ilp
    from .placement.layout import SOLVERS
    from .synthetic import MoEShape, generate

    if a.objective == "bytes":
        return _ilp_bytes(a)
    methods = ("coclust", "alternating", "ceo", "metis", "round_robin", "linear")
    gaps = {m: [] for m in methods}
    print(f"instances: {a.instances} x (vocab {a.vocab}, {a.experts} experts, top-{a.top_k}, {a.tokens} tokens, "
          f"ep {a.ep_size}), capacity {a.capacity}, expert-load cap {a.max_expert_load}")
    for seed in range(a.instances):
        ch = next(generate(MoEShape(1, a.experts, a.top_k, a.vocab, 64), a.tokens, seed=seed, hotness=a.hotness,
                           token_zipf=0.8))
        ids, A, occ = layer_counts(ch["token_ids"], ch["topk_ids"][:, 0], a.experts)
        t0 = time.perf_counter()
        opt, _, _, proven = solve_ilp(A.toarray(), occ, a.ep_size, a.capacity, max_expert_load=a.max_expert_load,
                                      time_limit=a.time_limit)
        secs = time.perf_counter() - t0
        row = []
        for m in methods:
            if m == "coclust":
                from .placement.coclust import place_coclust

                e2r = place_coclust(A, occ, a.ep_size, capacity=a.capacity, seed=seed,
                                    max_expert_load=a.max_expert_load or np.inf)
            else:
                e2r = SOLVERS[m](A, occ, a.ep_size, a.capacity, 0.5, seed)
            val, *_ = solve_ilp(A.toarray(), occ, a.ep_size, a.capacity, fixed_expert2rank=e2r,
                                max_expert_load=a.max_expert_load, time_limit=a.time_limit)
            gaps[m].append(1.0 - val / opt)  # NaN-free: a method breaking the load cap is infeasible
            row.append(f"{m} {100 * gaps[m][-1]:5.1f}%")
        print(f"seed {seed}: ILP {opt:.0f} ({'optimal' if proven else 'time limit'}, {secs:.1f} s); gaps: "
              + ", ".join(row))
    print("mean gap to the ILP bound: " + ", ".join(f"{m} {100 * np.mean(g):.2f}%" for m, g in gaps.items()))
    print("max gap: " + ", ".join(f"{m} {100 * np.max(g):.2f}%" for m, g in gaps.items()))
    return 0


def _ilp_bytes(a) -> int:
    """Every method's de-duplicated remote rows (tokens by the capped best-rank rule) against the
    exact optimum of the bytes program, on small synthetic instances."""
    from .placement.bytes import layer_instances, remote_bytes
    from .placement.counts import assign_token_ids, layer_counts, rank_scores
    from .placement.ilp import solve_ilp_bytes
    from .placement.layout import NEEDS_INSTANCES, SOLVERS
    from .synthetic import MoEShape, generate

    methods = ("bytes", "coclust", "alternating", "ceo", "metis", "round_robin", "linear")
    mel = a.max_expert_load or 1.10
    gaps: dict[str, list[float]] = {m: [] for m in methods}
    loads: dict[str, list[float]] = {m: [] for m in methods}
    print(f"instances: {a.instances} x (vocab {a.vocab}, {a.experts} experts, top-{a.top_k}, {a.tokens} tokens, "
          f"ep {a.ep_size}), capacity {a.capacity}, expert-load cap {mel} (bytes program and coclust/bytes)")
    for seed in range(a.instances):
        ch = next(generate(MoEShape(1, a.experts, a.top_k, a.vocab, 64), a.tokens, seed=seed, hotness=a.hotness,
                           token_zipf=0.8))
        tok, topk = ch["token_ids"], ch["topk_ids"][:, 0]
        ids, A, occ = layer_counts(tok, topk, a.experts)
        inst = layer_instances(np.searchsorted(ids, tok), topk)
        t0 = time.perf_counter()
        opt, _, _, proven = solve_ilp_bytes(A.toarray(), occ, inst, a.ep_size, a.capacity, mel, a.time_limit)
        secs = time.perf_counter() - t0
        load = np.asarray(A.sum(axis=0)).ravel()
        row = []
        for m in methods:
            kw = {"inst": inst} if m in NEEDS_INSTANCES else {}
            e2r = SOLVERS[m](A, occ, a.ep_size, a.capacity, 0.5, seed, mel, **kw)
            got = remote_bytes(inst[1], inst[2], inst[0], e2r,
                               assign_token_ids(rank_scores(A, e2r, a.ep_size), occ, a.capacity))
            rl = np.bincount(e2r, weights=load, minlength=a.ep_size)
            gaps[m].append(got / opt - 1.0)
            loads[m].append(rl.max() / rl.mean())
            row.append(f"{m} {100 * gaps[m][-1]:+5.1f}% (load {loads[m][-1]:.2f})")
        print(f"seed {seed}: ILP {opt:.0f} rows ({'optimal' if proven else 'time limit'}, {secs:.1f} s); "
              + ", ".join(row))
    print("mean excess rows over the optimum: " + ", ".join(
        f"{m} {100 * np.mean(g):.2f}% (load {np.mean(loads[m]):.2f})" for m, g in gaps.items()))
    return 0


def _trace_prompts(trace_path: str, requests: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` token ids of the first ``requests`` requests of a trace."""
    from .trace import open_trace

    t = open_trace(trace_path)
    tok, req = t["token_ids"], t["request_ids"]
    return [tok[req == r][:prompt_tokens].tolist() for r in np.unique(req)[:requests]]


def _placement_arg(given: str | None, default: str, ep_size: int, build_flags: str = "") -> str:
    """--placement, or the repository's configs/<default>; a missing file is a usage error."""
    path = given or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", default)
    if not os.path.isfile(path):
        raise ValueError(f"--placement {path}: no such file (the default lives in the repository's configs/; "
                         f"build one with smoe-place build {build_flags}--ep-size {ep_size})")
    return path


def _plugin(a) -> int:
    import tempfile

    from .server_process import VllmServer
    from .testbed import FIXTURE_MODEL, FIXTURE_TRACES

    prompts = _trace_prompts(FIXTURE_TRACES["heldout"], a.requests, a.prompt_tokens)
    work = tempfile.mkdtemp(prefix="smoe-bench-")
    placement = _placement_arg(a.placement, "tiny-4dom-ep4.yaml", 4)
    runs = {
        "plain": (),
        "place": ("--plugin", "smoe", "--smoe-placement", placement),
        "record": ("--plugin", "smoe", "--smoe-record", os.path.join(work, "traces")),
    }
    res = {}
    for rnd in range(a.rounds):  # interleaved rounds: drift of a shared machine hits every config alike
        for name, flags in runs.items():
            with VllmServer(FIXTURE_MODEL, *flags, log=os.path.join(work, f"{name}-{rnd}.log")) as s:
                from concurrent.futures import ThreadPoolExecutor

                c = s.client()
                s.complete(prompts[:2], max_tokens=4)  # warm the server
                t0 = time.perf_counter()
                with ThreadPoolExecutor(a.concurrency) as ex:
                    list(ex.map(lambda p: c.completions.create(model=FIXTURE_MODEL, prompt=p, max_tokens=a.max_tokens,
                                                               temperature=0.0, extra_body={"ignore_eos": True}),
                                prompts))
                secs = time.perf_counter() - t0
            r = res.setdefault(name, {"start_s": [], "tok_s": []})
            r["start_s"].append(s.started_s)
            r["tok_s"].append(len(prompts) * a.max_tokens / secs)
            print(f"round {rnd} {name:>6}: start {s.started_s:5.1f} s, {r['tok_s'][-1]:6.1f} output tokens/s",
                  flush=True)
    base = res["plain"]
    print(f"{a.requests} requests x {a.max_tokens} tokens, {a.concurrency} concurrent, {a.rounds} rounds (median)")
    for name, r in res.items():
        print(f"{name:>6}: start-up {np.median(r['start_s']):5.1f} s ({np.median(r['start_s']) - np.median(base['start_s']):+.1f} s "
              f"vs plain), throughput {np.median(r['tok_s']):6.1f} tok/s "
              f"({np.median(r['tok_s']) / np.median(base['tok_s']):.3f}x plain)")
    return 0


def _stream(client, model: str, prompt, max_tokens: int) -> tuple[float, list[float], int]:
    """One streamed greedy completion: (start, arrival time of each chunk, completion tokens)."""
    t0 = time.perf_counter()
    times, n = [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.choices:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return t0, times, n


def _drive(server, model: str, prompts, concurrency: int, max_tokens: int, into: dict) -> None:
    """Send every prompt streamed from ``concurrency`` clients; add the run's output tok/s and
    each request's TTFT, TPOT and inter-token gaps to ``into`` (lists, created on first use)."""
    from concurrent.futures import ThreadPoolExecutor

    c = server.client()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda p: _stream(c, model, p, max_tokens), prompts))
    secs = time.perf_counter() - t0
    for key in ("tok_s", "ttft", "tpot", "itl"):
        into.setdefault(key, [])
    into["tok_s"].append(sum(n for _, _, n in outs) / secs)
    into["ttft"] += [ts[0] - st for st, ts, _ in outs if ts]
    into["tpot"] += [(ts[-1] - ts[0]) / (n - 1) for _, ts, n in outs if len(ts) > 1 and n > 1]
    into["itl"] += [d for _, ts, _ in outs for d in np.diff(ts)]


LATENCY = {"tok_s": ("output tok/s", lambda v: float(np.median(v))),  # column: (label, statistic)
           "ttft": ("TTFT ms", lambda v: 1e3 * float(np.median(v))),
           "tpot": ("TPOT ms", lambda v: 1e3 * float(np.median(v))),
           "itl": ("p90 ITL ms", lambda v: 1e3 * float(np.percentile(v, 90)))}


def _null_nan(x):
    if isinstance(x, float) and not np.isfinite(x):
        return None  # strict JSON has no NaN
    if isinstance(x, dict):
        return {k: _null_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_null_nan(v) for v in x]
    return x


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(_null_nan(payload), f, indent=1)


_SPEC_LINE = (r"speculate \(predictor [\w-]+\): rank (\d+) served ([0-9.]+) of its expert activations locally "
              r"\((\d+) tokens\)(?:; sparse all2all: ([0-9.]+) remote \(token, rank\) pairs and ([0-9.]+) B per token)?")
_DP_LINE = (r"dp rank (\d+) served ([0-9.]+) of its requests' expert activations locally \((\d+) tokens"
            r".*?([0-9.]+) remote \(token, rank\) pairs and ([0-9.]+) B per token")


def _rank_numbers(lines, pattern: str) -> dict:
    """Every rank's last line of ``pattern`` (groups: rank, local share, tokens, remote pairs and
    bytes per token, the last two optional), combined over ranks weighted by their tokens."""
    import re

    last: dict[int, tuple] = {}
    pat = re.compile(pattern)
    for ln in lines:
        m = pat.search(ln)
        if m:
            last[int(m.group(1))] = (float(m.group(2)), int(m.group(3)),
                                     *(None if m.group(i) is None else float(m.group(i)) for i in (4, 5)))
    if not last:
        return {}
    tok = max(1, sum(v[1] for v in last.values()))
    out = {"local_share": sum(v[0] * v[1] for v in last.values()) / tok,
           "tokens_per_rank": {r: v[1] for r, v in sorted(last.items())}}
    if all(v[2] is not None for v in last.values()):
        out["remote_pairs_per_token"] = sum(v[2] * v[1] for v in last.values()) / tok
        out["bytes_per_token_layer"] = sum(v[3] * v[1] for v in last.values()) / tok
    return out


def _dp_numbers(log_path: str) -> dict:
    """Served-step locality of every DP rank from its last ``dp rank d served ...`` log line,
    combined over ranks weighted by their tokens: local activation share, remote (token, rank)
    pairs and bytes per token and MoE layer; plus the front ends' routing counts."""
    import re

    with open(log_path) as f:
        lines = f.readlines()
    out = _rank_numbers(lines, _DP_LINE)
    routed = {}
    rpat = re.compile(r"\((ApiServer_\d+|APIServer) pid=\d+\).*smoe dp routing: (\d+) requests: (\d+) by the placement "
                      r"\((\d+) on their best-scoring engine\), (\d+) left to vLLM's balancer, (\d+) with their own rank")
    for ln in lines:
        m = rpat.search(ln)
        if m:
            routed[m.group(1)] = tuple(int(m.group(i)) for i in range(2, 7))
    if out and routed:
        out["routed"] = {k: sum(v[i] for v in routed.values()) for i, k in
                         enumerate(("requests", "by_placement", "best_engine", "by_vllm", "explicit"))}
    return out


def _mixed_prompts(trace_path: str, requests: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """``requests`` requests drawn evenly over the whole trace (every workload in it), in a
    seeded random order: a mix of clients, not one workload after another."""
    from .trace import open_trace

    t = open_trace(trace_path)
    tok, req = t["token_ids"], t["request_ids"]
    ids = np.unique(req)
    pick = ids[np.linspace(0, ids.size - 1, min(requests, ids.size)).round().astype(int)]
    pick = pick[np.random.default_rng(seed).permutation(pick.size)]
    return [tok[req == r][:prompt_tokens].tolist() for r in pick]


def _dp(a) -> int:
    """vllm serve --data-parallel-size N --enable-expert-parallel: vLLM's default (linear experts,
    its balancer), smoe's placement with vLLM's balancer, and smoe's placement with smoe's request
    routing; all on smoe's sparse all2all, whose counters give locality and bytes (vLLM's CPU
    build only)."""
    import tempfile

    from .cli_util import check_output_file
    from .server_process import VllmServer

    if a.json:
        check_output_file(a.json, "--json")
    from .testbed import FIXTURE_MODEL, FIXTURE_TRACES

    model = a.model or FIXTURE_MODEL
    prompts = _mixed_prompts(a.prompts_trace or FIXTURE_TRACES["heldout"], a.requests, a.prompt_tokens, a.seed)
    work = tempfile.mkdtemp(prefix="smoe-bench-dp-")
    placement = _placement_arg(a.placement, f"tiny-4dom-dp{a.dp}.yaml", a.dp, "--mode dp ")
    base = ("--data-parallel-size", str(a.dp), "--enable-expert-parallel", "--plugin", "smoe",
            "--smoe-log-interval", "0.5") + (("--api-server-count", str(a.api_servers)) if a.api_servers else ())
    runs = {"vllm-default": base,
            "placed": base + ("--smoe-placement", placement, "--smoe-dp-routing", "off"),
            "smoe-routed": base + ("--smoe-placement", placement)}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(a.dp))} if a.cpu_bind else None
    res: dict = {}
    for rnd in range(a.rounds):  # interleaved rounds: drift of a shared machine hits every config alike
        for name, flags in runs.items():
            r = res.setdefault(name, {"dp": []})
            with VllmServer(model, *flags, log=os.path.join(work, f"{name}-{rnd}.log"), env=env) as s:
                s.complete(prompts[:2], max_tokens=4)  # warm the server
                _drive(s, model, prompts, a.concurrency, a.max_tokens, r)
                # counters log on the next step after their interval: one more interval, then a
                # one-token request steps every rank (and routes once) so the last lines cover the run
                time.sleep(0.6)
                s.client().completions.create(model=model, prompt=prompts[0][:1], max_tokens=1, temperature=0.0)
                time.sleep(0.3)
            r["dp"].append(_dp_numbers(s.log))
            d = r["dp"][-1]
            print(f"round {rnd} {name:>12}: {r['tok_s'][-1]:6.1f} output tok/s, local {d.get('local_share', 0):.3f}, "
                  f"{d.get('bytes_per_token_layer', 0):.0f} B per token and layer"
                  + (f", routed {d['routed']}" if "routed" in d else ""), flush=True)
    print(f"{len(prompts)} requests x {a.max_tokens} tokens (prompts {a.prompt_tokens} tokens, mixed workloads), "
          f"DP={a.dp} + EP, {a.concurrency} concurrent, {a.rounds} rounds; logs in {work}")
    cols = {k: LATENCY[k] for k in ("tok_s", "ttft", "tpot")}
    wire = ("local_share", "remote_pairs_per_token", "bytes_per_token_layer")
    print(f"{'config':>12} " + " ".join(f"{label:>14}" for label, _ in cols.values())
          + "   local   pairs/tok   B/tok/layer")
    if not any(d for r in res.values() for d in r["dp"]):
        print("warning: no 'dp rank d served ...' log lines: locality and bytes come from smoe's sparse all2all, "
              "on vLLM's CPU build only", file=sys.stderr)
    ref = {k: f(res["vllm-default"][k]) for k, (_, f) in cols.items()}
    ref_w = {k: float(np.mean([d.get(k, np.nan) for d in res["vllm-default"]["dp"]])) for k in wire}

    def ratio(x, y):
        return x / y if y and np.isfinite(x) and np.isfinite(y) else float("nan")
    summary = {}
    for name, r in res.items():
        vals = {k: f(r[k]) for k, (_, f) in cols.items()}
        w = {k: float(np.mean([d.get(k, np.nan) for d in r["dp"]])) for k in wire}
        summary[name] = {**vals, **w, "vs_vllm_default": {**{k: ratio(vals[k], ref[k]) for k in cols},
                                                          **{k: ratio(w[k], ref_w[k]) for k in wire}},
                         "flags": list(runs[name]), "rounds": r["dp"]}
        print(f"{name:>12} " + " ".join(f"{vals[k]:8.1f} {ratio(vals[k], ref[k]):4.2f}x" for k in cols)
              + f"   {w['local_share']:.3f}   {w['remote_pairs_per_token']:.3f}   {w['bytes_per_token_layer']:7.0f} "
              f"({ratio(w['bytes_per_token_layer'], ref_w['bytes_per_token_layer']):.2f}x)")
    print("(ratios vs vllm-default; locality and bytes from the DP ranks' served steps, mean over rounds)")
    _write_json(a.json, {"dp": a.dp, "requests": len(prompts), "max_tokens": a.max_tokens, "rounds": a.rounds,
                         "concurrency": a.concurrency, "model": model, "placement": placement, "configs": summary})
    return 0


def _is_mla(model_dir: str) -> bool:
    """Whether the checkpoint's attention is DeepSeek's MLA (its config names a kv_lora_rank)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return bool(json.load(f).get("kv_lora_rank"))


def _serve(a) -> int:
    import tempfile

    from .cli_util import check_output_file
    from .server_process import VllmServer

    if a.json:
        check_output_file(a.json, "--json")
    from .testbed import FIXTURE_MODEL, FIXTURE_TRACES

    model = a.model or FIXTURE_MODEL
    prompts = _trace_prompts(a.prompts_trace or FIXTURE_TRACES["heldout"], a.requests, a.prompt_tokens)
    work = tempfile.mkdtemp(prefix="smoe-bench-serve-")
    placement = _placement_arg(a.placement, "tiny-4dom-ep2.yaml", a.tp)
    ep = ("--enable-expert-parallel", "--plugin", "smoe", "--smoe-log-interval", "1")
    spec = ep + ("--smoe-mode", "speculate", "--smoe-placement", placement)
    # MLA models: vLLM's CPU rotary op needs the plugin's fix, so their plain run is
    # `--plugin smoe` alone (the CPU fixes: rope, experts, communicator; no placement, no
    # order): the same function in every configuration
    mla = _is_mla(model)
    runs = {"plain": ("--plugin", "smoe") if mla else (), "vllm-ep": ep + ("--smoe-all2all", "vllm"),
            "speculate": spec}
    if a.with_baselines:
        runs["spec-agrs"] = spec + ("--smoe-all2all", "vllm")  # smoe's order, vLLM's allgather-reducescatter
        runs["sparse-random"] = spec + ("--smoe-predictor", "random")  # the sparse manager without speculation
    if not mla:  # one order per step there: the gate cannot run ahead of each layer
        runs["spec-router"] = spec + ("--smoe-predictor", "router")  # vLLM's gate run ahead: exact ranks
    tp = ("--tensor-parallel-size", str(a.tp))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(a.tp))} if a.cpu_bind else None
    res: dict = {}
    for rnd in range(a.rounds):  # interleaved rounds: drift of a shared machine hits every config alike
        for name, flags in runs.items():
            r = res.setdefault(name, {})
            with VllmServer(model, *tp, *flags, log=os.path.join(work, f"{name}-{rnd}.log"), env=env) as s:
                s.complete(prompts[:2], max_tokens=4)  # warm the server
                _drive(s, model, prompts, a.concurrency, a.max_tokens, r)
            print(f"round {rnd} {name:>13}: {r['tok_s'][-1]:6.1f} output tok/s", flush=True)
            with open(s.log) as f:
                lines = f.readlines()
            online = _rank_numbers(lines, _SPEC_LINE)
            if online:  # every rank's last counters, weighted by its tokens
                print(f"    all ranks: {online['local_share']:.3f} of activations local" + (
                      f", {online['bytes_per_token_layer']:.0f} B per token and MoE layer on the sparse all2all"
                      if "bytes_per_token_layer" in online else ""), flush=True)
                r.setdefault("log", []).append(online)
    print(f"{len(prompts)} requests x {a.max_tokens} tokens (prompts {a.prompt_tokens} tokens), TP={a.tp}, "
          f"{a.concurrency} concurrent, {a.rounds} rounds; logs in {work}")
    cols = LATENCY
    print(f"{'config':>13} " + " ".join(f"{label:>14}" for label, _ in cols.values()))
    base = {k: f(res["plain"][k]) for k, (_, f) in cols.items()}
    summary = {}
    for name, r in res.items():
        vals = {k: f(r[k]) for k, (_, f) in cols.items()}
        logs = r.get("log") or []
        summary[name] = {**vals, "vs_plain": {k: vals[k] / base[k] for k in cols}, "flags": list(runs[name]),
                         "rounds_counters": logs, **{k: v for k, v in (logs[-1] if logs else {}).items()
                                                     if k != "tokens_per_rank"}}
        print(f"{name:>13} " + " ".join(f"{vals[k]:8.1f} {vals[k] / base[k]:4.2f}x" for k in cols))
    print("(ratios vs plain; medians over all requests of all rounds, throughput median over rounds)")
    if "vllm-ep" in summary and "speculate" in summary:
        print(f"speculate TPOT / vllm-ep TPOT: {summary['speculate']['tpot'] / summary['vllm-ep']['tpot']:.2f}x")
    _write_json(a.json, {"tp": a.tp, "requests": len(prompts), "max_tokens": a.max_tokens, "rounds": a.rounds,
                         "concurrency": a.concurrency, "model": model, "placement": placement, "configs": summary})
    return 0


def gloo_collectives(world: int):
    """(gather, reduce_scatter) over the default process group, shaped as SparseExchange takes
    them: [n, ...] -> [world * n, ...] and [world * n, ...] -> [n, ...] summed over ranks."""
    import torch.distributed as dist

    def gather(x):
        o = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(o, x.contiguous())
        return o

    def reduce_scatter(x):
        o = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(o, x.contiguous())
        return o
    return gather, reduce_scatter


def _comm_worker(rank, world, init, plan, reps, out):
    """One MoE layer's communication on gloo ranks, both as served: vLLM's sequence-parallel EP
    with allgather-reducescatter on contiguous chunks, and smoe's predicted chunks with the sparse
    exchange. Experts are a cheap stand-in (row x its local weight) so the time is communication
    and bookkeeping."""
    import torch
    import torch.distributed as dist

    from .serving.sparse_a2a import SparseExchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    H = plan["hidden"]
    g = torch.Generator().manual_seed(0)

    gather, reduce_scatter = gloo_collectives(world)

    def experts(x, w, ids, owner):
        return x * (w * (owner[ids] == rank)).sum(dim=1, keepdim=True)

    times = {"baseline": [], "smoe": []}
    nbytes = {"baseline": 0.0, "smoe": 0.0}
    last = {}
    for step in plan["steps"]:
        ids_all = torch.as_tensor(step["ids"]).long()
        T, K = ids_all.shape
        c = -(-T // world)
        x_all = torch.randn(T, H, generator=g)
        w_all = torch.full((T, K), 1.0 / K)
        for _ in range(reps):  # alternate the pipelines: drift of a shared machine hits both alike
            for name in ("baseline", "smoe"):
                order = torch.as_tensor(step["order"]) if name == "smoe" else torch.arange(T)
                owner = torch.as_tensor(plan[name]["expert2rank"]).long()
                rows = order[rank * c: (rank + 1) * c]
                x, w, ids = x_all[rows], w_all[rows], ids_all[rows]
                dist.barrier()
                t0 = time.perf_counter()
                if name == "smoe":
                    ex = SparseExchange(rank, world, owner, gather, reduce_scatter, exact=True)
                    y = ex.combine(experts(*ex.dispatch(x, w, ids), owner))
                    sent = int(ex.stats[2])
                else:  # equal chunks: all-gather everything, reduce-scatter full-size partial sums
                    full = experts(gather(x), gather(w), gather(ids), owner)
                    part = full.new_empty((c, H))
                    dist.reduce_scatter_tensor(part, full)
                    y, sent = part, (world - 1) * x.shape[0] * (2 * H * x.element_size() + 8 * K)
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                assert y.shape == x.shape
                last[name] = sent  # bytes do not depend on the repetition
        for name in nbytes:
            nbytes[name] += last[name]
    result = {n: {"seconds": float(np.median(times[n])), "bytes": nbytes[n] / len(plan["steps"])} for n in times}
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def _comm_plan(a) -> dict:
    """Steps of replayed routing and both pipelines' placements/predictions (numpy only)."""
    from .placement.assign import assign_tokens, chunk_caps, contiguous_tokens
    from .placement.layout import place_model
    from .placement.metrics import evaluate
    from .placement.peers import place_linear
    from .placement.predict import predict_layer
    from .placement.routing_counts import RoutingCounts
    from .synthetic import SHAPES, generate
    from .testbed import FIXTURE_TRACES
    from .trace import open_trace

    if a.routing == "testbed":
        tr, te = open_trace(FIXTURE_TRACES["train"]), open_trace(FIXTURE_TRACES["heldout"])
        train_tok, train_topk = tr["token_ids"], tr["topk_ids"][:, a.layer: a.layer + 1]
        test_tok, test_topk = te["token_ids"], te["topk_ids"][:, a.layer: a.layer + 1]
        vocab, E = tr.meta.vocab_size, tr.meta.num_experts
    else:
        shape = SHAPES[a.routing]
        chunks = list(generate(shape, 4 * a.tokens * a.steps, seed=0, chunk_tokens=a.tokens * a.steps))
        train = {k: np.concatenate([c[k] for c in chunks[:-1]]) for k in chunks[0]}
        train_tok, train_topk = train["token_ids"], train["topk_ids"][:, a.layer: a.layer + 1]
        test_tok, test_topk = chunks[-1]["token_ids"], chunks[-1]["topk_ids"][:, a.layer: a.layer + 1]
        vocab, E = shape.vocab_size, shape.num_experts
    N = a.ranks
    counts = RoutingCounts.from_arrays(train_tok, train_topk, E, vocab, sample_tokens=0)  # coclust: no expert sets
    e2r, _, tables = place_model("coclust", counts, N, vocab_size=vocab)
    steps = []
    for s in range(a.steps):
        sl = slice(s * a.tokens, (s + 1) * a.tokens)
        tok, topk = test_tok[sl], test_topk[sl]
        pref, conf, _ = predict_layer(tables, 0, tok.astype(np.int64))
        t2r = assign_tokens(pref, conf, np.zeros(len(tok), int), N, rank_caps=chunk_caps(len(tok), N)[None])
        steps.append({"ids": topk[:, 0].astype(np.int64), "token2rank": t2r,
                      "order": np.argsort(t2r, kind="stable")})
    base_e2r = place_linear(E, N)

    def lar(expert2rank, token2rank):
        return np.mean([evaluate(st["ids"][:, None], token2rank(st)[:, None], expert2rank[None],
                                 np.zeros(len(st["ids"]), int), N)["lar"] for st in steps])

    smoe_lar = lar(e2r[0], lambda st: st["token2rank"])
    base_lar = lar(base_e2r, lambda st: contiguous_tokens(np.zeros(len(st["ids"]), int), N))
    return {"hidden": a.hidden, "experts": E, "steps": steps, "lar": float(smoe_lar),
            "base_lar": float(base_lar), "baseline": {"expert2rank": base_e2r}, "smoe": {"expert2rank": e2r[0]},
            "top_k": int(test_topk.shape[2])}


def _comm(a) -> int:
    import tempfile

    import torch.multiprocessing as mp

    from .cli_util import check_output_file

    if a.json:
        check_output_file(a.json, "--json")

    plan = _comm_plan(a)
    out = tempfile.mkdtemp(prefix="smoe-comm-")
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(_comm_worker, args=(a.ranks, init, plan, a.reps, out), nprocs=a.ranks, join=True)
    import torch

    res = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(a.ranks)]
    t = {n: max(r[n]["seconds"] for r in res) for n in ("baseline", "smoe")}
    b = {n: sum(r[n]["bytes"] for r in res) for n in ("baseline", "smoe")}
    print(f"routing {a.routing} layer {a.layer}: {plan['experts']} experts, top-{plan['top_k']}, {a.ranks} gloo ranks, "
          f"{a.tokens} tokens/step x {a.steps} steps, hidden {a.hidden}, fp32, capacity 1.0 (static chunks)")
    print(f"LAR: baseline (linear, contiguous) {plan['base_lar']:.3f}, smoe (coclust + predictor) {plan['lar']:.3f}")
    names = {"baseline": "vLLM EP (allgather-reducescatter)", "smoe": "smoe (predicted chunks, sparse all2all)"}
    for n in ("baseline", "smoe"):
        print(f"{names[n]:>40}: {t[n] * 1e3:8.1f} ms per layer (median over {a.reps} reps, slowest rank), "
              f"{b[n] / 1e6:8.2f} MB per step (all ranks, point-to-point)")
    print(f"ratio smoe/baseline: time {t['smoe'] / t['baseline']:.3f}x, bytes {b['smoe'] / b['baseline']:.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"routing": a.routing, "ranks": a.ranks, "tokens": a.tokens, "hidden": a.hidden,
                       "lar": {"baseline": plan["base_lar"], "smoe": plan["lar"]}, "seconds": t, "bytes": b,
                       "time_ratio": t["smoe"] / t["baseline"], "bytes_ratio": b["smoe"] / b["baseline"]}, f, indent=1)
    return 0


def _kernels(a) -> int:
    """Speculate's per-step ordering on one GPU: the Triton assignment + permutation kernel
    (after one confidence sort) against the torch ops it replaces, same inputs, exact equality,
    eager and as a CUDA-graph replay; times per step (median of --reps graph replays)."""
    import torch

    from .serving import device_predict as dp

    if not torch.cuda.is_available():
        raise ValueError("smoe-bench kernels needs a CUDA device (the CPU path is the torch ops)")
    dev = torch.device("cuda")
    rows = []
    for T in a.tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        L, N = a.layers, a.ranks
        pref = torch.randint(-1, N, (L, T, 2), device=dev, generator=g)
        conf = torch.rand((L, T), device=dev, generator=g)
        caps = dp.chunk_caps(T, N, dev)
        perm, inv = (torch.empty((L, T), dtype=torch.long, device=dev) for _ in range(2))
        want = dp.permutation(dp.assign(pref, conf, caps))
        dp.assign_permute(pref, conf, caps, perm, inv)
        ok = torch.equal(perm, want[0]) and torch.equal(inv, want[1])

        def fused():
            dp.assign_permute(pref, conf, caps, perm, inv)

        def ops():
            dp.permutation(dp.assign(pref, conf, caps))

        times = {}
        for name, fn in (("kernel", fused), ("torch", ops)):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            samples = []
            for _ in range(a.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            times[name] = float(np.median(samples))
        replay_ok = torch.equal(perm, want[0])
        rows.append({"layers": L, "ranks": N, "tokens": T, "equal": ok and replay_ok,
                     "kernel_us": times["kernel"], "torch_us": times["torch"]})
        print(f"L={L} N={N} T={T:6d}: {'equal' if ok and replay_ok else 'MISMATCH'}; kernel {times['kernel']:8.1f} us, "
              f"torch ops {times['torch']:8.1f} us per step (graph replay, median of {a.reps}); "
              f"{times['torch'] / times['kernel']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


def _tree_memory(pid: int) -> tuple[int, int]:
    """(sum of proportional set sizes, largest resident set) of ``pid`` and its descendants, bytes
    (Linux /proc; PSS shares copy-on-write pages between forked workers instead of counting them twice)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    pss = rss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss = max(rss, int(line.split()[1]) * 1024)
        except OSError:
            continue
    return pss, rss


def _measure_command(cmd: list[str], interval: float = 0.5) -> dict:
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_pss = peak_rss = 0
    while proc.poll() is None:
        pss, rss = _tree_memory(proc.pid)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(interval)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return {"command": " ".join(cmd), "wall_s": round(wall, 1), "peak_pss_mb": round(peak_pss / 2**20),
            "peak_rss_one_process_mb": round(peak_rss / 2**20), "stdout": out.strip().splitlines()[-1:],
            "log": [x for x in err.replace("\r", "\n").splitlines() if x.startswith(("counted", "wrote", "evaluating"))]}


def _place_scale(a) -> int:
    """Build (and evaluate) a placement from each trace spec, measuring time and memory."""
    import tempfile

    from .trace import open_traces

    results = []
    for spec in a.trace:
        _, traces = open_traces([spec])
        tokens = sum(t.num_tokens for t in traces)
        with tempfile.TemporaryDirectory() as d:
            yaml_path = os.path.join(d, "p.yaml")
            base = [sys.executable, "-m", "vllm_smoe.place_cli"]
            jobs = ["--jobs", str(a.jobs)] if a.jobs else []
            row = {"trace": spec, "tokens": tokens, "files": len(traces), "ep_size": a.ep_size,
                   "build": _measure_command(base + ["build", "--trace", spec, "--ep-size", str(a.ep_size), "-o",
                                                     yaml_path] + jobs)}
            if a.evaluate:
                row["evaluate"] = _measure_command(base + ["evaluate", "--trace", spec, "--placement", yaml_path] + jobs)
        results.append(row)
        for what in ("build", "evaluate"):
            if what in row:
                r = row[what]
                print(f"{spec}: {tokens} tokens, {what}: {r['wall_s']} s, peak {r['peak_pss_mb']} MiB PSS over all "
                      f"processes (largest process {r['peak_rss_one_process_mb']} MiB RSS)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": f"{os.cpu_count()} cores", "results": results}, f, indent=2)
    return 0


def _predictors(a) -> int:
    """Each predictor's share of the capped oracle, in domain and on every domain left out of
    training: placement and tables built with smoe-place on the training trace (without the
    domain), scored on the held-out trace (that domain only)."""
    import tempfile

    from . import place_cli
    from .cli_util import check_output_file
    from .placement.online import PREDICTORS as SIM
    from .testbed import FIXTURE_MODEL, FIXTURE_TRACES
    from .trace import read_traces, write_trace

    if a.json:
        check_output_file(a.json, "--json")
    train, held = a.train or FIXTURE_TRACES["train"], a.heldout or FIXTURE_TRACES["heldout"]
    model = a.model if a.model is not None else (FIXTURE_MODEL if a.train is None else None)
    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([train], fields)
    hmeta, he, _ = read_traces([held], fields)
    for name, arr, m in ((train, tr, meta), (held, he, hmeta)):
        if "domain" not in arr or not m.domains:
            raise ValueError(f"{name}: needs the 'domain' field and meta.domains to leave a domain out")
    if hmeta.domains != meta.domains:  # a domain is an index into its file's list
        raise ValueError(f"{held}: field 'meta.domains' = {list(hmeta.domains)} differs from {train}'s "
                         f"{list(meta.domains)}")

    def place(*args):
        if place_cli.main(list(args)) != 0:
            raise ValueError(f"smoe-bench predictors: smoe-place {' '.join(args)} failed (its error above)")
    splits = [("in-domain", None)] + [(f"without {d}", i) for i, d in enumerate(meta.domains)]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ep in a.ep_size:
            for label, d in splits:
                if d is not None and not ((tr["domain"] != d).any() and (he["domain"] == d).any()):
                    raise ValueError(f"{train if (tr['domain'] == d).all() else held}: leaving out domain "
                                     f"{meta.domains[d]!r} leaves no training or no held-out rows")
                pair = []
                for arr, keep in ((tr, None if d is None else tr["domain"] != d),
                                  (he, None if d is None else he["domain"] == d)):
                    path = os.path.join(work, f"{len(pair)}.npz")
                    write_trace(path, meta, **{k: v if keep is None else v[keep] for k, v in arr.items()})
                    pair.append(path)
                yaml_path = os.path.join(work, "p.yaml")
                build = ["build", "--trace", pair[0], "--ep-size", str(ep), "-o", yaml_path]
                place(*build, *(["--model", model] if model else []))
                # the same placement without the bigram table: what the pairs add to the token table
                unigram = os.path.join(work, "u.yaml")
                place(*build[:-1], unigram, "--bigram-pairs", "0", *(["--model", model] if model else []))
                row = {"ep_size": ep, "split": label,
                       "test_tokens": int(he["token_ids"].size if d is None else (he["domain"] == d).sum())}
                for name, placement, pred in [(p, yaml_path, p) for p in SIM] + [("tables-unigram", unigram, "tables")]:
                    out = os.path.join(work, f"{name}.json")
                    place("evaluate", "--trace", pair[1], "--placement", placement, "--predictor", pred, "--json", out)
                    m = next(iter(json.load(open(out)).values()))
                    row[name] = {k: m[k] for k in ("lar", "oracle_lar", "oracle_share", "a2a_bytes_per_token")}
                rows.append(row)
                print(f"EP {ep} {label:>16}: oracle LAR {row['router']['lar']:.3f}; " + ", ".join(
                    f"{p} {row[p]['lar']:.3f} ({row[p]['oracle_share']:.3f})" for p in row
                    if isinstance(row[p], dict) and p != "router"), flush=True)
    if a.json:
        _write_json(a.json, {"train": train, "heldout": held, "model": model, "rows": rows})
    return 0


def main(argv=None) -> int:
    from .cli_util import number

    p = argparse.ArgumentParser(prog="smoe-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("ilp", help="placement methods vs the exact ILP (scipy HiGHS) on small instances")
    i.add_argument("--instances", type=int, default=6)
    i.add_argument("--vocab", type=int, default=24)
    i.add_argument("--experts", type=int, default=8)
    i.add_argument("--top-k", type=int, default=2)
    i.add_argument("--tokens", type=int, default=2000)
    i.add_argument("--ep-size", type=int, default=2)
    i.add_argument("--hotness", type=float, default=0.7)
    i.add_argument("--capacity", type=float, default=1.10)
    i.add_argument("--max-expert-load", type=float, default=None,
                   help="also cap expert load in the ILP and in coclust (default: no cap, the plain program)")
    i.add_argument("--time-limit", type=float, default=120.0)
    i.add_argument("--objective", choices=("lar", "bytes"), default="lar",
                   help="lar: local activations (solve_ilp); bytes: de-duplicated remote rows (solve_ilp_bytes)")
    i.set_defaults(fn=_ilp)
    g = sub.add_parser("plugin", help="vllm serve start-up and throughput: plain vs --plugin smoe (needs vLLM)")
    g.add_argument("--requests", type=int, default=64)
    g.add_argument("--prompt-tokens", type=int, default=96)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--concurrency", type=int, default=8)
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--placement", help="placement YAML (default: configs/tiny-4dom-ep4.yaml)")
    g.set_defaults(fn=_plugin)
    v = sub.add_parser("serve", help="vllm serve at TP=N: plain vs --plugin smoe --smoe-mode speculate (tok/s, TTFT, "
                                     "TPOT, p90 inter-token latency; needs vLLM)")
    v.add_argument("--model", help="model directory (default: the testbed fixture)")
    v.add_argument("--placement", help="EP=TP placement YAML (default: configs/tiny-4dom-ep2.yaml)")
    v.add_argument("--prompts-trace", help="routing trace whose requests are the prompts (default: fixture held-out)")
    v.add_argument("--tp", type=int, default=2, help="tensor-parallel size = ranks the experts are split over")
    v.add_argument("--requests", type=int, default=32)
    v.add_argument("--prompt-tokens", type=int, default=64)
    v.add_argument("--max-tokens", type=int, default=32)
    v.add_argument("--concurrency", type=int, default=8)
    v.add_argument("--rounds", type=int, default=2)
    v.add_argument("--with-baselines", action="store_true",
                   help="also speculate over vLLM's allgather-reducescatter, and the sparse all2all with a random "
                        "predictor (no speculation)")
    v.add_argument("--json", help="write per-configuration medians and ratios here")
    v.add_argument("--no-cpu-bind", dest="cpu_bind", action="store_false",
                   help="do not set VLLM_CPU_OMP_THREADS_BIND (set it on vLLM's CPU build)")
    v.set_defaults(fn=_serve)
    d = sub.add_parser("dp", help="vllm serve at DP=N + EP: vLLM's default vs smoe's placement vs smoe's request "
                                  "routing (locality, bytes, tok/s, TTFT, TPOT; needs vLLM)")
    d.add_argument("--model", help="model directory (default: the testbed fixture)")
    d.add_argument("--placement", help="placement YAML with ep_size = DP (default: configs/tiny-4dom-dp<N>.yaml)")
    d.add_argument("--prompts-trace", help="routing trace whose requests are the prompts, drawn over all of it and "
                                           "shuffled (default: fixture held-out, four workloads)")
    d.add_argument("--dp", type=int, default=2, help="data-parallel size (one engine per rank, TP=1)")
    d.add_argument("--requests", type=int, default=64)
    d.add_argument("--prompt-tokens", type=int, default=96)
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--concurrency", type=int, default=8)
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--seed", type=int, default=0, help="order of the prompts")
    d.add_argument("--api-servers", type=int, default=0,
                   help="--api-server-count for vllm serve (default: vLLM's, one per DP rank)")
    d.add_argument("--json", help="write per-configuration medians, locality, bytes and ratios here")
    d.add_argument("--no-cpu-bind", dest="cpu_bind", action="store_false",
                   help="do not set VLLM_CPU_OMP_THREADS_BIND (set it on vLLM's CPU build)")
    d.set_defaults(fn=_dp)
    c = sub.add_parser("comm", help="one EP MoE layer on gloo ranks: baseline EP vs smoe shuffling (bytes, time)")
    c.add_argument("--routing", default="deepseek-v2-lite",
                   help="'testbed' (the trained fixture's traces) or a synthetic shape (default deepseek-v2-lite)")
    c.add_argument("--layer", type=int, default=0, help="MoE layer of the trace to replay")
    c.add_argument("--ranks", type=int, default=4)
    c.add_argument("--tokens", type=int, default=2048, help="tokens per step")
    c.add_argument("--steps", type=int, default=2)
    c.add_argument("--hidden", type=int, default=2048)
    c.add_argument("--reps", type=int, default=3)
    c.add_argument("--json", help="write times, bytes and ratios here")
    c.set_defaults(fn=_comm)
    k = sub.add_parser("kernels", help="CUDA only: speculate's assignment + permutation kernel vs the torch ops")
    k.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    k.add_argument("--layers", type=int, default=48)
    k.add_argument("--ranks", type=int, default=8)
    k.add_argument("--reps", type=int, default=20)
    k.add_argument("--json", help="write the rows here")
    k.set_defaults(fn=_kernels)
    s = sub.add_parser("place-scale", help="smoe-place build (and evaluate) on large traces: wall time and peak "
                                           "memory summed over its processes")
    s.add_argument("--trace", nargs="+", required=True, help="one trace spec (file, directory or glob) per run")
    s.add_argument("--ep-size", type=int, default=64)
    s.add_argument("--jobs", type=int, default=0, help="smoe-place --jobs (default: its own default, all cores)")
    s.add_argument("--evaluate", action="store_true", help="also time smoe-place evaluate on the same trace")
    s.add_argument("--json", help="write the measurements here")
    s.set_defaults(fn=_place_scale)
    r = sub.add_parser("predictors", help="each predictor's share of the capped oracle, in domain and with each "
                                          "domain left out of training (traces with a 'domain' field)")
    r.add_argument("--train", help="training trace (default: the fixture's)")
    r.add_argument("--heldout", help="held-out trace (default: the fixture's)")
    r.add_argument("--model", help="checkpoint for smoe-place build --model (default: the fixture's with the "
                                   "fixture's traces, none otherwise)")
    r.add_argument("--ep-size", type=number(int, 1), nargs="+", default=[2, 4, 8])
    r.add_argument("--json", help="write every row here")
    r.set_defaults(fn=_predictors)
    from .bench_load import add_parser as add_load

    add_load(sub)
    from .bench_cluster import add_parser as add_cluster

    add_cluster(sub)
    from .cli_util import run_cli

    return run_cli(p, argv)


if __name__ == "__main__":
    sys.exit(main())
