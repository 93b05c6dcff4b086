"""Sem-MoE (v5) style alternating heuristic for expert placement.

Each round: (1) greedy expert placement, hottest experts first, each on the rank that scores
best on expert-expert affinity (co-activation with experts already there) plus token-expert
affinity (activations by the token ids scheduled there last round) minus a load penalty;
(2) random swap refinement on that score; (3) token scheduling (capacity-capped best rank).
Keep the round with most local activations.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .counts import assign_token_ids, check_ep_size, coactivation, expert_gains, local_count, rank_scores


def _greedy_place(C: np.ndarray, G: np.ndarray, load: np.ndarray, ep_size: int, theta: float) -> np.ndarray:
    E = C.shape[0]
    per = E // ep_size
    e2r = np.full(E, -1, dtype=np.int64)
    count = np.zeros(ep_size, dtype=np.int64)
    rank_load = np.zeros(ep_size)
    aff = np.zeros((E, ep_size))  # co-activation of e with experts already on r
    mean_load = load.sum() / ep_size
    for e in np.argsort(-load, kind="stable"):
        score = aff[e] + G[e] - theta * rank_load / max(mean_load, 1e-12)
        score[count >= per] = -np.inf
        r = int(np.argmax(score))
        e2r[e] = r
        count[r] += 1
        rank_load[r] += load[e]
        aff[:, r] += C[:, e]
    return e2r


def _swap_refine(e2r: np.ndarray, C: np.ndarray, G: np.ndarray, swaps: int, rng: np.random.Generator) -> np.ndarray:
    e2r = e2r.copy()
    E = e2r.size
    N = G.shape[1]
    onehot = np.zeros((E, N))
    onehot[np.arange(E), e2r] = 1.0
    aff = C @ onehot  # [E, N] affinity of e to each rank's experts
    for _ in range(swaps):
        a, b = rng.integers(0, E, size=2)
        ra, rb = e2r[a], e2r[b]
        if ra == rb:
            continue
        # gain of swapping a<->b on the (co-activation + token gain) score; C[a, b] counted once
        delta = (aff[a, rb] - aff[a, ra] + aff[b, ra] - aff[b, rb] - 2 * C[a, b]
                 + G[a, rb] - G[a, ra] + G[b, ra] - G[b, rb])
        if delta > 0:
            e2r[a], e2r[b] = rb, ra
            aff[:, ra] += C[:, b] - C[:, a]
            aff[:, rb] += C[:, a] - C[:, b]
    return e2r


def place_alternating(A: sp.csr_matrix, occ: np.ndarray, ep_size: int, capacity: float = 1.10,
                      theta: float = 0.5, rounds: int = 5, swaps: int = 2000, seed: int = 0) -> np.ndarray:
    """Expert placement for one layer. A: [V', E] csr; occ: [V']. Returns expert2rank [E] int32."""
    E = A.shape[1]
    check_ep_size(E, ep_size)
    rng = np.random.default_rng(seed)
    C = coactivation(A)
    C = C / max(C.sum(), 1e-12) * float(A.sum())  # same scale as the token gains
    load = np.asarray(A.sum(axis=0)).ravel()
    G = np.zeros((E, ep_size))
    best, best_val = None, -np.inf
    for _ in range(rounds):
        e2r = _swap_refine(_greedy_place(C, G, load, ep_size, theta * load.mean()), C, G, swaps, rng)
        R = rank_scores(A, e2r, ep_size)
        t2r = assign_token_ids(R, occ, capacity)
        val = local_count(R, t2r)
        if val > best_val:
            best, best_val = e2r.copy(), val
        G = expert_gains(A, t2r, ep_size)
    return best.astype(np.int32)
