"""s-MoE's s-EG solver: cross-entropy optimisation (CEO) of the 0-1 co-clustering program.

Keep a probability P[e, r] that expert e belongs to rank r; sample balanced placements from it
(Gumbel-perturbed log P, then the exact balanced assignment), score each by the program's
objective, and move P towards the elite samples. Objective (minimised):
    theta * (token-load imbalance, max/mean - 1) + (1 - theta) * (share of remote activations)
with every token id on the rank that holds most of its activations.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .counts import balanced_assignment, check_ep_size, rank_scores


def _ceo_objective(A: sp.csr_matrix, occ: np.ndarray, expert2rank: np.ndarray, ep_size: int,
                   theta: float, total: float) -> float:
    R = rank_scores(A, expert2rank, ep_size)
    t2r = R.argmax(axis=1)
    local = R[np.arange(R.shape[0]), t2r].sum()
    tl = np.bincount(t2r, weights=occ, minlength=ep_size)
    imbalance = tl.max() / max(tl.mean(), 1e-12) - 1.0
    return theta * imbalance + (1.0 - theta) * (1.0 - local / total)


def place_ceo(A: sp.csr_matrix, occ: np.ndarray, ep_size: int, theta: float = 0.5, samples: int = 48,
              elite: float = 0.1, iters: int = 30, smoothing: float = 0.7, seed: int = 0) -> np.ndarray:
    """Expert placement for one layer by CEO. A: [V', E] csr; occ: [V']. Returns [E] int32."""
    E = A.shape[1]
    check_ep_size(E, ep_size)
    rng = np.random.default_rng(seed)
    total = float(A.sum())
    P = np.full((E, ep_size), 1.0 / ep_size)
    n_elite = max(1, int(round(elite * samples)))
    best, best_val = None, np.inf
    for _ in range(iters):
        logp = np.log(np.maximum(P, 1e-9))
        cand = [balanced_assignment(logp + rng.gumbel(size=P.shape)) for _ in range(samples)]
        vals = np.array([_ceo_objective(A, occ, c, ep_size, theta, total) for c in cand])
        order = np.argsort(vals, kind="stable")[:n_elite]
        if vals[order[0]] < best_val:
            best, best_val = cand[order[0]], vals[order[0]]
        freq = np.zeros_like(P)
        for i in order:
            freq[np.arange(E), cand[i]] += 1.0 / n_elite
        P = smoothing * freq + (1.0 - smoothing) * P
        if P.max(axis=1).min() > 0.999:  # converged to one placement
            break
    return best.astype(np.int32)
