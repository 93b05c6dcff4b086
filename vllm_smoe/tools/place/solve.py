"""Running the placement solvers for ``smoe-place``: one method over a trace's counts (timed,
its memory measured, layers over forked workers, a progress bar), ``--mode dp``'s request
co-clustering, and ``--method auto``'s candidates, each judged and the pick said on stderr."""

from __future__ import annotations

import sys
import time

import numpy as np

from ...placement.choose import auto_candidates, pick
from ...placement.dp import request_index
from ...placement.dp_build import build_dp
from ...placement.layout import POLISH_MIN_SCORES, POLISHED, PREDICTED, place_model, polish_evals, polish_fit, polishes
from ...placement.measure import measure
from ...placement.metrics import holds_from_expert2rank
from ...placement.stream import by_step
from ...placement.train import with_bigrams
from ..parallel import fork_map, peak_rss_since, start_peak_rss
from .read import bar

# rows coclust's layers are polished on (placement/polish.py): each exact score is one capped
# assignment of them, ~70 ms per 131072 rows here
POLISH_TOKENS = 1 << 17


def _map_layers(jobs: int, peaks: list):
    """place_model's ``map_layers``: layers over ``jobs`` forked workers, each reporting the
    peak of its resident memory above what it shared at the fork (appended to ``peaks``, bytes)."""
    if jobs <= 1:
        return map

    def run(fn, layers):
        def measured(layer):
            base = start_peak_rss()
            out = fn(layer)
            return out, peak_rss_since(base)

        for out, peak in fork_map(measured, layers, jobs):
            peaks.append(peak)
            yield out
    return run


def _ticking(it, progress):
    for x in it:
        yield x
        progress.update(1)


def polish_note(rows, meta, method: str, ep_size: int, nodes: int, groups: int, kicks: int) -> bool:
    """Whether coclust's layers get polished on ``rows``; says so where the budget leaves too few
    exact scores per layer to run, or where ``--polish-kicks`` was asked of a layout the polish
    leaves alone."""
    if rows is None or method not in POLISHED + ("auto",):
        if kicks:
            print(f"--polish-kicks {kicks}: not applied: the kicks follow the polish, which runs on coclust's "
                  f"layers in --mode tp with --polish-tokens > 0", file=sys.stderr)
        return False
    if not polishes("coclust", meta.num_experts, ep_size, nodes, groups):
        if kicks:
            why = (f"{nodes} nodes" if nodes > 1 else f"{groups} routing groups" if groups > 1
                   else f"{meta.num_experts} experts split unevenly over {ep_size} ranks")
            print(f"--polish-kicks {kicks}: not applied: the polish and its kicks swap experts freely, which "
                  f"{why} would not survive; coclust's placement kept unpolished", file=sys.stderr)
        return False
    if polish_evals(rows[0].shape, meta.num_layers, "coclust"):
        return True
    T, L, K = rows[0].shape
    print(f"--polish-tokens {T}: {L} layers x top-{K} leave fewer than {POLISH_MIN_SCORES} exact scores per "
          f"layer: coclust's placement kept unpolished; --polish-tokens {polish_fit(L, K)} "
          f"or fewer polishes on fewer rows", file=sys.stderr)
    return False


def solve(method, counts, meta, args, ep_size, nodes, embeddings=None, groups=1, rows=None):
    """Run one method on a trace's counts; returns (expert2rank, replicas, tables or None,
    seconds, peak MiB). rows: see place_model. Time and memory cover placement plus predictor tables: the peak resident
    memory this process added, plus with --jobs > 1 the largest worker's times the workers."""
    base = start_peak_rss()
    t0 = time.perf_counter()
    peaks: list[int] = []
    if method == "eplb":
        from ..peers import place_eplb

        e2r, reps = place_eplb(counts.expert_load(), ep_size, nodes, args.replicas)
        tables = None
    else:
        predicted = method in PREDICTED
        progress = bar(method, meta.num_layers, "layer")
        e2r, reps, tables = place_model(
            method, counts, ep_size, nodes=nodes, capacity=args.capacity, theta=args.theta,
            replicas=args.replicas if predicted else 0, seed=args.seed, max_expert_load=args.max_expert_load,
            vocab_size=meta.vocab_size if predicted else None, embeddings=embeddings if predicted else None,
            progress=lambda it: _ticking(it, progress), map_layers=_map_layers(args.jobs, peaks), groups=groups,
            rows=rows, polish_kicks=getattr(args, "polish_kicks", 0))
        progress.close()
    secs = time.perf_counter() - t0
    peak = peak_rss_since(base) + (max(peaks) * min(args.jobs, len(peaks)) if peaks else 0)
    return e2r, reps, tables, secs, peak / 2**20


def solve_dp(counts, sample, meta, args, embeddings, groups=1):
    """--mode dp: experts co-clustered with whole requests (the requests of the leading
    --metrics-tokens tokens), refined per layer for the fewest all-to-all rows with the
    requests' ranks fixed, then the router's tables (placement/dp_build.py). Returns what
    :func:`solve` does."""
    base = start_peak_rss()
    t0 = time.perf_counter()
    print(f"--mode dp: co-clustering {request_index(sample['request_ids'])[0].size} requests "
          f"({sample['request_ids'].shape[0]} tokens) with experts", file=sys.stderr)
    e2r, reps, tables = build_dp(sample, counts, meta.vocab_size, args.ep_size, args.nodes, args.capacity,
                                 args.max_expert_load, seed=args.seed, groups=groups, embeddings=embeddings)
    return e2r, reps, tables, time.perf_counter() - t0, peak_rss_since(base) / 2**20


def choose(counts, meta, a, emb, groups, sample, judge, spans: list[tuple[int, int]], rows=None):
    """--method auto: solve every candidate (placement/choose.py) with the same flags, score each
    with its predictor tables on ``judge`` (rows sorted by step), and keep the one
    :func:`...placement.choose.pick` picks (evaluate --compare's rule: the fewest rows per token
    within 2% of the best LAR, at a balanced expert load). Returns (method, what :func:`solve`
    returns for it, the choice's record for the YAML's built_from)."""
    held_out = spans[0][0] >= a.instance_tokens
    jarr, jbatch = by_step(judge, a.batch_tokens)
    hidden = meta.hidden_size or a.hidden_size
    solved, scores = {}, {}
    methods, unsupported = auto_candidates(a.nodes, groups)
    if unsupported:
        print(f"--method auto: bytes does not support {' and '.join(unsupported)} yet; coclust alone", file=sys.stderr)
    for method in methods:
        e2r, reps, tables, secs, peak = solve(method, counts, meta, a, a.ep_size, a.nodes, emb, groups, rows)
        t1 = time.perf_counter()
        holds = holds_from_expert2rank(e2r, a.ep_size, reps)
        tables = with_bigrams(tables, sample, holds, meta.vocab_size, a.bigram_pairs, a.batch_tokens)
        secs += time.perf_counter() - t1
        m = measure(jarr, jbatch, meta.num_layers, e2r, reps, tables, a.ep_size, a.capacity, True, hidden,
                    a.dtype_bytes, nodes=a.nodes, predictor="tables" if a.predictor == "learned" else a.predictor)
        solved[method] = (e2r, reps, tables, secs, peak)
        scores[method] = {k: float(m[k]) for k in ("lar", "remote_unique_per_token", "expert_load")}
    method, why = pick(scores, a.max_expert_load)
    n = sum(hi - lo for lo, hi in spans)
    where = (f"{n} rows in {len(spans)} windows past the first {a.instance_tokens} (those the bytes objective is "
             f"scored on)" if held_out else f"{n} rows in {len(spans)} windows (in sample: the trace holds too few "
                                            f"rows past the bytes objective's first {a.instance_tokens})")
    line = ", ".join(f"{k} LAR {v['lar']:.3f} rows/token {v['remote_unique_per_token']:.3f} expert load "
                     f"{v['expert_load']:.3f}" for k, v in scores.items())
    print(f"--method auto: {method}: {why}; judged on {where}: {line}", file=sys.stderr)
    total_secs = sum(v[3] for v in solved.values())
    e2r, reps, tables, _, _ = solved[method]
    peak = max(v[4] for v in solved.values())
    record = {"chosen": method, "why": why, "judged_rows": int(n), "held_out": bool(held_out),
              "candidates": scores}
    return method, (e2r, reps, tables, total_secs, peak), record
