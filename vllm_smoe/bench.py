"""``smoe-bench``: benchmarks that are not unit tests (results go to BENCHMARKS.md).

  smoe-bench ilp     -- every placement method against the exact ILP bound on small instances
  smoe-bench plugin  -- start-up time and throughput of plain vLLM vs --plugin smoe (place, record)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def _ilp(a) -> int:
    from .placement.counts import layer_counts
    from .placement.ilp import solve_ilp
    from .placement.layout import SOLVERS
    from .synthetic import MoEShape, generate

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


def _plugin(a) -> int:
    import tempfile

    from .serving import VllmServer
    from .testbed import FIXTURE_MODEL, FIXTURE_TRACES
    from .trace import open_trace

    t = open_trace(FIXTURE_TRACES["heldout"])
    tok, req = t["token_ids"], t["request_ids"]
    prompts = [tok[req == r][: a.prompt_tokens].tolist() for r in np.unique(req)[: a.requests]]
    work = tempfile.mkdtemp(prefix="smoe-bench-")
    placement = a.placement or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                            "configs", "tiny-4dom-ep4.yaml")
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


def main(argv=None) -> int:
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
    i.set_defaults(fn=_ilp)
    g = sub.add_parser("plugin", help="vllm serve start-up and throughput: plain vs --plugin smoe (needs vLLM)")
    g.add_argument("--requests", type=int, default=64)
    g.add_argument("--prompt-tokens", type=int, default=96)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--concurrency", type=int, default=8)
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--placement", help="placement YAML (default: configs/tiny-4dom-ep4.yaml)")
    g.set_defaults(fn=_plugin)
    from .cli_util import run_cli

    return run_cli(p, argv)


if __name__ == "__main__":
    sys.exit(main())
