"""Polish one layer's expert placement on the routing itself: swaps of two experts scored by the
objective a served step meets.

coclust optimises token *ids* (every occurrence of an id goes to one rank). Served, a step's rows
are ordered by their own top-k (predictor ``router``, and what every predictor approximates) under
a per-step token cap, so an id's occurrences with different expert sets can land on different
ranks. Starting from a solver's placement, :func:`polish_routed` hill-climbs that served
objective on sample rows by swaps of two experts on different ranks. Expert load never rises
past ``max(max_expert_load, the input's)``; with ``home`` a live swap's move budget holds too.
History: docs/history.md#placementpolishpy.

Shapes: T rows, K top-k, E experts, N = ep_size ranks, S distinct top-k sets."""

from __future__ import annotations

import numpy as np

from .assign import assign_tokens
from .predict import prefer_ranks


def routed_local(topk: np.ndarray, batch_ids: np.ndarray, expert2rank: np.ndarray, ep_size: int, capacity: float) -> int:
    """Activations local on rows topk [T, K] (batches batch_ids [T]) when each row goes to the rank
    holding most of its experts under the per-batch cap (the capped oracle, what ``evaluate
    --predictor router`` scores): int."""
    er = expert2rank[topk]
    pref, conf = prefer_ranks(er, ep_size)
    t2r = assign_tokens(pref, conf, batch_ids, ep_size, capacity)
    return int((er == t2r[:, None]).sum())


def routed_score(topk: np.ndarray, batch_ids: np.ndarray, expert2rank: np.ndarray, ep_size: int, capacity: float,
                 load: np.ndarray, max_expert_load: float, balance_weight: float) -> float:
    """:func:`routed_local` less ``balance_weight`` x the activations (in the rows' units) the
    busiest rank holds past ``max_expert_load`` x the mean (load: [E] float, any scale): the
    objective of a live swap that must also bring a layer's expert load down."""
    local = routed_local(topk, batch_ids, expert2rank, ep_size, capacity)
    if balance_weight == 0 or load.sum() <= 0:
        return float(local)
    rl = np.bincount(expert2rank, weights=load, minlength=ep_size)
    return local - balance_weight * topk.size / load.sum() * max(0.0, rl.max() - max_expert_load * rl.mean())


def busiest_after_swaps(loads: np.ndarray, expert2rank: np.ndarray, act: np.ndarray) -> np.ndarray:
    """[E, E] float: the busiest rank's activations once experts e and f trade ranks, for every
    pair (e, f). loads: [N] float, activations on each rank; expert2rank: [E] int; act: [E]
    float, activations of each expert. Same-rank pairs give the loads' max."""
    N, r = loads.size, expert2rank
    d = act[:, None] - act[None, :]  # e leaves r[e] for r[f], f the other way
    pair = np.maximum(loads[r][:, None] - d, loads[r][None, :] + d)  # [E, E]: the two ranks after
    pair[r[:, None] == r[None, :]] = loads.max()
    others = np.zeros((N, N))  # [N, N]: the most any rank but a and b holds (one of the top three)
    ra, rb = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
    for t in np.argsort(loads, kind="stable")[-3:]:  # ascending: the busiest left last wins
        others[(ra != t) & (rb != t)] = loads[t]
    return np.maximum(pair, others[r][:, r])


def _load_ceiling(rank_load: np.ndarray, max_expert_load: float) -> float:
    """The busiest rank's most activations a swap may leave (rank_load: [N] float, activations per
    rank): ``max_expert_load`` x the mean, or the placement's own busiest where it is already
    past that (a swap never makes the load worse than it found it)."""
    mean = rank_load.mean()
    return max(max_expert_load, rank_load.max() / mean if mean > 0 else 1.0) * mean + 1e-9


def _contrib(pairs: np.ndarray, set_of: np.ndarray, expert_of: np.ndarray, w: np.ndarray, C: np.ndarray,
             expert2rank: np.ndarray, num_experts: int, block: int = 1 << 16) -> np.ndarray:
    """Uncapped gain, summed over the (set, expert) incidence ``pairs``, of moving each expert
    alone to each rank: [E, N] int64 (exact integers: updates add and subtract without drift).

    set_of, expert_of: [S * K] every (set, expert) pair; w: [S] rows per set; C: [S, N] the set's
    experts per rank. A set goes to its best rank, so its local count is max(C)."""
    E, N = num_experts, C.shape[1]
    g = np.zeros((E, N), dtype=np.int64)
    for s in range(0, pairs.size, block):
        p = pairs[s: s + block]
        rows, ex = set_of[p], expert_of[p]
        Cm = C[rows].astype(np.int64)
        Cm[np.arange(rows.size), expert2rank[ex]] -= 1
        new = np.maximum(Cm.max(axis=1, keepdims=True), Cm + 1)  # [P, N]: the expert moved to each rank
        contrib = (new - C[rows].max(axis=1, keepdims=True)) * w[rows, None]
        for r in range(N):  # bincount per rank: far faster than np.add.at; integers, exact in float64
            g[:, r] += np.rint(np.bincount(ex, weights=contrib[:, r], minlength=E)).astype(np.int64)
    return g


def polish_routed(topk_layer: np.ndarray, batch_ids: np.ndarray, expert2rank: np.ndarray, ep_size: int,
                  capacity: float = 1.10, load: np.ndarray | None = None, max_expert_load: float = 1.10,
                  shortlist: int = 64, max_evals: int = 1024, home: np.ndarray | None = None,
                  max_moved: int | None = None, balance_weight: float = 0.0) -> np.ndarray:
    """Swap experts between ranks while the served objective on the rows rises.

    Each round ranks every swap of two experts on different ranks by an uncapped estimate (each
    expert's gain from moving alone, over the distinct top-k sets; a taken swap updates only the
    sets that hold its two experts), scores swaps exactly down that order (the capped assignment of
    :func:`.assign.assign_tokens` over the rows' batches, ranks preferred by
    :func:`.predict.prefer_ranks`), at most ``shortlist`` of them, and takes the first that gains.

    topk_layer: [T, K] int, each row's routed experts in one layer (no sentinel);
    batch_ids: [T] int, non-decreasing batch (engine step) of each row, the token cap's unit;
    expert2rank: [E] int, the placement to start from (any rank sizes: swaps keep them);
    load: [E] float, activations per expert for the compute-load guard (default: counted on
    the rows); shortlist: swaps scored exactly at most per round; max_evals: exact scores in all
    (each costs one capped assignment of the T rows);
    home: [E] int, with max_moved: no swap leaves more than max_moved experts off their home rank
    (a live swap's move budget; the input may already use some of it); balance_weight: > 0 climbs
    :func:`routed_score` instead, so swaps that unload the busiest rank pay too.
    Returns expert2rank [E] int32 whose objective on the rows is >= the input's.
    """
    topk = np.asarray(topk_layer, dtype=np.int64)
    e2r = np.asarray(expert2rank, dtype=np.int64).copy()
    E, N = e2r.size, ep_size
    if topk.ndim != 2 or topk.shape[0] != np.asarray(batch_ids).shape[0]:
        raise ValueError(f"topk_layer must be [T, K] with batch_ids [T], got {topk.shape} and "
                         f"{np.asarray(batch_ids).shape}")
    if topk.size and (topk.min() < 0 or topk.max() >= E):
        raise ValueError(f"topk_layer holds experts outside 0..{E - 1}")
    if (home is None) != (max_moved is None):
        raise ValueError("home and max_moved go together")
    home = None if home is None else np.asarray(home, dtype=np.int64)
    if N < 2 or topk.shape[0] == 0:
        return e2r.astype(np.int32)
    load = np.bincount(topk.ravel(), minlength=E).astype(np.float64) if load is None else np.asarray(load, float)
    rl = np.bincount(e2r, weights=load, minlength=N)
    mean = rl.mean()
    ceiling = _load_ceiling(rl, max_expert_load)
    sets, w = np.unique(np.sort(topk, axis=1), axis=0, return_counts=True)  # [S, K], [S]
    S, K = sets.shape
    set_of, expert_of = np.repeat(np.arange(S), K), sets.ravel()  # pair p = (set p // K, expert)
    by_expert = np.argsort(expert_of, kind="stable")
    first = np.searchsorted(expert_of[by_expert], np.arange(E + 1))  # pairs of expert e: by_expert[first[e]:]
    C = np.bincount(set_of * N + e2r[expert_of], minlength=S * N).reshape(S, N)
    g = _contrib(np.arange(set_of.size), set_of, expert_of, w, C, e2r, E)
    def score(e):
        return routed_score(topk, batch_ids, e, N, capacity, load, max_expert_load, balance_weight)
    best = score(e2r)
    unit = balance_weight * topk.size / max(load.sum(), 1e-30)  # one activation of excess, in rows' units
    iu, ju = np.triu_indices(E, 1)
    evals = max_evals
    while evals > 0:
        ra, rb = e2r[iu], e2r[ju]
        est = g[iu, rb] + g[ju, ra]  # the two moves' gains (sets holding both are counted twice)
        new_a, new_b = rl[ra] - load[iu] + load[ju], rl[rb] - load[ju] + load[iu]
        ok = (ra != rb) & (np.maximum(new_a, new_b) <= ceiling)
        if balance_weight > 0:  # the penalty's change
            excess = busiest_after_swaps(rl, e2r, load)[iu, ju] - max_expert_load * mean
            est = est - unit * (np.maximum(excess, 0) - max(0.0, rl.max() - max_expert_load * mean))
        if home is not None:  # experts off home after the swap, against the budget
            moved = int((e2r != home).sum()) + (rb != home[iu]).astype(int) + (ra != home[ju]) \
                - (ra != home[iu]) - (rb != home[ju])
            ok &= moved <= max_moved
        cand = np.flatnonzero(ok)
        cand = cand[np.argsort(-est[cand], kind="stable")[:min(shortlist, evals)]]
        for c in cand:  # first improvement, in the estimate's order
            a, b = iu[c], ju[c]
            trial = e2r.copy()
            trial[a], trial[b] = rb[c], ra[c]
            val = score(trial)
            evals -= 1
            if val > best:
                break
        else:
            break
        # only the sets holding a or b change: take their pairs' gains out, move, put them back
        hit = np.union1d(set_of[by_expert[first[a]: first[a + 1]]], set_of[by_expert[first[b]: first[b + 1]]])
        pairs = (hit[:, None] * K + np.arange(K)).ravel()
        g -= _contrib(pairs, set_of, expert_of, w, C, e2r, E)
        e2r, best = trial, val
        C[hit] = np.bincount(np.repeat(np.arange(hit.size), K) * N + e2r[sets[hit]].ravel(),
                             minlength=hit.size * N).reshape(hit.size, N)
        g += _contrib(pairs, set_of, expert_of, w, C, e2r, E)
        rl = np.bincount(e2r, weights=load, minlength=N)
    return e2r.astype(np.int32)


def polish_kicked(topk_layer: np.ndarray, batch_ids: np.ndarray, expert2rank: np.ndarray, ep_size: int,
                  kicks: int, capacity: float = 1.10, load: np.ndarray | None = None,
                  max_expert_load: float = 1.10, kick_swaps: int = 3, seed: int = 0, max_evals: int = 1024,
                  shortlist: int = 64) -> np.ndarray:
    """:func:`polish_routed`, then ``kicks`` rounds of an iterated local search: swap
    ``kick_swaps`` random pairs of experts on different ranks in the best placement so far, polish
    again, keep the result where the objective on the rows rises; the kicked rounds never leave
    more expert load than the first polish did. The swap search stops in a local optimum; a kick
    lets it leave one (on the fixture at EP 8, 15 rounds lift held-out LAR from 0.362 to 0.369:
    BENCHMARKS.md, "Kicked polish").

    Arguments as :func:`polish_routed` (kicks >= 0; seed: the kicks' random stream, so equal
    inputs give equal placements). Each round costs up to ``max_evals`` exact scores.
    Returns expert2rank [E] int32 whose objective on the rows is >= polish_routed's.
    """
    if kicks < 0 or kick_swaps < 1:
        raise ValueError(f"kicks must be >= 0 and kick_swaps >= 1, got {kicks} and {kick_swaps}")
    topk = np.asarray(topk_layer, dtype=np.int64)
    e2r = np.asarray(expert2rank, dtype=np.int64)
    E, N = e2r.size, ep_size
    kw = dict(capacity=capacity, max_expert_load=max_expert_load, max_evals=max_evals, shortlist=shortlist)
    best = polish_routed(topk, batch_ids, e2r, N, load=load, **kw).astype(np.int64)
    if kicks == 0 or N < 2 or topk.shape[0] == 0:
        return best.astype(np.int32)
    load = np.bincount(topk.ravel(), minlength=E).astype(np.float64) if load is None else np.asarray(load, float)
    # held to the first polish's expert load: free up to the cap, the kicks bought +0.003 held-out
    # LAR at EP 4 with +0.041 load (BENCHMARKS.md "Kicked polish")
    rl = np.bincount(best, weights=load, minlength=N)
    kw["max_expert_load"] = min(max_expert_load, rl.max() / rl.mean() if rl.mean() > 0 else 1.0)
    ceiling = _load_ceiling(rl, kw["max_expert_load"])
    top = routed_local(topk, batch_ids, best, N, capacity)
    rng = np.random.default_rng(seed)
    for _ in range(kicks):
        e, done = best.copy(), 0
        for a, b in rng.integers(E, size=(64 * kick_swaps, 2)):
            if done == kick_swaps:
                break
            if e[a] == e[b]:
                continue
            e[a], e[b] = e[b], e[a]
            if np.bincount(e, weights=load, minlength=N).max() > ceiling:
                e[a], e[b] = e[b], e[a]  # over the ceiling: undo
                continue
            done += 1
        if done == 0:
            break  # no swap fits under the ceiling: nothing to kick
        e = polish_routed(topk, batch_ids, e, N, load=load, **kw).astype(np.int64)
        val = routed_local(topk, batch_ids, e, N, capacity)
        if val > top:
            best, top = e, val
    return best.astype(np.int32)
