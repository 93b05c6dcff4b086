"""Peer placements users run today: vLLM's static strategies and METIS graph partitioning.

Each returns expert2rank: [E] int32 for one layer with E/N experts per rank (linear and
round_robin also vLLM's uneven split where N does not divide E).
(vLLM's EPLB policy needs torch and is called from :mod:`vllm_smoe.tools.peers`.)
"""

from __future__ import annotations

import numpy as np

from .counts import check_ep_size, rank_sizes


def place_linear(num_experts: int, ep_size: int) -> np.ndarray:
    """vLLM's default ``linear``: contiguous blocks of experts per rank (the first E mod N ranks
    one expert more, :func:`.counts.rank_sizes`)."""
    return np.repeat(np.arange(ep_size), rank_sizes(num_experts, ep_size)).astype(np.int32)


def place_round_robin(num_experts: int, ep_size: int) -> np.ndarray:
    """vLLM's ``round_robin``: expert e on rank e mod N."""
    rank_sizes(num_experts, ep_size)  # the same bounds
    return (np.arange(num_experts) % ep_size).astype(np.int32)


def _rebalance_parts(parts: np.ndarray, C: np.ndarray, ep_size: int) -> np.ndarray:
    """Move experts from overfull parts to underfull ones (least attached first)."""
    E = parts.size
    per = E // ep_size
    parts = parts.copy()
    while True:
        sizes = np.bincount(parts, minlength=ep_size)
        over = np.flatnonzero(sizes > per)
        if over.size == 0:
            return parts
        src = over[0]
        members = np.flatnonzero(parts == src)
        under = np.flatnonzero(sizes < per)
        # affinity of each member to its own part and to each underfull part
        own = C[members][:, members].sum(axis=1)
        to = np.stack([C[members][:, parts == u].sum(axis=1) for u in under], axis=1)
        gain = to - own[:, None]
        i, j = np.unravel_index(np.argmax(gain), gain.shape)
        parts[members[i]] = under[j]


def place_metis(coact: np.ndarray, ep_size: int, seed: int = 0) -> np.ndarray:
    """METIS (pymetis) k-way partition of the expert co-activation graph, then exact balance.

    coact: [E, E] float, symmetric expert affinity (see counts.coactivation)."""
    import pymetis

    E = coact.shape[0]
    check_ep_size(E, ep_size)
    if ep_size == 1:
        return np.zeros(E, dtype=np.int32)
    W = coact + coact.T
    scale = 1000.0 / max(W.max(), 1e-12)
    xadj, adjncy, ew = [0], [], []
    for e in range(E):
        nb = np.flatnonzero((W[e] > 0) & (np.arange(E) != e))
        adjncy.extend(nb.tolist())
        ew.extend(np.maximum(1, np.rint(W[e, nb] * scale)).astype(int).tolist())
        xadj.append(len(adjncy))
    opts = pymetis.Options(seed=seed)
    graph = pymetis.CSRAdjacency(adj_starts=xadj, adjacent=adjncy)
    _, parts = pymetis.part_graph(ep_size, graph, eweights=ew, options=opts)
    return _rebalance_parts(np.asarray(parts, dtype=np.int64), W, ep_size).astype(np.int32)
