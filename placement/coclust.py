"""smoe's own solver: balanced token-expert co-clustering by exact alternating optimisation.

Alternate two exact or near-exact steps on the layer problem of :mod:`.counts`:
- tokens: capacity-capped best-rank assignment of token ids given the experts' ranks;
- experts: the optimal balanced expert->rank assignment given the tokens' ranks (Hungarian on
  E x E slots), followed by a swap repair that caps the expert (compute) load;
from several starts (the caller's seeds plus random balanced placements), keeping the best.
Each step never lowers the local-activation objective, so every start converges in a few steps.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .counts import assign_token_ids, balanced_assignment, check_ep_size, expert_gains, local_count, rank_scores


def cap_expert_load(expert2rank: np.ndarray, gains: np.ndarray, load: np.ndarray, ep_size: int,
                    max_ratio: float) -> np.ndarray:
    """Swap experts between ranks until max/mean expert load <= ``max_ratio`` (or no swap helps),
    choosing each time the swap that loses least gain per unit of load moved off the hottest rank.

    expert2rank: [E] int; gains: [E, N] float, value of expert e on rank r; load: [E] float,
    activations of each expert. Returns a new expert2rank [E] int32.
    """
    e2r = expert2rank.astype(np.int64).copy()
    E = e2r.size
    for _ in range(4 * E):
        rl = np.bincount(e2r, weights=load, minlength=ep_size)
        src = int(np.argmax(rl))
        if rl[src] <= max_ratio * rl.mean() + 1e-9:
            break
        a = np.flatnonzero(e2r == src)  # experts leaving the hot rank
        b = np.flatnonzero(e2r != src)  # experts coming in
        d = e2r[b]
        moved = load[a][:, None] - load[b][None, :]  # load taken off src
        new_src = rl[src] - moved
        new_dst = rl[d][None, :] + moved
        ok = (moved > 0) & (np.maximum(new_src, new_dst) < rl[src] - 1e-9)
        if not ok.any():
            break
        loss = (gains[a, src][:, None] + gains[b, d][None, :] - gains[a][:, d] - gains[b, src][None, :])
        score = np.where(ok, loss / np.maximum(moved, 1e-12), np.inf)
        i, j = np.unravel_index(np.argmin(score), score.shape)
        e2r[a[i]], e2r[b[j]] = d[j], src
    return e2r.astype(np.int32)


def place_coclust(A: sp.csr_matrix, occ: np.ndarray, ep_size: int, capacity: float = 1.10,
                  max_expert_load: float = 1.10, starts: list[np.ndarray] | None = None,
                  random_starts: int = 1, max_iters: int = 30, tol: float = 2e-3, seed: int = 0) -> np.ndarray:
    """Expert placement for one layer. A: [V', E] csr activation counts; occ: [V'] occurrences.
    starts: optional initial expert2rank arrays ([E] int). Returns expert2rank [E] int32."""
    E = A.shape[1]
    check_ep_size(E, ep_size)
    rng = np.random.default_rng(seed)
    load = np.asarray(A.sum(axis=0)).ravel()
    inits = list(starts or [])
    per = E // ep_size
    for _ in range(random_starts):
        inits.append(rng.permutation(np.repeat(np.arange(ep_size), per)))
    best, best_val = None, -np.inf
    for e2r in inits:
        e2r = cap_expert_load(np.asarray(e2r), np.zeros((E, ep_size)), load, ep_size, max_expert_load)
        prev = -np.inf
        for _ in range(max_iters):
            R = rank_scores(A, e2r, ep_size)
            t2r = assign_token_ids(R, occ, capacity)
            val = local_count(R, t2r)
            if val > best_val:
                best, best_val = e2r.copy(), val
            if val <= prev * (1.0 + tol) + 1e-9:  # converged (gains below tol)
                break
            prev = val
            G = expert_gains(A, t2r, ep_size)
            e2r = cap_expert_load(balanced_assignment(G), G, load, ep_size, max_expert_load)
    return best.astype(np.int32)
