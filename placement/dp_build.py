"""A placement for attention data parallel (``--mode dp``) built from sample rows: experts
co-clustered with whole requests, refined per layer for the fewest all-to-all rows with the
requests' ranks fixed, then the router's tables.

Shapes: T sample rows, L layers, K top-k, E experts, N = ep_size ranks, Q requests, V vocab.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from .bytes import layer_instances, swap_for_bytes
from .dp import place_requests, request_counts, request_index, request_token_table
from .metrics import holds_from_expert2rank
from .predict import PredictorTables, tables_for_placement
from .routing_counts import RoutingCounts


def build_dp(rows: dict[str, np.ndarray], counts: RoutingCounts, vocab_size: int, ep_size: int, nodes: int,
             capacity: float, max_expert_load: float, seed: int = 0, groups: int = 1,
             embeddings: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, PredictorTables]:
    """rows: {token_ids, request_ids, topk_ids [T, L, K] (-1 = none), and is_prefill where the
    trace has it}: the requests placed; counts: the whole trace's routing (the tables' Markov and
    prior rows); embeddings: [V, H] for ids the trace never saw, or None. Returns (expert2rank
    [L, E] int32, replicas [L, 0, 2] int32 (none), tables whose token2rank / token_conf [L, V]
    are the request router's votes: the ranks of the training requests each token appeared in,
    the same in every layer)."""
    L = counts.num_layers
    A, tokens = request_counts(rows["request_ids"], rows["topk_ids"], counts.num_experts)
    e2r, r2r, _ = place_requests(A, tokens, ep_size, capacity, seed=seed, groups=groups,
                                 max_expert_load=max_expert_load, nodes=nodes)
    # then per layer, with the requests' ranks fixed, expert swaps that cut the all-to-all rows
    # (a token crosses once per remote rank, whatever its experts there); a swap could split a
    # routing group, so not for grouped models, and could move an expert across nodes, so not
    # with nodes (the hierarchical solve put the slow link first)
    _, q = request_index(rows["request_ids"])
    for layer in range(L if groups == 1 and nodes in (1, ep_size) else 0):
        inst = layer_instances(q, rows["topk_ids"][:, layer].astype(np.int64))
        e2r[layer] = swap_for_bytes(sp.csr_matrix(A[:, layer]), inst, r2r, ep_size, e2r[layer], max_expert_load,
                                    seed=seed)
    del A  # [Q, L, E]: freed before the tables are built
    holds = holds_from_expert2rank(e2r, ep_size)
    tables = tables_for_placement(counts, holds, vocab_size, embeddings)
    # the router scores a prompt by the ranks of the training requests its tokens came from (the
    # same vote in every layer); the Markov and prior rows stay per layer
    t2r, conf = request_token_table(rows["token_ids"], rows["request_ids"], r2r, vocab_size, ep_size,
                                    rows.get("is_prefill"))
    tables = dataclasses.replace(tables, token2rank=np.repeat(t2r[None], L, axis=0),
                                 token_conf=np.repeat(conf[None], L, axis=0))
    return e2r, np.zeros((L, 0, 2), np.int32), tables
