"""``smoe-bench comm``: one expert-parallel MoE layer on gloo ranks, vLLM's exchange against smoe's."""

from __future__ import annotations

import json
import os
import time

import numpy as np


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

    from ...serving.exchange.sparse_a2a import SparseExchange

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


def comm_plan(a) -> dict:
    """Steps of replayed routing and both pipelines' placements/predictions (numpy only)."""
    from ...placement.assign import assign_tokens, chunk_caps, contiguous_tokens
    from ...placement.layout import place_model
    from ...placement.metrics import evaluate
    from ...placement.peers import place_linear
    from ...placement.predict import predict_layer
    from ...placement.routing_counts import RoutingCounts
    from ...testbed.synthetic import SHAPES, generate
    from ...testbed import FIXTURE_TRACES
    from ...formats.trace import open_trace

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


def run_comm(a) -> int:
    import tempfile

    import torch.multiprocessing as mp

    from ..cli_util import check_output_file

    if a.json:
        check_output_file(a.json, "--json")

    plan = comm_plan(a)
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
