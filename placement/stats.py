"""Routing statistics of a trace: how predictable expert choice is (arrays in, arrays out).

Shapes: T tokens, L MoE layers, K top-k, E experts, D domains.
"""

from __future__ import annotations

import numpy as np


def _topk_share_per_group(keys_group: np.ndarray, keys_item: np.ndarray, k: int,
                          min_count: int) -> tuple[float, int]:
    """Share of activations falling on each group's k most frequent items, over groups with at
    least ``min_count`` activations. Returns (weighted share, number of groups counted)."""
    pair = keys_group.astype(np.int64) * (int(keys_item.max()) + 1) + keys_item
    uniq, counts = np.unique(pair, return_counts=True)
    grp = uniq // (int(keys_item.max()) + 1)
    # sort by group, then count descending; rank inside each group
    order = np.lexsort((-counts, grp))
    grp, counts = grp[order], counts[order]
    starts = np.r_[0, np.flatnonzero(np.diff(grp)) + 1]
    rank = np.arange(len(grp)) - np.repeat(starts, np.diff(np.r_[starts, len(grp)]))
    total = np.add.reduceat(counts, starts)
    top = np.add.reduceat(np.where(rank < k, counts, 0), starts)
    keep = total >= min_count
    if not keep.any():
        return float("nan"), 0
    return float(top[keep].sum() / total[keep].sum()), int(keep.sum())


def token_hotness(token_ids: np.ndarray, topk_ids: np.ndarray, min_count: int = 20) -> np.ndarray:
    """Per layer, the share of a frequent token's activations taken by its own top-K experts.

    token_ids: [T] int; topk_ids: [T, L, K] int. A token is frequent when it occurs at least
    ``min_count`` times. Returns [L] float64 (NaN where no token is frequent); the papers call
    this conjugacy and report 0.83-0.98 on production models.
    """
    T, L, K = topk_ids.shape
    out = np.empty(L)
    tok = np.repeat(token_ids.astype(np.int64), K)
    for layer in range(L):
        out[layer], _ = _topk_share_per_group(tok, topk_ids[:, layer, :].reshape(-1).astype(np.int64), K,
                                              min_count * K)
    return out


def expert_usage(topk_ids: np.ndarray, num_experts: int, domain: np.ndarray | None = None,
                 num_domains: int = 1) -> np.ndarray:
    """Share of activations per expert: [D, L, E] float64 (rows sum to 1; D = 1 without domains)."""
    T, L, K = topk_ids.shape
    dom = np.zeros(T, dtype=np.int64) if domain is None else domain.astype(np.int64)
    out = np.zeros((num_domains, L, num_experts))
    for layer in range(L):
        key = dom[:, None] * num_experts + topk_ids[:, layer, :].astype(np.int64)
        out[:, layer, :] = np.bincount(key.reshape(-1), minlength=num_domains * num_experts).reshape(
            num_domains, num_experts)
    s = out.sum(axis=2, keepdims=True)
    return np.divide(out, s, out=np.zeros_like(out), where=s > 0)


def domain_specificity(usage: np.ndarray) -> np.ndarray:
    """Per layer, mean total-variation distance between each domain's expert usage and the
    all-domain average. usage: [D, L, E] from :func:`expert_usage`. Returns [L] float64 in
    [0, 1]; 0 means every domain uses experts alike."""
    mean = usage.mean(axis=0, keepdims=True)
    return 0.5 * np.abs(usage - mean).sum(axis=2).mean(axis=0)


def interlayer_precision(topk_ids: np.ndarray, num_experts: int,
                         block: int = 1 << 15) -> tuple[np.ndarray, np.ndarray]:
    """How well layer l-1's experts predict layer l's (first-order Markov, in-sample).

    For each layer l >= 1, count co-activations C[e_prev, e_next] over the trace, score every
    expert for a token as the sum of C rows of its K previous experts, predict the K best and
    measure precision |predicted & actual| / K. Returns ([L-1] Markov precision, [L-1] precision
    of always predicting the layer's K most popular experts) as float64.
    """
    T, L, K = topk_ids.shape
    E = num_experts
    markov, popular = np.empty(L - 1), np.empty(L - 1)
    for layer in range(1, L):
        prev = topk_ids[:, layer - 1, :].astype(np.int64)
        cur = topk_ids[:, layer, :].astype(np.int64)
        pairs = (prev[:, :, None] * E + cur[:, None, :]).reshape(-1)
        C = np.bincount(pairs, minlength=E * E).reshape(E, E).astype(np.float64)
        pop = np.argsort(-np.bincount(cur.reshape(-1), minlength=E))[:K]
        hit_markov = hit_pop = 0
        for s in range(0, T, block):  # blocks keep the [rows, E] score matrix small
            actual = np.zeros((min(block, T - s), E), dtype=bool)
            np.put_along_axis(actual, cur[s: s + block], True, axis=1)
            score = C[prev[s: s + block]].sum(axis=1)
            pred = np.argpartition(-score, K - 1, axis=1)[:, :K]
            hit_markov += int(np.take_along_axis(actual, pred, axis=1).sum())
            hit_pop += int(actual[:, pop].sum())
        markov[layer - 1] = hit_markov / (T * K)
        popular[layer - 1] = hit_pop / (T * K)
    return markov, popular
