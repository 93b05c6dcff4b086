"""``smoe-place advise``: what a placement built from a live recording would gain over the one
being served: each DP engine's first half of steps trains a candidate (the served placement's
method, ep_size, nodes, groups, replicas and capacity; a --mode dp placement's request
co-clustering), its second half scores both with the same predictor (--mode dp: the same request
routing); with --max-moves also a candidate that moves few expert slots."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from ...formats.placement_file import load_placement, load_tables, write_placement
from ...placement.choose import moved_slots, renamed_candidate
from ...placement.layout import PREDICTED, polish_evals
from ...placement.measure import measure
from ...placement.metrics import holds_from_expert2rank
from ...placement.migrate import BALANCE_WEIGHT, limit_moves, rename_block
from ...placement.predict import tables_for_placement
from ...placement.routing_counts import RoutingCounts
from ...placement.spans import eval_windows, late_half
from ...placement.stream import by_step, polish_rows
from ...placement.train import with_bigrams, with_learned
from ..cli_util import check_output_file
from .build import METRIC_KEYS, dp_flags
from .read import model_info, rel, stream
from .solve import polish_note, solve, solve_dp

ADVISE_KEYS = ("lar", "remote_unique_per_token", "a2a_bytes_per_token", "expert_load", "token_load")


def _check_flags(a, p, dp: bool) -> None:
    """Refuses what advise cannot do for the served placement ``p``, before any reading."""
    dp_flags(a, dp, f"only for a --mode dp placement (field 'method' = dp-coclust); {a.placement} has method "
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


def _check_recording(a, p, meta, dp: bool) -> None:
    """Refuses a recording of another model; picks --rename from how it was served."""
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


def _limited(a, p, meta, counts, train, test, test_batch, results, method, prow, learned, emb, fresh):
    """--max-moves: the candidate that moves at most that share of the served slots (taken from
    ``fresh`` [L, E], the fresh candidate), measured beside the others in ``results`` and said on
    stdout. Returns (e2r, reps, tables, its metrics)."""
    cur, new = results[f"served ({p.method})"], results[f"candidate ({method})"]
    hidden = meta.hidden_size or a.hidden_size
    budget = int(a.max_moves * p.expert2rank.size)
    e2r, info = limit_moves(p.expert2rank, fresh, [counts.layer_matrix(layer) for layer in range(meta.num_layers)],
                            counts.seen()[1], budget, p.ep_size, capacity=p.capacity, groups=p.groups,
                            swaps=True, resolve=True, max_expert_load=a.max_expert_load,  # BENCHMARKS.md
                            balance_weight=BALANCE_WEIGHT if a.balance_weight is None else a.balance_weight,
                            rows=prow, per_layer=a.rename == "layer", block=rename_block(p.ep_size, p.nodes, p.groups),
                            polish_evals=0 if prow is None else polish_evals(prow[0].shape, meta.num_layers, method))
    holds = holds_from_expert2rank(e2r, p.ep_size)
    tables = with_bigrams(tables_for_placement(counts, holds, meta.vocab_size, emb), train, holds,
                          meta.vocab_size, a.bigram_pairs, a.batch_tokens)
    if learned:
        tables = with_learned(tables, train, holds, meta.vocab_size, emb, learned, a.batch_tokens, a.seed)
    reps = np.zeros((meta.num_layers, 0, 2), dtype=np.int32)
    lim = results[f"limited (at most {a.max_moves:g} of slots moved)"] = measure(
        test, test_batch, meta.num_layers, e2r, reps, tables, p.ep_size, p.capacity, True, hidden, a.dtype_bytes,
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
    return e2r, reps, tables, lim


def cmd_advise(a) -> int:
    """What a placement built from a live recording would gain over the one being served (see
    the module's docstring)."""
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
    _check_flags(a, p, dp)
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
    meta, _, arr, files, total = stream(a.trace, lambda T: eval_windows(T, a.max_tokens), counts=False,
                                        desc="reading", engines=True)
    _check_recording(a, p, meta, dp)
    # a served placement with a fingerprint names its model (checked below); else the recording's shape does
    fingerprint, emb, _ = model_info(a.model, meta.vocab_size, meta if p.fingerprint is None else None)
    if fingerprint is not None and p.fingerprint is not None and fingerprint != p.fingerprint:
        raise ValueError(f"--model {a.model}: its fingerprint {fingerprint} is not the served placement's "
                         f"model.fingerprint {p.fingerprint} ({a.placement})")
    arr, batch = by_step(arr, a.batch_tokens)
    late = late_half(batch, arr.pop("engine"), arr["request_ids"] if dp else None)
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
    prow = None
    if dp:  # whole requests, routed as the server routes them; the engines' recordings interleaved
        a.ep_size, a.nodes = p.ep_size, p.nodes
        method = p.method
        e2r, reps, tables, secs, _ = solve_dp(counts, train, meta, a, emb, groups=p.groups)
        judge = dict(mode="dp", shuffle=a.seed if a.shuffle_requests is None else a.shuffle_requests,
                     in_flight=a.in_flight, concurrency=a.decode_concurrency)
    else:
        method = p.method if p.method in PREDICTED else "coclust"
        prow = polish_rows(train, batch[~late], a.polish_tokens)
        if not polish_note(prow, meta, method, p.ep_size, p.nodes, p.groups, a.polish_kicks):
            prow = None  # the limited candidate's polish follows the fresh one's
        e2r, reps, tables, secs, _ = solve(method, counts, meta, a, p.ep_size, p.nodes, emb, groups=p.groups,
                                           rows=prow)
        # named as the served ranks, so that a live swap moves only the slots whose expert changes
        e2r, reps, tables = renamed_candidate(p.expert2rank, e2r, reps, tables, p.ep_size, p.nodes, p.groups,
                                              a.rename == "layer")
        holds = holds_from_expert2rank(e2r, p.ep_size, reps)
        tables = with_bigrams(tables, train, holds, meta.vocab_size, a.bigram_pairs, a.batch_tokens)
        if learned:
            tables = with_learned(tables, train, holds, meta.vocab_size, emb, learned, a.batch_tokens, a.seed)
        judge = dict(predictor=a.predictor)
    results = {
        f"served ({p.method})": measure(test, test_batch, meta.num_layers, p.expert2rank, p.replicas, current,
                                        p.ep_size, p.capacity, current is not None or a.predictor == "router",
                                        hidden, a.dtype_bytes, nodes=p.nodes, **judge),
        f"candidate ({method})": measure(test, test_batch, meta.num_layers, e2r, reps, tables, p.ep_size, p.capacity,
                                         True, hidden, a.dtype_bytes, nodes=p.nodes, **judge)}
    (cur, new) = results.values()
    print(f"{'':26}{'served':>12}{'candidate':>12}{'change':>10}")
    for k in ADVISE_KEYS + (("step_imbalance",) if "step_imbalance" in cur and "step_imbalance" in new else ()):
        print(f"{k:26}{cur[k]:12.4g}{new[k]:12.4g}{(new[k] / cur[k] - 1) * 100 if cur[k] else 0.0:+9.1f}%")
    cur["moved_slots"] = 0
    new["moved_slots"] = moved_slots(p.expert2rank, e2r, p.ep_size, renamed=not dp)
    which = "the candidate"
    if a.max_moves is not None:
        e2r, reps, tables, new = _limited(a, p, meta, counts, train, test, test_batch, results, method, prow,
                                          learned, emb, e2r)
        method, which = f"{method}+moves", "the limited candidate"
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
                        built_from={"traces": [rel(f, a.output) for f in files], "tokens": int((~late).sum()),
                                    "batch_tokens": a.batch_tokens, "theta": a.theta, "seed": a.seed,
                                    "max_expert_load": a.max_expert_load, "mode": "dp" if dp else "tp",
                                    "predictor": a.predictor,
                                    **({"in_flight": a.in_flight, "shuffle_requests": judge["shuffle"]} if dp else {}),
                                    "advised_over": os.path.abspath(a.placement)},
                        metrics={k: new[k] for k in METRIC_KEYS if k in new})
        print(f"wrote {a.output}")
    return 0
