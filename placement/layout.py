"""Whole-model placement: run a solver on every MoE layer, optionally hierarchical (nodes first)
and with redundant copies of hot experts.

Shapes: T tokens, L layers, K top-k, E experts, N = ep_size ranks, R replicas per layer.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp

from .alternating import place_alternating
from .bytes import place_bytes
from .ceo import place_ceo
from .coclust import place_coclust
from .counts import assign_token_ids, coactivation, expert_gains, rank_scores
from .groups import check_groups
from .metrics import holds_from_expert2rank
from .peers import place_linear, place_metis, place_round_robin
from .polish import polish_kicked
from .predict import PredictorTables, empty_tables, fill_layer, local_counts, nearest_token_map
from .routing_counts import RoutingCounts
from .uneven import fit_rank_sizes, with_phantoms

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
    # also takes the layer's instances (token id, expert set): RoutingCounts.layer_instances
    "bytes": lambda A, occ, n, cap, theta, seed, mel=1.10, inst=None: place_bytes(A, occ, inst, n, capacity=cap,
                                                                                 max_expert_load=mel, seed=seed),
}
NEEDS_INSTANCES = ("bytes",)
# methods that cap each rank's expert (compute) load at max_expert_load
CAPPED = ("coclust", "bytes")
# peers that follow vLLM's own split of E experts over N ranks, divisible or not
EXACT_SIZES = ("linear", "round_robin")
# polished on sample rows' routing where place_model is given them (plain layouts: no nodes,
# routing groups or uneven split, whose structure a free swap would break)
POLISHED = ("coclust",)
# the polish's budget for the whole model, in row-experts scored exactly (T * K each):
# a small model's layers get all they use (the fixture's 4 layers: 190 scores of 131072 rows),
# a big one's a bounded share, none where a layer's is under POLISH_MIN_SCORES, which would not
# pay for its set-up (DeepSeek-V3's 58 layers, top-8: 6 scores of 131072 rows; 17 of 49152)
POLISH_WORK = 4e8
POLISH_MIN_SCORES = 16
# methods whose tokens follow the predictor; the rest are plain EP (contiguous token slices)
PREDICTED = ("coclust", "alternating", "ceo", "metis", "bytes")


def polish_evals(rows_shape: tuple[int, ...], num_layers: int, method: str) -> int:
    """Exact scores each layer's polish spends on sample rows of shape [T, L, K]: 0 where
    ``method`` is not polished or a layer's share of POLISH_WORK is under POLISH_MIN_SCORES."""
    T, _, K = rows_shape
    n = int(POLISH_WORK / num_layers // max(1, T * K))
    return n if method in POLISHED and n >= POLISH_MIN_SCORES else 0


def polishes(method: str, num_experts: int, ep_size: int, nodes: int = 1, groups: int = 1) -> bool:
    """Whether :func:`place_model` polishes ``method``'s layers when given rows: only plain
    layouts (no nodes, routing groups or uneven split, whose structure a free swap would break)."""
    return method in POLISHED and nodes <= 1 and groups <= 1 and num_experts % ep_size == 0


def polish_fit(num_layers: int, top_k: int) -> int:
    """The most sample rows with which every layer still gets POLISH_MIN_SCORES exact scores."""
    return int(POLISH_WORK / num_layers // (top_k * POLISH_MIN_SCORES))


def _split_parts(A: sp.csr_matrix, occ: np.ndarray, part_of: np.ndarray, parts: int, per: int, inner,
                 capacity: float) -> np.ndarray:
    """Experts already split into ``parts`` (part_of [E] int64); tokens follow their best part
    under the capacity; each part's experts are then placed on its ``per`` ranks by
    ``inner(A_sub, occ_sub) -> [E_sub] int`` on the part's tokens. Returns [E] int32."""
    E = A.shape[1]
    t2p = assign_token_ids(rank_scores(A, part_of, parts), occ, capacity)
    e2r = np.empty(E, dtype=np.int32)
    for n in range(parts):
        ex = np.flatnonzero(part_of == n)
        rows = np.flatnonzero(t2p == n)
        if rows.size == 0:
            e2r[ex] = n * per + np.arange(ex.size) // (ex.size // per)
            continue
        e2r[ex] = n * per + np.asarray(inner(A[rows][:, ex].tocsr(), occ[rows]), dtype=np.int32)
    return e2r


def _hierarchical(solver, A: sp.csr_matrix, occ: np.ndarray, ep_size: int, nodes: int, capacity: float,
                  theta: float, seed: int, mel: float) -> np.ndarray:
    """Nodes first (inter-node traffic), then ranks inside each node on the node's tokens."""
    node_of = np.asarray(solver(A, occ, nodes, capacity, theta, seed, mel), dtype=np.int64)
    per = ep_size // nodes
    return _split_parts(A, occ, node_of, nodes, per, lambda sub, o: solver(sub, o, per, capacity, theta, seed, mel),
                        capacity)


def _grouped(solver, A: sp.csr_matrix, occ: np.ndarray, ep_size: int, nodes: int, groups: int, capacity: float,
             theta: float, seed: int, mel: float) -> np.ndarray:
    """Placement that keeps every routing group whole (see check_groups). With at least as
    many groups as ranks the solver places groups (token x group activations) on ranks; with
    fewer, each group gets its block of ep_size/groups ranks (groups sharing a node chosen by
    the solver on groups) and the solver splits it inside the block on its tokens."""
    E = A.shape[1]
    size = E // groups
    group_of = np.arange(E) // size
    member = sp.csr_matrix((np.ones(E), (np.arange(E), group_of)), shape=(E, groups))
    Ag = (A @ member).tocsr()
    if groups >= ep_size:
        if nodes > 1:
            g2r = _hierarchical(solver, Ag, occ, ep_size, nodes, capacity, theta, seed, mel)
        else:
            g2r = np.asarray(solver(Ag, occ, ep_size, capacity, theta, seed, mel), dtype=np.int32)
        return g2r[group_of].astype(np.int32)
    per = ep_size // groups
    block = np.arange(groups)
    if 1 < nodes < groups:  # which groups share a node: a placement of groups on nodes
        g2n = np.asarray(solver(Ag, occ, nodes, capacity, theta, seed, mel), dtype=np.int64)
        block = np.argsort(np.argsort(g2n, kind="stable"), kind="stable")  # node by node
    sub_nodes = nodes // groups if nodes > groups else 1

    def inner(sub, o):
        if sub_nodes > 1:
            return _hierarchical(solver, sub, o, per, sub_nodes, capacity, theta, seed, mel)
        return solver(sub, o, per, capacity, theta, seed, mel)
    return _split_parts(A, occ, block[group_of], groups, per, inner, capacity)


def align_ranks(ref: np.ndarray, scores: np.ndarray, nodes: int = 1, move_nodes: bool = True) -> np.ndarray:
    """The relabelling of one layer's ranks that best agrees with the layers before it.

    A layer's rank labels are arbitrary (any permutation of them is an equally good placement),
    but a token keeps one rank across layers when the model keeps its rows split between layers
    (DeepSeek-style sequence parallelism: one token order per step). ref: [V', N] float, the
    aligned layers' rank scores per token summed; scores: [V', N] float, this layer's. Ranks
    move only within nodes and nodes as a whole (not at all with ``move_nodes`` False), so a
    hierarchical placement stays one. Returns new2old [N] int64: new rank a is old rank new2old[a]."""
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
    node_of = linear_sum_assignment(-best)[1] if move_nodes else np.arange(nodes)
    new2old = np.empty(N, dtype=np.int64)
    for a, b in enumerate(node_of):
        new2old[a * per:(a + 1) * per] = b * per + inner[a, b]
    return new2old


def _check_replicas(replicas: int, num_experts: int, ep_size: int) -> None:
    if replicas % ep_size:
        raise ValueError(f"replicas {replicas} must be a multiple of ep_size {ep_size}")
    if replicas // ep_size > num_experts - num_experts // ep_size:
        raise ValueError(f"replicas {replicas}: at most {num_experts - num_experts // ep_size} extra experts fit "
                         f"per rank")


def add_replicas(A: sp.csr_matrix, occ: np.ndarray, expert2rank: np.ndarray, ep_size: int, replicas: int,
                 capacity: float = 1.10) -> np.ndarray:
    """Extra copies: each rank gets replicas/N more experts, those its scheduled tokens use most
    among experts it does not hold. Returns [replicas, 2] int32 (expert, rank) pairs."""
    _check_replicas(replicas, A.shape[1], ep_size)
    per = replicas // ep_size
    E = A.shape[1]
    t2r = assign_token_ids(rank_scores(A, expert2rank, ep_size), occ, capacity)
    G = expert_gains(A, t2r, ep_size)
    G[np.arange(E), expert2rank] = -np.inf  # already home there
    out = []
    for r in range(ep_size):
        for e in np.argsort(-G[:, r], kind="stable")[:per]:
            out.append((int(e), r))
    return np.asarray(out, dtype=np.int32).reshape(-1, 2)


def _solve_layer(counts: RoutingCounts, layer: int, method: str, ep_size: int, nodes: int, capacity: float,
                 theta: float, seed: int, max_expert_load: float, groups: int = 1,
                 rows: tuple[np.ndarray, np.ndarray] | None = None, polish_kicks: int = 0
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """One layer's expert2rank [E] int32 and, for predicted methods, its rank scores [V', N] float64.
    Where ep_size does not divide E, expert2rank has the phantoms too ([E + pad], see :mod:`.uneven`).
    rows, polish_kicks: see :func:`place_model`."""
    _, occ = counts.seen()
    A = counts.layer_matrix(layer)
    if method not in EXACT_SIZES:  # solvers place E / N per rank: phantoms make up the count
        A = with_phantoms(A, ep_size)
    solver = SOLVERS[method]
    if method in NEEDS_INSTANCES:
        inst = counts.layer_instances(layer)
        solver = lambda A, occ, n, cap, theta, seed, mel, _s=SOLVERS[method]: _s(A, occ, n, cap, theta, seed, mel,  # noqa: E731
                                                                                 inst=inst)
    if groups > 1:
        e2r = _grouped(solver, A, occ, ep_size, nodes, groups, capacity, theta, seed + layer, max_expert_load)
    elif nodes > 1:
        e2r = _hierarchical(solver, A, occ, ep_size, nodes, capacity, theta, seed + layer, max_expert_load)
    else:
        e2r = np.asarray(solver(A, occ, ep_size, capacity, theta, seed + layer, max_expert_load), dtype=np.int32)
        scores = polish_evals(rows[0].shape, counts.num_layers, method) if rows is not None and polishes(
            method, counts.num_experts, ep_size) else 0
        if scores:
            e2r = polish_kicked(rows[0][:, layer], rows[1], e2r, ep_size, polish_kicks, capacity,
                                load=np.asarray(A.sum(axis=0)).ravel(), max_expert_load=max_expert_load,
                                max_evals=scores, seed=seed + layer)
    return e2r, (rank_scores(A, e2r, ep_size) if method in PREDICTED else None)


def place_model(method: str, counts: RoutingCounts, ep_size: int, nodes: int = 1, capacity: float = 1.10,
                theta: float = 0.5, replicas: int = 0, seed: int = 0, max_expert_load: float = 1.10,
                vocab_size: int | None = None, embeddings: np.ndarray | None = None,
                progress: Callable | None = None, map_layers: Callable = map, groups: int = 1,
                rows: tuple[np.ndarray, np.ndarray] | None = None, polish_kicks: int = 0
                ) -> tuple[np.ndarray, np.ndarray, PredictorTables | None]:
    """Place every layer of ``counts``; with ``vocab_size`` also fill the predictor tables.

    Layers are solved independently, through ``map_layers(fn, layers)`` (the builtin ``map``, or
    any ordered parallel map: results do not depend on it); then, in layer order, each layer's
    ranks are renamed to agree with the layers before it and its replicas and table rows are made.
    embeddings: [V, H] for the unseen-token fallback; progress: wraps the per-layer iterator;
    groups: routing groups of grouped top-k (DeepSeek's ``n_group``): every group stays whole
    (see check_groups), so the placement can be loaded without changing the routing.
    rows: (topk_ids [T, L, K] int, batch_ids [T] non-decreasing) sample rows of the trace: each
    coclust layer is then polished on their routing (:func:`.polish.polish_routed`), the
    objective a served step meets; None keeps the solver's placement.
    polish_kicks: rounds of :func:`.polish.polish_kicked` after that polish (each a kick of a few
    random swaps and a polish at the same budget; 0 = the polish alone).
    Returns (expert2rank [L, E] int32, replicas [L, R, 2] int32 (expert, rank), R = ``replicas``;
    tables or None).
    """
    if method not in SOLVERS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(SOLVERS)}")
    num_experts, L = counts.num_experts, counts.num_layers
    if not 1 <= ep_size <= num_experts:
        raise ValueError(f"ep_size {ep_size} must be in 1..num_experts ({num_experts})")
    if num_experts % ep_size:
        extra = [name for name, on in ((f"nodes {nodes}", nodes > 1), (f"{groups} routing groups", groups > 1),
                                       (f"replicas {replicas}", replicas > 0)) if on]
        if extra:
            raise ValueError(f"ep_size {ep_size} does not divide num_experts {num_experts} (ranks hold vLLM's "
                             f"uneven split): not supported with {', '.join(extra)} yet")
    if nodes < 1 or ep_size % nodes or num_experts % nodes:
        raise ValueError(f"nodes {nodes} must divide ep_size {ep_size} and num_experts {num_experts}")
    if nodes > 1 and method in NEEDS_INSTANCES:
        raise ValueError(f"method {method!r} does not support nodes > 1 yet (use coclust)")
    check_groups(num_experts, ep_size, nodes, groups)
    if groups > 1 and method in NEEDS_INSTANCES:
        raise ValueError(f"method {method!r} does not support grouped routing yet (use coclust)")
    if method in NEEDS_INSTANCES and counts.sample_tokens == 0:
        raise ValueError(f"method {method!r} needs counts with sample_tokens > 0 (whole expert sets per token)")
    _check_replicas(replicas, num_experts, ep_size)  # before any solving
    ids, occ = counts.seen()
    e2r = np.empty((L, num_experts), dtype=np.int32)
    reps = np.full((L, replicas, 2), -1, dtype=np.int32)
    tables = empty_tables(L, vocab_size, num_experts) if vocab_size else None
    nearest = nearest_token_map(embeddings, ids, vocab_size) if vocab_size else None

    def solve(layer: int):
        return _solve_layer(counts, layer, method, ep_size, nodes, capacity, theta, seed, max_expert_load, groups,
                            rows if nodes == 1 and groups == 1 else None, polish_kicks)

    # rank renaming must keep routing groups whole: with fewer groups than ranks, ranks move
    # only inside their group's block (and group blocks as a whole when there are no nodes)
    blocks, move = nodes, True
    if 1 < groups < ep_size:
        blocks, move = max(nodes, groups), nodes == 1

    solved = map_layers(solve, range(L))
    if progress is not None:
        solved = progress(solved)
    agreed = np.zeros((ids.size, ep_size))  # aligned layers' rank scores per token
    for layer, (placed, scores) in enumerate(solved):
        if scores is not None and layer:  # same token, same rank in every layer where possible
            new2old = align_ranks(agreed, scores, blocks, move)
            placed = np.argsort(new2old)[placed]  # old rank -> new rank
            scores = scores[:, new2old]
        if placed.size > num_experts:  # phantoms onto the ranks vLLM gives one expert fewer, then dropped
            A = counts.layer_matrix(layer)
            placed = fit_rank_sizes(A, occ, placed, ep_size, capacity,
                                    max_expert_load if method in CAPPED else None)
            scores = None if scores is None else rank_scores(A, placed, ep_size)
        e2r[layer] = placed
        if scores is not None:
            agreed += scores
        # with one copy per expert the rank scores are the table's counts; else count them again
        A = counts.layer_matrix(layer) if replicas or (tables is not None and scores is None) else None
        if replicas:
            reps[layer] = add_replicas(A, occ, e2r[layer], ep_size, replicas, capacity)
        if tables is not None:
            holds = holds_from_expert2rank(e2r[layer: layer + 1], ep_size, reps[layer: layer + 1])[0]
            R = scores if A is None else local_counts(A, holds)
            fill_layer(tables, layer, R, ids, occ, counts.markov_matrix(layer), holds, counts.top_k, nearest)
    return e2r, reps, tables
