"""bf16 rounding of the DeepSeek family's order per layer against vLLM's, on the residual stream.

    python benchmarks/fold_rounding.py [--hidden 7168] [--rows 256]
    python benchmarks/fold_rounding.py --served deepseek_v3     # vLLM at TP=2 + EP, ~5 min

vLLM's sequence-parallel DeepSeek layer reduce-scatters the attention's bf16 partial sums (a
sequential sum over the ranks) and adds the residual once, in fp32, in its add + norm; smoe's
order per layer adds each row's residual to one rank's partial first (``order_folded``), so the
rows are rounded at the residual's magnitude at every later step of the sum. Prints the mean
absolute error against the exact float64 sum for each, at 2, 4 and 8 ranks and every rank the
residual may sit on (residual rows N(0, 1) with 8 outlier channels x 100, partials N(0, 0.05^2)).

``--served FIXTURE`` serves a trained DeepSeek fixture at TP=2 in float32 and bfloat16: plain
TP=2, then speculate over an EP 2 placement with an order per layer and with one per step (32
held-out prompts, 16 greedy tokens each), and prints, per dtype and order, how many requests
give plain TP=2's tokens and the mean |logprob difference| before each request's first
different token. Needs vLLM's CPU build and 2 cores.
"""

from __future__ import annotations

import argparse

import torch


def _chain(parts):
    """The sum over ranks as a ring reduce rounds it: one bf16 rounding per addition."""
    acc = parts[0]
    for p in parts[1:]:
        acc = (acc.float() + p.float()).bfloat16()
    return acc


def served(fixture: str) -> None:
    import itertools
    import os
    import sys
    import tempfile

    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.support import heldout_prompts, vllm_runs
    from tests.unit.test_deepseek import _build
    from vllm_smoe.testbed import FIXTURES

    work = tempfile.mkdtemp(prefix="smoe-fold-rounding-")
    placement = os.path.join(work, "ep2.yaml")
    r = _build(fixture, placement, 2)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    model, traces = FIXTURES[fixture]
    base = {"model": model, "prompts": heldout_prompts(32, trace=traces["heldout"]), "max_tokens": 16}
    orders, dtypes, runs = ("layer", "step"), ("float32", "bfloat16"), []
    for dt in dtypes:
        runs.append({**base, "dtype": dt, "extra": {"smoe": {}}, "ep": False})
        runs += [{**base, "dtype": dt, "ep": True, "extra": {"smoe": {"mode": "speculate", "placement": placement,
                                                                     "stack_order": o}}} for o in orders]
    res = [out for out, _ in vllm_runs(runs, work, tp=2)]
    for i, dt in enumerate(dtypes):
        plain = res[3 * i]
        for j, o in enumerate(orders):
            got = res[3 * i + 1 + j]
            same = [len(list(itertools.takewhile(lambda ab: ab[0] == ab[1], zip(a, b))))
                    for a, b in zip(got["tokens"], plain["tokens"])]
            diff = np.concatenate([np.abs(np.subtract(a[:k], b[:k])) for a, b, k in
                                   zip(got["logprobs"], plain["logprobs"], same)])
            equal = sum(a == b for a, b in zip(got["tokens"], plain["tokens"]))
            print(f"{fixture} {dt} order per {o}: {equal} of {len(same)} requests give plain TP=2's tokens; "
                  f"mean |logprob difference| before the first different token {diff.mean():.1e} "
                  f"(max {diff.max():.1e}, {sum(same)} tokens)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--served", default=None, choices=("deepseek_v2", "deepseek_v3"),
                    help="serve this fixture at TP=2 instead (vLLM's CPU build)")
    a = ap.parse_args(argv)
    if a.served:
        served(a.served)
        return 0
    torch.manual_seed(0)
    for n in (2, 4, 8):
        residual = torch.randn(a.rows, a.hidden)
        residual[:, :8] *= 100
        residual = residual.bfloat16()
        parts = [(torch.randn(a.rows, a.hidden) * 0.05).bfloat16() for _ in range(n)]
        exact = residual.double() + sum(p.double() for p in parts)
        vllm = (_chain(parts).float() + residual.float()).bfloat16()
        folded = []
        for r in range(n):
            mine = [p if i != r else (p.float() + residual.float()).bfloat16() for i, p in enumerate(parts)]
            folded.append((_chain(mine).double() - exact).abs().mean().item())
        base = (vllm.double() - exact).abs().mean().item()
        print(f"N={n}: vLLM {base:.2e}, folded {min(folded):.2e}-{max(folded):.2e} "
              f"({min(folded) / base:.2f}-{max(folded) / base:.2f}x) mean |error| per row element")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
