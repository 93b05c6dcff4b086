"""``smoe-place``: learn route predictors and a balanced token-expert placement from routing
traces, write it as YAML, and compare it with the placements users run today."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import numpy as np
import scipy.sparse as sp

from .cluster_cost import add_args as add_cost_args
from .cluster_cost import add_calibrate_parser, cost_setup, print_costs
from .cli_util import check_output_dir, check_output_file, keep_heap, number, run_cli
from ..placement.assign import batches_from_windows, contiguous_tokens
from ..placement.bytes import layer_instances, swap_for_bytes
from ..formats.model_info import expert_groups
from ..placement.dp import WINDOW as DP_WINDOW
from ..placement.dp import (DECODE_CONCURRENCY, assign_requests, place_requests, request_affinity, request_counts,
                           request_index, request_token_table, round_robin_requests, step_imbalance,
                           workload_scores)
from ..placement.groups import check_groups
from ..placement.layout import (NEEDS_INSTANCES, POLISH_MIN_SCORES, POLISHED, PREDICTED, SOLVERS, place_model,
                                polish_evals, polish_fit, polishes)
from ..placement.metrics import evaluate, holds_from_expert2rank, local_share, recommend
from ..placement.migrate import BALANCE_WEIGHT, limit_moves, rank_names, rename_block, rename_ranks
from ..placement.online import PREDICTORS as SIM_PREDICTORS
from ..placement.online import simulate
from ..placement.learned import MAX_WIDTH, default_width, layer_targets, train_predictor
from ..placement.predict import (bigram_keys, bigram_table, named_ranks, previous_ids, rename_tables,
                                 tables_for_placement)
from ..formats.checkpoint import read_embeddings
from ..formats.placement_file import load_placement, load_tables, model_fingerprint, write_placement
from .parallel import default_jobs, fork_map, peak_rss_since, prefetch, start_peak_rss
from ..placement.routing_counts import RoutingCounts
from ..formats.trace import iter_traces, open_traces

METRIC_KEYS = ("lar", "token_load", "expert_load", "remote_pairs_per_token", "remote_unique_per_token",
               "a2a_bytes_per_token", "internode_bytes_per_token", "intranode_bytes_per_token", "hit_rate",
               "oracle_hit_rate", "oracle_lar", "oracle_share", "step_imbalance", "solve_seconds", "peak_mem_mb",
               "table_bytes")
COMPARE_ALL = ("linear", "round_robin", "eplb", "metis", "ceo", "alternating", "coclust", "bytes")


SAMPLE_FIELDS = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
# the held-out expert load a build capped at --max-expert-load may reach (coclust caps it in sample)
LOAD_SLACK = 0.05
BIGRAM_TOKENS = 131072  # training rows evaluate --compare learns its peers' bigram tables from
EVAL_WINDOWS = 16  # evenly spaced windows a bounded evaluation sample is cut into
# rows coclust's layers are polished on (placement/polish.py): each exact score is one capped
# assignment of them, ~70 ms per 131072 rows here
POLISH_TOKENS = 1 << 17


def _bar(desc: str, total: int, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "tok", leave=False, file=sys.stderr,
                mininterval=1.0)


def _windows(total: int, max_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges to evaluate: everything, or ``EVAL_WINDOWS`` (fewer for tiny
    bounds) evenly spaced contiguous windows totalling about ``max_tokens`` (0 = no bound)."""
    if max_tokens == 0 or total <= max_tokens:
        return [(0, total)]
    n = min(EVAL_WINDOWS, max_tokens)
    return [(s, s + max_tokens // n) for s in (i * total // n for i in range(n))]


def _engine(trace) -> int:
    """The DP engine that recorded ``trace``: its meta's ``dp_rank``, else the recorder's file name
    (``trace-dp<rank>-...``), else 0."""
    if "dp_rank" in trace.meta.extra:
        return int(trace.meta.extra["dp_rank"])
    m = re.match(r"trace-dp(\d+)-", os.path.basename(trace.path))
    return int(m.group(1)) if m else 0


def _stream(specs, windows=None, counts: bool = True, desc: str = "counting", sample_tokens: int = 0,
            engines: bool = False):
    """One pass over the traces: routing counts of every token (when ``counts``) and the rows
    inside ``windows`` (a function of the total token count -> [start, stop) ranges) as arrays;
    the counts keep the first ``sample_tokens`` rows whole (for the bytes objective). With
    ``engines``, the rows also get ``engine`` [n] int64: the DP engine that recorded each
    (:func:`_engine`), whose recordings ran side by side where one engine's follow each other.
    Returns (meta, RoutingCounts or None, {field: rows} sorted by step, batch ids [n], files, total)."""
    meta, traces = open_traces(specs)
    files = [t.path for t in traces]
    total = sum(t.num_tokens for t in traces)
    ends = np.cumsum([t.num_tokens for t in traces])  # [files]: the row past each file's last
    engine_of_file = np.array([_engine(t) for t in traces], dtype=np.int64)
    if total == 0:
        raise ValueError(f"{', '.join(files)}: the trace holds no tokens")
    if counts and total >= 2**32:
        raise ValueError(f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: {total} tokens; smoe-place counts "
                         f"at most {2**32 - 1} (pass a sample of the recording)")
    rc = None
    if counts:  # a pass over the small token_ids column first: every id's counts start in their final form
        occ = np.zeros(meta.vocab_size, dtype=np.int64)
        with _bar("scanning token ids", total, "tok") as bar:
            for ch in iter_traces(traces, ("token_ids",), chunk_tokens=1 << 20, validate=False):
                tok = ch["token_ids"]
                occ += np.bincount(tok[(tok >= 0) & (tok < meta.vocab_size)], minlength=meta.vocab_size)
                bar.update(tok.size)
        rc = RoutingCounts(meta.num_layers, meta.num_experts, meta.top_k, meta.vocab_size, occurrences=occ,
                           sample_tokens=sample_tokens)
    wins = windows(total) if windows else []
    parts, start = [], 0
    with _bar(desc, total, "tok") as bar:
        for ch in prefetch(iter_traces(traces, SAMPLE_FIELDS)):
            n = ch["token_ids"].shape[0]
            if rc is not None:
                rc.add(ch["token_ids"], ch["topk_ids"])
            for lo, hi in wins:
                a, b = max(lo - start, 0), min(hi - start, n)
                if a < b:
                    parts.append({k: v[a:b].copy() for k, v in ch.items()})
                    if engines:
                        parts[-1]["engine"] = engine_of_file[np.searchsorted(ends, np.arange(start + a, start + b),
                                                                             side="right")]
            start += n
            bar.update(n)
    sample = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}
    return meta, rc, sample, files, total


def _batched(arr, batch_tokens: int):
    """Rows sorted by engine step, and their batch ids [n] (steps, else windows of batch_tokens)."""
    if "step_ids" in arr:
        order = np.argsort(arr["step_ids"], kind="stable")
        if (order != np.arange(order.size)).any():
            arr = {k: v[order] for k, v in arr.items()}
        return arr, arr["step_ids"]
    return arr, batches_from_windows(arr["token_ids"].size, batch_tokens)


def _model_info(model_dir: str | None, vocab_size: int):
    """(fingerprint, embeddings [V, H] or None, routing groups) from a checkpoint directory."""
    if model_dir is None:
        return None, None, 1
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{model_dir}: no config.json (--model must be a checkpoint directory)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    return model_fingerprint(cfg), read_embeddings(model_dir, vocab_size), expert_groups(cfg)


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


def _polish_rows(arr, batch, tokens: int):
    """place_model's ``rows``: the routing and batches of the first ``tokens`` rows (sorted by
    step) of ``arr``, or None (``tokens`` 0, or no rows)."""
    if not tokens or not arr or arr["topk_ids"].shape[0] == 0:
        return None
    return arr["topk_ids"][:tokens], np.asarray(batch)[:tokens]


def _polish_note(rows, meta, method: str, ep_size: int, nodes: int, groups: int, kicks: int) -> bool:
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


def _solve(method, counts, meta, args, ep_size, nodes, embeddings=None, groups=1, rows=None):
    """Run one method on a trace's counts; returns (expert2rank, replicas, tables or None,
    seconds, peak MiB). rows: see place_model. Time and memory cover placement plus predictor tables: the peak resident
    memory this process added, plus with --jobs > 1 the largest worker's times the workers."""
    base = start_peak_rss()
    t0 = time.perf_counter()
    peaks: list[int] = []
    if method == "eplb":
        from .peers import place_eplb

        e2r, reps = place_eplb(counts.expert_load(), ep_size, nodes, args.replicas)
        tables = None
    else:
        predicted = method in PREDICTED
        bar = _bar(method, meta.num_layers, "layer")
        e2r, reps, tables = place_model(
            method, counts, ep_size, nodes=nodes, capacity=args.capacity, theta=args.theta,
            replicas=args.replicas if predicted else 0, seed=args.seed, max_expert_load=args.max_expert_load,
            vocab_size=meta.vocab_size if predicted else None, embeddings=embeddings if predicted else None,
            progress=lambda it: _ticking(it, bar), map_layers=_map_layers(args.jobs, peaks), groups=groups,
            rows=rows, polish_kicks=getattr(args, "polish_kicks", 0))
        bar.close()
    secs = time.perf_counter() - t0
    peak = peak_rss_since(base) + (max(peaks) * min(args.jobs, len(peaks)) if peaks else 0)
    return e2r, reps, tables, secs, peak / 2**20


def _solve_dp(counts, sample, meta, args, embeddings, groups=1):
    """--mode dp: experts co-clustered with whole requests (the requests of the leading
    --metrics-tokens tokens), refined per layer for the fewest all-to-all rows with the
    requests' ranks fixed, then the router's tables (the ranks of the training requests each
    token appeared in). Returns what :func:`_solve` does."""
    base = start_peak_rss()
    t0 = time.perf_counter()
    A, tokens = request_counts(sample["request_ids"], sample["topk_ids"], meta.num_experts)
    print(f"--mode dp: co-clustering {A.shape[0]} requests ({int(tokens.sum())} tokens) with experts",
          file=sys.stderr)
    e2r, r2r, _ = place_requests(A, tokens, args.ep_size, args.capacity, seed=args.seed, groups=groups,
                                 max_expert_load=args.max_expert_load, nodes=args.nodes)
    # then per layer, with the requests' ranks fixed, expert swaps that cut the all-to-all rows
    # (a token crosses once per remote rank, whatever its experts there); a swap could split a
    # routing group, so not for grouped models, and could move an expert across nodes, so not
    # with --nodes (the hierarchical solve put the slow link first)
    _, q = request_index(sample["request_ids"])
    for layer in range(meta.num_layers if groups == 1 and args.nodes in (1, args.ep_size) else 0):
        inst = layer_instances(q, sample["topk_ids"][:, layer].astype(np.int64))
        e2r[layer] = swap_for_bytes(sp.csr_matrix(A[:, layer]), inst, r2r, args.ep_size, e2r[layer],
                                    args.max_expert_load, seed=args.seed)
    del A
    holds = holds_from_expert2rank(e2r, args.ep_size)
    tables = tables_for_placement(counts, holds, meta.vocab_size, embeddings)
    # the router scores a prompt by the ranks of the training requests its tokens came from (the
    # same vote in every layer); the Markov and prior rows stay per layer
    t2r, conf = request_token_table(sample["token_ids"], sample["request_ids"], r2r, meta.vocab_size, args.ep_size,
                                    sample.get("is_prefill"))
    L = meta.num_layers
    tables = dataclasses.replace(tables, token2rank=np.repeat(t2r[None], L, axis=0),
                                 token_conf=np.repeat(conf[None], L, axis=0))
    return (e2r, np.zeros((meta.num_layers, 0, 2), np.int32), tables, time.perf_counter() - t0,
            peak_rss_since(base) / 2**20)


def _with_bigrams(tables, sample, holds, vocab_size: int, max_pairs: int, batch_tokens: int):
    """``tables`` plus the bigram table learned from ``sample``'s rows (sorted by step)."""
    if max_pairs == 0 or not sample:
        return tables
    arr, batch = _batched(sample, batch_tokens)
    tok = arr["token_ids"].astype(np.int64)
    keys = bigram_keys(previous_ids(tok, arr["positions"], batch), tok, vocab_size)
    L = tables.token2rank.shape[0]
    # default: the pairs fit in the token table's bytes (6 per id and layer; a pair: 8 + 6 per layer)
    budget = vocab_size * 6 * L // (8 + 6 * L) if max_pairs < 0 else max_pairs
    bk, b2r, bconf = bigram_table(keys, arr["topk_ids"], holds, tables.token2rank, budget)
    return dataclasses.replace(tables, bigram_keys=bk, bigram2rank=b2r, bigram_conf=bconf)


def _with_learned(tables, sample, holds, vocab_size: int, embeddings, width: int, batch_tokens: int, seed: int):
    """``tables`` plus the learned predictor (:mod:`..placement.learned`) trained on ``sample``'s
    rows, the previous id taken within each engine step as serving takes it."""
    if not sample:
        raise ValueError("--learned: no training rows")
    arr, batch = _batched(sample, batch_tokens)
    tok = arr["token_ids"].astype(np.int64)
    prev = previous_ids(tok, arr["positions"], batch)
    model = train_predictor(tok, prev, layer_targets(arr["topk_ids"], holds), vocab_size, embeddings, width=width,
                            seed=seed)
    return dataclasses.replace(tables, **model.arrays())


def _ticking(it, bar):
    for x in it:
        yield x
        bar.update(1)


def _measure(arr, batch, meta, e2r, reps, tables, ep_size, capacity, predicted, hidden, dtype_bytes, mode="tp",
             nodes=1, shuffle=None, workloads=False, predictor="tables-markov", copies="own",
             concurrency=DECODE_CONCURRENCY, route_nodes=None, in_flight=None, cost=None):
    """Metrics of one placement on ``arr``'s rows. nodes: how the bytes split into inter- and
    intra-node; route_nodes: the nodes the placement was built for, which --mode dp's request
    router scores with (default ``nodes``); in_flight: --mode dp's balance window, in requests
    (the server's router balances over max(WINDOW, its requests in flight); None: WINDOW);
    cost: cluster_cost.cost_setup's projection, whose columns are added (None: none)."""
    window = max(DP_WINDOW, in_flight or 0)
    holds = holds_from_expert2rank(e2r, ep_size, reps)
    if mode == "dp":  # whole requests on attention-DP ranks
        reqs, q = request_index(arr["request_ids"])  # q: each token's request, in first-appearance order
        Q = reqs.size
        # arrival[i]: the request arriving i-th (the trace's order, or a seeded shuffle of it)
        arrival = np.arange(Q) if shuffle is None else np.random.default_rng(shuffle).permutation(Q)
        r2r = np.empty(Q, dtype=np.int64)
        if predicted:
            _, scores, tokens = request_affinity(tables.token2rank, tables.token_conf, arr["token_ids"],
                                                 arr["request_ids"], arr.get("is_prefill"), ep_size,
                                                 nodes=route_nodes or nodes)
            scores = scores[arrival]
            if workloads:  # workload-aware grouping: a request scores as its workload's centroid so far
                if "domain" not in arr:
                    raise ValueError("--group-workloads: the trace has no 'domain' field (the workload of each token)")
                wl = np.empty(Q, dtype=np.int64)
                wl[q] = arr["domain"]
                scores = workload_scores(scores, wl[arrival])
            r2r[arrival] = assign_requests(scores, tokens[arrival], ep_size, capacity, window=window)
        else:
            r2r[arrival] = round_robin_requests(Q, ep_size)
        pos = np.empty(Q, dtype=np.int64)
        pos[arrival] = np.arange(Q)
        # balance is judged per scheduling window (DP ranks batch their own requests)
        win = pos[q] // window
        order = np.argsort(win, kind="stable")
        arr = {k: v[order] for k, v in arr.items()}
        t2r = np.repeat(r2r[q[order]][:, None], meta.num_layers, axis=1)
        batch = win[order]
    elif predicted:
        t2r, _ = simulate(tables, holds, arr["token_ids"], arr["topk_ids"], batch, ep_size, capacity,
                          arr.get("request_ids"), arr.get("is_prefill"), predictor, arr["positions"])
        # the capped oracle: the same placement and cap with every token's routing known
        oracle = t2r if predictor == "router" else simulate(None, holds, arr["token_ids"], arr["topk_ids"], batch,
                                                             ep_size, capacity, predictor="router")[0]
        m = evaluate(arr["topk_ids"], t2r, e2r, batch, ep_size, holds, hidden, dtype_bytes, nodes)
        m["oracle_lar"] = local_share(arr["topk_ids"], oracle, holds)
        m["oracle_share"] = m["lar"] / max(m["oracle_lar"], 1e-12)
        if cost is not None:
            m.update(cost(arr, t2r, e2r, holds, "own", batch))
        return m
    else:
        t2r = np.repeat(contiguous_tokens(batch, ep_size)[:, None], meta.num_layers, axis=1)
    m = evaluate(arr["topk_ids"], t2r, e2r, batch, ep_size, holds, hidden, dtype_bytes, nodes, copies=copies)
    if cost is not None:
        m.update(cost(arr, t2r, e2r, holds, copies, batch))
    if mode == "dp" and not (np.asarray(reps) >= 0).any():  # copies would split an expert's reads: not modelled
        m["step_imbalance"] = step_imbalance(arr["topk_ids"], arr["request_ids"], e2r, ep_size, concurrency)
    return m


def _dp_flags(a, dp: bool, why: str) -> None:
    """The flags only whole-request routing takes: refused naming ``why`` unless ``dp``, else
    their defaults filled in."""
    if not dp:
        given = [f for f, v in (("--shuffle-requests", a.shuffle_requests is not None),
                                ("--group-workloads", a.group_workloads),
                                ("--decode-concurrency", a.decode_concurrency is not None),
                                ("--in-flight", a.in_flight is not None)) if v]
        if given:
            raise ValueError(f"{', '.join(given)}: {why}")
    else:
        a.decode_concurrency = DECODE_CONCURRENCY if a.decode_concurrency is None else a.decode_concurrency
        a.in_flight = DP_WINDOW if a.in_flight is None else a.in_flight


def _check_dp_flags(a) -> None:
    if a.mode == "dp" and a.predictor != "tables-markov":
        raise ValueError(f"--predictor {a.predictor}: --mode dp routes whole requests by their prompt's votes, "
                         f"not tokens by a predictor")
    if a.mode == "dp" and a.bigram_pairs != -1:
        raise ValueError(f"--bigram-pairs {a.bigram_pairs}: --mode dp routes whole requests by their prompt's "
                         f"votes and learns no bigram table")
    _dp_flags(a, a.mode == "dp", "only with --mode dp (whole requests routed to ranks)")
    if a.group_workloads:  # a domain is an index into its file's meta.domains: one list for all
        _, traces = open_traces(a.trace)
        named = [t for t in traces if t.meta.domains]
        for t in named[1:]:
            if t.meta.domains != named[0].meta.domains:
                raise ValueError(f"--group-workloads: {t.path}: field 'meta.domains' = {list(t.meta.domains)} "
                                 f"differs from {named[0].path} ({list(named[0].meta.domains)})")


def cmd_build(a) -> int:
    check_output_file(a.output, "-o")
    _check_dp_flags(a)
    if a.predictor == "learned" and not a.learned:
        raise ValueError("--predictor learned scores the learned predictor, which only --learned trains")
    if a.learned and (a.mode == "dp" or a.method not in PREDICTED + ("auto",)):
        raise ValueError(f"--learned: trained for the token order of a locality placement (--mode tp, --method "
                         f"{' / '.join(PREDICTED)}), not {'--mode dp' if a.mode == 'dp' else '--method ' + a.method}")
    if a.ep_size % a.nodes:
        raise ValueError(f"--nodes {a.nodes} does not divide --ep-size {a.ep_size}")
    if a.mode == "dp":
        bad = [f for f, v in (("--replicas", a.replicas > 0),
                              ("--method", a.method != "coclust")) if v]
        if bad:
            raise ValueError(f"--mode dp: {', '.join(bad)} not supported with request-level placement yet")
    if a.replicas and a.method not in PREDICTED + ("auto",):
        raise ValueError(f"--replicas needs a locality method ({', '.join(PREDICTED)}), not {a.method!r}")
    E = open_traces(a.trace)[0].num_experts  # the headers alone: refuse before a long pass
    if not 1 <= a.ep_size <= E:
        raise ValueError(f"--ep-size {a.ep_size} must be in 1..{E} (the trace's experts)")
    if E % a.ep_size:
        bad = [f for f, on in (("--mode dp", a.mode == "dp"), ("--method eplb", a.method == "eplb"),
                               (f"--nodes {a.nodes}", a.nodes > 1), (f"--replicas {a.replicas}", a.replicas > 0),
                               (f"--groups {a.groups}", (a.groups or 1) > 1)) if on]
        if bad:
            raise ValueError(f"--ep-size {a.ep_size} does not divide the trace's {E} experts (vLLM's uneven split): "
                             f"not supported with {', '.join(bad)} yet")
    t0 = time.perf_counter()
    # one pass: counts of every token, and the leading rows for the in-sample metrics
    # --mode dp learns from these rows' requests: evenly spaced windows, so a recording made one
    # workload after another still shows every workload; --method auto also keeps a tail to judge on
    judge_span: list[tuple[int, int]] = []

    def window(T):
        if a.mode == "dp":
            return _windows(T, a.metrics_tokens)
        lead = [(0, min(T, a.metrics_tokens))]
        if a.method == "auto":
            judge_span.extend(_judge_windows(T, a.metrics_tokens, a.instance_tokens))
            return _union(lead + judge_span)
        return lead

    instances = a.method in NEEDS_INSTANCES or a.method == "auto"
    meta, counts, sample, files, total = _stream(a.trace, window, sample_tokens=a.instance_tokens if instances else 0)
    count_s = time.perf_counter() - t0
    fingerprint, emb, model_groups = _model_info(a.model, meta.vocab_size)
    groups = a.groups or model_groups
    if a.groups and a.model and a.groups != model_groups:
        raise ValueError(f"--groups {a.groups}: the model at {a.model} routes in {model_groups} group(s) (n_group)")
    if groups > 1 and a.method == "eplb":
        raise ValueError(f"--method eplb: vLLM's EPLB policy does not keep the {groups} routing groups whole; "
                         f"use a locality method or linear")
    try:
        check_groups(meta.num_experts, a.ep_size, a.nodes, groups)
    except ValueError as e:
        raise ValueError(f"{f'--groups {a.groups}' if a.groups else f'--model {a.model} (n_group {groups})'}: {e}"
                         ) from None
    print(f"counted {total} tokens x {meta.num_layers} layers in {count_s:.1f} s ({total / count_s:,.0f} tokens/s, "
          f"{counts.nbytes / 2**20:.0f} MiB of counts); placing {meta.num_experts} experts on {a.ep_size} ranks "
          f"with {a.method}, {a.jobs} job{'s' if a.jobs > 1 else ''}", file=sys.stderr)
    auto = judge = None
    if judge_span:  # --method auto: the lead rows first, then (or among them) the rows it judges on
        rows = np.concatenate([np.arange(lo, hi) for lo, hi in _union(judge_span)])
        kept = _union([(0, min(total, a.metrics_tokens))] + judge_span)
        at = _positions(kept, rows)
        judge = {k: v[at] for k, v in sample.items()}
        sample = {k: v[:min(total, a.metrics_tokens)] for k, v in sample.items()}
    rows = _polish_rows(*_batched(sample, a.batch_tokens), a.polish_tokens) if a.mode == "tp" and sample else None
    polished = _polish_note(rows, meta, a.method, a.ep_size, a.nodes, groups, a.polish_kicks)
    if a.mode == "dp":
        e2r, reps, tables, secs, peak = _solve_dp(counts, sample, meta, a, emb, groups)
    elif a.method == "auto":
        method, (e2r, reps, tables, secs, peak), auto = _choose(counts, meta, a, emb, groups, sample, judge,
                                                                spans=judge_span, rows=rows)
    else:
        e2r, reps, tables, secs, peak = _solve(a.method, counts, meta, a, a.ep_size, a.nodes, emb, groups, rows)
    if a.mode == "tp" and tables is not None:
        t1 = time.perf_counter()
        holds = holds_from_expert2rank(e2r, a.ep_size, reps)
        if auto is None:  # auto's candidates came with their bigrams (they were judged with them)
            tables = _with_bigrams(tables, sample, holds, meta.vocab_size, a.bigram_pairs, a.batch_tokens)
        if a.learned:  # the network for the method kept only
            tables = _with_learned(tables, sample, holds, meta.vocab_size, emb,
                                   a.learned_width or default_width(a.ep_size), a.batch_tokens, a.seed)
        secs += time.perf_counter() - t1
    del counts
    sub, batch = _batched(sample, a.batch_tokens)
    m = _measure(sub, batch, meta, e2r, reps, tables, a.ep_size, a.capacity,
                 tables is not None or a.predictor == "router",
                 meta.hidden_size or a.hidden_size, a.dtype_bytes, mode=a.mode, nodes=a.nodes,
                 shuffle=a.shuffle_requests, workloads=a.group_workloads, predictor=a.predictor,
                 concurrency=a.decode_concurrency, in_flight=a.in_flight)
    m.update(solve_seconds=secs, peak_mem_mb=peak, table_bytes=tables.nbytes if tables is not None else 0)
    chosen = method if auto is not None else a.method
    write_placement(a.output, expert2rank=e2r, ep_size=a.ep_size, nodes=a.nodes, top_k=meta.top_k,
                    vocab_size=meta.vocab_size,
                    method=chosen if a.mode == "tp" else "dp-coclust",
                    capacity=a.capacity,
                    tables=tables.arrays() if tables is not None else None,
                    replicas=reps if a.replicas else None, fingerprint=fingerprint, groups=groups,
                    built_from={"traces": [_rel(f, a.output) for f in files], "tokens": int(total),
                                "batch_tokens": a.batch_tokens, "theta": a.theta, "seed": a.seed,
                                "max_expert_load": a.max_expert_load, "mode": a.mode, "predictor": a.predictor,
                                **({"polish_tokens": int(rows[0].shape[0])} if polished and chosen in POLISHED
                                   else {}),
                                **({"polish_kicks": a.polish_kicks} if polished and a.polish_kicks and
                                   chosen in POLISHED else {}),
                                **({"shuffle_requests": a.shuffle_requests} if a.shuffle_requests is not None else {}),
                                **({"in_flight": a.in_flight} if a.mode == "dp" else {}),
                                **({"auto": auto} if auto is not None else {})},
                    metrics={k: m[k] for k in METRIC_KEYS if k in m})
    nodes = (f", a2a bytes/token {m['internode_bytes_per_token']:.0f} inter-node + "
             f"{m['intranode_bytes_per_token']:.0f} intra-node" if a.nodes > 1 else "")
    step = f", step imbalance {m['step_imbalance']:.3f}" if "step_imbalance" in m else ""
    print(f"wrote {a.output}: in-sample LAR {m['lar']:.3f}, token load {m['token_load']:.3f}, "
          f"expert load {m['expert_load']:.3f}{step}{nodes} (first {sub['token_ids'].size} tokens), "
          f"solve {secs:.1f} s, tables {m['table_bytes'] / 1e6:.2f} MB, total {time.perf_counter() - t0:.1f} s")
    return 0


AUTO_METHODS = ("coclust", "bytes")  # --method auto's candidates: the most local, the fewest rows


def _judge_windows(total: int, metrics_tokens: int, instance_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of the rows --method auto judges its candidates on: about
    ``metrics_tokens`` rows in evenly spaced windows (a recording made one workload after another
    still shows every workload) past the leading ``instance_tokens`` rows the bytes objective is
    scored on, where at least a quarter of the trace lies there; else over the whole trace."""
    lo = instance_tokens if total - instance_tokens >= total // 4 and total > instance_tokens else 0
    return [(lo + a, lo + b) for a, b in _windows(total - lo, metrics_tokens)]


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged [start, stop) ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _positions(kept: list[tuple[int, int]], rows: np.ndarray) -> np.ndarray:
    """Indices into the concatenation of the merged ranges ``kept`` of the trace rows ``rows``
    (each inside one of them)."""
    starts = np.array([lo for lo, _ in kept])
    offsets = np.cumsum([0] + [hi - lo for lo, hi in kept])[:-1]
    k = np.searchsorted(starts, rows, side="right") - 1
    return offsets[k] + rows - starts[k]


def _choose(counts, meta, a, emb, groups, sample, judge, spans: list[tuple[int, int]], rows=None):
    """--method auto: solve every :data:`AUTO_METHODS` candidate with the same flags, score each
    with its predictor tables on ``judge`` (rows sorted by step), and keep the one
    :func:`..placement.metrics.recommend` picks (evaluate --compare's rule: the fewest rows per
    token within 2% of the best LAR, at a balanced expert load). Returns (method, what
    :func:`_solve` returns for it, the choice's record for the YAML's built_from)."""
    held_out = spans[0][0] >= a.instance_tokens
    jarr, jbatch = _batched(judge, a.batch_tokens)
    hidden = meta.hidden_size or a.hidden_size
    solved, scores = {}, {}
    # bytes places on one level of ranks with experts free to move: hierarchical and grouped builds keep coclust
    unsupported = [f for f, v in ((f"--nodes {a.nodes}", a.nodes > 1), (f"{groups} routing groups", groups > 1)) if v]
    methods = AUTO_METHODS[:1] if unsupported else AUTO_METHODS
    if unsupported:
        print(f"--method auto: bytes does not support {' and '.join(unsupported)} yet; coclust alone", file=sys.stderr)
    for method in methods:
        e2r, reps, tables, secs, peak = _solve(method, counts, meta, a, a.ep_size, a.nodes, emb, groups, rows)
        t1 = time.perf_counter()
        holds = holds_from_expert2rank(e2r, a.ep_size, reps)
        tables = _with_bigrams(tables, sample, holds, meta.vocab_size, a.bigram_pairs, a.batch_tokens)
        secs += time.perf_counter() - t1
        m = _measure(jarr, jbatch, meta, e2r, reps, tables, a.ep_size, a.capacity, True, hidden, a.dtype_bytes,
                     nodes=a.nodes, predictor="tables" if a.predictor == "learned" else a.predictor)
        solved[method] = (e2r, reps, tables, secs, peak)
        scores[method] = {k: float(m[k]) for k in ("lar", "remote_unique_per_token", "expert_load")}
    cap = a.max_expert_load * (1 + LOAD_SLACK)
    i, why = recommend([scores[k]["lar"] for k in methods],
                       [scores[k]["remote_unique_per_token"] for k in methods],
                       [scores[k]["expert_load"] for k in methods], cap)
    if i < 0:  # the judge rows load every candidate unevenly (a workload they lack): the least uneven
        i = int(np.argmin([scores[k]["expert_load"] for k in methods]))
        why += f"; kept {methods[i]}, the lowest expert load"
    method = methods[i]
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


def _evaluate_all(a):
    _check_dp_flags(a)
    p = load_placement(a.placement)
    meta, _, arr, _, total = _stream(a.trace, lambda T: _windows(T, a.max_tokens), counts=False, desc="reading")
    for key, want in (("num_layers", p.num_layers), ("num_experts", p.num_experts), ("top_k", p.top_k)):
        if getattr(meta, key) != want:
            raise ValueError(f"{a.trace[0]}: trace meta.{key} = {getattr(meta, key)} but placement "
                             f"{a.placement} has model.{key} = {want}")
    if arr["token_ids"].size < total:
        print(f"evaluating {arr['token_ids'].size} of {total} tokens: {EVAL_WINDOWS} evenly spaced windows "
              f"(--max-tokens 0 for all)", file=sys.stderr)
    arr, batch = _batched(arr, a.batch_tokens)
    cost = cost_setup(a, p.ep_size, p.top_k)
    if cost is not None:
        print(cost.note, file=sys.stderr)
        if a.mode == "tp":  # the cluster's steps: every rank holds --tokens-per-rank of each
            arr, batch = cost.steps(arr)
    hidden = meta.hidden_size or a.hidden_size
    results: dict[str, dict] = {}
    tables = load_tables(p) if p.predictor else None
    if a.predictor == "learned":
        if tables is None or tables.learned is None:
            raise ValueError(f"--predictor learned: {p.predictor or a.placement} holds no learned predictor "
                             f"(build it with smoe-place build --learned)")
        if a.compare:
            raise ValueError("--predictor learned with --compare: the peers' placements get no learned predictor "
                             "yet; compare with --predictor tables")
    label = f"placement ({p.method})"
    nodes = a.nodes or p.nodes  # the bytes split only: every placement is solved as the placement was
    if p.ep_size % nodes:
        raise ValueError(f"--nodes {nodes} does not divide the ep_size {p.ep_size} of {a.placement}")
    m = _measure(arr, batch, meta, p.expert2rank, p.replicas, tables, p.ep_size, p.capacity,
                 tables is not None or a.predictor == "router",
                 hidden, a.dtype_bytes, a.mode, nodes, a.shuffle_requests, a.group_workloads, a.predictor,
                 concurrency=a.decode_concurrency, route_nodes=p.nodes, in_flight=a.in_flight, cost=cost)
    m.update({k: p.metrics[k] for k in ("solve_seconds", "peak_mem_mb", "table_bytes") if k in p.metrics})
    results[label] = m
    methods = [] if not a.compare else (COMPARE_ALL if a.compare == "all" else a.compare.split(","))
    unknown = [x for x in methods if x not in COMPARE_ALL]
    if unknown:
        raise ValueError(f"--compare: unknown method(s) {unknown}; choose from {', '.join(COMPARE_ALL)} or 'all'")
    if methods:
        train_specs = a.train or (load_train_specs(a.placement))
        tmeta, counts, tsample, _, _ = _stream(train_specs, lambda T: [(0, min(T, BIGRAM_TOKENS))],
                                               sample_tokens=a.instance_tokens
                                               if any(m in NEEDS_INSTANCES for m in methods) else 0)
        if (tmeta.num_layers, tmeta.num_experts) != (meta.num_layers, meta.num_experts):
            raise ValueError(f"--train traces have a different model shape than {a.trace[0]}")
        # every peer that takes copies gets the placement's budget: EPLB (copies of hot experts)
        # and smoe's locality methods
        a.replicas = int((p.replicas[..., 0] >= 0).sum(axis=1).max()) if p.replicas.size else 0
        for method in methods:
            if p.groups > 1 and method in NEEDS_INSTANCES:
                print(f"skipping {method}: it does not support grouped routing yet", file=sys.stderr)
                continue
            if p.nodes > 1 and method in NEEDS_INSTANCES:
                print(f"skipping {method}: it does not support placements over nodes (--nodes) yet", file=sys.stderr)
                continue
            if method == "eplb":
                from .peers import eplb_available

                ok, why = eplb_available()
                if ok and (tmeta.num_experts + a.replicas) % p.ep_size:
                    ok, why = False, (f"vLLM's EPLB needs {tmeta.num_experts} experts + {a.replicas} copies to split "
                                      f"evenly over ep_size {p.ep_size}")
                if not ok:
                    print(f"skipping eplb: {why}", file=sys.stderr)
                    continue
            # coclust as build makes it: polished on the same leading training rows
            e2r, reps, tab, secs, peak = _solve(method, counts, tmeta, a, p.ep_size, p.nodes,
                                                groups=1 if method == "eplb" else p.groups,
                                                rows=_polish_rows(*_batched(tsample, a.batch_tokens), POLISH_TOKENS))
            if tab is None:  # a plain-EP placement: smoe's predictor built for it, for the +pred form
                tab = tables_for_placement(counts, holds_from_expert2rank(e2r, p.ep_size, reps), tmeta.vocab_size)
            if tab.bigram_keys is None:  # the same predictor as smoe's placement, bigrams included
                tab = _with_bigrams(tab, tsample, holds_from_expert2rank(e2r, p.ep_size, reps), tmeta.vocab_size,
                                    a.bigram_pairs, a.batch_tokens)
            # each placement as plain EP runs it (contiguous token slices), then with smoe's predictor
            for form, predicted in ((method, False), (method + "+pred", True)):
                # served as plain EP, EPLB's copies are picked by vLLM's hash; smoe picks the token's own
                m = _measure(arr, batch, meta, e2r, reps, tab, p.ep_size, p.capacity, predicted, hidden,
                             a.dtype_bytes, a.mode, nodes, a.shuffle_requests, a.group_workloads, a.predictor,
                             copies="hashed" if method == "eplb" and not predicted else "own",
                             concurrency=a.decode_concurrency, route_nodes=p.nodes, in_flight=a.in_flight,
                             cost=cost)
                m.update(solve_seconds=secs, peak_mem_mb=peak, table_bytes=tab.nbytes if predicted else 0)
                results[form] = m
    if cost is not None:
        print_costs(results, cost.backends)
    return p, results, meta, arr


def _rel(path: str, yaml_path: str) -> str:
    """Trace path as stored in the YAML: relative to the YAML's directory."""
    return os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.abspath(yaml_path)))


def load_train_specs(placement_path: str) -> list[str]:
    from ..formats.bounded import load_yaml

    doc = load_yaml(placement_path, "placement file")
    traces = (doc.get("built_from") or {}).get("traces") if isinstance(doc, dict) else None
    if not traces:
        raise ValueError(f"{placement_path}: field 'built_from.traces' is empty; pass --train")
    base = os.path.dirname(os.path.abspath(placement_path))
    return [os.path.join(base, t) for t in traces]


def _print_table(results: dict[str, dict]) -> None:
    cols = ("lar", "token_load", "expert_load", "remote_pairs_per_token", "remote_unique_per_token",
            "a2a_bytes_per_token", "hit_rate", "oracle_hit_rate", "oracle_share", "solve_seconds")
    head = ("method", "LAR", "tok_load", "exp_load", "remote/tok", "uniq/tok", "a2a B/tok", "hit", "oracle_hit",
            "LAR/oracle", "solve_s")
    if any("step_imbalance" in m for m in results.values()):  # --mode dp
        cols = cols[:3] + ("step_imbalance",) + cols[3:]
        head = head[:4] + ("step_imb",) + head[4:]
    if any("internode_bytes_per_token" in m for m in results.values()):  # --nodes > 1
        cols = cols[:6] + ("internode_bytes_per_token", "intranode_bytes_per_token") + cols[6:]
        head = head[:7] + ("inter B/tok", "intra B/tok") + head[7:]
    w = max(len(k) for k in results) + 2
    print(f"{head[0]:<{w}}" + "".join(f"{h:>11}" for h in head[1:]))
    for name, m in results.items():
        cells = []
        for c in cols:
            v = m.get(c)
            cells.append(f"{'-':>11}" if v is None else (f"{v:>11.0f}" if "bytes" in c else f"{v:>11.3f}"))
        print(f"{name:<{w}}" + "".join(cells))


def cmd_evaluate(a) -> int:
    if a.json:
        check_output_file(a.json, "--json")
    results = _evaluate_all(a)[1]
    _print_table(results)
    # what to serve: every form that serves with smoe's token order, judged on this trace
    served = [k for k in results if k.startswith("placement") or k.endswith("+pred")]
    if len(served) > 1:
        cap = a.max_expert_load * (1 + LOAD_SLACK)
        i, why = recommend([results[k]["lar"] for k in served], [results[k]["remote_unique_per_token"] for k in served],
                           [results[k]["expert_load"] for k in served], cap)
        print(f"recommended: {served[i]}: {why}" if i >= 0 else f"recommended: none: {why}")
        for n, k in enumerate(served):  # the same choice in the JSON, with its reason on every served form
            results[k]["recommended"] = n == i
            results[k]["recommended_why"] = why
    if a.json:
        out = {k: {m: v for m, v in r.items()} for k, r in results.items()}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {a.json}")
    return 0


ADVISE_KEYS = ("lar", "remote_unique_per_token", "a2a_bytes_per_token", "expert_load", "token_load")


def _late_half(batch: np.ndarray, engine: np.ndarray | None, request_ids: np.ndarray | None = None) -> np.ndarray:
    """[n] bool: the rows of each DP engine's second half of engine steps (batch: [n] step ids,
    sorted, one engine's recordings one after another; engine: [n] int, or None for one). An
    engine of one step stays whole in the first half. With request_ids ([n] int, distinct
    across recordings) every request goes whole to the half its first row is in (--mode dp
    judges whole requests, routed by their prompts)."""
    rec = np.zeros(batch.size, dtype=np.int64) if engine is None else engine
    late = np.zeros(batch.size, dtype=bool)
    for r in np.unique(rec):
        mine = rec == r
        steps = np.unique(batch[mine])
        late |= mine & (batch >= steps[steps.size // 2]) if steps.size >= 2 else False
    if request_ids is not None:
        _, first, q = np.unique(request_ids, return_index=True, return_inverse=True)
        late = late[first][q.ravel()]
    return late


def cmd_advise(a) -> int:
    """What a placement built from a live recording would gain over the one being served: each
    DP engine's first half of steps trains a candidate (the served placement's method, ep_size,
    nodes, groups, replicas and capacity; a --mode dp placement's request co-clustering), its
    second half scores both with the same predictor (--mode dp: the same request routing)."""
    given = [f for f, v in (("--capacity", a.capacity is not None), ("--replicas", a.replicas is not None)) if v]
    if given:
        raise ValueError(f"{', '.join(given)}: advise takes capacity and copies from the served placement")
    if a.group_workloads:
        raise ValueError("--group-workloads: advise judges the router as the server runs it (each request by its "
                         "own prompt); the workload-grouped router is a what-if of evaluate --mode dp")
    if a.balance_weight is not None and a.max_moves is None:
        raise ValueError(f"--balance-weight {a.balance_weight:g}: only with --max-moves (it weighs expert load "
                         f"against locality in the limited candidate)")
    if a.json:
        check_output_file(a.json, "--json")
    if a.output:
        check_output_file(a.output, "-o")
    p = load_placement(a.placement)
    dp = p.method == "dp-coclust"
    _dp_flags(a, dp, f"only for a --mode dp placement (field 'method' = dp-coclust); {a.placement} has method "
                     f"{p.method}")
    if dp and a.max_moves is not None:
        raise ValueError(f"{a.placement}: field 'method' = dp-coclust: --max-moves limits a live swap, which DP "
                         f"engines do not take (POST /smoe/placement answers 409 with DP > 1); a DP placement is "
                         f"changed by a restart, all of it")
    if dp and a.rename is not None:
        raise ValueError(f"--rename {a.rename}: {a.placement} has method dp-coclust, which engines load at a "
                         f"restart: there is no live swap whose moves renaming would keep few")
    given = [f for f, v in (("--predictor", a.predictor is not None), ("--bigram-pairs", a.bigram_pairs != -1)) if v]
    if dp and given:
        raise ValueError(f"{', '.join(given)}: {a.placement} has method dp-coclust: whole requests are routed by "
                         f"their prompt's votes, not tokens by a predictor")
    # serving's default predictor; a DP placement's tables are built as build --mode dp builds them
    a.predictor = a.predictor or ("tables-markov" if dp else "tables")
    current = load_tables(p) if p.predictor else None
    # the served tables' learned predictor: every candidate gets one of the same width, so that a
    # server ordering with --smoe-predictor learned can take it
    learned = None if current is None or current.learned is None else current.learned_token_proj.shape[1]
    if a.predictor == "learned" and learned is None:
        raise ValueError(f"--predictor learned: {p.predictor or a.placement} holds no learned predictor (build the "
                         f"served placement with smoe-place build --learned)")
    if a.max_moves is not None and p.replicas.size and (p.replicas[..., 0] >= 0).any():
        raise ValueError(f"{a.placement}: field 'layers[].replicas': --max-moves limits the moves of placements "
                         f"without copies only, so far")
    meta, _, arr, files, total = _stream(a.trace, lambda T: _windows(T, a.max_tokens), counts=False, desc="reading",
                                         engines=True)
    for key, want in (("num_layers", p.num_layers), ("num_experts", p.num_experts), ("top_k", p.top_k)):
        if getattr(meta, key) != want:
            raise ValueError(f"{a.trace[0]}: trace meta.{key} = {getattr(meta, key)} but placement "
                             f"{a.placement} has model.{key} = {want}")
    if p.vocab_size is not None and meta.vocab_size > p.vocab_size:
        raise ValueError(f"{a.trace[0]}: trace meta.vocab_size = {meta.vocab_size} but placement {a.placement} has "
                         f"model.vocab_size = {p.vocab_size}")
    served_order = meta.extra.get("token_order")  # how speculate ordered the recorded rows, if it did
    if served_order not in (None, "layer", "step"):
        raise ValueError(f"{a.trace[0]}: field 'meta.token_order' must be 'layer' or 'step', got {served_order!r}")
    if a.rename is None and not dp:
        a.rename = "model" if served_order == "step" else "layer"
        if served_order == "step":
            print("--rename model: the recording was served with one token order per step (meta.token_order), "
                  "so the candidate's layers keep agreeing rank names", file=sys.stderr)
    elif a.rename == "layer" and served_order == "step":
        print("--rename layer: the recording was served with one token order per step (meta.token_order): "
              "renamed per layer, the candidate's layers stop agreeing on rank names, which that order needs "
              "(--rename model keeps them)", file=sys.stderr)
    fingerprint, emb, _ = _model_info(a.model, meta.vocab_size)
    if fingerprint is not None and p.fingerprint is not None and fingerprint != p.fingerprint:
        raise ValueError(f"--model {a.model}: its fingerprint {fingerprint} is not the served placement's "
                         f"model.fingerprint {p.fingerprint} ({a.placement})")
    arr, batch = _batched(arr, a.batch_tokens)
    late = _late_half(batch, arr.pop("engine"), arr["request_ids"] if dp else None)
    if not late.any() and dp and np.unique(batch).size >= 2:
        raise ValueError(f"{a.trace[0]}: no request starts in the second half of its engine's steps (advise judges "
                         f"whole requests on it, the first half trains the candidate): record longer")
    if not late.any():
        raise ValueError(f"{a.trace[0]}: {np.unique(batch).size} engine step(s) recorded; advise needs two or more "
                         f"from one engine (its first half trains the candidate, the second judges it)")
    train = {k: v[~late] for k, v in arr.items()}
    test, test_batch = {k: v[late] for k, v in arr.items()}, batch[late]
    print(f"training a candidate on {int((~late).sum())} tokens, judging both on the next {int(late.sum())}",
          file=sys.stderr)
    counts = RoutingCounts.from_arrays(train["token_ids"], train["topk_ids"], meta.num_experts, meta.vocab_size)
    a.replicas = int((p.replicas[..., 0] >= 0).sum(axis=1).max()) if p.replicas.size else 0
    a.capacity = p.capacity
    hidden = meta.hidden_size or a.hidden_size
    if dp:  # whole requests, routed as the server routes them; the engines' recordings interleaved
        a.ep_size, a.nodes = p.ep_size, p.nodes
        method = p.method
        e2r, reps, tables, secs, _ = _solve_dp(counts, train, meta, a, emb, groups=p.groups)
        judge = dict(mode="dp", shuffle=a.seed if a.shuffle_requests is None else a.shuffle_requests,
                     in_flight=a.in_flight, concurrency=a.decode_concurrency)
    else:
        method = p.method if p.method in PREDICTED else "coclust"
        prow = _polish_rows(train, batch[~late], a.polish_tokens)
        if not _polish_note(prow, meta, method, p.ep_size, p.nodes, p.groups, a.polish_kicks):
            prow = None  # the limited candidate's polish follows the fresh one's
        e2r, reps, tables, secs, _ = _solve(method, counts, meta, a, p.ep_size, p.nodes, emb, groups=p.groups,
                                            rows=prow)
        # named as the served ranks, so that a live swap moves only the slots whose expert changes
        block = rename_block(p.ep_size, p.nodes, p.groups)
        names = rank_names(p.expert2rank, e2r, p.ep_size, a.rename == "layer", block)
        e2r, reps = named_ranks(names, e2r), np.stack([reps[..., 0], named_ranks(names, reps[..., 1])], axis=-1)
        tables = None if tables is None else rename_tables(tables, names)
        holds = holds_from_expert2rank(e2r, p.ep_size, reps)
        tables = _with_bigrams(tables, train, holds, meta.vocab_size, a.bigram_pairs, a.batch_tokens)
        if learned:
            tables = _with_learned(tables, train, holds, meta.vocab_size, emb, learned, a.batch_tokens, a.seed)
        judge = dict(predictor=a.predictor)
    results = {
        f"served ({p.method})": _measure(test, test_batch, meta, p.expert2rank, p.replicas, current, p.ep_size,
                                         p.capacity, current is not None or a.predictor == "router", hidden,
                                         a.dtype_bytes, nodes=p.nodes, **judge),
        f"candidate ({method})": _measure(test, test_batch, meta, e2r, reps, tables, p.ep_size, p.capacity, True,
                                          hidden, a.dtype_bytes, nodes=p.nodes, **judge)}
    (cur, new) = results.values()
    print(f"{'':26}{'served':>12}{'candidate':>12}{'change':>10}")
    for k in ADVISE_KEYS + (("step_imbalance",) if "step_imbalance" in cur and "step_imbalance" in new else ()):
        print(f"{k:26}{cur[k]:12.4g}{new[k]:12.4g}{(new[k] / cur[k] - 1) * 100 if cur[k] else 0.0:+9.1f}%")
    cur["moved_slots"] = 0
    new["moved_slots"] = int((e2r != p.expert2rank).sum()) if not dp else int(
        (rename_ranks(p.expert2rank, e2r, p.ep_size) != p.expert2rank).sum())
    which = "the candidate"
    if a.max_moves is not None:
        budget = int(a.max_moves * p.expert2rank.size)
        e2r, info = limit_moves(p.expert2rank, e2r, [counts.layer_matrix(layer) for layer in range(meta.num_layers)],
                                counts.seen()[1], budget, p.ep_size, capacity=p.capacity, groups=p.groups,
                                swaps=True, resolve=True, max_expert_load=a.max_expert_load,  # BENCHMARKS.md
                                balance_weight=BALANCE_WEIGHT if a.balance_weight is None else a.balance_weight,
                                rows=prow, per_layer=a.rename == "layer", block=block,
                                polish_evals=0 if prow is None else polish_evals(prow[0].shape, meta.num_layers, method))
        holds = holds_from_expert2rank(e2r, p.ep_size)
        tables = _with_bigrams(tables_for_placement(counts, holds, meta.vocab_size, emb), train, holds,
                               meta.vocab_size, a.bigram_pairs, a.batch_tokens)
        if learned:
            tables = _with_learned(tables, train, holds, meta.vocab_size, emb, learned, a.batch_tokens, a.seed)
        reps = np.zeros((meta.num_layers, 0, 2), dtype=np.int32)
        lim = results[f"limited (at most {a.max_moves:g} of slots moved)"] = _measure(
            test, test_batch, meta, e2r, reps, tables, p.ep_size, p.capacity, True, hidden, a.dtype_bytes,
            nodes=p.nodes, predictor=a.predictor)
        lim["moved_slots"] = info["moved"]
        for res, k in ((cur, "current"), (new, "fresh"), (lim, "result")):  # what the cap is judged on
            res["train_expert_load"] = info["expert_load"][k]
        gain = new["lar"] - cur["lar"]
        print(f"{'lar, moves limited':26}{cur['lar']:12.4g}{lim['lar']:12.4g}"
              f"{(lim['lar'] / cur['lar'] - 1) * 100 if cur['lar'] else 0.0:+9.1f}%")
        kept = f"; it keeps {(lim['lar'] - cur['lar']) / gain:.0%} of the candidate's LAR gain" if gain > 0 else ""
        print(f"moves: the candidate changes {new['moved_slots']} of {p.expert2rank.size} expert slots (its ranks "
              f"renamed to agree with the served ones), the limited one {info['moved']} (" + (
                  f"placed by a 0-1 program, {info['programs']} solved, bettering the greedy search" if info["resolved"]
                  else f"{info['cycles']} of its exchange cycles, {info['swaps']} swaps of two experts") + (
                  f"; polished on the routing in {info['polished']} layer(s)" if info["polished"] else "") + f"){kept}")
        load = info["expert_load"]
        print(f"expert load on the training half (the most over layers; cap {a.max_expert_load:g}): served "
              f"{load['current']:.2f}, candidate {load['fresh']:.2f}, limited {load['result']:.2f}")
        new, method, which = lim, f"{method}+moves", "the limited candidate"
    else:
        print(f"moves: the candidate changes {new['moved_slots']} of {p.expert2rank.size} expert slots (its ranks "
              f"renamed to agree with the served ones; " + ("DP engines load it at a restart)" if dp else
                                                            "--max-moves F limits them)"))
    verdict = (f"{which} keeps more activations local" if new["lar"] > cur["lar"]
               else "the served placement still does as well")
    judged = (f"requests routed as the server does at {a.in_flight} in flight, in a random order (seed "
              f"{judge['shuffle']})" if dp else f"predictor {a.predictor}")
    print(f"{verdict}: LAR {cur['lar']:.3f} -> {new['lar']:.3f}, rows per token "
          f"{cur['remote_unique_per_token']:.3f} -> {new['remote_unique_per_token']:.3f} (held-out half, {judged}; "
          f"candidate built in {secs:.1f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {a.json}")
    if a.output:
        write_placement(a.output, expert2rank=e2r, ep_size=p.ep_size, nodes=p.nodes, top_k=meta.top_k,
                        vocab_size=meta.vocab_size, method=method, capacity=p.capacity,
                        tables=tables.arrays() if tables is not None else None,
                        replicas=reps if a.replicas else None, fingerprint=p.fingerprint, groups=p.groups,
                        built_from={"traces": [_rel(f, a.output) for f in files], "tokens": int((~late).sum()),
                                    "batch_tokens": a.batch_tokens, "theta": a.theta, "seed": a.seed,
                                    "max_expert_load": a.max_expert_load, "mode": "dp" if dp else "tp",
                                    "predictor": a.predictor,
                                    **({"in_flight": a.in_flight, "shuffle_requests": judge["shuffle"]} if dp else {}),
                                    "advised_over": os.path.abspath(a.placement)},
                        metrics={k: new[k] for k in METRIC_KEYS if k in new})
        print(f"wrote {a.output}")
    return 0


def cmd_report(a) -> int:
    from .report import write_report

    check_output_dir(a.output, "-o")
    p, results, meta, arr = _evaluate_all(a)
    _print_table(results)
    os.makedirs(a.output, exist_ok=True)
    with open(os.path.join(a.output, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    page = write_report(a.output, results, p, arr["topk_ids"], meta.num_experts)
    print(f"wrote {page}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smoe-place", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s):
        s.add_argument("--predictor", choices=SIM_PREDICTORS, default="tables-markov",
                       help="the token -> rank predictor simulated for smoe's placements and every X+pred form: "
                            "tables-markov (default: token and bigram tables, Markov table on the previous layer's "
                            "top-1, prefill -> decode table; the largest confidence wins), tables (the token and "
                            "bigram tables alone: what serving's default predictor uses), learned (the placement's "
                            "learned predictor: build --learned), router (every token's routing known: serving's "
                            "predictor that runs vLLM's gate ahead, and the capped oracle every predicted form is "
                            "also scored against as oracle_lar / oracle_share)")
        s.add_argument("--bigram-pairs", type=number(int, -1), default=-1,
                       help="at most this many (previous token, token) pairs in the bigram table, learned from the "
                            "first --metrics-tokens training rows (build) or first %d (evaluate --compare): the "
                            "pairs the token table predicts worst; -1 (default) = as many as fit in the token table's "
                            "bytes, so the tables at most double; 0 = none" % BIGRAM_TOKENS)
        s.add_argument("--capacity", type=number(float, 1.0), default=1.10,
                       help="per-batch token cap per rank, as a multiple of the fair share, >= 1 (default 1.10)")
        s.add_argument("--shuffle-requests", type=number(int, 0), default=None, metavar="SEED",
                       help="--mode dp: requests arrive in a random order (this seed) instead of the trace's, for "
                            "traces recorded one workload after another (the simulated routing only: build "
                            "learns from the same requests either way)")
        s.add_argument("--decode-concurrency", type=number(int, 1), default=None,
                       help="--mode dp: requests decoding at once when scoring the placement's lock-step cost "
                            "(step_imbalance: the busiest rank's distinct experts per MoE layer over the mean's; "
                            "default 8)")
        s.add_argument("--in-flight", type=number(int, 1), default=None, metavar="R",
                       help="--mode dp: requests in flight the simulated server balances over (its router's window "
                            "is the larger of this and %d, its in-flight count when serving); token load is judged "
                            "per window of that many arrivals (default %d)" % (DP_WINDOW, DP_WINDOW))
        s.add_argument("--group-workloads", action="store_true",
                       help="--mode dp: route each request by its workload's running score (the trace's 'domain' "
                            "field) instead of its own, so that a workload's requests land together")
        s.add_argument("--batch-tokens", type=number(int, 1), default=512,
                       help="batch size for traces without step_ids (default 512)")
        s.add_argument("--theta", type=number(float, 0.0, 1.0), default=0.5,
                       help="balance weight of ceo/alternating, in [0, 1] (default 0.5)")
        s.add_argument("--max-expert-load", type=number(float, 1.0), default=1.10,
                       help="coclust, bytes, --mode dp: cap on each rank's expert (compute) load, x mean, >= 1 "
                            "(default 1.10; --mode dp with routing groups: not capped, only kept from rising)")
        s.add_argument("--seed", type=number(int, 0), default=0)
        s.add_argument("--hidden-size", type=number(int, 1), default=4096,
                       help="for a2a bytes when the trace meta has no hidden_size (default 4096)")
        s.add_argument("--dtype-bytes", type=number(int, 1), default=2,
                       help="activation bytes per element (default 2)")
        s.add_argument("--instance-tokens", type=number(int, 1), default=1 << 17,
                       help="bytes: the objective is scored on the whole expert sets of this many leading "
                            "training tokens (default 131072)")
        s.add_argument("--jobs", type=number(int, 1), default=default_jobs(),
                       help=f"worker processes solving layers in parallel (default: all cores, here "
                            f"{default_jobs()}); the result does not depend on it")

    def polish(s):
        s.add_argument("--polish-tokens", type=number(int, 0), default=POLISH_TOKENS,
                       help=f"polish each coclust layer on the routing of this many leading rows: swaps of two experts "
                            f"scored by the capped order a served step gets (default {POLISH_TOKENS}; 0 = the solver's "
                            f"placement as is)")
        s.add_argument("--polish-kicks", type=number(int, 0), default=0,
                       help="after the polish, this many rounds of an iterated local search per layer: a kick of "
                            "3 random swaps, a polish at the same budget, kept where it scores higher (default 0; "
                            "each round costs about one polish: BENCHMARKS.md, 'Kicked polish')")

    b = sub.add_parser("build", help="place experts and build predictor tables; writes YAML + .tables.npz")
    b.add_argument("--trace", nargs="+", required=True, help="trace files, directories or globs")
    b.add_argument("--ep-size", type=number(int, 1), required=True)
    b.add_argument("--method", choices=tuple(SOLVERS) + ("eplb", "auto"), default="coclust",
                   help="coclust (default: most local activations), bytes (fewest all-to-all rows), auto (both "
                        "solved, the one sending fewer rows per token kept where its LAR is within 2%% of the "
                        "other's at balanced load, judged on the trace's last quarter), or a peer")
    b.add_argument("--nodes", type=number(int, 1), default=1,
                   help="hierarchical: nodes first, then ranks inside a node")
    b.add_argument("--replicas", type=number(int, 0), default=0,
                   help="redundant copies per layer (multiple of ep-size)")
    b.add_argument("--model", help="checkpoint directory: fingerprint, embeddings for unseen tokens, and its "
                                   "routing groups (n_group)")
    b.add_argument("--groups", type=number(int, 1),
                   help="grouped top-k routing (DeepSeek's n_group): keep every group of experts whole, so "
                        "that loading the placement leaves the routing unchanged (default: the --model's "
                        "n_group, else 1)")
    b.add_argument("--mode", choices=("tp", "dp"), default="tp",
                   help="tp: tokens shuffled to ranks per layer (speculate, default); dp: attention data "
                        "parallel, each request runs on one rank, so experts are co-clustered with whole "
                        "requests (those of --metrics-tokens tokens); serve it with TP = 1")
    b.add_argument("-o", "--output", required=True, help="placement YAML to write")
    b.add_argument("--learned", action="store_true",
                   help="also train the learned predictor (a small network over the token's and the previous "
                        "token's input embeddings, from --model, else per-id rows) on the first --metrics-tokens "
                        "rows, for serving with --smoe-predictor learned")
    b.add_argument("--learned-width", type=number(int, 1, MAX_WIDTH), default=None,
                   help=f"hidden width of the learned predictor (default 16 x --ep-size within 64..{MAX_WIDTH})")
    polish(b)
    b.add_argument("--metrics-tokens", type=number(int, 1), default=131072,
                   help="in-sample metrics stored in the YAML use this many leading tokens (default 131072); "
                        "--mode dp also learns from the requests of this many tokens, in evenly spaced windows")
    common(b)
    b.set_defaults(fn=cmd_build)

    for name, fn, helptext in (("evaluate", cmd_evaluate, "metrics of a placement on a trace, peers side by side"),
                               ("report", cmd_report, "evaluate, then draw PNGs and an HTML page")):
        e = sub.add_parser(name, help=helptext)
        e.add_argument("--trace", nargs="+", required=True, help="test trace files, directories or globs")
        e.add_argument("--placement", required=True)
        e.add_argument("--compare", help="'all' or a comma list of " + ", ".join(COMPARE_ALL))
        e.add_argument("--train", nargs="+", help="training traces for --compare (default: the placement's)")
        e.add_argument("--max-tokens", type=number(int, 0), default=1 << 20,
                       help=f"evaluate at most this many test tokens, in {EVAL_WINDOWS} evenly spaced windows "
                            "(default 1048576; 0 = all, held in memory)")
        e.add_argument("--mode", choices=("tp", "dp"), default="tp",
                       help="tp: attention in tensor parallel, tokens shuffled per layer (default); "
                            "dp: attention data parallel, whole requests scheduled on ranks")
        e.add_argument("--nodes", type=number(int, 1), default=None,
                       help="split the all-to-all bytes into inter- and intra-node as if ranks n*N/nodes .. "
                            "(n+1)*N/nodes - 1 formed node n (default: the placement's nodes); every placement "
                            "is still solved as the placement was")
        common(e)
        add_cost_args(e)
        if name == "evaluate":
            e.add_argument("--json", help="write {method: {metric: value}} here")
        else:
            e.add_argument("-o", "--output", required=True, help="report directory")
        e.set_defaults(fn=fn, replicas=0)

    v = sub.add_parser("advise", help="what a placement built from a live recording would gain over the served one",
                       description="Trains a candidate on each DP engine's first half of engine steps (the "
                                   "served placement's method, ep_size, nodes, groups, copies and capacity) and "
                                   "scores both on the second halves. --predictor defaults to tables here (serving's "
                                   "default). A --mode dp placement (method dp-coclust): pass every DP engine's "
                                   "recording; the candidate co-clusters their requests with experts, and both are "
                                   "judged with the server's request routing (--in-flight, --shuffle-requests: "
                                   "default the --seed, which interleaves the engines' requests).")
    v.add_argument("--trace", nargs="+", required=True,
                   help="the live recording (trace files, directories or globs, e.g. a --smoe-record directory)")
    v.add_argument("--placement", required=True, help="the placement being served")
    v.add_argument("--model", help="checkpoint directory, as build --model: its input embeddings give tokens the "
                                   "recording never saw a rank, and feed the learned predictor a candidate gets "
                                   "when the served tables hold one")
    v.add_argument("--max-tokens", type=number(int, 0), default=1 << 20,
                   help=f"use at most this many recorded tokens, in {EVAL_WINDOWS} evenly spaced windows "
                        "(default 1048576; 0 = all, held in memory)")
    v.add_argument("--max-moves", type=number(float, 0.0, 1.0), default=None, metavar="F",
                   help="also a candidate that moves at most this share of the served expert slots (a live swap "
                        "moves what changes): the fresh candidate's exchange cycles that pay most per moved slot, "
                        "its ranks renamed to agree with the served ones; -o then writes this one")
    v.add_argument("--rename", choices=("layer", "model"), default=None,
                   help="rename the fresh candidate's ranks to agree with the served ones per MoE layer (fewer "
                        "slots move) or once for the whole model (keeps its layers' rank names agreeing, for the "
                        "DeepSeek family served with one order per step, --smoe-stack-order step); default: model "
                        "where the recording says it was served so (its meta.token_order = step), else layer")
    v.add_argument("--balance-weight", type=number(float, 0.0), default=None, metavar="W",
                   help="with --max-moves: local activations one activation of a layer's busiest rank past "
                        f"--max-expert-load is worth (default {BALANCE_WEIGHT:g}; 0: the cap only guards, the load a "
                        "workload shift left stays)")
    v.add_argument("-o", "--output", help="also write the candidate placement here (POST /smoe/placement swaps it "
                                          "in live)")
    v.add_argument("--json", help="write {placement: {metric: value}} here")
    polish(v)
    common(v)
    # the predictor is serving's default (cmd_advise); capacity and copies come from the served placement
    v.set_defaults(fn=cmd_advise, predictor=None, capacity=None, replicas=None)
    add_calibrate_parser(sub)
    return p


def main(argv=None) -> int:
    keep_heap()
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
