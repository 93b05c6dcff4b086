"""``smoe-place evaluate`` and ``report``: a placement's metrics on a trace, the placements users
run today (--compare) solved on the training traces and scored beside it, the table printed,
the pick said, and the JSON or the report's figures written."""

from __future__ import annotations

import json
import os
import sys

from ...formats.placement_file import load_placement, load_tables
from ...placement.choose import LOAD_SLACK
from ...placement.layout import NEEDS_INSTANCES
from ...placement.measure import measure
from ...placement.metrics import holds_from_expert2rank, recommend
from ...placement.predict import tables_for_placement
from ...placement.spans import EVAL_WINDOWS, eval_windows
from ...placement.stream import by_step, polish_rows
from ...placement.train import with_bigrams
from ..cli_util import check_output_dir, check_output_file
from ..cluster_cost import cost_setup, print_costs
from .build import check_dp_flags
from .read import load_train_specs, stream
from .solve import POLISH_TOKENS, solve

COMPARE_ALL = ("linear", "round_robin", "eplb", "metis", "ceo", "alternating", "coclust", "bytes")
BIGRAM_TOKENS = 131072  # training rows evaluate --compare learns its peers' bigram tables from


def _skip(method: str, p, tmeta, replicas: int) -> str | None:
    """Why --compare leaves ``method`` out for placement ``p`` (None: it runs)."""
    if p.groups > 1 and method in NEEDS_INSTANCES:
        return f"skipping {method}: it does not support grouped routing yet"
    if p.nodes > 1 and method in NEEDS_INSTANCES:
        return f"skipping {method}: it does not support placements over nodes (--nodes) yet"
    if method == "eplb":
        from ..peers import eplb_available

        ok, why = eplb_available()
        if ok and (tmeta.num_experts + replicas) % p.ep_size:
            ok, why = False, (f"vLLM's EPLB needs {tmeta.num_experts} experts + {replicas} copies to split "
                              f"evenly over ep_size {p.ep_size}")
        if not ok:
            return f"skipping eplb: {why}"
    return None


def evaluate_all(a):
    check_dp_flags(a)
    p = load_placement(a.placement)
    meta, _, arr, _, total = stream(a.trace, lambda T: eval_windows(T, a.max_tokens), counts=False, desc="reading")
    for key, want in (("num_layers", p.num_layers), ("num_experts", p.num_experts), ("top_k", p.top_k)):
        if getattr(meta, key) != want:
            raise ValueError(f"{a.trace[0]}: trace meta.{key} = {getattr(meta, key)} but placement "
                             f"{a.placement} has model.{key} = {want}")
    if arr["token_ids"].size < total:
        print(f"evaluating {arr['token_ids'].size} of {total} tokens: {EVAL_WINDOWS} evenly spaced windows "
              f"(--max-tokens 0 for all)", file=sys.stderr)
    arr, batch = by_step(arr, a.batch_tokens)
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
    m = measure(arr, batch, meta.num_layers, p.expert2rank, p.replicas, tables, p.ep_size, p.capacity,
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
        tmeta, counts, tsample, _, _ = stream(train_specs, lambda T: [(0, min(T, BIGRAM_TOKENS))],
                                              sample_tokens=a.instance_tokens
                                              if any(m in NEEDS_INSTANCES for m in methods) else 0)
        if (tmeta.num_layers, tmeta.num_experts) != (meta.num_layers, meta.num_experts):
            raise ValueError(f"--train traces have a different model shape than {a.trace[0]}")
        # every peer that takes copies gets the placement's budget: EPLB (copies of hot experts)
        # and smoe's locality methods
        a.replicas = int((p.replicas[..., 0] >= 0).sum(axis=1).max()) if p.replicas.size else 0
        for method in methods:
            why = _skip(method, p, tmeta, a.replicas)
            if why is not None:
                print(why, file=sys.stderr)
                continue
            # coclust as build makes it: polished on the same leading training rows
            e2r, reps, tab, secs, peak = solve(method, counts, tmeta, a, p.ep_size, p.nodes,
                                               groups=1 if method == "eplb" else p.groups,
                                               rows=polish_rows(*by_step(tsample, a.batch_tokens), POLISH_TOKENS))
            if tab is None:  # a plain-EP placement: smoe's predictor built for it, for the +pred form
                tab = tables_for_placement(counts, holds_from_expert2rank(e2r, p.ep_size, reps), tmeta.vocab_size)
            if tab.bigram_keys is None:  # the same predictor as smoe's placement, bigrams included
                tab = with_bigrams(tab, tsample, holds_from_expert2rank(e2r, p.ep_size, reps), tmeta.vocab_size,
                                   a.bigram_pairs, a.batch_tokens)
            # each placement as plain EP runs it (contiguous token slices), then with smoe's predictor
            for form, predicted in ((method, False), (method + "+pred", True)):
                # served as plain EP, EPLB's copies are picked by vLLM's hash; smoe picks the token's own
                m = measure(arr, batch, meta.num_layers, e2r, reps, tab, p.ep_size, p.capacity, predicted, hidden,
                            a.dtype_bytes, a.mode, nodes, a.shuffle_requests, a.group_workloads, a.predictor,
                            copies="hashed" if method == "eplb" and not predicted else "own",
                            concurrency=a.decode_concurrency, route_nodes=p.nodes, in_flight=a.in_flight,
                            cost=cost)
                m.update(solve_seconds=secs, peak_mem_mb=peak, table_bytes=tab.nbytes if predicted else 0)
                results[form] = m
    if cost is not None:
        print_costs(results, cost.backends)
    return p, results, meta, arr


def print_table(results: dict[str, dict]) -> None:
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
    results = evaluate_all(a)[1]
    print_table(results)
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


def cmd_report(a) -> int:
    from ..report import write_report

    check_output_dir(a.output, "-o")
    p, results, meta, arr = evaluate_all(a)
    print_table(results)
    os.makedirs(a.output, exist_ok=True)
    with open(os.path.join(a.output, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    page = write_report(a.output, results, p, arr["topk_ids"], meta.num_experts)
    print(f"wrote {page}")
    return 0
