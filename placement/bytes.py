"""Expert placement that minimises the bytes the all-to-all carries, not the remote activations.

A token crosses to each remote rank once, whatever the number of its experts there (de-duplicated
dispatch). So what one layer sends is, per token, the number of distinct ranks among its top-k
experts' ranks, minus one when its own rank is among them: the connectivity - 1 metric of
hypergraph partitioning, with each token's expert set a hyperedge. Maximising local activations
(:mod:`.coclust`) does not minimise it: it ignores whether a token's remote experts share a rank.

Input per layer, besides the count matrix A [V', E] and occurrences occ [V'] of :mod:`.counts`:
instances, the distinct (token id, top-k expert set) pairs of a sample of the trace:
hv [H] int64 row of the token id in A; sets [H, K] int64 expert ids (-1 = none); w [H] float64
occurrences. Placement: expert2rank [E] int (E/N per rank); tokens go to ranks by the same
capacity-capped rule as everywhere (:func:`.counts.assign_token_ids`). The search:
:func:`place_bytes`."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .coclust import place_coclust
from .counts import assign_token_ids, check_ep_size, rank_scores


def layer_instances(token_rows: np.ndarray, topk_layer: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (token row, expert set) pairs. token_rows: [S] int rows of A; topk_layer: [S, K] int.
    Returns (hv [H] int64, sets [H, K] int64 sorted ascending, w [H] float64 occurrences)."""
    if token_rows.size == 0:
        return np.zeros(0, np.int64), np.zeros((0, topk_layer.shape[1]), np.int64), np.zeros(0)
    key = np.concatenate([token_rows[:, None].astype(np.int64), np.sort(topk_layer, axis=1).astype(np.int64)], axis=1)
    u, counts = np.unique(key, axis=0, return_counts=True)
    return u[:, 0], u[:, 1:], counts.astype(np.float64)


def _remote_rows(sets: np.ndarray, hv: np.ndarray, expert2rank: np.ndarray, token2rank: np.ndarray) -> np.ndarray:
    """[H] int64 per instance: distinct ranks of the set - [token's rank among them]."""
    ranks = np.where(sets >= 0, expert2rank[np.maximum(sets, 0)], -1)
    if hasattr(np, "bitwise_count") and expert2rank.size and expert2rank.max() < 64:
        # up to 64 ranks: the set's ranks as one bit mask per instance, the token's rank cleared
        bits = np.where(ranks >= 0, np.left_shift(np.uint64(1), np.maximum(ranks, 0).astype(np.uint64)),
                        np.uint64(0))
        mask = np.bitwise_or.reduce(bits, axis=1)
        mask &= ~np.left_shift(np.uint64(1), token2rank[hv].astype(np.uint64))
        return np.bitwise_count(mask).astype(np.int64)
    srt = np.sort(ranks, axis=1)
    distinct = (srt[:, :1] >= 0).sum(axis=1) + ((srt[:, 1:] != srt[:, :-1]) & (srt[:, 1:] >= 0)).sum(axis=1)
    hit = (ranks == token2rank[hv][:, None]).any(axis=1)
    return distinct - hit


def remote_bytes(sets: np.ndarray, w: np.ndarray, hv: np.ndarray, expert2rank: np.ndarray,
                 token2rank: np.ndarray) -> float:
    """Sum over instances of w x (distinct ranks of the set - [token's rank among them]): the
    rows one layer's de-duplicated all-to-all sends (times hidden x dtype bytes x 2 for bytes)."""
    if sets.shape[0] == 0:
        return 0.0
    return float((w * _remote_rows(sets, hv, expert2rank, token2rank)).sum())


def _rank_counts(sets: np.ndarray, expert2rank: np.ndarray, ep_size: int) -> np.ndarray:
    """[H, N] int64 experts of each set on each rank."""
    H, K = sets.shape
    ok = sets >= 0
    rows = np.repeat(np.arange(H), K)[ok.ravel()]
    return np.bincount(rows * ep_size + expert2rank[sets[ok]], minlength=H * ep_size).reshape(H, ep_size)


def _move_deltas(sets, w, t_h, expert2rank, cnt, incidence: sp.csr_matrix) -> np.ndarray:
    """D: [E, N] float64, change in bytes if expert e alone moved to rank r (0 on its own rank);
    an estimate that orders the swaps tried (float32 sums), each trial recounts exactly.

    Leaving rank p saves a row where e was the set's only expert on p (unless p is the token's
    rank, where the row was local anyway); arriving on r costs a row where the set had no expert
    on r (unless r is the token's rank: then the remote row it had becomes local)."""
    H, K = sets.shape
    E = expert2rank.size
    ok = sets >= 0
    h = np.repeat(np.arange(H), K)[ok.ravel()]
    e = sets[ok]
    p = expert2rank[e]
    alone = cnt[h, p] == 1
    leave = np.bincount(e, weights=w[h] * np.where(alone & (p != t_h[h]), -1.0, 0.0), minlength=E)
    cost = np.where(cnt == 0, w.astype(np.float32)[:, None], np.float32(0))  # [H, N] a new rank's row
    cost[np.arange(H), t_h] = 0.0  # arriving on the token's rank costs nothing
    D = leave[:, None] + incidence @ cost
    D[np.arange(E), expert2rank] = 0.0
    return D


def _search(A, occ, instances, ep_size, capacity, max_expert_load, start, seed, max_passes, trials_per_pass,
            token2rank=None):
    """The swap search of :func:`place_bytes` from one start. token2rank: [V'] int, the tokens'
    ranks held fixed (whole requests under attention DP), else they follow the capped rule."""
    E = A.shape[1]
    hv, sets, w = instances
    e2r = np.asarray(start, dtype=np.int64).copy()
    load = np.asarray(A.sum(axis=0)).ravel()
    cap = max_expert_load * load.sum() / ep_size
    H, K = sets.shape
    ok = sets >= 0
    inc_h = np.repeat(np.arange(H), K)[ok.ravel()]
    incidence = sp.csr_matrix((np.ones(inc_h.size, np.float32), (sets[ok], inc_h)), shape=(E, H))  # expert x set
    touch = [incidence.indices[incidence.indptr[x]: incidence.indptr[x + 1]] for x in range(E)]
    fixed = token2rank is not None
    t2r = np.asarray(token2rank) if fixed else assign_token_ids(rank_scores(A, e2r, ep_size), occ, capacity)
    cur = remote_bytes(sets, w, hv, e2r, t2r)
    best = e2r.copy()
    rng = np.random.default_rng(seed)
    stamp = np.full(H, -1, dtype=np.int64)  # the trial that last listed an instance
    trial = 0
    for _ in range(max_passes):
        t_h = t2r[hv]
        D = _move_deltas(sets, w, t_h, e2r, _rank_counts(sets, e2r, ep_size), incidence)
        rl = np.bincount(e2r, weights=load, minlength=ep_size)
        worst = max(cap, rl.max())
        # estimated change of swapping a (on p) and b (on q): a moves to q, b to p
        est = D[:, e2r] + D[:, e2r].T
        da = load[:, None] - load[None, :]  # load leaving a's rank for b's
        fits = ((rl[e2r][:, None] - da) <= worst + 1e-9) & ((rl[e2r][None, :] + da) <= worst + 1e-9)
        est = np.where((e2r[:, None] != e2r[None, :]) & fits & np.triu(np.ones((E, E), bool), 1), est, np.inf)
        cand = np.flatnonzero(est.ravel() < -1e-9)
        cand = cand[np.argsort(est.ravel()[cand] + 1e-12 * rng.random(cand.size), kind="stable")]
        moved = np.zeros(E, bool)
        gained = 0.0
        trials = trials_per_pass or 4 * E
        vals = _remote_rows(sets, hv, e2r, t2r)  # each instance's rows now: a trial recounts only its own
        for a, b in zip(*np.unravel_index(cand, (E, E))):
            if moved[a] or moved[b]:  # their estimates are stale; exact recount next pass
                continue
            if trials == 0:
                break
            trials -= 1
            # the load test first: it needs no recount
            if max(rl[e2r[a]] - load[a] + load[b], rl[e2r[b]] - load[b] + load[a]) > worst + 1e-9:
                continue
            trial += 1  # the instances of a or b, each once, without sorting
            stamp[touch[a]] = trial
            rows = np.concatenate([touch[a], touch[b][stamp[touch[b]] != trial]])
            e2r[a], e2r[b] = e2r[b], e2r[a]
            new = _remote_rows(sets[rows], hv[rows], e2r, t2r)
            delta = float((w[rows] * (new - vals[rows])).sum())
            if delta < -1e-9:
                moved[a] = moved[b] = True
                gained += delta
                vals[rows] = new
                rl[e2r[a]] += load[a] - load[b]
                rl[e2r[b]] += load[b] - load[a]
            else:
                e2r[a], e2r[b] = e2r[b], e2r[a]
        if gained > -1e-9:
            break
        # tokens follow the capped best-rank rule when served: a pass counts only if the bytes
        # with the tokens that rule gives fall
        t_new = t2r if fixed else assign_token_ids(rank_scores(A, e2r, ep_size), occ, capacity)
        val = remote_bytes(sets, w, hv, e2r, t_new)
        if val >= cur - 1e-9:
            e2r = best
            break
        best, t2r, cur = e2r.copy(), t_new, val
    return best


def place_bytes(A: sp.csr_matrix, occ: np.ndarray, instances: tuple[np.ndarray, np.ndarray, np.ndarray],
                ep_size: int, capacity: float = 1.10, max_expert_load: float = 1.10,
                start: np.ndarray | None = None, seed: int = 0, max_passes: int = 30,
                trials_per_pass: int | None = None, work: float = 2e6) -> np.ndarray:
    """Expert placement for one layer minimising :func:`remote_bytes` on ``instances`` (see the
    module doc), E/N experts per rank, expert load (activations per rank, from A) at most
    ``max_expert_load`` x mean or no worse than the start's. Searches from coclust's placement
    (or ``start``) and, while ``work`` (sets x experts) allows, from a METIS partition of the
    co-activation graph and random balanced placements, each capped in expert load; keeps the
    placement with the fewest rows. trials_per_pass: exact swap evaluations per pass (default
    4 E). Returns expert2rank [E] int32.

    Search: from coclust's placement (and, on small layers, a few more starts), swaps of two experts
    on different ranks, proposed by a first-order estimate of every swap's change in bytes (from
    each expert's best single move) and accepted only when their exact change, recomputed on the
    hyperedges they touch, is a gain and the expert-load cap holds; after each pass tokens are
    reassigned by the capped rule, and the pass is kept only if the bytes with those tokens fell."""
    from .coclust import cap_expert_load
    from .counts import coactivation
    from .peers import place_metis

    E = A.shape[1]
    check_ep_size(E, ep_size)
    first = start if start is not None else place_coclust(A, occ, ep_size, capacity=capacity,
                                                          max_expert_load=max_expert_load, seed=seed)
    hv, sets, w = instances
    if ep_size == 1 or sets.shape[0] == 0:
        return np.asarray(first, dtype=np.int32)
    load = np.asarray(A.sum(axis=0)).ravel()
    starts = [np.asarray(first)]
    extra = int(np.clip(work / max(1, sets.shape[0] * E), 0, 4))
    rng = np.random.default_rng(seed)
    if extra:
        starts.append(place_metis(coactivation(A), ep_size, seed=seed))
    for _ in range(extra - 1):
        starts.append(rng.permutation(np.repeat(np.arange(ep_size), E // ep_size)))
    limit = max(max_expert_load * load.sum() / ep_size, np.bincount(first, weights=load, minlength=ep_size).max())
    best, best_val = None, np.inf
    for i, s0 in enumerate(starts):
        if i:  # the extra starts obey the cap before the search
            s0 = cap_expert_load(np.asarray(s0), np.zeros((E, ep_size)), load, ep_size, max_expert_load)
        e2r = _search(A, occ, instances, ep_size, capacity, max_expert_load, s0, seed + i, max_passes,
                      trials_per_pass)
        if i and np.bincount(e2r, weights=load, minlength=ep_size).max() > limit + 1e-9:
            continue  # a start the cap could not repair
        val = remote_bytes(sets, w, hv, e2r, assign_token_ids(rank_scores(A, e2r, ep_size), occ, capacity))
        if val < best_val - 1e-9:
            best, best_val = e2r, val
    return best.astype(np.int32)


def swap_for_bytes(A: sp.csr_matrix, instances: tuple[np.ndarray, np.ndarray, np.ndarray], token2rank: np.ndarray,
                   ep_size: int, start: np.ndarray, max_expert_load: float = 1.10, seed: int = 0,
                   max_passes: int = 30) -> np.ndarray:
    """:func:`place_bytes`' swap search for one layer with the tokens' ranks fixed (whole
    requests under attention DP, :func:`.dp.place_requests`): from ``start`` [E] int, swaps of
    experts on different ranks that cut :func:`remote_bytes`, expert load no worse than the cap or
    the start. A: [V', E] counts of the rows ``token2rank`` [V'] int indexes (for the loads).
    Returns expert2rank [E] int32."""
    check_ep_size(A.shape[1], ep_size)
    if ep_size == 1 or instances[1].shape[0] == 0:
        return np.asarray(start, dtype=np.int32)
    occ = np.asarray(A.sum(axis=1)).ravel()
    return _search(A, occ, instances, ep_size, 1.0, max_expert_load, start, seed, max_passes, None,
                   token2rank=token2rank).astype(np.int32)
