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

from .counts import (assign_token_ids, balanced_assignment, check_ep_size, coactivation, expert_gains, local_count,
                     rank_scores)
from .peers import place_metis


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


def _objective(A: sp.csr_matrix, occ: np.ndarray, expert2rank: np.ndarray, ep_size: int, capacity: float) -> float:
    R = rank_scores(A, expert2rank, ep_size)
    return local_count(R, assign_token_ids(R, occ, capacity))


def _swap_search(A: sp.csr_matrix, occ: np.ndarray, e2r: np.ndarray, val: float, load: np.ndarray, ep_size: int,
                 capacity: float, max_expert_load: float, budget: int, rng: np.random.Generator
                 ) -> tuple[np.ndarray, float]:
    """First-improvement swaps of two experts on different ranks, scored exactly; keeps the
    expert-load cap. Stops after a full pass without gain or ``budget`` evaluations."""
    E = e2r.size
    cap = max_expert_load * load.sum() / ep_size
    while budget > 0:
        improved = False
        for a, b in rng.permutation(np.array(np.triu_indices(E, 1)).T):
            if e2r[a] == e2r[b]:
                continue
            if budget <= 0:
                break
            trial = e2r.copy()
            trial[a], trial[b] = e2r[b], e2r[a]
            rl = np.bincount(trial, weights=load, minlength=ep_size)
            if rl.max() > max(cap, np.bincount(e2r, weights=load, minlength=ep_size).max()) + 1e-9:
                continue
            budget -= 1
            v = _objective(A, occ, trial, ep_size, capacity)
            if v > val + 1e-9:
                e2r, val, improved = trial, v, True
        if not improved:
            break
    return e2r, val


def place_coclust(A: sp.csr_matrix, occ: np.ndarray, ep_size: int, capacity: float = 1.10,
                  max_expert_load: float = 1.10, starts: list[np.ndarray] | None = None,
                  random_starts: int | None = None, max_iters: int = 30, tol: float = 2e-3,
                  work: float = 4e7, seed: int = 0) -> np.ndarray:
    """Expert placement for one layer. A: [V', E] csr activation counts; occ: [V'] occurrences.

    starts: extra initial expert2rank arrays ([E] int); when ``work`` allows, a METIS partition
    of the co-activation graph is one more. random_starts: random balanced starts (default: as
    many as ``work`` allows, 1..8). Small instances finish with an exact swap search within the same
    work budget. Returns expert2rank [E] int32."""
    E = A.shape[1]
    check_ep_size(E, ep_size)
    rng = np.random.default_rng(seed)
    load = np.asarray(A.sum(axis=0)).ravel()
    step_cost = max(1.0, float(A.nnz + A.shape[0] * ep_size))  # ~ one objective evaluation
    affordable = int(work / (step_cost * 40))  # alternations the work budget pays for
    if random_starts is None:
        random_starts = int(np.clip(affordable, 1, 8))
    inits = list(starts or [])
    if ep_size > 1 and affordable >= 1:  # big layers: one random start converges as well
        inits.append(place_metis(coactivation(A), ep_size, seed=seed))
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
    budget = int(work / step_cost) - 40 * len(inits)
    if budget > 0 and ep_size > 1:
        best, best_val = _swap_search(A, occ, best.astype(np.int64), best_val, load, ep_size, capacity,
                                      max_expert_load, budget, rng)
    return best.astype(np.int32)
