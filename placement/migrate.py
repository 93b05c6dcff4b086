"""A placement between the served one and a fresh one that moves few experts (live swaps).

A live swap moves every expert slot whose expert changes, and a fresh placement from a new
recording usually changes almost all of them (the ranks' names are arbitrary, and so are most
tie-breaks). :func:`limit_moves` keeps the served placement and applies only the parts of the
fresh one that pay most per moved slot, within a budget:

1. the fresh placement's ranks are renamed, once for all layers, to agree with the served one
   most (an assignment problem on the rank overlap; one renaming keeps layers consistent for
   models that order tokens once per step);
2. per layer, the experts whose rank differs are split into exchange cycles: expert e_1 moves
   from rank r_1 to r_2, e_2 from r_2 to r_3, ..., e_k from r_k back to r_1; each cycle keeps every
   rank's expert count, so any subset of cycles is a balanced placement;
3. cycles are applied greedily by gain per moved slot (lazily re-scored against the layer as it
   is then), where the gain is the change in :mod:`.coclust`'s objective on the training trace
   (activations served locally when token ids take their best ranks in order of confidence,
   each rank capped at ``capacity`` x its share), until the budget is spent or no cycle gains.

No torch, no I/O. Arrays: expert2rank [L, E] int (rank of each expert, E / N per rank).
"""

from __future__ import annotations

import heapq

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment

from .counts import assign_token_ids, local_count, rank_scores
from .groups import broken_group


def rename_ranks(current: np.ndarray, fresh: np.ndarray, N: int) -> np.ndarray:
    """fresh ([L, E] int expert2rank) with its N ranks renamed to agree with current ([L, E])
    on the most experts, one renaming for all layers (Hungarian on the rank overlap)."""
    overlap = np.zeros((N, N), dtype=np.int64)
    np.add.at(overlap, (current.reshape(-1), fresh.reshape(-1)), 1)
    rows, cols = linear_sum_assignment(overlap, maximize=True)
    name = np.empty(N, dtype=np.int64)
    name[cols] = rows
    return name[fresh]


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


class _Layer:
    """One layer's capped objective under its current assignment (what :mod:`.coclust` solves:
    activations served locally when token ids go to ranks by confidence, each rank capped at
    ``capacity`` x its share of the occurrences)."""

    def __init__(self, A: sp.csr_matrix, occ: np.ndarray, expert2rank: np.ndarray, N: int, capacity: float):
        self.A, self.occ, self.N, self.capacity = sp.csr_matrix(A, dtype=np.float64), occ, N, capacity
        self.e2r = expert2rank.astype(np.int64).copy()
        self.value = self.score(self.e2r)

    def score(self, e2r: np.ndarray) -> float:
        R = rank_scores(self.A, e2r, self.N)
        return local_count(R, assign_token_ids(R, self.occ, self.capacity))

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


def limit_moves(current: np.ndarray, fresh: np.ndarray, layer_counts, occ: np.ndarray, max_moves: int,
                ep_size: int, capacity: float = 1.10, groups: int = 1) -> tuple[np.ndarray, dict]:
    """The served placement with the fresh one's best exchange cycles applied, at most
    ``max_moves`` expert slots changed in all.

    current, fresh: [L, E] int expert2rank, balanced (E / ep_size experts per rank);
    layer_counts: L token x expert count matrices ([V', E] float, scipy sparse or dense; rows
    the training trace's seen token ids); occ: [V'] float occurrences of each; max_moves: int >=
    0; capacity: the token-load cap of the objective; groups: grouped routing (a cycle that would
    split a group is skipped). When the budget covers every move and the fresh placement scores
    more, it is the fresh placement (renamed). Returns (expert2rank [L, E] int32, info) with info:
    ``moved`` slots, ``cycles`` (units) applied, ``fresh_moves`` (slots the renamed fresh placement
    moves), ``score`` of current, result and fresh (the capped objective summed over layers)."""
    current = np.asarray(current, dtype=np.int64)
    fresh = np.asarray(fresh, dtype=np.int64)
    if current.shape != fresh.shape or current.ndim != 2:
        raise ValueError(f"current {current.shape} and fresh {fresh.shape} must both be [L, E]")
    if max_moves < 0:
        raise ValueError(f"max_moves must be >= 0, got {max_moves}")
    L, E = current.shape
    for name, e2r in (("current", current), ("fresh", fresh)):
        if (np.bincount(e2r.reshape(-1), minlength=ep_size) != L * E // ep_size).any() or e2r.max() >= ep_size:
            raise ValueError(f"{name}: every rank must hold E / ep_size = {E // ep_size} experts per layer")
    target = rename_ranks(current, fresh, ep_size)
    occ = np.asarray(occ, dtype=np.float64)
    layers = [_Layer(layer_counts[layer], occ, current[layer], ep_size, capacity) for layer in range(L)]
    score = {"current": sum(x.value for x in layers)}
    # units: each exchange cycle, and per layer the rest of its moves together (a layer's fresh
    # assignment can pay as a whole where no single cycle does)
    heap, tie = [], 0
    for layer in range(L):
        cycles = _cycles(current[layer], target[layer])
        for unit in cycles + ([None] if len(cycles) > 1 else []):
            experts = _experts(layers[layer], target[layer], unit)
            heapq.heappush(heap, (-layers[layer].gain(experts, target[layer]) / len(experts), tie, layer, unit))
            tie += 1
    budget, applied = max_moves, 0
    while heap and budget > 0:
        neg, _, layer, unit = heapq.heappop(heap)
        if -neg <= 0:
            break
        experts = _experts(layers[layer], target[layer], unit)
        if not experts or len(experts) > budget:
            continue  # done already, or a shorter unit may still fit
        g = layers[layer].gain(experts, target[layer]) / len(experts)  # against the layer as it is now
        if heap and g < -heap[0][0] - 1e-12:
            heapq.heappush(heap, (-g, tie, layer, unit))
            tie += 1
            continue
        if g <= 0:
            continue
        if groups > 1:
            trial = layers[layer].e2r.copy()
            trial[experts] = target[layer][experts]
            if broken_group(trial, groups) >= 0:
                continue
        layers[layer].apply(experts, target[layer])
        budget -= len(experts)
        applied += 1
    score["result"] = sum(x.value for x in layers)
    score["fresh"] = sum(x.score(target[layer]) for layer, x in enumerate(layers))
    if max_moves >= int((target != current).sum()) and score["fresh"] > score["result"]:
        for layer, x in enumerate(layers):  # every move fits: the fresh placement, whole
            x.e2r = target[layer].copy()
        score["result"] = score["fresh"]
    out = np.stack([x.e2r for x in layers]).astype(np.int32)
    info = {"moved": int((out != current).sum()), "cycles": applied,
            "fresh_moves": int((target != current).sum()), "score": score}
    return out, info
