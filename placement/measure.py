"""Metrics of one placement on trace rows, routed as it would be served: tokens by the predictor
(tensor-parallel attention), whole requests by their prompts' votes (data-parallel attention),
or contiguous token slices (plain EP).

Shapes: T rows, L layers, K top-k, E experts, N = ep_size ranks, R copies per layer.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .assign import contiguous_tokens
from .dp import WINDOW as DP_WINDOW
from .dp import (DECODE_CONCURRENCY, assign_requests, request_affinity, request_index, round_robin_requests,
                 step_imbalance, workload_scores)
from .metrics import evaluate, holds_from_expert2rank, local_share
from .online import simulate
from .predict import PredictorTables


def measure(arr: dict[str, np.ndarray], batch: np.ndarray, num_layers: int, e2r: np.ndarray, reps: np.ndarray,
            tables: PredictorTables | None, ep_size: int, capacity: float, predicted: bool, hidden: int,
            dtype_bytes: int, mode: str = "tp", nodes: int = 1, shuffle: int | None = None, workloads: bool = False,
            predictor: str = "tables-markov", copies: str = "own", concurrency: int = DECODE_CONCURRENCY,
            route_nodes: int | None = None, in_flight: int | None = None, cost: Callable | None = None) -> dict:
    """Metrics of one placement on ``arr``'s rows ({field: [T, ...]}, sorted by step; batch: [T]
    their step ids). e2r: [L, E] int rank of each expert; reps: [L, R, 2] int (expert, rank), -1
    = none; predicted: tokens (tp) or requests (dp) follow ``tables``' votes, else plain EP.
    nodes: how the bytes split into inter- and intra-node; route_nodes: the nodes the placement
    was built for, which mode "dp"'s request router scores with (default ``nodes``); shuffle:
    mode "dp"'s requests arrive in this seed's random order (None: the trace's); in_flight:
    mode "dp"'s balance window, in requests (the server's router balances over max(WINDOW, its
    requests in flight); None: WINDOW); cost(arr, t2r, e2r, holds, copies, batch) -> {column:
    value}: a cluster's projection, whose columns are added (None: none). Returns {metric: value}
    (placement.metrics.evaluate's, and oracle_lar / oracle_share or step_imbalance)."""
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
        t2r = np.repeat(r2r[q[order]][:, None], num_layers, axis=1)
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
        t2r = np.repeat(contiguous_tokens(batch, ep_size)[:, None], num_layers, axis=1)
    m = evaluate(arr["topk_ids"], t2r, e2r, batch, ep_size, holds, hidden, dtype_bytes, nodes, copies=copies)
    if cost is not None:
        m.update(cost(arr, t2r, e2r, holds, copies, batch))
    if mode == "dp" and not (np.asarray(reps) >= 0).any():  # copies would split an expert's reads: not modelled
        m["step_imbalance"] = step_imbalance(arr["topk_ids"], arr["request_ids"], e2r, ep_size, concurrency)
    return m
