"""Whole-model placement: run a solver on every MoE layer, optionally hierarchical (nodes first)
and with redundant copies of hot experts.

Shapes: T tokens, L layers, K top-k, E experts, N = ep_size ranks, R replicas per layer.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp

from .alternating import place_alternating
from .ceo import place_ceo
from .coclust import place_coclust
from .counts import assign_token_ids, check_ep_size, coactivation, count_matrix, expert_gains, rank_scores
from .metrics import holds_from_expert2rank
from .peers import place_linear, place_metis, place_round_robin
from .predict import PredictorTables, empty_tables, fill_layer, nearest_token_map

# name -> solver(A [V', E] csr, occ [V'], groups, capacity, theta, seed, max_expert_load) -> [E] int
SOLVERS: dict[str, Callable[..., np.ndarray]] = {
    "coclust": lambda A, occ, n, cap, theta, seed, mel=1.10: place_coclust(A, occ, n, capacity=cap, seed=seed,
                                                                         max_expert_load=mel),
    "alternating": lambda A, occ, n, cap, theta, seed, mel=None: place_alternating(A, occ, n, capacity=cap, theta=theta,
                                                                        seed=seed),
    "ceo": lambda A, occ, n, cap, theta, seed, mel=None: place_ceo(A, occ, n, theta=theta, seed=seed),
    "metis": lambda A, occ, n, cap, theta, seed, mel=None: place_metis(coactivation(A), n, seed=seed),
    "linear": lambda A, occ, n, cap, theta, seed, mel=None: place_linear(A.shape[1], n),
    "round_robin": lambda A, occ, n, cap, theta, seed, mel=None: place_round_robin(A.shape[1], n),
}
# methods whose tokens follow the predictor; the rest are plain EP (contiguous token slices)
PREDICTED = ("coclust", "alternating", "ceo", "metis")


def _hierarchical(solver, A: sp.csr_matrix, occ: np.ndarray, ep_size: int, nodes: int, capacity: float,
                  theta: float, seed: int, mel: float) -> np.ndarray:
    """Nodes first (inter-node traffic), then ranks inside each node on the node's tokens."""
    E = A.shape[1]
    node_of = np.asarray(solver(A, occ, nodes, capacity, theta, seed, mel), dtype=np.int64)
    t2n = assign_token_ids(rank_scores(A, node_of, nodes), occ, capacity)
    per = ep_size // nodes
    e2r = np.empty(E, dtype=np.int32)
    for n in range(nodes):
        ex = np.flatnonzero(node_of == n)
        rows = np.flatnonzero(t2n == n)
        if rows.size == 0:
            e2r[ex] = n * per + np.arange(ex.size) // (ex.size // per)
            continue
        sub = A[rows][:, ex].tocsr()
        e2r[ex] = n * per + np.asarray(solver(sub, occ[rows], per, capacity, theta, seed, mel), dtype=np.int32)
    return e2r


def align_ranks(ref: np.ndarray, scores: np.ndarray, nodes: int = 1) -> np.ndarray:
    """The relabelling of one layer's ranks that best agrees with the layers before it.

    A layer's rank labels are arbitrary (any permutation of them is an equally good placement),
    but a token keeps one rank across layers when the model keeps its rows split between layers
    (DeepSeek-style sequence parallelism: one token order per step). ref: [V', N] float, the
    aligned layers' rank scores per token summed; scores: [V', N] float, this layer's. Ranks
    move only within nodes and nodes as a whole, so a hierarchical placement stays one.
    Returns new2old [N] int64: new rank a is old rank new2old[a]."""
    from scipy.optimize import linear_sum_assignment

    N = ref.shape[1]
    per = N // nodes
    share = ref / np.maximum(ref.sum(axis=1, keepdims=True), 1e-12)  # per token: weighted by its traffic once
    M = share.T @ scores  # [N, N] activations that would agree if old rank b were named a
    best = np.empty((nodes, nodes))  # node a named after node b: best rank matching inside
    inner = {}
    for a in range(nodes):
        for b in range(nodes):
            sub = M[a * per:(a + 1) * per, b * per:(b + 1) * per]
            rows, cols = linear_sum_assignment(-sub)
            best[a, b], inner[a, b] = sub[rows, cols].sum(), cols
    _, node_of = linear_sum_assignment(-best)
    new2old = np.empty(N, dtype=np.int64)
    for a, b in enumerate(node_of):
        new2old[a * per:(a + 1) * per] = b * per + inner[a, b]
    return new2old


def add_replicas(A: sp.csr_matrix, occ: np.ndarray, expert2rank: np.ndarray, ep_size: int, replicas: int,
                 capacity: float = 1.10) -> np.ndarray:
    """Extra copies: each rank gets replicas/N more experts, those its scheduled tokens use most
    among experts it does not hold. Returns [replicas, 2] int32 (expert, rank) pairs."""
    if replicas % ep_size:
        raise ValueError(f"replicas {replicas} must be a multiple of ep_size {ep_size}")
    per = replicas // ep_size
    E = A.shape[1]
    if per > E - E // ep_size:
        raise ValueError(f"replicas {replicas}: at most {E - E // ep_size} extra experts fit per rank")
    t2r = assign_token_ids(rank_scores(A, expert2rank, ep_size), occ, capacity)
    G = expert_gains(A, t2r, ep_size)
    G[np.arange(E), expert2rank] = -np.inf  # already home there
    out = []
    for r in range(ep_size):
        for e in np.argsort(-G[:, r], kind="stable")[:per]:
            out.append((int(e), r))
    return np.asarray(out, dtype=np.int32).reshape(-1, 2)


def place_model(method: str, token_ids: np.ndarray, topk_ids: np.ndarray, num_experts: int, ep_size: int,
                nodes: int = 1, capacity: float = 1.10, theta: float = 0.5, replicas: int = 0, seed: int = 0,
                max_expert_load: float = 1.10,
                vocab_size: int | None = None, embeddings: np.ndarray | None = None,
                progress: Callable | None = None) -> tuple[np.ndarray, np.ndarray, PredictorTables | None]:
    """Place every layer; with ``vocab_size`` also count the predictor tables in the same pass
    (each layer's token-expert counts are built once and shared).

    token_ids: [T] int; topk_ids: [T, L, K] int; embeddings: [V, H] for the unseen-token fallback.
    Returns (expert2rank [L, E] int32, replicas [L, R, 2] int32 (expert, rank), R = ``replicas``;
    tables or None).
    """
    if method not in SOLVERS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(SOLVERS)}")
    check_ep_size(num_experts, ep_size)
    if nodes < 1 or ep_size % nodes or num_experts % nodes:
        raise ValueError(f"nodes {nodes} must divide ep_size {ep_size} and num_experts {num_experts}")
    T, L, K = topk_ids.shape
    ids, row = np.unique(token_ids, return_inverse=True)
    occ = np.bincount(row, minlength=ids.size).astype(np.float64)
    rows = np.repeat(row, K)
    solver = SOLVERS[method]
    e2r = np.empty((L, num_experts), dtype=np.int32)
    reps = np.full((L, replicas, 2), -1, dtype=np.int32)
    tables = empty_tables(L, vocab_size, num_experts) if vocab_size else None
    nearest = nearest_token_map(embeddings, ids, vocab_size) if vocab_size else None
    layers = range(L) if progress is None else progress(range(L))
    agreed = np.zeros((ids.size, ep_size))  # aligned layers' rank scores per token
    for layer in layers:
        A = count_matrix(rows, topk_ids[:, layer, :].reshape(-1), ids.size, num_experts)
        if nodes > 1:
            e2r[layer] = _hierarchical(solver, A, occ, ep_size, nodes, capacity, theta, seed + layer, max_expert_load)
        else:
            e2r[layer] = solver(A, occ, ep_size, capacity, theta, seed + layer, max_expert_load)
        if method in PREDICTED:  # same token, same rank in every layer where possible
            scores = rank_scores(A, e2r[layer], ep_size)
            if layer:
                new2old = align_ranks(agreed, scores, nodes)
                e2r[layer] = np.argsort(new2old)[e2r[layer]]  # old rank -> new rank
                scores = scores[:, new2old]
            agreed += scores
        if replicas:
            reps[layer] = add_replicas(A, occ, e2r[layer], ep_size, replicas, capacity)
        if tables is not None:
            holds = holds_from_expert2rank(e2r[layer: layer + 1], ep_size, reps[layer: layer + 1])[0]
            fill_layer(tables, layer, A, ids, occ, topk_ids, holds, nearest)
    return e2r, reps, tables
