"""The wire check: the MoE layer's exchange alone across the veth, on gloo ranks in the two
namespaces, smoe's counted bytes between nodes against the veth's counters."""

from __future__ import annotations

import json
import os
import time

from ..veth import ADDR, run_ranks
from .netns import Net
from .readings import counters_agree, wire_delta


# smoe's sparse exchange over the shared-memory transport's gather (as it would run over a
# network before the point-to-point one), over its point-to-point transport, and vLLM's
# allgather-reducescatter; smoe-p2p sends its sizes first (three all-to-alls), smoe-p2p-slots
# pads every peer's rows to the step's row count with the sizes riding along (two), as served
# steps do up to sparse_a2a.PAD_BYTES; with several ranks a node, smoe-hier is the hierarchical
# exchange (a row crosses to another node once, then fans out inside it; as served past the slots)
PIPELINES = ("smoe-gather", "smoe-p2p", "smoe-p2p-slots", "vllm")
NODE_PIPELINES = ("smoe-p2p", "smoe-p2p-slots", "smoe-hier", "vllm")


def exchange_step(name: str, rank: int, per_node: int, hidden: int, step: dict, owner, gather, reduce_scatter,
                  all_to_all, g) -> int:
    """One step of pipeline ``name`` (:data:`NODE_PIPELINES`, smoe-gather) on ``rank`` of two
    nodes of ``per_node`` ranks, over the given collectives (``SparseExchange``'s): this rank's
    chunk of ``step`` (rows ``step["order"][rank * c: (rank + 1) * c]``, c = ceil(T / N); vLLM's
    in arange order), random fp32 rows from ``g``. Returns the bytes it counts between nodes."""
    import torch

    from ....serving.exchange.sparse_a2a import SparseExchange

    N = 2 * per_node
    ids_all = torch.as_tensor(step["ids"]).long()
    T, K = ids_all.shape
    c = -(-T // N)
    order = torch.arange(T) if name == "vllm" else torch.as_tensor(step["order"])
    rows = order[rank * c: (rank + 1) * c]
    ids = ids_all[rows]
    x, w = torch.randn(len(rows), hidden, generator=g), torch.full((len(rows), K), 1.0 / K)
    if name != "vllm":
        ex = SparseExchange(rank, N, owner, gather, reduce_scatter, exact=True,
                            all_to_all=None if name == "smoe-gather" else all_to_all,
                            pad_bytes=1 << 40 if name.endswith("-slots") else 0,
                            node_of=torch.arange(N) // per_node, hierarchical=name.startswith("smoe-hier"))
        h, ww, ii = ex.dispatch(x, w, ids)
        ex.combine(h * (ww * (owner[ii] == rank)).sum(1, keepdim=True))
        return int(ex.stats[5])  # the bytes that cross between nodes
    # vLLM's: every row to every rank (ids, weights too), full partial sums back;
    # counted: what crosses to the other node's ranks, were each peer sent its share once
    full = gather(x)
    gather(w), gather(ids)
    reduce_scatter(full.contiguous())
    return (N - per_node) * x.shape[0] * (2 * hidden * x.element_size() + 8 * K)


def wire_worker(rank: int, spec_path: str) -> int:
    """One gloo rank of ``spec["per_node"]`` in its node's namespace: the MoE layer's exchange
    alone on the veth, smoe's sparse one and vLLM's allgather-reducescatter, each step as served
    over a network (exact sizes, all_gather_into_tensor and reduce_scatter_tensor as smoe's CPU
    communicator uses on gloo). Writes each pipeline's counted bytes between nodes and, on a
    node's first rank, the node's veth tx counters around it."""
    import torch
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    plan, per_node = spec["plan"], spec["per_node"]
    N, dev = 2 * per_node, spec["dev"][rank // per_node]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{ADDR[0]}:{spec['port']}", rank=rank, world_size=N)

    def tx():
        if rank % per_node:
            return None
        vals = [int(open(f"/sys/class/net/{dev}/statistics/{k}").read()) for k in ("tx_bytes", "tx_packets")]
        return {"tx_bytes": vals[0], "tx_packets": vals[1]}

    from ..comm import gloo_collectives

    gather, reduce_scatter = gloo_collectives(N)

    def all_to_all(o, x, out_splits, in_splits):
        dist.all_to_all_single(o, x, out_splits, in_splits)

    H, g = plan["hidden"], torch.Generator().manual_seed(rank)
    out = {}
    for name in spec["pipelines"]:
        owner = torch.as_tensor(plan["baseline" if name == "vllm" else "smoe"]["expert2rank"]).long()
        counted = 0
        dist.barrier()
        before = tx()
        # no rank sends before every node's first rank has read its counter: a rank leaving the
        # first barrier early put a step's rows on the veth before its node's reading (counted /
        # wire 1.02-1.03 on some runs)
        dist.barrier()
        t0 = time.perf_counter()
        for step in plan["steps"]:
            counted += exchange_step(name, rank, per_node, H, step, owner, gather, reduce_scatter, all_to_all, g)
        dist.barrier()
        out[name] = {"counted": counted, "before": before, "after": tx(), "seconds": time.perf_counter() - t0}
    with open(spec["out"].format(rank=rank), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


def wire_plan(hidden: int, tokens: int = 64, steps: int = 24, per_node: int = 1) -> dict:
    """:func:`wire_check`'s plan (JSON types): the fixture's held-out routing of layer 1, its
    placement and predicted order over two nodes of ``per_node`` ranks (``smoe-bench comm``'s)."""
    import argparse

    from ..comm import comm_plan

    plan = comm_plan(argparse.Namespace(routing="testbed", layer=1, tokens=tokens, steps=steps, ranks=2 * per_node,
                                        hidden=hidden))
    return json.loads(json.dumps(plan, default=lambda o: o.tolist()))


def wire_check(net: Net, hidden: int, work: str, tokens: int = 64, steps: int = 24, port: int = 29650,
               per_node: int = 1) -> dict:
    """smoe's byte counters (and the bytes vLLM's allgather-reducescatter is modelled to carry)
    against the veth, on the exchange alone: the fixture's held-out routing, its placement and
    predictor (as ``smoe-bench comm``), ``steps`` steps of ``tokens`` tokens at ``hidden``, over
    two nodes of ``per_node`` ranks each (the placement built for all of them)."""
    N = 2 * per_node
    pipelines = PIPELINES if per_node == 1 else NODE_PIPELINES
    plan = wire_plan(hidden, tokens, steps, per_node)
    spec = {"plan": plan, "dev": net.dev, "port": port, "out": os.path.join(work, "wire-{rank}.json"),
            "per_node": per_node, "pipelines": pipelines}
    path = os.path.join(work, "wire-spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    # a prefill-sized step on a slow host's prefill link (tens of Mbit/s) takes minutes a pipeline
    run_ranks(net, per_node, "vllm_smoe.tools.bench.cluster", "--wire-worker", path, 3600, "wire check")
    ranks = [json.load(open(spec["out"].format(rank=r))) for r in range(N)]
    heads = range(0, N, per_node)  # each node's first rank read its veth
    res = {"tokens_per_step": tokens, "steps": steps, "hidden": hidden, "ranks_per_node": per_node,
           "lar": {"smoe": plan["lar"], "vllm": plan["base_lar"]}}
    res["seconds"] = {name: max(ranks[r][name]["seconds"] for r in range(N)) for name in pipelines}
    for name in pipelines:
        w = wire_delta({r: ranks[r][name]["before"] for r in heads}, {r: ranks[r][name]["after"] for r in heads})
        counted = sum(ranks[r][name]["counted"] for r in range(N))
        res[name] = {"counted_bytes": counted, "wire": w, "agreement": counters_agree(w["payload"], counted)}
    return res
