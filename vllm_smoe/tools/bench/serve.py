"""``smoe-bench plugin``, ``serve``, ``dp``: ``vllm serve`` with and without smoe on one machine."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .common import (LATENCY, SPEC_LINE, dp_numbers, drive, is_mla, mixed_prompts, placement_arg, rank_numbers,
                     scale_dependent_routing, trace_prompts, write_json)


def run_plugin(a) -> int:
    import tempfile

    from ..server_process import VllmServer
    from ...testbed import FIXTURE_MODEL, FIXTURE_TRACES

    prompts = trace_prompts(FIXTURE_TRACES["heldout"], a.requests, a.prompt_tokens)
    work = tempfile.mkdtemp(prefix="smoe-bench-")
    placement = placement_arg(a.placement, "tiny-4dom-ep4.yaml", 4)
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


def run_dp(a) -> int:
    """vllm serve --data-parallel-size N --enable-expert-parallel: vLLM's default (linear experts,
    its balancer), smoe's placement with vLLM's balancer, and smoe's placement with smoe's request
    routing; all on smoe's sparse all2all, whose counters give locality and bytes (vLLM's CPU
    build only)."""
    import tempfile

    from ..cli_util import check_output_file
    from ..server_process import VllmServer

    if a.json:
        check_output_file(a.json, "--json")
    from ...testbed import FIXTURE_MODEL, FIXTURE_TRACES

    model = a.model or FIXTURE_MODEL
    prompts = mixed_prompts(a.prompts_trace or FIXTURE_TRACES["heldout"], a.requests, a.prompt_tokens, a.seed)
    work = tempfile.mkdtemp(prefix="smoe-bench-dp-")
    placement = placement_arg(a.placement, f"tiny-4dom-dp{a.dp}.yaml", a.dp, "--mode dp ")
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
                drive(s, model, prompts, a.concurrency, a.max_tokens, r)
                # counters log on the next step after their interval: one more interval, then a
                # one-token request steps every rank (and routes once) so the last lines cover the run
                time.sleep(0.6)
                s.client().completions.create(model=model, prompt=prompts[0][:1], max_tokens=1, temperature=0.0)
                time.sleep(0.3)
            r["dp"].append(dp_numbers(s.log))
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
    write_json(a.json, {"dp": a.dp, "requests": len(prompts), "max_tokens": a.max_tokens, "rounds": a.rounds,
                         "concurrency": a.concurrency, "model": model, "placement": placement, "configs": summary})
    return 0


def run_serve(a) -> int:
    import tempfile

    from ..cli_util import check_output_file
    from ..server_process import VllmServer

    if a.json:
        check_output_file(a.json, "--json")
    from ...testbed import FIXTURE_MODEL, FIXTURE_TRACES

    model = a.model or FIXTURE_MODEL
    prompts = trace_prompts(a.prompts_trace or FIXTURE_TRACES["heldout"], a.requests, a.prompt_tokens)
    work = tempfile.mkdtemp(prefix="smoe-bench-serve-")
    placement = placement_arg(a.placement, "tiny-4dom-ep2.yaml", a.tp)
    ep = ("--enable-expert-parallel", "--plugin", "smoe", "--smoe-log-interval", "1")
    spec = ep + ("--smoe-mode", "speculate", "--smoe-placement", placement)
    # MLA models: vLLM's CPU rotary op needs the plugin's fix, so their plain run is
    # `--plugin smoe` alone (the CPU fixes: rope, experts, communicator; no placement, no
    # order): the same function in every configuration
    mla = is_mla(model)
    runs = {"plain": ("--plugin", "smoe") if mla else (), "vllm-ep": ep + ("--smoe-all2all", "vllm"),
            "speculate": spec}
    if a.with_baselines:
        runs["spec-agrs"] = spec + ("--smoe-all2all", "vllm")  # smoe's order, vLLM's allgather-reducescatter
        runs["sparse-random"] = spec + ("--smoe-predictor", "random")  # the sparse manager without speculation
    if not (mla and scale_dependent_routing(model)):  # refused on the DeepSeek family's V3 routing
        runs["spec-router"] = spec + ("--smoe-predictor", "router")  # vLLM's gate run ahead: exact ranks
    tp = ("--tensor-parallel-size", str(a.tp))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(a.tp))} if a.cpu_bind else None
    res: dict = {}
    for rnd in range(a.rounds):  # interleaved rounds: drift of a shared machine hits every config alike
        for name, flags in runs.items():
            r = res.setdefault(name, {})
            with VllmServer(model, *tp, *flags, log=os.path.join(work, f"{name}-{rnd}.log"), env=env) as s:
                s.complete(prompts[:2], max_tokens=4)  # warm the server
                drive(s, model, prompts, a.concurrency, a.max_tokens, r)
            print(f"round {rnd} {name:>13}: {r['tok_s'][-1]:6.1f} output tok/s", flush=True)
            with open(s.log) as f:
                lines = f.readlines()
            online = rank_numbers(lines, SPEC_LINE)
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
    write_json(a.json, {"tp": a.tp, "requests": len(prompts), "max_tokens": a.max_tokens, "rounds": a.rounds,
                         "concurrency": a.concurrency, "model": model, "placement": placement, "configs": summary})
    return 0
