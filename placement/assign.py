"""Online token -> rank assignment under a per-batch capacity cap (what the engine runs).

Every token names its preferred ranks; ranks accept the most confident proposals first, up to
``ceil(batch_tokens / ep_size * capacity)`` tokens per batch; tokens refused by all their
preferences fill the remaining free slots of their batch. Vectorised over all batches at once.
"""

from __future__ import annotations

import numpy as np


def batch_capacity(batch_sizes: np.ndarray, ep_size: int, capacity: float) -> np.ndarray:
    """Tokens each rank may take per batch: [B] int64 = ceil(size / ep_size * capacity)."""
    if capacity < 1.0:
        raise ValueError(f"capacity must be >= 1.0 (a batch must fit), got {capacity}")
    cap = np.ceil(batch_sizes.astype(np.float64) / ep_size * capacity - 1e-9).astype(np.int64)
    return np.maximum(cap, -(-batch_sizes // ep_size))


def _group_rank(keys: np.ndarray) -> np.ndarray:
    """Position of each element inside its run of equal ``keys`` (keys sorted)."""
    if keys.size == 0:
        return keys.astype(np.int64)
    starts = np.r_[0, np.flatnonzero(np.diff(keys)) + 1]
    lengths = np.diff(np.r_[starts, keys.size])
    return np.arange(keys.size) - np.repeat(starts, lengths)


def chunk_caps(num_tokens: int, ep_size: int) -> np.ndarray:
    """Rows of each rank in vLLM's sequence-parallel chunk of a ``num_tokens`` step: [N] int64,
    ceil(T / N) each, the padding taken from the last ranks."""
    c = -(-num_tokens // ep_size)
    return np.clip(num_tokens - np.arange(ep_size) * c, 0, c).astype(np.int64)


def assign_tokens(pref: np.ndarray, conf: np.ndarray, batch_ids: np.ndarray, ep_size: int,
                  capacity: float = 1.10, rank_caps: np.ndarray | None = None) -> np.ndarray:
    """Capacity-capped assignment of tokens to ranks.

    pref: [T, P] int, preferred ranks in order, -1 = no preference.
    conf: [T] float, confidence; more confident tokens are served first.
    batch_ids: [T] int, non-decreasing batch (engine step) index per token.
    rank_caps: [B, N] int, exact tokens per (batch, rank) instead of ``capacity`` (summing to each
    batch's size, e.g. :func:`chunk_caps`), optional.
    Returns token2rank: [T] int32, every entry in [0, ep_size).
    """
    T = pref.shape[0]
    if T == 0:
        return np.zeros(0, dtype=np.int32)
    if np.any(np.diff(batch_ids) < 0):
        raise ValueError("batch_ids must be non-decreasing")
    _, batch = np.unique(batch_ids, return_inverse=True)
    sizes = np.bincount(batch)
    if rank_caps is None:
        remaining = np.repeat(batch_capacity(sizes, ep_size, capacity), ep_size)  # [B * N] free slots
    else:
        if rank_caps.shape != (sizes.size, ep_size) or (rank_caps.sum(axis=1) < sizes).any():
            raise ValueError(f"rank_caps must be [{sizes.size}, {ep_size}] and hold every token of each batch")
        remaining = rank_caps.astype(np.int64).reshape(-1).copy()
    token2rank = np.full(T, -1, dtype=np.int64)
    order = np.argsort(-conf, kind="stable")
    for j in range(pref.shape[1]):
        idx = order[token2rank[order] < 0]
        want = pref[idx, j]
        ok = want >= 0
        idx, want = idx[ok], want[ok]
        if idx.size == 0:
            continue
        key = batch[idx] * ep_size + want
        srt = np.argsort(key, kind="stable")  # stable: keeps confidence order inside a key
        idx, key = idx[srt], key[srt]
        take = _group_rank(key) < remaining[key]
        token2rank[idx[take]] = key[take] % ep_size
        remaining -= np.bincount(key[take], minlength=remaining.size)
    left = np.flatnonzero(token2rank < 0)
    if left.size:
        # free slots, grouped by batch, matched in order to the batch's leftover tokens
        slot_key = np.repeat(np.arange(remaining.size), remaining)
        slot_batch = slot_key // ep_size
        slot_start = np.searchsorted(slot_batch, np.arange(sizes.size))
        lb = batch[left]
        pos = _group_rank(lb)  # left is sorted by token index, hence by batch
        token2rank[left] = slot_key[slot_start[lb] + pos] % ep_size
    assert (token2rank >= 0).all()
    return token2rank.astype(np.int32)


def contiguous_tokens(batch_ids: np.ndarray, ep_size: int) -> np.ndarray:
    """Plain EP: each batch split into ``ep_size`` contiguous slices. Returns [T] int32."""
    _, batch = np.unique(batch_ids, return_inverse=True)
    sizes = np.bincount(batch)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    pos = np.arange(batch_ids.size) - starts[batch]
    return (pos * ep_size // sizes[batch]).astype(np.int32)


def batches_from_windows(num_tokens: int, batch_tokens: int) -> np.ndarray:
    """Batch ids for traces without step_ids: consecutive windows of ``batch_tokens``. [T] int64."""
    if batch_tokens <= 0:
        raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
    return np.arange(num_tokens, dtype=np.int64) // batch_tokens
