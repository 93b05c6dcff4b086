"""Attention-DP request routing (Sem-MoE): whole requests go to data-parallel ranks.

A request's affinity to rank r is how many of its prompt tokens the token tables send to r
(weighted by confidence), summed over MoE layers. Requests are routed one at a time, in
arrival order, exactly as a server must: each goes to its best-scoring rank among those the
balance mask leaves open, where a rank is masked while its routed work in the sliding window of
the last ``window`` requests would pass ``capacity`` x the fair share (the least loaded rank is
never masked). A request with no preference (no rank scores strictly higher than the others
left open) is left to the caller's own choice (vLLM's load balancer when serving). The engine's
router (:mod:`vllm_smoe.serving.dp_router`) and ``smoe-place evaluate --mode dp`` call these same
functions, so the offline simulation is the online rule.
"""

from __future__ import annotations

import numpy as np

WINDOW = 64  # requests in the sliding balance window
CAPACITY = 1.10  # default cap on a rank's share of the window's work, x fair share


def request_affinity(token2rank: np.ndarray, token_conf: np.ndarray, token_ids: np.ndarray,
                     request_ids: np.ndarray, is_prefill: np.ndarray | None, ep_size: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Score every request against every rank from its prompt tokens.

    token2rank: [L, V, 2] int16 (-1 = unseen) and token_conf: [L, V] float tables;
    token_ids, request_ids: [T] int; is_prefill: [T] bool or None (all tokens count).
    Token ids outside the tables (>= V) score nothing.
    Returns (request ids [Q] in first-appearance order, scores [Q, N] float64, tokens [Q] int64).
    """
    L, V = token_conf.shape
    uniq, first = np.unique(request_ids, return_index=True)
    order = np.argsort(first, kind="stable")
    reqs = uniq[order]
    q_of = np.empty(uniq.size, dtype=np.int64)
    q_of[order] = np.arange(uniq.size)
    q = q_of[np.searchsorted(uniq, request_ids)]
    use = np.ones(token_ids.size, dtype=bool) if is_prefill is None else is_prefill.astype(bool)
    use &= (token_ids >= 0) & (token_ids < V)
    scores = np.zeros(uniq.size * ep_size)
    for layer in range(L):
        r = token2rank[layer, token_ids[use], 0].astype(np.int64)
        ok = r >= 0
        w = token_conf[layer, token_ids[use]].astype(np.float64)
        scores += np.bincount(q[use][ok] * ep_size + r[ok], weights=w[ok], minlength=scores.size)
    tokens = np.bincount(q, minlength=uniq.size).astype(np.int64)
    return reqs, scores.reshape(uniq.size, ep_size), tokens


def balance_mask(load: np.ndarray, weight: float, capacity: float) -> np.ndarray:
    """[N] bool, True = rank may take a request of ``weight``. load: [N] float work already on
    each rank (window tokens offline; vLLM's waiting requests when serving). A rank is open while
    its load plus the request stays within ``capacity`` x the fair share of the total, or
    within the least loaded rank's load plus the request (so some rank is always open)."""
    total = load.sum() + weight
    limit = max(capacity * total / load.size, load.min() + weight)
    return load + weight <= limit * (1 + 1e-9)


def pick_rank(scores: np.ndarray, allowed: np.ndarray) -> int:
    """The open rank with the strictly highest score, or -1 = no preference (every open rank
    scores the same, e.g. a prompt the tables have never seen). scores: [N]; allowed: [N] bool."""
    s = np.where(allowed, scores, -np.inf)
    best = int(np.argmax(s))
    top = s[best]
    if not np.isfinite(top) or np.count_nonzero(s >= top - 1e-9 * max(abs(top), 1.0)) > 1:
        return -1
    return best


def assign_requests(scores: np.ndarray, tokens: np.ndarray, ep_size: int, capacity: float = CAPACITY,
                    window: int = WINDOW) -> np.ndarray:
    """request2rank: [Q] int64 for requests in arrival order, routed one at a time as the server
    does. scores: [Q, N] float; tokens: [Q] int work of each request. A request without a
    preference goes where the least work of the window is (the load balancer's stand-in)."""
    Q = scores.shape[0]
    out = np.empty(Q, dtype=np.int64)
    load = np.zeros(ep_size)
    for q in range(Q):
        if q >= window:  # the request leaving the sliding window
            load[out[q - window]] -= tokens[q - window]
        r = pick_rank(scores[q], balance_mask(load, float(tokens[q]), capacity))
        out[q] = int(np.argmin(load)) if r < 0 else r
        load[out[q]] += tokens[q]
    return out


def round_robin_requests(num_requests: int, ep_size: int) -> np.ndarray:
    """Plain attention-DP: request q on rank q mod N. [Q] int64."""
    return np.arange(num_requests, dtype=np.int64) % ep_size
