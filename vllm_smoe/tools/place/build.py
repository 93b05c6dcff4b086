"""``smoe-place build``: one pass over the traces, a placement solved (or chosen by --method
auto), its predictor tables completed, in-sample metrics, and the YAML + .tables.npz written."""

from __future__ import annotations

import sys
import time

import numpy as np

from ...formats.placement_file import write_placement
from ...formats.trace import open_traces
from ...placement.dp import DECODE_CONCURRENCY
from ...placement.dp import WINDOW as DP_WINDOW
from ...placement.groups import check_groups
from ...placement.layout import NEEDS_INSTANCES, POLISHED, PREDICTED
from ...placement.learned import default_width
from ...placement.measure import measure
from ...placement.metrics import holds_from_expert2rank
from ...placement.spans import eval_windows, judge_windows, span_positions, union_spans
from ...placement.stream import by_step, polish_rows
from ...placement.train import with_bigrams, with_learned
from ..cli_util import check_output_file
from .read import model_info, rel, stream
from .solve import choose, polish_note, solve, solve_dp

METRIC_KEYS = ("lar", "token_load", "expert_load", "remote_pairs_per_token", "remote_unique_per_token",
               "a2a_bytes_per_token", "internode_bytes_per_token", "intranode_bytes_per_token", "hit_rate",
               "oracle_hit_rate", "oracle_lar", "oracle_share", "step_imbalance", "solve_seconds", "peak_mem_mb",
               "table_bytes")


def dp_flags(a, dp: bool, why: str) -> None:
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


def check_dp_flags(a) -> None:
    if a.mode == "dp" and a.predictor != "tables-markov":
        raise ValueError(f"--predictor {a.predictor}: --mode dp routes whole requests by their prompt's votes, "
                         f"not tokens by a predictor")
    if a.mode == "dp" and a.bigram_pairs != -1:
        raise ValueError(f"--bigram-pairs {a.bigram_pairs}: --mode dp routes whole requests by their prompt's "
                         f"votes and learns no bigram table")
    dp_flags(a, a.mode == "dp", "only with --mode dp (whole requests routed to ranks)")
    if a.group_workloads:  # a domain is an index into its file's meta.domains: one list for all
        _, traces = open_traces(a.trace)
        named = [t for t in traces if t.meta.domains]
        for t in named[1:]:
            if t.meta.domains != named[0].meta.domains:
                raise ValueError(f"--group-workloads: {t.path}: field 'meta.domains' = {list(t.meta.domains)} "
                                 f"differs from {named[0].path} ({list(named[0].meta.domains)})")


def _check_build_flags(a) -> None:
    """Refuses the flag combinations build cannot place, before any reading."""
    check_output_file(a.output, "-o")
    check_dp_flags(a)
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


def _groups(a, meta, model_groups: int) -> int:
    """The routing groups the placement keeps whole: --groups, else the --model's n_group."""
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
    return groups


def cmd_build(a) -> int:
    _check_build_flags(a)
    t0 = time.perf_counter()
    # one pass: counts of every token, and the leading rows for the in-sample metrics
    # --mode dp learns from these rows' requests: evenly spaced windows, so a recording made one
    # workload after another still shows every workload; --method auto also keeps a tail to judge on
    judge_span: list[tuple[int, int]] = []

    def window(T):
        if a.mode == "dp":
            return eval_windows(T, a.metrics_tokens)
        lead = [(0, min(T, a.metrics_tokens))]
        if a.method == "auto":
            judge_span.extend(judge_windows(T, a.metrics_tokens, a.instance_tokens))
            return union_spans(lead + judge_span)
        return lead

    instances = a.method in NEEDS_INSTANCES or a.method == "auto"
    meta, counts, sample, files, total = stream(a.trace, window, sample_tokens=a.instance_tokens if instances else 0)
    count_s = time.perf_counter() - t0
    fingerprint, emb, model_groups = model_info(a.model, meta.vocab_size, meta)
    groups = _groups(a, meta, model_groups)
    print(f"counted {total} tokens x {meta.num_layers} layers in {count_s:.1f} s ({total / count_s:,.0f} tokens/s, "
          f"{counts.nbytes / 2**20:.0f} MiB of counts); placing {meta.num_experts} experts on {a.ep_size} ranks "
          f"with {a.method}, {a.jobs} job{'s' if a.jobs > 1 else ''}", file=sys.stderr)
    auto = judge = None
    if judge_span:  # --method auto: the lead rows first, then (or among them) the rows it judges on
        rows = np.concatenate([np.arange(lo, hi) for lo, hi in union_spans(judge_span)])
        kept = union_spans([(0, min(total, a.metrics_tokens))] + judge_span)
        at = span_positions(kept, rows)
        judge = {k: v[at] for k, v in sample.items()}
        sample = {k: v[:min(total, a.metrics_tokens)] for k, v in sample.items()}
    rows = polish_rows(*by_step(sample, a.batch_tokens), a.polish_tokens) if a.mode == "tp" and sample else None
    polished = polish_note(rows, meta, a.method, a.ep_size, a.nodes, groups, a.polish_kicks)
    if a.mode == "dp":
        e2r, reps, tables, secs, peak = solve_dp(counts, sample, meta, a, emb, groups)
    elif a.method == "auto":
        method, (e2r, reps, tables, secs, peak), auto = choose(counts, meta, a, emb, groups, sample, judge,
                                                               spans=judge_span, rows=rows)
    else:
        e2r, reps, tables, secs, peak = solve(a.method, counts, meta, a, a.ep_size, a.nodes, emb, groups, rows)
    if a.mode == "tp" and tables is not None:
        t1 = time.perf_counter()
        holds = holds_from_expert2rank(e2r, a.ep_size, reps)
        if auto is None:  # auto's candidates came with their bigrams (they were judged with them)
            tables = with_bigrams(tables, sample, holds, meta.vocab_size, a.bigram_pairs, a.batch_tokens)
        if a.learned:  # the network for the method kept only
            tables = with_learned(tables, sample, holds, meta.vocab_size, emb,
                                  a.learned_width or default_width(a.ep_size), a.batch_tokens, a.seed)
        secs += time.perf_counter() - t1
    del counts
    sub, batch = by_step(sample, a.batch_tokens)
    m = measure(sub, batch, meta.num_layers, e2r, reps, tables, a.ep_size, a.capacity,
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
                    built_from={"traces": [rel(f, a.output) for f in files], "tokens": int(total),
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
