"""The wire check's exchange modelled with placement/a2a_cost.py's byte rules
(tools/bench/wire_model.py): its bytes between nodes are the exchange's counted bytes, exactly,
for every pipeline; no namespaces (the exchange's own counting over thread collectives, and a
stored run over the veth)."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch

from vllm_smoe.tools.bench.cluster.wire import NODE_PIPELINES, PIPELINES, exchange_step, wire_plan
from vllm_smoe.tools.bench.wire_model import model_wire_check, step_transfers

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
ZERO = {"rate_bytes_s": 1e8, "local_bytes_s": 1e9}


class ThreadGroup:
    """N ranks as threads of this process: gloo's collectives as SparseExchange takes them."""

    def __init__(self, n: int):
        self.n, self.bar, self.box = n, threading.Barrier(n), [None] * n

    def _swap(self, rank, obj):
        self.box[rank] = obj
        self.bar.wait()
        got = list(self.box)
        self.bar.wait()
        return got

    def collectives(self, rank):
        n = self.n

        def gather(x):
            return torch.cat(self._swap(rank, x.clone()))

        def reduce_scatter(x):
            s = sum(self._swap(rank, x.clone()))
            c = x.shape[0] // n
            return s[rank * c: (rank + 1) * c]

        def all_to_all(out, inp, out_splits, in_splits):
            parts = inp.split(in_splits if in_splits is not None else inp.shape[0] // n)
            got = self._swap(rank, [p.clone() for p in parts])
            out.copy_(torch.cat([got[q][rank] for q in range(n)]))
        return gather, reduce_scatter, all_to_all


def counted_by_threads(plan: dict, per_node: int, name: str) -> int:
    """The bytes between nodes the wire check's workers count for ``name`` on ``plan``, each rank a
    thread running :func:`cluster.wire.exchange_step` as the worker does."""
    N = 2 * per_node
    group, counted, errors = ThreadGroup(N), [0] * N, []
    owner = torch.as_tensor(plan["baseline" if name == "vllm" else "smoe"]["expert2rank"]).long()

    def rank_main(r):
        try:
            torch.set_num_threads(1)
            g = torch.Generator().manual_seed(r)
            gather, rs, a2a = group.collectives(r)
            for step in plan["steps"]:
                counted[r] += exchange_step(name, r, per_node, plan["hidden"], step, owner, gather, rs, a2a, g)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.bar.abort()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return sum(counted)


@pytest.fixture(scope="module")
def stored():
    with open(os.path.join(DOCS, "exchange-2x2.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def plans(stored):
    """The stored run's plans (2 nodes x 2, 64 and 512 tokens) and a small 2 x 1 one: placements
    are built once each (a second apiece)."""
    return {("2x2", t): wire_plan(stored["runs"]["none decode"]["hidden"], t, stored["runs"]["none decode"]["steps"], 2)
            for t in (64, 512)} | {("2x1", 24): wire_plan(64, tokens=24, steps=3, per_node=1)}


@pytest.mark.parametrize("per_node", [1, 2])
def test_model_bytes_equal_the_exchanges_counters(plans, per_node):
    """Each pipeline's counted bytes between nodes (SparseExchange.stats[5]; vLLM's formula),
    the exchange run by every rank as a thread: the model's, exactly."""
    plan = plans[("2x1", 24)] if per_node == 1 else {**plans[("2x2", 64)], "hidden": 64}
    plan = {**plan, "steps": plan["steps"][:3]}
    pipelines = PIPELINES if per_node == 1 else NODE_PIPELINES
    model = model_wire_check(plan, per_node, {**ZERO, "collective_s": dict.fromkeys(pipelines, 0.0)})
    assert set(model) == set(pipelines)
    for name in pipelines:
        assert model[name]["bytes"] == counted_by_threads(plan, per_node, name), name
    if per_node == 2:  # the hierarchical exchange crosses once per (token, other node)
        assert 0 < model["smoe-hier"]["bytes"] < model["smoe-p2p"]["bytes"]


def test_model_bytes_equal_a_stored_run_over_the_veth(stored, plans):
    """docs/exchange-2x2.json (2 nodes x 2 gloo ranks over a veth, hidden 1536, 24 steps of 64 and
    512 tokens): the plan is deterministic, so the model's bytes are its counted bytes exactly,
    and gloo's transport bytes for vLLM's allgather-reducescatter within 1% of the veth's payload."""
    for key, tokens in (("none decode", 64), ("none prefill", 512)):
        run = stored["runs"][key]
        model = model_wire_check(plans[("2x2", tokens)], 2,
                                 {**ZERO, "collective_s": dict.fromkeys(NODE_PIPELINES, 0.0)})
        for name in NODE_PIPELINES:
            assert model[name]["bytes"] == run[name]["counted_bytes"], (key, name)
        assert abs(model["vllm"]["transport_bytes"] / run["vllm"]["wire"]["payload"] - 1) < 0.01


def test_time_is_latency_plus_busiest_direction(plans):
    """2 nodes x 1: the time is the collectives' latency plus, per collective, the busier
    direction's bytes over the rate (a2a_cost's phase_seconds); with an overlap of 1 for
    all-to-alls, both directions' bytes."""
    plan = {**plans[("2x1", 24)], "steps": plans[("2x1", 24)]["steps"][:1]}
    c = {"collective_s": {"smoe-p2p": 1e-3}, "rate_bytes_s": 1e6, "local_bytes_s": 1e12, "delay_s": 1e-2,
         "hops": {"all_to_all": 2.0}, "overlap": {"all_to_all": 1.0}}
    m = model_wire_check(plan, 1, c)["smoe-p2p"]
    tr = step_transfers(plan, plan["steps"][0], 1, "smoe-p2p")
    busiest = sum(float(np.max(r[1])) * b for r, b in tr["rule"])  # RDMA rows, the busier direction
    both = sum(float(r[1, 0].sum()) * b for r, b in tr["rule"])  # RDMA out of both nodes
    assert m["seconds"] == pytest.approx(3 * (1e-3 + 2 * 1e-2) + busiest / 1e6)
    assert m["transport_seconds"] == pytest.approx(3 * (1e-3 + 2 * 1e-2) + both / 1e6)
    assert both > busiest
