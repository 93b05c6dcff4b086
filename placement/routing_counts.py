"""The counts every placement method and predictor table needs, summed chunk by chunk.

Placement never needs the trace itself, only sums over its tokens: per layer, how often each
token id activated each expert (A [V', E]), how often each id occurred, and the inter-layer
transitions (previous layer's top-1 expert -> this layer's experts). :class:`RoutingCounts`
accumulates them from chunks of any trace length, so memory follows the vocabulary, experts and
layers, not the number of tokens.

Storage: an id's counts live in the smallest of three forms for it. A rare id keeps its raw routing
rows (K small ints per layer per occurrence); once seen ``dense_after`` times it gets a dense row of
E counters per layer, 8-bit while it has occurred fewer than 256 times, then 16-bit, then 32-bit
(a counter never exceeds its id's occurrences, so none can overflow). Raw rows are counted when a
layer's matrix is asked for. Counts are exact in every form.

Notation: T tokens, L layers, K top-k, E experts, V vocabulary, V' ids seen, F frequent ids.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp



def _small_int(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16) if num_experts <= 65536 else np.dtype(
        np.int32)


def _add_counts(flat: np.ndarray, keys: np.ndarray) -> None:
    """flat[k] += occurrences of k in ``keys`` (flat: 1-d integer counters, keys: [M] int)."""
    if keys.size == 0:
        return
    if flat.size <= 4 * keys.size:  # dense bincount beats sorting
        flat += np.bincount(keys, minlength=flat.size).astype(flat.dtype)
        return
    srt = np.sort(keys)
    starts = np.r_[0, np.flatnonzero(srt[1:] != srt[:-1]) + 1]
    flat[srt[starts]] += np.diff(np.r_[starts, srt.size]).astype(flat.dtype)


class RoutingCounts:
    """Sufficient statistics of a routing trace for :func:`~.layout.place_model`.

    Build with :meth:`add` per chunk (or :meth:`from_arrays`), then read :meth:`seen`,
    :meth:`layer_matrix`, :meth:`markov_matrix` and :meth:`expert_load`.

    dense_after: occurrences after which an id's counts move to a dense row (default: where an
    8-bit dense row [L, E] costs what the id's raw rows [L, K] would).
    occurrences: [V] int, each id's occurrences in the whole stream when known beforehand (a cheap
    pass over ``token_ids``): ids then start in their final form, so no id keeps raw rows it will
    outgrow, no row moves between tiers and every block has its exact size. Counts are exact
    either way; a stream that exceeds the plan is handled as without one.
    sample_tokens: keep the first this many rows as they are, for objectives that need each
    token's whole expert set (:meth:`layer_instances`).
    """

    # dense tiers: (counter dtype, most occurrences an id may have to live in it)
    TIERS = ((np.dtype(np.uint8), 255), (np.dtype(np.uint16), 65535), (np.dtype(np.uint32), 2**32 - 1))

    def __init__(self, num_layers: int, num_experts: int, top_k: int, vocab_size: int,
                 dense_after: int | None = None, occurrences: np.ndarray | None = None, sample_tokens: int = 0):
        if min(num_layers, num_experts, top_k, vocab_size) < 1 or top_k > num_experts:
            raise ValueError(f"bad routing shape: num_layers {num_layers}, num_experts {num_experts}, "
                             f"top_k {top_k}, vocab_size {vocab_size}")
        self.num_layers, self.num_experts, self.top_k, self.vocab_size = num_layers, num_experts, top_k, vocab_size
        self._raw_dtype = _small_int(num_experts)
        raw_bytes = num_layers * top_k * self._raw_dtype.itemsize + 4
        self.dense_after = dense_after or max(1, -(-num_layers * num_experts // raw_bytes))
        self.num_tokens = 0
        self.occ = np.zeros(vocab_size, dtype=np.int64)  # [V] occurrences per token id
        self.tier = np.full(vocab_size, -1, dtype=np.int8)  # [V] dense tier of each id, -1 = raw
        self.dense_row = np.full(vocab_size, -1, dtype=np.int64)  # [V] row in its tier's block
        # per tier: [F_t] token id of each row (an id that moved up leaves a stale row behind) and
        # the counters [L, F_cap, E]
        self._dense_ids = [np.zeros(0, dtype=np.int64) for _ in self.TIERS]
        self._dense = [np.zeros((num_layers, 0, num_experts), dtype=dt) for dt, _ in self.TIERS]
        self._raw_ids: list[np.ndarray] = []  # per chunk [n] int32 token ids of raw rows
        self._raw_topk: list[np.ndarray] = []  # per chunk [L, n, K] small ints
        # [L, E, E]: [l, i, j] = tokens whose layer l-1 top-1 expert was i and that chose j at l
        self._markov = np.zeros((num_layers, num_experts, num_experts), dtype=np.int64)
        self.sample_tokens = sample_tokens
        self._sample: list[tuple[np.ndarray, np.ndarray]] = []  # (token ids [n], topk [n, L, K])
        self._sampled = 0
        if occurrences is not None:
            if occurrences.shape != (vocab_size,):
                raise ValueError(f"occurrences has shape {occurrences.shape}, expected ({vocab_size},)")
            for t, (dt, most) in enumerate(self.TIERS):
                low = max(self.TIERS[t - 1][1] if t else 0, self.dense_after - 1)
                ids = np.flatnonzero((occurrences > low) & (occurrences <= most))
                self._dense[t] = np.zeros((num_layers, ids.size, num_experts), dtype=dt)
                self._dense_ids[t] = ids.astype(np.int64)
                self.tier[ids] = t
                self.dense_row[ids] = np.arange(ids.size)

    @classmethod
    def from_arrays(cls, token_ids: np.ndarray, topk_ids: np.ndarray, num_experts: int,
                    vocab_size: int | None = None, **kw) -> "RoutingCounts":
        """Counts of one in-memory trace. token_ids: [T] int; topk_ids: [T, L, K] int."""
        _, L, K = topk_ids.shape
        V = vocab_size if vocab_size is not None else int(token_ids.max(initial=-1)) + 1
        kw.setdefault("sample_tokens", token_ids.shape[0])  # in memory already: keep every row
        c = cls(L, num_experts, K, max(V, 1), **kw)
        c.add(token_ids, topk_ids)
        return c

    @property
    def nbytes(self) -> int:
        """Bytes held (dense blocks at their capacity, raw rows, tables)."""
        return int(self.occ.nbytes + self.tier.nbytes + self.dense_row.nbytes + self._markov.nbytes
                   + sum(t.nbytes + k.nbytes for t, k in self._sample)
                   + sum(d.nbytes for d in self._dense) + sum(a.nbytes for a in self._raw_ids)
                   + sum(a.nbytes for a in self._raw_topk))

    def _live_rows(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, token ids) of tier ``t`` whose id still lives there."""
        ids = self._dense_ids[t]
        live = np.flatnonzero(self.tier[ids] == t)
        return live, ids[live]

    def _promote(self, t: int, ids: np.ndarray) -> None:
        """Give ``ids`` rows in tier ``t``, carrying over the counts of a lower tier."""
        F = self._dense_ids[t].size
        need = F + ids.size
        block = self._dense[t]
        if need > block.shape[1]:  # grow by doubling: amortised copies (untouched capacity costs no memory)
            grown = np.zeros((self.num_layers, max(need, 2 * block.shape[1], 16), self.num_experts), dtype=block.dtype)
            grown[:, :F] = block[:, :F]
            self._dense[t] = block = grown
        rows = np.arange(F, need)
        was = self.tier[ids]
        for lower in np.unique(was[was >= 0]):
            sel = was == lower
            block[:, rows[sel]] = self._dense[lower][:, self.dense_row[ids[sel]]]
        self.tier[ids] = t
        self.dense_row[ids] = rows
        self._dense_ids[t] = np.concatenate([self._dense_ids[t], ids])

    def add(self, token_ids: np.ndarray, topk_ids: np.ndarray) -> None:
        """Count one chunk. token_ids: [n] int in [0, V); topk_ids: [n, L, K] int in [0, E), no
        expert twice in one top-k (a trace's validation guarantees it; counters are sized by
        occurrences, so a repeat could overflow an 8-bit one)."""
        n = token_ids.shape[0]
        L, E, K = self.num_layers, self.num_experts, self.top_k
        if topk_ids.shape != (n, L, K):
            raise ValueError(f"topk_ids has shape {topk_ids.shape}, expected ({n}, {L}, {K})")
        if self.num_tokens + n >= 2**32:  # a 32-bit counter could overflow
            raise ValueError(f"more than {2**32 - 1} tokens in one count")
        if n == 0:
            return
        if token_ids.min() < 0 or token_ids.max() >= self.vocab_size:
            raise ValueError(f"token_ids outside [0, vocab_size={self.vocab_size})")
        if topk_ids.min() < 0 or topk_ids.max() >= E:
            raise ValueError(f"topk_ids outside [0, num_experts={E})")
        if self._sampled < self.sample_tokens:
            m = min(n, self.sample_tokens - self._sampled)
            self._sample.append((token_ids[:m].astype(np.int64), np.array(topk_ids[:m], dtype=self._raw_dtype)))
            self._sampled += m
        tok = token_ids.astype(np.int64)
        self.occ += np.bincount(tok, minlength=self.vocab_size)
        self.num_tokens += n
        # every id's tier before counting this chunk: the lowest whose counters hold its occurrences
        for t, (_, most) in reversed(list(enumerate(self.TIERS))):
            low = max(self.TIERS[t - 1][1] if t else 0, self.dense_after - 1)
            up = np.flatnonzero((self.occ > low) & (self.occ <= most) & (self.tier < t))
            if up.size:
                self._promote(t, up)
        tier = self.tier[tok]
        for t in range(len(self.TIERS)):
            sel = tier == t
            if sel.any():
                d = self.dense_row[tok[sel]] * E
                sub = topk_ids[sel]
                for layer in range(L):
                    _add_counts(self._dense[t][layer].reshape(-1), (d[:, None] + sub[:, layer, :]).reshape(-1))
        rare = tier < 0
        if rare.any():
            self._raw_ids.append(token_ids[rare].astype(np.int32))
            self._raw_topk.append(np.ascontiguousarray(topk_ids[rare].transpose(1, 0, 2), dtype=self._raw_dtype))
        for layer in range(1, L):
            keys = (topk_ids[:, layer - 1, :1].astype(np.int64) * E + topk_ids[:, layer, :]).reshape(-1)
            _add_counts(self._markov[layer].reshape(-1), keys)

    def seen(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids [V'] int64 token ids seen, ascending; occ [V'] float64 occurrences of each)."""
        ids = np.flatnonzero(self.occ)
        return ids, self.occ[ids].astype(np.float64)

    def layer_matrix(self, layer: int) -> sp.csr_matrix:
        """A: [V', E] csr float64 (canonical), activations of expert e by the i-th seen id (rows as
        :meth:`seen`). Raw rows are counted by an in-place sort of 4-byte keys, so the temporary
        memory is about 4 bytes per raw activation of this layer."""
        ids, _ = self.seen()
        E, K = self.num_experts, self.top_k
        row_of = np.full(self.vocab_size, -1, dtype=np.int64)
        row_of[ids] = np.arange(ids.size)
        # dense tiers: each id lives in one tier, so their (row, expert) keys are distinct
        keys, weights = [], []
        for t in range(len(self.TIERS)):
            live, tids = self._live_rows(t)
            block = self._dense[t][layer, live]
            r, c = np.nonzero(block)
            keys.append(row_of[tids[r]] * E + c)
            weights.append(block[r, c].astype(np.float64))
        key = np.concatenate(keys)
        order = np.argsort(key, kind="stable")
        key, weight = key[order], np.concatenate(weights)[order]
        if self._raw_ids:
            n = sum(x.size for x in self._raw_ids) * K
            raw = np.empty(n, dtype=np.uint32 if ids.size * E < 2**32 else np.int64)
            pos = 0
            for tok, topk in zip(self._raw_ids, self._raw_topk):
                m = tok.size * K
                raw[pos: pos + m] = (row_of[tok][:, None] * E + topk[layer]).reshape(-1)
                pos += m
            raw.sort()
            starts = np.r_[0, np.flatnonzero(raw[1:] != raw[:-1]) + 1]
            raw_key = raw[starts].astype(np.int64)
            raw_weight = np.diff(np.r_[starts, n]).astype(np.float64)
            del raw
            # merge the two sorted key lists, adding the counts of keys in both
            at = np.searchsorted(raw_key, key)
            both = at < raw_key.size
            both[both] = raw_key[at[both]] == key[both]
            raw_weight[at[both]] += weight[both]
            key = np.insert(raw_key, at[~both], key[~both])
            weight = np.insert(raw_weight, at[~both], weight[~both])
        rows = key // E
        indptr = np.r_[0, np.cumsum(np.bincount(rows, minlength=ids.size))]
        return sp.csr_matrix((weight, (key % E).astype(np.int32), indptr), shape=(ids.size, E))

    def layer_instances(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sample's distinct (token, expert set) pairs at ``layer``, rows as :meth:`seen`:
        (hv [H] int64, sets [H, K] int64, w [H] float64), see :func:`.bytes.layer_instances`."""
        from .bytes import layer_instances

        ids, _ = self.seen()
        if not self._sample:
            return layer_instances(np.zeros(0, np.int64), np.zeros((0, self.top_k), np.int64))
        tok = np.concatenate([t for t, _ in self._sample])
        topk = np.concatenate([k[:, layer] for _, k in self._sample])
        return layer_instances(np.searchsorted(ids, tok), topk)

    def markov_matrix(self, layer: int) -> np.ndarray:
        """[E, E] int64: tokens whose top-1 expert at ``layer - 1`` was i that chose expert j at
        ``layer`` (all zero at layer 0)."""
        return self._markov[layer]

    def expert_load(self) -> np.ndarray:
        """[L, E] float64 activations of each expert."""
        load = np.zeros((self.num_layers, self.num_experts))
        for t in range(len(self.TIERS)):
            live, _ = self._live_rows(t)
            load += self._dense[t][:, live].sum(axis=1, dtype=np.float64)
        for t in self._raw_topk:
            for layer in range(self.num_layers):
                load[layer] += np.bincount(t[layer].reshape(-1), minlength=self.num_experts)
        return load
