"""The per-layer co-clustering problem every solver works on, and its objective.

A layer's routing is summarised by A: [V', E] sparse float64, A[v, e] = activations of expert
e by token id v (rows: the V' token ids seen), and occ: [V'] float64, occurrences of each id.
A placement is expert2rank: [E] int (E / N experts per rank, or vLLM's uneven split:
:func:`rank_sizes`). Tokens then go to the rank that
holds most of their activations, capped so that no rank takes more than ``capacity`` times its
share of tokens: :func:`assign_token_ids`. The objective is the local activation count.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def count_matrix(rows: np.ndarray, cols: np.ndarray, n_rows: int, n_cols: int) -> sp.csr_matrix:
    """csr [n_rows, n_cols] float64 counting the (rows[i], cols[i]) pairs (rows, cols: [M] int)."""
    key = rows.astype(np.int64) * n_cols + cols.astype(np.int64)
    if n_rows * n_cols <= max(8 * key.size, 1 << 25):  # a dense bincount beats sorting the keys
        dense = np.bincount(key, minlength=n_rows * n_cols)
        nz = np.flatnonzero(dense)
        data = dense[nz].astype(np.float64)
    else:
        nz, counts = np.unique(key, return_counts=True)
        data = counts.astype(np.float64)
    r, c = nz // n_cols, nz % n_cols
    indptr = np.r_[0, np.cumsum(np.bincount(r, minlength=n_rows))]
    return sp.csr_matrix((data, c.astype(np.int32), indptr), shape=(n_rows, n_cols))


def layer_counts(token_ids: np.ndarray, topk_layer: np.ndarray, num_experts: int
                 ) -> tuple[np.ndarray, sp.csr_matrix, np.ndarray]:
    """token_ids: [T] int; topk_layer: [T, K] int. Returns (ids [V'] int64 seen token ids,
    A [V', E] csr float64, occ [V'] float64)."""
    ids, row = np.unique(token_ids, return_inverse=True)
    K = topk_layer.shape[1]
    A = count_matrix(np.repeat(row, K), topk_layer.reshape(-1), ids.size, num_experts)
    return ids.astype(np.int64), A, np.bincount(row, minlength=ids.size).astype(np.float64)


def top_ranks(scores: np.ndarray, k: int) -> np.ndarray:
    """Column indices of each row's ``k`` largest scores, best first: [M, k] int64.
    (argpartition, then a sort of k columns: much cheaper than a full argsort for N >> k.)"""
    M, N = scores.shape
    k = min(k, N)
    if k < N:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(N), (M, N)).copy()
    vals = np.take_along_axis(scores, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def coactivation(A: sp.csr_matrix) -> np.ndarray:
    """Expert-expert affinity through shared tokens: [E, E] float64, zero diagonal.

    (A^T A counts co-occurrence at token-id level, a superset of same-token co-activation
    that also links experts serving the same ids.)"""
    C = np.asarray((A.T @ A).todense(), dtype=np.float64)
    np.fill_diagonal(C, 0.0)
    return C


def rank_scores(A: sp.csr_matrix, expert2rank: np.ndarray, ep_size: int) -> np.ndarray:
    """R: [V', N] float64, activations of each token id that rank r would serve locally."""
    E = A.shape[1]
    onehot = sp.csr_matrix((np.ones(E), (np.arange(E), np.asarray(expert2rank, dtype=np.int64))), shape=(E, ep_size))
    return np.asarray((A @ onehot).toarray(), dtype=np.float64)


def assign_token_ids(R: np.ndarray, occ: np.ndarray, capacity: float, choices: int = 3) -> np.ndarray:
    """Capacity-capped best-rank assignment of token ids. R: [V', N]; occ: [V'] weights.

    Ids go in order of confidence (best share of their activations) to their best rank while
    it has room (capacity x mean load, in occurrences), else to their next choices; the rest
    fill the remaining room rank after rank. Returns token2rank: [V'] int64.
    """
    V, N = R.shape
    cap = capacity * occ.sum() / N
    remaining = np.full(N, cap)
    out = np.full(V, -1, dtype=np.int64)
    best = R.argmax(axis=1)
    tot = R.sum(axis=1)
    conf = np.divide(R[np.arange(V), best], tot, out=np.zeros(V), where=tot > 0)
    order = np.argsort(-conf, kind="stable")
    for j in range(min(choices, N)):
        idx = order if j == 0 else order[out[order] < 0]
        if idx.size == 0:
            break
        # later choices are ranked only for the ids still waiting
        r = best[idx] if j == 0 else top_ranks(R[idx], j + 1)[:, j]
        srt = np.argsort(r, kind="stable")
        idx, r = idx[srt], r[srt]
        w = occ[idx]
        cum = np.cumsum(w)
        starts = np.r_[0, np.flatnonzero(np.diff(r)) + 1]
        base = np.repeat(cum[starts] - w[starts], np.diff(np.r_[starts, r.size]))
        take = (cum - base) <= remaining[r] + 1e-9
        out[idx[take]] = r[take]
        remaining -= np.bincount(r[take], weights=w[take], minlength=N)
    left = order[out[order] < 0]
    if left.size:
        # leftovers fill the free room rank after rank, in confidence order (vectorised first fit)
        room = np.cumsum(np.maximum(remaining, 0.0))
        w = occ[left]
        mid = (np.cumsum(w) - w / 2) * room[-1] / max(w.sum(), 1e-12)
        out[left] = np.minimum(np.searchsorted(room, mid), N - 1)
    return out


def local_count(R: np.ndarray, token2rank: np.ndarray) -> float:
    """Activations served locally when ids go to ``token2rank`` ([V'] int)."""
    return float(R[np.arange(R.shape[0]), token2rank].sum())


def expert_gains(A: sp.csr_matrix, token2rank: np.ndarray, ep_size: int) -> np.ndarray:
    """G: [E, N] float64, activations of expert e by ids assigned to rank r."""
    coo = A.tocoo()
    key = coo.col.astype(np.int64) * ep_size + token2rank[coo.row]
    return np.bincount(key, weights=coo.data, minlength=A.shape[1] * ep_size).reshape(A.shape[1], ep_size)


def balanced_assignment(score: np.ndarray) -> np.ndarray:
    """Experts to ranks, E/N each, maximising sum score[e, rank(e)]. score: [E, N].
    Returns expert2rank: [E] int32 (exact, Hungarian on E x E slots)."""
    from scipy.optimize import linear_sum_assignment

    E, N = score.shape
    per = E // N
    cost = -np.repeat(score, per, axis=1)  # [E, E]: slot s belongs to rank s // per
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(E, dtype=np.int32)
    out[rows] = cols // per
    return out


def check_ep_size(num_experts: int, ep_size: int) -> None:
    if ep_size <= 0 or num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} must be positive and divide num_experts {num_experts}")


def rank_sizes(num_experts: int, ep_size: int) -> np.ndarray:
    """[N] int64: experts vLLM puts on each rank (the first E mod N ranks one more)."""
    if ep_size < 1 or num_experts < ep_size:
        raise ValueError(f"ep_size {ep_size} must be in 1..num_experts ({num_experts})")
    base, rem = divmod(num_experts, ep_size)
    return base + (np.arange(ep_size) < rem).astype(np.int64)
