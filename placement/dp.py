"""Attention-DP scheduling (Sem-MoE): whole requests go to data-parallel ranks.

A request's affinity to rank r is how many of its prefill tokens the token tables send to r
(weighted by confidence). Requests are scheduled in arrival windows; inside a window the most
confident go first to their best rank, and a rank whose token share passes ``capacity`` x fair
share is masked for the rest of the window (the balance mask).
"""

from __future__ import annotations

import numpy as np

from .counts import assign_token_ids


def request_affinity(token2rank: np.ndarray, token_conf: np.ndarray, token_ids: np.ndarray,
                     request_ids: np.ndarray, is_prefill: np.ndarray | None, ep_size: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Score every request against every rank from its prompt tokens.

    token2rank: [L, V, 2] int16 (-1 = unseen) and token_conf: [L, V] float tables;
    token_ids, request_ids: [T] int; is_prefill: [T] bool or None (all tokens count).
    Returns (request ids [Q] in first-appearance order, scores [Q, N] float64, tokens [Q] int64).
    """
    L = token2rank.shape[0]
    uniq, first = np.unique(request_ids, return_index=True)
    order = np.argsort(first, kind="stable")
    reqs = uniq[order]
    q_of = np.empty(uniq.size, dtype=np.int64)
    q_of[order] = np.arange(uniq.size)
    q = q_of[np.searchsorted(uniq, request_ids)]
    use = np.ones(token_ids.size, dtype=bool) if is_prefill is None else is_prefill.astype(bool)
    scores = np.zeros(uniq.size * ep_size)
    for layer in range(L):
        r = token2rank[layer, token_ids[use], 0].astype(np.int64)
        ok = r >= 0
        w = token_conf[layer, token_ids[use]].astype(np.float64)
        scores += np.bincount(q[use][ok] * ep_size + r[ok], weights=w[ok], minlength=scores.size)
    tokens = np.bincount(q, minlength=uniq.size).astype(np.int64)
    return reqs, scores.reshape(uniq.size, ep_size), tokens


def assign_requests(scores: np.ndarray, tokens: np.ndarray, ep_size: int, capacity: float = 1.10,
                    window: int = 64) -> np.ndarray:
    """request2rank: [Q] int64 for requests in arrival order. scores: [Q, N]; tokens: [Q] int;
    each window of ``window`` requests is balanced to ``capacity`` x the fair token share."""
    Q = scores.shape[0]
    out = np.empty(Q, dtype=np.int64)
    for s in range(0, Q, window):
        sl = slice(s, min(Q, s + window))
        out[sl] = assign_token_ids(scores[sl], tokens[sl].astype(np.float64), capacity)
    return out


def round_robin_requests(num_requests: int, ep_size: int) -> np.ndarray:
    """Plain attention-DP: request q on rank q mod N. [Q] int64."""
    return np.arange(num_requests, dtype=np.int64) % ep_size
