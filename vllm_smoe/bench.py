"""``smoe-bench``: benchmarks that are not unit tests (results go to BENCHMARKS.md).

  smoe-bench ilp   -- every placement method against the exact ILP bound on small instances
"""

from __future__ import annotations

import argparse
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
    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
