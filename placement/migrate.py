"""A placement between the served one and a fresh one that moves few experts (live swaps).

A live swap moves every expert slot whose expert changes, and a fresh placement from a new
recording usually changes almost all of them (the ranks' names are arbitrary, and so are most
tie-breaks). :func:`limit_moves` keeps the served placement and applies only the parts of the
fresh one that pay most per moved slot, within a budget and the compute balance :mod:`.coclust`
keeps (the search step by step: :func:`limit_moves`).

No torch, no I/O. Arrays: expert2rank [L, E] int (rank of each expert, E / N per rank, or
vLLM's uneven split where N does not divide E: :func:`.counts.rank_sizes`)."""

from __future__ import annotations

import heapq
import math

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment

from .counts import assign_token_ids, expert_gains, local_count, rank_scores, rank_sizes
from .groups import broken_group
from .polish import busiest_after_swaps, polish_routed, routed_score
from .predict import named_ranks


def rank_names(current: np.ndarray, fresh: np.ndarray, N: int, per_layer: bool = False, block: int | None = None
               ) -> np.ndarray:
    """[L, N] int64: the name each of fresh's ranks takes in each layer so that fresh ([L, E] int
    expert2rank) agrees with current ([L, E]) on the most experts (Hungarian on the rank
    overlap): one renaming for all layers (every row the same), or with ``per_layer`` one for
    each layer (fewer moves; rank names then agree across layers only as far as current's do,
    which an order per MoE layer does not need). block: names move only inside blocks of this
    many consecutive ranks (:func:`rename_block`: nodes and routing-group blocks stay whole);
    None: anywhere."""
    if per_layer:
        return np.concatenate([rank_names(c[None], f[None], N, block=block) for c, f in zip(current, fresh)])
    overlap = np.zeros((N, N), dtype=np.int64)
    np.add.at(overlap, (current.reshape(-1), fresh.reshape(-1)), 1)
    # where N does not divide E, a rank keeps vLLM's size: only ranks of one size trade names
    sizes = rank_sizes(current.shape[-1], N)
    apart = sizes[:, None] != sizes[None, :]
    if block is not None:
        apart |= (np.arange(N)[:, None] // block) != (np.arange(N)[None, :] // block)
    overlap[apart] = -current.size - 1
    rows, cols = linear_sum_assignment(overlap, maximize=True)
    name = np.empty(N, dtype=np.int64)
    name[cols] = rows
    return np.tile(name, (current.shape[0], 1))


def rename_block(N: int, nodes: int = 1, groups: int = 1) -> int:
    """The largest run of consecutive ranks inside which renaming keeps a placement's structure:
    a node's ranks (``nodes`` > 1) and a routing group's block of ranks (1 < ``groups`` < N; a
    rank holding whole groups keeps them under any name)."""
    return math.gcd(N // nodes if nodes > 1 else N, N // groups if 1 < groups < N else N)


def rename_ranks(current: np.ndarray, fresh: np.ndarray, N: int, per_layer: bool = False,
                 block: int | None = None) -> np.ndarray:
    """fresh ([L, E] int expert2rank) with its ranks renamed by :func:`rank_names`."""
    return named_ranks(rank_names(current, fresh, N, per_layer, block), np.asarray(fresh, dtype=np.int64))


def _cycles(current: np.ndarray, target: np.ndarray) -> list[list[int]]:
    """Experts of one layer that move (current [E] -> target [E], both balanced) as exchange
    cycles, shortest first: each a list of experts e_1..e_k with target[e_i] = current[e_{i+1}]
    and target[e_k] = current[e_1]. Balanced placements differ by whole cycles (every rank loses
    as many experts as it gains), so all moving experts end up in one."""
    out: dict[int, list[int]] = {}  # rank -> experts leaving it, not yet in a cycle
    for e in np.flatnonzero(current != target):
        out.setdefault(int(current[e]), []).append(int(e))
    cycles = []
    while out:
        best = None
        for start in sorted(out):
            cyc = _shortest_cycle(start, out, target)
            if cyc is not None and (best is None or len(cyc) < len(best)):
                best = cyc
                if len(best) == 2:
                    break
        assert best is not None, "balanced placements differ by whole cycles"
        for e in best:
            out[int(current[e])].remove(e)
        out = {r: es for r, es in out.items() if es}
        cycles.append(best)
    return cycles


def _shortest_cycle(start: int, out: dict[int, list[int]], target: np.ndarray) -> list[int] | None:
    """The fewest experts that leave ``start`` and lead back to it (breadth-first over ranks)."""
    via = {start: None}  # rank -> (previous rank, expert that moved from it to this rank)
    frontier = [start]
    while frontier:
        nxt = []
        for rank in frontier:
            for e in out.get(rank, ()):
                to = int(target[e])
                if to == start:
                    path = [e]
                    while via[rank] is not None:
                        rank, moved = via[rank]
                        path.append(moved)
                    return path[::-1]
                if to not in via:
                    via[to] = (rank, e)
                    nxt.append(to)
        frontier = nxt
    return None


# Local activations one activation of excess expert load is worth (limit_moves' default): the
# busiest rank's excess delays the whole step, a remote activation only its share of the links
# (why 4: docs/history.md#placementmigratepy)
BALANCE_WEIGHT = 4.0


class _Layer:
    """One layer's capped objective under its current assignment (what :mod:`.coclust` solves:
    activations served locally when token ids go to ranks by confidence, each rank capped at
    ``capacity`` x its share of the occurrences), less ``weight`` x the activations its busiest
    rank holds past ``max_load`` x the mean (the expert-load cap coclust keeps)."""

    def __init__(self, A: sp.csr_matrix, occ: np.ndarray, expert2rank: np.ndarray, N: int, capacity: float,
                 max_load: float, weight: float):
        self.A, self.occ, self.N, self.capacity = sp.csr_matrix(A, dtype=np.float64), occ, N, capacity
        self.e2r = expert2rank.astype(np.int64).copy()
        self.act = np.asarray(self.A.sum(axis=0)).ravel()  # [E] float: activations of each expert
        self.cap = max_load * self.act.sum() / N  # activations the busiest rank may hold
        self.weight = weight
        self.value = self.score(self.e2r)

    def loads(self, e2r: np.ndarray) -> np.ndarray:
        """[N] float: activations of the experts on each rank."""
        return np.bincount(e2r, weights=self.act, minlength=self.N)

    def load_ratio(self, e2r: np.ndarray) -> float:
        """Expert load: the busiest rank's activations over the mean (1.0 when the layer has none)."""
        loads = self.loads(e2r)
        return float(loads.max() / loads.mean()) if loads.sum() > 0 else 1.0

    def local(self, e2r: np.ndarray) -> float:
        R = rank_scores(self.A, e2r, self.N)
        return local_count(R, assign_token_ids(R, self.occ, self.capacity))

    def score(self, e2r: np.ndarray) -> float:
        return self.local(e2r) - self.weight * max(0.0, self.loads(e2r).max() - self.cap)

    def allows(self, e2r: np.ndarray) -> bool:
        """Whether e2r keeps the busiest rank within the cap, or within what it holds now."""
        return self.loads(e2r).max() <= max(self.cap, self.loads(self.e2r).max()) + 1e-9

    def gain(self, cycle: list[int], target: np.ndarray) -> float:
        trial = self.e2r.copy()
        trial[cycle] = target[cycle]
        return self.score(trial) - self.value

    def apply(self, cycle: list[int], target: np.ndarray) -> None:
        self.e2r[cycle] = target[cycle]
        self.value = self.score(self.e2r)


def _experts(layer: "_Layer", target: np.ndarray, unit: list[int] | None) -> list[int]:
    """The experts a unit still moves: a cycle's (none once applied), or every one of the layer
    not yet at its target (``unit`` None)."""
    if unit is None:
        return np.flatnonzero(layer.e2r != target).tolist()
    return [] if (layer.e2r[unit] == target[unit]).all() else unit


def _best_swap(layer: "_Layer", current: np.ndarray, groups: int, top: int = 16):
    """The pairwise exchange of two experts on different ranks that gains most per moved slot,
    or None: candidates ranked by their gain with the token ids' ranks held fixed (the
    activations each expert gets from each rank's ids, less the expert-load penalty), the
    ``top`` best re-scored exactly. A swap may not raise the layer's busiest rank past the cap
    (or past what it holds, if already higher). Returns (gain per slot, experts [2], their new
    ranks [2], slots it adds to the moves)."""
    act, N = layer.act, layer.N
    loads = layer.loads(layer.e2r)  # [N]
    ceiling = max(layer.cap, loads.max()) + 1e-9
    R = rank_scores(layer.A, layer.e2r, N)
    G = expert_gains(layer.A, assign_token_ids(R, layer.occ, layer.capacity), N)  # [E, N]
    r = layer.e2r
    own = G[np.arange(r.size), r]  # [E]: what each expert serves locally now
    # swap e (on r[e]) with f (on r[f]): e serves G[e, r[f]], f serves G[f, r[e]]
    proxy = G[:, r] - own[:, None]  # [E, E]: e moved to f's rank
    proxy = proxy + proxy.T
    proxy[r[:, None] == r[None, :]] = -np.inf
    after = busiest_after_swaps(loads, r, act)
    proxy -= layer.weight * (np.maximum(after - layer.cap, 0.0) - max(loads.max() - layer.cap, 0.0))
    proxy[after > ceiling] = -np.inf
    iu = np.triu_indices(r.size, 1)
    order = np.argsort(-proxy[iu], kind="stable")[:top]
    best = None
    for k in order:
        e, f = int(iu[0][k]), int(iu[1][k])
        if not np.isfinite(proxy[e, f]):
            break
        new = np.array([r[f], r[e]])
        pair = [e, f]
        trial = r.copy()
        trial[pair] = new
        if groups > 1 and broken_group(trial, groups) >= 0:
            continue
        cost = int((new != current[pair]).sum() - (r[pair] != current[pair]).sum())
        g = layer.score(trial) - layer.value
        per = g / max(cost, 1)
        if g > 1e-12 and (best is None or per > best[0]):
            best = (per, pair, new, cost)
    return best


# Variables one HiGHS program of the re-solve (step 5) may hold: the fixture's layers solve jointly
# in well under a second; a model past it re-solves layer by layer within the greedy search's
# moves per layer, and a layer past it keeps the greedy result
MILP_MAX_VARIABLES = 1 << 16
MILP_ROUNDS = 4  # re-solves per starting assignment; the fixture's settle in 2-3


def _budgeted_assignment(G: list[np.ndarray], act: list[np.ndarray], cap: np.ndarray, ceiling: np.ndarray,
                         current: np.ndarray, sizes: np.ndarray, budget: int, weight: float) -> np.ndarray | None:
    """Experts to ranks for the given layers, at most ``budget`` slots moved from ``current``:
    max sum_l sum_e G[l][e, rank] - weight * sum_l excess_l, each rank holding ``sizes`` experts,
    excess_l >= a rank's activations - cap[l], no rank past ceiling[l] (a 0-1 program, HiGHS).

    G: L arrays [E, N] float, activations of expert e by the ids assigned to rank r (fixed);
    act: L arrays [E] float; cap, ceiling: [L] float; current: [L, E] int; sizes: [N] int.
    Returns expert2rank [L, E] int64, or None when HiGHS returns no solution."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    L, E = current.shape
    N = sizes.size
    nx = L * E * N
    n = nx + L  # x[l, e, r] at (l * E + e) * N + r, then excess_l
    c = np.r_[-np.concatenate([g.reshape(-1) for g in G]), np.full(L, weight)]
    xl = np.arange(nx) // (E * N)
    xe = np.arange(nx) // N  # l * E + e
    xr = np.arange(nx) % N
    one = sp.csr_matrix((np.ones(nx), (xe, np.arange(nx))), shape=(L * E, n))  # each expert once
    count = sp.csr_matrix((np.ones(nx), (xl * N + xr, np.arange(nx))), shape=(L * N, n))  # sizes per rank
    acts = np.concatenate(act)[xe]
    excess = nx + np.repeat(np.arange(L), N)  # [L * N]: excess_l's column for each (layer, rank) row
    load = sp.csr_matrix((np.r_[acts, -np.ones(L * N)],
                          (np.r_[xl * N + xr, np.arange(L * N)], np.r_[np.arange(nx), excess])),
                         shape=(L * N, n))  # a rank's activations - excess_l <= cap_l
    stay = sp.csr_matrix((np.ones(L * E), (np.zeros(L * E, dtype=np.int64),
                                           np.arange(L * E) * N + current.reshape(-1))), shape=(1, n))
    cons = [LinearConstraint(one, 1, 1), LinearConstraint(count, np.tile(sizes, L), np.tile(sizes, L)),
            LinearConstraint(load, -np.inf, np.repeat(cap, N)), LinearConstraint(stay, L * E - budget, np.inf)]
    # the ceiling as excess_l's upper bound: every rank's activations <= cap_l + excess_l <= ceiling_l
    ub = np.r_[np.ones(nx), np.maximum(ceiling - cap, 0.0)]
    res = milp(c, constraints=cons, integrality=np.r_[np.ones(nx), np.zeros(L)], bounds=Bounds(0, ub),
               options={"disp": False, "time_limit": 60.0})
    if res.x is None:
        return None
    return res.x[:nx].reshape(L, E, N).argmax(axis=2)


def _resolve(layers: list["_Layer"], current: np.ndarray, start: np.ndarray, seeds: list[np.ndarray],
             budget: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, int]:
    """Step 5: from each seed placement ([L', E]: its ids' capped assignment is the first one), alternate
    :func:`_budgeted_assignment` and the capped token assignment while the objective rises, the
    programs solved jointly over the layers (``budget`` [1]: moves in all) or layer by layer
    (``budget`` [L']: moves each). Returns (the best placement met, ``start`` (within budget) if
    none beats it, [L', E] int64; programs solved)."""
    L = len(layers)
    occ, N, capacity = layers[0].occ, layers[0].N, layers[0].capacity
    act = [x.act for x in layers]
    cap = np.array([x.cap for x in layers])
    ceiling = np.array([max(x.cap, x.loads(current[i]).max()) for i, x in enumerate(layers)]) + 1e-9
    value = lambda e2r: sum(x.score(e2r[i]) for i, x in enumerate(layers))  # noqa: E731
    best, best_value, solved = start, value(start), 0
    parts = [np.arange(L)] if budget.size == 1 else [np.array([i]) for i in range(L)]
    for seed in seeds:
        e2r, last = seed, -np.inf
        for _ in range(MILP_ROUNDS):
            G = [expert_gains(x.A, assign_token_ids(rank_scores(x.A, e2r[i], N), occ, capacity), N)
                 for i, x in enumerate(layers)]
            new = e2r.copy()
            for k, idx in enumerate(parts):
                got = _budgeted_assignment([G[i] for i in idx], [act[i] for i in idx], cap[idx], ceiling[idx],
                                           current[idx], sizes, int(budget[k]), layers[0].weight)
                solved += 1
                new[idx] = current[idx] if got is None else got
            v = value(new)
            if v > best_value + 1e-9:
                best, best_value = new, v
            if v <= last + 1e-9 or np.array_equal(new, e2r):
                break
            e2r, last = new, v
    return best, solved


def _polish_across(e2r: np.ndarray, current: np.ndarray, rows: tuple[np.ndarray, np.ndarray], loads: np.ndarray,
                   max_moves: int, ep_size: int, capacity: float, max_expert_load: float, balance_weight: float,
                   evals: int, step: int = 32) -> tuple[np.ndarray, int]:
    """:func:`.polish.polish_routed` on every layer with one move budget for the model: each layer
    proposes the swaps its next ``step`` exact scores find (within the moves left), and the
    proposal gaining most routed local activations per slot it moves is taken, so the budget goes
    where the routing pays most rather than to the first layers.

    e2r, current: [L, E] int (the start, and the served placement moves are counted against);
    rows: (topk_ids [T, L, K], batch_ids [T]); loads: [L, E] float activations per expert (the
    compute-load guard); evals: exact scores per layer on average. Returns (expert2rank [L, E]
    int64, layers changed)."""
    e2r = np.asarray(e2r, dtype=np.int64).copy()
    L = e2r.shape[0]
    topk, batch = rows

    def score(layer, e):
        return routed_score(topk[:, layer], batch, e, ep_size, capacity, loads[layer], max_expert_load, balance_weight)
    value = [score(layer, e2r[layer]) for layer in range(L)]
    prop: list = [None] * L  # per layer: (gain per slot, gain, cost, placement) or False (nothing found)
    spent, total, changed = 0, evals * L, set()
    while True:
        left = max_moves - int((e2r != current).sum())
        prop = [None if p and p[2] > left else p for p in prop]  # no longer fits the moves left: ask again
        for layer in range(L):
            if prop[layer] is None and spent < total:
                mine = int((e2r[layer] != current[layer]).sum())
                new = polish_routed(topk[:, layer], batch, e2r[layer], ep_size, capacity, load=loads[layer],
                                    max_expert_load=max_expert_load, max_evals=min(step, total - spent),
                                    home=current[layer], max_moved=mine + left,
                                    balance_weight=balance_weight).astype(np.int64)
                spent += step
                gain = score(layer, new) - value[layer]
                cost = int((new != current[layer]).sum()) - mine
                prop[layer] = (gain / max(cost, 0.5), gain, cost, new) if gain > 0 else False
        live = [layer for layer in range(L) if prop[layer] and prop[layer][2] <= left]
        if not live:
            break
        best = max(live, key=lambda layer: prop[layer][0])
        _, gain, _, e2r[best] = prop[best]
        value[best] += gain
        changed.add(best)
        prop[best] = None
    return e2r, len(changed)


def limit_moves(current: np.ndarray, fresh: np.ndarray, layer_counts, occ: np.ndarray, max_moves: int,
                ep_size: int, capacity: float = 1.10, groups: int = 1, swaps: bool = False,
                max_expert_load: float = 1.10, balance_weight: float = BALANCE_WEIGHT,
                resolve: bool = False, rows: tuple[np.ndarray, np.ndarray] | None = None,
                polish_evals: int = 0, per_layer: bool = False, block: int | None = None
                ) -> tuple[np.ndarray, dict]:
    """The served placement with the fresh one's best exchange cycles applied, at most
    ``max_moves`` expert slots changed in all, found in these steps:

    1. the fresh placement's ranks are renamed to agree with the served one most (an assignment
       problem on the rank overlap), per layer or once for all layers (which keeps the fresh
       placement's layers agreeing, for models that order tokens once per step), inside nodes and
       routing-group blocks;
    2. per layer, the experts whose rank differs are split into exchange cycles: expert e_1 moves
       from rank r_1 to r_2, e_2 from r_2 to r_3, ..., e_k from r_k back to r_1; each cycle keeps every
       rank's expert count, so any subset of cycles is a balanced placement;
    3. cycles are applied greedily by gain per moved slot (lazily re-scored against the layer as it
       is then), where the gain is the change in :mod:`.coclust`'s objective on the training trace
       (activations served locally when token ids take their best ranks in order of confidence,
       each rank capped at ``capacity`` x its share), until the budget is spent or no cycle gains;
    4. with ``swaps``, an exchange of two experts on different ranks that the fresh placement does
       not make competes with the cycles on the same gain per moved slot (candidates ranked with the
       token ids' ranks held fixed, the best few scored exactly): a budget too small for the fresh
       placement's cycles may still buy its best pairs, and a swap that moves an expert back home
       costs nothing.
    5. with ``resolve``, the greedy result is bettered where a 0-1 program finds more: from the
       greedy placement, and from the fresh one, each id's capped assignment is held fixed and the
       experts placed to serve most of it within the budget and the balance terms (one HiGHS program
       over all layers), then the ids re-assigned, while the objective rises; kept only where it
       beats the greedy result. A unit above pays alone; the program finds moves that pay together.

    Compute balance, as :mod:`.coclust` keeps it: no unit raises a layer's expert load (its busiest
    rank's training activations over the mean) past the cap or past what it is, and every gain is
    net of ``balance_weight`` x the activations the busiest rank holds past the cap, so a layer the
    workload shift left unbalanced gets its load down (swaps of a heavy expert for a light one, or
    the fresh placement's cycles) where that pays more per slot than locality elsewhere.

    current, fresh: [L, E] int expert2rank, balanced (E / ep_size experts per rank, or vLLM's
    uneven split, :func:`.counts.rank_sizes`, in every layer);
    layer_counts: L token x expert count matrices ([V', E] float, scipy sparse or dense; rows
    the training trace's seen token ids); occ: [V'] float occurrences of each; max_moves: int >=
    0; capacity: the token-load cap of the objective; groups: grouped routing (a cycle that would
    split a group is skipped); swaps: also exchanges of two experts outside the fresh placement
    (step 4 above); max_expert_load: no cycle or swap raises a layer's expert load (its busiest
    rank's training activations over the mean) past it or past what it is; balance_weight: local
    activations one activation of the busiest rank's excess over that cap is worth (0: the cap
    only guards); resolve: step 5 above, after the greedy one (needs no
    routing groups); rows: (topk_ids [T, L, K], batch_ids [T]) of the training rows: the result
    then gets :func:`.polish.polish_routed` (``polish_evals`` exact scores per layer on average,
    net of the balance term) with the moves left, spent across layers where they gain most per
    slot (no routing groups or uneven split); per_layer, block: how fresh's ranks are renamed
    (:func:`rank_names`). When the budget covers every move and the fresh placement scores more,
    within the same guard, it is the fresh placement (renamed).
    Returns (expert2rank [L, E] int32, info) with info: ``moved`` slots, ``cycles`` (units)
    applied, ``swaps`` applied (by the greedy search), ``resolved`` (whether step 5 bettered it),
    ``programs`` (0-1 programs step 5 solved), ``fresh_moves`` (slots the renamed fresh placement
    moves), ``score`` of current, result and fresh (the capped objective summed
    over layers, without the balance term), ``expert_load`` of each (the most over layers),
    ``polished``: layers the polish changed."""
    current = np.asarray(current, dtype=np.int64)
    fresh = np.asarray(fresh, dtype=np.int64)
    if current.shape != fresh.shape or current.ndim != 2:
        raise ValueError(f"current {current.shape} and fresh {fresh.shape} must both be [L, E]")
    if max_moves < 0:
        raise ValueError(f"max_moves must be >= 0, got {max_moves}")
    if not balance_weight >= 0:
        raise ValueError(f"balance_weight must be >= 0, got {balance_weight}")
    L, E = current.shape
    sizes = rank_sizes(E, ep_size)
    for name, e2r in (("current", current), ("fresh", fresh)):
        if e2r.max() >= ep_size or any((np.bincount(row, minlength=ep_size) != sizes).any() for row in e2r):
            raise ValueError(f"{name}: every rank must hold its {sizes.tolist()} experts in every layer "
                             f"(vLLM's split of {E} over {ep_size})")
    target = rename_ranks(current, fresh, ep_size, per_layer, block)
    occ = np.asarray(occ, dtype=np.float64)
    layers = [_Layer(layer_counts[layer], occ, current[layer], ep_size, capacity, max_expert_load,
                     balance_weight) for layer in range(L)]
    score = {"current": sum(x.local(x.e2r) for x in layers)}
    load = {"current": max(x.load_ratio(x.e2r) for x in layers)}
    # units: each exchange cycle, and per layer the rest of its moves together (a layer's fresh
    # assignment can pay as a whole where no single cycle does)
    heap, tie = [], 0
    for layer in range(L):
        cycles = _cycles(current[layer], target[layer])
        for unit in cycles + ([None] if len(cycles) > 1 else []):
            experts = _experts(layers[layer], target[layer], unit)
            heapq.heappush(heap, (-layers[layer].gain(experts, target[layer]) / len(experts), tie, layer, unit))
            tie += 1
    budget, applied, swapped = max_moves, 0, 0
    swap = [None] * L  # per layer: its best exchange of two experts (swaps), re-found when it changes
    while budget > 0:
        cycle = None  # the best fresh unit that fits, scored against its layer as it is now
        while heap:
            neg, _, layer, unit = heapq.heappop(heap)
            if -neg <= 0:
                heap.clear()
                break
            experts = _experts(layers[layer], target[layer], unit)
            if not experts or len(experts) > budget:
                continue  # done already, or a shorter unit may still fit
            if unit is not None and (layers[layer].e2r[unit] != current[layer][unit]).any():
                continue  # a swap moved one of its experts: the cycle no longer keeps ranks balanced
            cost = int((target[layer][experts] != current[layer][experts]).sum()
                       - (layers[layer].e2r[experts] != current[layer][experts]).sum())
            g = layers[layer].gain(experts, target[layer]) / max(cost, 1)
            if heap and g < -heap[0][0] - 1e-12:
                heapq.heappush(heap, (-g, tie, layer, unit))
                tie += 1
                continue
            if g <= 0:
                continue
            trial = layers[layer].e2r.copy()
            trial[experts] = target[layer][experts]
            if not layers[layer].allows(trial) or (groups > 1 and broken_group(trial, groups) >= 0):
                continue
            cycle = (g, layer, unit, experts, cost)
            break
        best_swap = None
        if swaps:
            for layer in range(L):
                if swap[layer] is None:
                    swap[layer] = _best_swap(layers[layer], current[layer], groups) or False
                if swap[layer] and swap[layer][3] <= budget and (best_swap is None or swap[layer][0] > best_swap[0]):
                    best_swap = (*swap[layer], layer)
        if cycle is None and best_swap is None:
            break
        if best_swap is not None and (cycle is None or best_swap[0] > cycle[0]):
            if cycle is not None:  # not taken: back in line
                heapq.heappush(heap, (-cycle[0], tie, cycle[1], cycle[2]))
                tie += 1
            _, pair, new, cost, layer = best_swap
            layers[layer].e2r[pair] = new
            layers[layer].value = layers[layer].score(layers[layer].e2r)
            swapped += 1
        else:
            _, layer, unit, experts, cost = cycle
            layers[layer].apply(experts, target[layer])
            applied += 1
        swap[layer] = None
        budget = max_moves - sum(int((x.e2r != current[i]).sum()) for i, x in enumerate(layers))
    resolved, programs = False, 0
    if resolve and groups <= 1 and max_moves > 0:
        greedy = np.stack([x.e2r for x in layers])
        joint = L * E * ep_size <= MILP_MAX_VARIABLES
        if joint or E * ep_size <= MILP_MAX_VARIABLES:
            budget_of = np.array([max_moves]) if joint else (greedy != current).sum(axis=1)
            best, programs = _resolve(layers, current, greedy, [greedy, target], budget_of, sizes)
            resolved = not np.array_equal(best, greedy)
            for layer, x in enumerate(layers):
                x.e2r = best[layer].copy()
                x.value = x.score(x.e2r)
    value = sum(x.value for x in layers)
    # every move fits: the fresh placement, whole, where it scores more and its layers keep the guard
    whole = max_moves >= int((target != current).sum()) and all(
        x.loads(target[i]).max() <= max(x.cap, x.loads(current[i]).max()) + 1e-9 for i, x in enumerate(layers))
    if whole and sum(x.score(target[i]) for i, x in enumerate(layers)) > value:
        resolved = False
        for layer, x in enumerate(layers):
            x.e2r = target[layer].copy()
    polished = 0
    if rows is not None and polish_evals > 0 and groups <= 1 and (sizes == sizes[0]).all():
        loads = np.stack([np.asarray(layer_counts[layer].sum(axis=0)).ravel() for layer in range(L)])
        greedy = np.stack([x.e2r for x in layers])
        out, polished = _polish_across(greedy, current, rows, loads, max_moves, ep_size, capacity,
                                       max_expert_load, balance_weight, polish_evals)
        for layer, x in enumerate(layers):
            x.e2r = out[layer]
    score["result"] = sum(x.local(x.e2r) for x in layers)
    score["fresh"] = sum(x.local(target[layer]) for layer, x in enumerate(layers))
    load["result"] = max(x.load_ratio(x.e2r) for x in layers)
    load["fresh"] = max(x.load_ratio(target[layer]) for layer, x in enumerate(layers))
    out = np.stack([x.e2r for x in layers]).astype(np.int32)
    info = {"moved": int((out != current).sum()), "cycles": applied, "swaps": swapped, "resolved": resolved,
            "programs": programs, "fresh_moves": int((target != current).sum()), "score": score, "expert_load": load,
            "polished": polished}
    return out, info
