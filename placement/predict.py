"""Route predictors: which rank will hold a token's experts at a layer (table look-ups only).

Three predictors, each giving a best and second-best rank with a confidence (the share of the
token's activations that would be local on the best rank, as seen in training):

- token table: token id -> rank, from Pr(expert | token) counted on the training trace;
  unseen ids copy the row of the nearest seen id by cosine of input embeddings (when given),
  else fall back to the layer prior;
- Markov table: the previous layer's top-1 expert -> rank (inter-layer affinity);
- request table (decode tokens): the ranks that held the request's prefill activations
  at this layer (prefill predicts decode).

Arbitration picks, per token, the candidate with the highest confidence.
Notation: T tokens, L layers, K top-k, E experts, N ranks, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from .counts import count_matrix, rank_scores, top_ranks

SOURCES = ("token", "markov", "request", "prior", "router", "learned")


@dataclass(frozen=True)
class PredictorTables:
    """token2rank: [L, V, 2] int16, best/second rank per token id, -1 = unseen.
    token_conf: [L, V] float16, expected local share on the best rank (0 for unseen).
    markov2rank: [L, E, 2] int16, best/second rank given the previous layer's top-1 expert,
    -1 = no data (layer 0 is always -1). markov_conf: [L, E] float16.
    prior2rank: [L, 2] int16 and prior_conf: [L] float16, for tokens nothing else covers.
    Optional (None = none), the bigram table: bigram_keys [M] int64, strictly increasing,
    previous token id * V + token id; bigram2rank [L, M, 2] int16 and bigram_conf [L, M] float16,
    the pairs whose routing the token table alone predicts worst (:func:`bigram_table`).
    Optional (None = none), the learned predictor's arrays, all five or none:
    learned_token_proj [V, D] and learned_prev_proj [V + 1, D] float16, learned_hidden_bias [D],
    learned_out_weight [D, L * N] and learned_out_bias [L * N] float32 (:mod:`.learned`)."""

    token2rank: np.ndarray
    token_conf: np.ndarray
    markov2rank: np.ndarray
    markov_conf: np.ndarray
    prior2rank: np.ndarray
    prior_conf: np.ndarray
    bigram_keys: np.ndarray | None = None
    bigram2rank: np.ndarray | None = None
    bigram_conf: np.ndarray | None = None
    learned_token_proj: np.ndarray | None = None
    learned_prev_proj: np.ndarray | None = None
    learned_hidden_bias: np.ndarray | None = None
    learned_out_weight: np.ndarray | None = None
    learned_out_bias: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if getattr(self, k) is not None}

    @property
    def has_bigrams(self) -> bool:
        return self.bigram_keys is not None and self.bigram_keys.size > 0

    @property
    def learned(self):
        """The :class:`~.learned.LearnedPredictor` these tables carry, or None."""
        from .learned import LEARNED_FIELDS, LearnedPredictor

        if self.learned_token_proj is None:
            return None
        return LearnedPredictor(**{k: getattr(self, "learned_" + k) for k in LEARNED_FIELDS})

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays().values()))


def _top2(scores: np.ndarray, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores: [M, N] float; totals: [M] float (activations per row). Returns ([M, 2] int16
    best/second rank, -1 where the row has no data; [M] float16 best share)."""
    M, N = scores.shape
    order = top_ranks(scores, 2)
    if N == 1:
        order = np.concatenate([order, order], axis=1)
    best = np.take_along_axis(scores, order[:, :1], axis=1)[:, 0]
    conf = np.divide(best, totals, out=np.zeros(M), where=totals > 0)
    out = order.astype(np.int16)
    out[totals <= 0] = -1
    return out, conf.astype(np.float16)


def nearest_seen(embeddings: np.ndarray, seen: np.ndarray, block: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """For every id, the most cosine-similar seen id. embeddings: [V, H]; seen: [V] bool.
    Returns ([V] int64 nearest seen id, [V] float32 cosine; seen ids map to themselves)."""
    x = embeddings.astype(np.float32)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    ids = np.flatnonzero(seen)
    ref = x[ids]
    nn = np.arange(len(x))
    sim = np.ones(len(x), dtype=np.float32)
    todo = np.flatnonzero(~seen)
    for s in range(0, todo.size, block):
        rows = todo[s: s + block]
        c = x[rows] @ ref.T
        j = c.argmax(axis=1)
        nn[rows] = ids[j]
        sim[rows] = c[np.arange(rows.size), j]
    return nn, sim


def local_counts(A: sp.csr_matrix, holds_layer: np.ndarray) -> np.ndarray:
    """[rows, N] activations of each row that rank r holds; A: [rows, E] csr; holds_layer: [N, E]."""
    if (holds_layer.sum(axis=0) == 1).all():  # one copy per expert: a bincount, no matmul
        return rank_scores(A, holds_layer.argmax(axis=0), holds_layer.shape[0])
    return np.asarray(A @ holds_layer.T.astype(np.float64))


def token_table(R: np.ndarray, ids: np.ndarray, occ: np.ndarray, vocab_size: int, top_k: int,
                nearest: tuple[np.ndarray, np.ndarray] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One layer's token table and prior from its counts.

    R: [V', N] float activations of the seen ids ``ids`` ([V'] int) that rank r holds;
    occ: [V'] occurrences; nearest: output of :func:`nearest_seen` for the unseen fallback.
    Returns (token2rank [V, 2] int16, token_conf [V] float16, prior2rank [2] int16,
    prior_conf float16 0-d).
    """
    t2r_seen, conf_seen = _top2(R, occ * top_k)
    t2r = np.full((vocab_size, 2), -1, dtype=np.int16)
    conf = np.zeros(vocab_size, dtype=np.float16)
    t2r[ids], conf[ids] = t2r_seen, conf_seen
    if nearest is not None and ids.size:
        nn, sim = nearest
        fill = np.ones(vocab_size, dtype=bool)
        fill[ids] = False
        t2r[fill] = t2r[nn[fill]]
        conf[fill] = (conf[nn[fill]].astype(np.float32) * np.clip(sim[fill], 0, 1)).astype(np.float16)
    tot = R.sum(axis=0)
    order = np.argsort(-tot, kind="stable")[:2]
    prior = np.resize(order, 2).astype(np.int16)
    return t2r, conf, prior, np.float16(tot[order[0]] / max(1.0, occ.sum() * top_k))


def markov_table(transitions: np.ndarray, holds_layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Previous layer's top-1 expert -> this layer's rank. transitions: [E, E] counts, [i, j] =
    tokens with previous top-1 expert i choosing expert j here (K per token); holds_layer: [N, E]
    bool. Returns ([E, 2] int16, -1 = never seen; [E] float16)."""
    P = sp.csr_matrix(transitions.astype(np.float64))
    return _top2(local_counts(P, holds_layer), transitions.sum(axis=1).astype(np.float64))


def empty_tables(num_layers: int, vocab_size: int, num_experts: int) -> PredictorTables:
    return PredictorTables(
        token2rank=np.full((num_layers, vocab_size, 2), -1, dtype=np.int16),
        token_conf=np.zeros((num_layers, vocab_size), dtype=np.float16),
        markov2rank=np.full((num_layers, num_experts, 2), -1, dtype=np.int16),
        markov_conf=np.zeros((num_layers, num_experts), dtype=np.float16),
        prior2rank=np.zeros((num_layers, 2), dtype=np.int16),
        prior_conf=np.zeros(num_layers, dtype=np.float16),
    )


def fill_layer(tables: PredictorTables, layer: int, R: np.ndarray, ids: np.ndarray, occ: np.ndarray,
               transitions: np.ndarray, holds_layer: np.ndarray, top_k: int,
               nearest: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Write one layer's rows of ``tables`` in place. R, ids, occ: :func:`token_table`'s inputs;
    transitions: :func:`markov_table`'s (ignored at layer 0)."""
    V = tables.token2rank.shape[1]
    (tables.token2rank[layer], tables.token_conf[layer], tables.prior2rank[layer],
     tables.prior_conf[layer]) = token_table(R, ids, occ, V, top_k, nearest)
    if layer > 0:
        tables.markov2rank[layer], tables.markov_conf[layer] = markov_table(transitions, holds_layer)


def named_ranks(names: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Rank ids under new names: names [L, N] int, rank n of layer l is now names[l, n]
    (:func:`.migrate.rank_names`); ranks [L, ...] int, -1 = none (kept). Same shape and dtype."""
    names = np.asarray(names, dtype=np.int64)
    ranks = np.asarray(ranks)
    flat = ranks.reshape(names.shape[0], -1).astype(np.int64)
    named = np.where(flat >= 0, np.take_along_axis(names, np.maximum(flat, 0), axis=1), -1)
    return named.astype(ranks.dtype).reshape(ranks.shape)


def rename_tables(tables: PredictorTables, names: np.ndarray) -> PredictorTables:
    """The same predictor for a placement whose ranks were renamed (names [L, N]: see
    :func:`named_ranks`): every rank id is mapped; the learned network's output columns of each
    layer are permuted to match."""
    L, N = np.shape(names)
    out = dict(tables.arrays())
    for k in ("token2rank", "markov2rank", "prior2rank", "bigram2rank"):
        if k in out:
            out[k] = named_ranks(names, out[k])
    if "learned_out_weight" in out:  # column l * N + n scores rank n of layer l: it moves to l * N + names[l, n]
        col = np.empty(L * N, dtype=np.int64)
        col[(np.arange(L)[:, None] * N + np.asarray(names)).ravel()] = np.arange(L * N)
        out["learned_out_weight"] = out["learned_out_weight"][:, col]
        out["learned_out_bias"] = out["learned_out_bias"][col]
    return PredictorTables(**out)


def tables_for_placement(counts, holds: np.ndarray, vocab_size: int, embeddings: np.ndarray | None = None
                         ) -> PredictorTables:
    """Predictor tables for a given placement from a training trace's counts.

    counts: :class:`~.routing_counts.RoutingCounts`; holds: [L, N, E] bool (rank holds expert);
    embeddings: [V, H] float input embeddings for the unseen-token fallback (optional).
    """
    ids, occ = counts.seen()
    nearest = nearest_token_map(embeddings, ids, vocab_size)
    tables = empty_tables(counts.num_layers, vocab_size, counts.num_experts)
    for layer in range(counts.num_layers):
        R = local_counts(counts.layer_matrix(layer), holds[layer])
        fill_layer(tables, layer, R, ids, occ, counts.markov_matrix(layer), holds[layer], counts.top_k, nearest)
    return tables


def build_predictor(token_ids: np.ndarray, topk_ids: np.ndarray, holds: np.ndarray, vocab_size: int,
                    embeddings: np.ndarray | None = None) -> PredictorTables:
    """:func:`tables_for_placement` of an in-memory trace (token_ids: [T] int; topk_ids: [T, L, K] int)."""
    from .routing_counts import RoutingCounts

    return tables_for_placement(RoutingCounts.from_arrays(token_ids, topk_ids, holds.shape[2], vocab_size, sample_tokens=0), holds,
                                vocab_size, embeddings)


def nearest_token_map(embeddings: np.ndarray | None, seen_ids: np.ndarray, vocab_size: int):
    """(nearest seen id [V], cosine [V]) for the unseen-token fallback, or None without embeddings."""
    if embeddings is None:
        return None
    if embeddings.shape[0] < vocab_size:
        raise ValueError(f"embeddings have {embeddings.shape[0]} rows, fewer than vocab_size {vocab_size}")
    seen = np.zeros(vocab_size, dtype=bool)
    seen[seen_ids] = True
    return nearest_seen(embeddings[:vocab_size], seen)


def previous_ids(token_ids: np.ndarray, positions: np.ndarray, batch_ids: np.ndarray) -> np.ndarray:
    """The previous row's token id where the row continues its sequence: same batch (engine step)
    and position one more, as a step lays out a request's prompt chunk; -1 elsewhere (first rows,
    decode rows, whose previous token was in an earlier step). token_ids, positions, batch_ids:
    [T] int. Returns [T] int64. What serving computes from a step's input_ids and positions."""
    T = token_ids.shape[0]
    prev = np.full(T, -1, dtype=np.int64)
    if T > 1:
        ok = (batch_ids[1:] == batch_ids[:-1]) & (positions[1:].astype(np.int64) == positions[:-1].astype(np.int64) + 1)
        prev[1:][ok] = token_ids[:-1][ok]
    return prev


def bigram_keys(prev_ids: np.ndarray, token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """[T] int64 key of each (previous id, id) pair, -1 where there is no previous id."""
    return np.where(prev_ids >= 0, prev_ids.astype(np.int64) * vocab_size + token_ids.astype(np.int64), -1)


def bigram_table(keys: np.ndarray, topk_ids: np.ndarray, holds: np.ndarray, token2rank: np.ndarray,
                 max_pairs: int, min_count: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (previous id, id) pairs that predict a token's ranks better than its id alone.

    keys: [T] int64 from :func:`bigram_keys` (-1 = none); topk_ids: [T, L, K]; holds: [L, N, E]
    bool; token2rank: [L, V, 2] the token table of the same placement. A pair seen at least
    ``min_count`` times scores, summed over layers, the activations its own best rank holds minus
    those on its token's best rank; the ``max_pairs`` best pairs with a positive score are kept.
    Returns (bigram_keys [M] int64 increasing, bigram2rank [L, M, 2] int16, bigram_conf [L, M] float16).
    """
    T, L, K = topk_ids.shape
    V = token2rank.shape[1]
    valid = np.flatnonzero(keys >= 0)
    uniq, inv, occ = np.unique(keys[valid], return_inverse=True, return_counts=True)
    cand = np.flatnonzero(occ >= min_count)
    rows = np.flatnonzero(np.isin(inv, cand))  # rows of the candidate pairs
    pair = np.searchsorted(cand, inv[rows])
    P = cand.size
    gain = np.zeros(P)
    ranks = np.full((L, P, 2), -1, dtype=np.int16)
    conf = np.zeros((L, P), dtype=np.float16)
    tok_best = token2rank[:, uniq[cand] % V, 0].astype(np.int64)  # [L, P]
    for layer in range(L):
        A = count_matrix(np.repeat(pair, K), topk_ids[valid[rows], layer].reshape(-1).astype(np.int64), P,
                         holds.shape[2])
        R = local_counts(A, holds[layer])  # [P, N]
        at_token = np.where(tok_best[layer] >= 0, R[np.arange(P), np.maximum(tok_best[layer], 0)], 0.0)
        gain += R.max(axis=1, initial=0.0) - at_token
        ranks[layer], conf[layer] = _top2(R, occ[cand] * float(K))
    keep = np.flatnonzero(gain > 0)
    keep = np.sort(keep[np.argsort(-gain[keep], kind="stable")[:max_pairs]])
    return uniq[cand][keep].astype(np.int64), ranks[:, keep], conf[:, keep]


def bigram_lookup(tables: PredictorTables, layer: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hit [T] bool, ranks [T, 2] int16, conf [T] float32) of the bigram table for ``keys`` [T]."""
    T = keys.shape[0]
    if not tables.has_bigrams:
        return np.zeros(T, dtype=bool), np.full((T, 2), -1, np.int16), np.zeros(T, np.float32)
    bk = tables.bigram_keys
    j = np.minimum(np.searchsorted(bk, np.maximum(keys, 0)), bk.size - 1)
    hit = (keys >= 0) & (bk[j] == keys)
    return hit, tables.bigram2rank[layer][j], tables.bigram_conf[layer][j].astype(np.float32)


def request_prefill_candidates(request_ids: np.ndarray, is_prefill: np.ndarray, topk_layer: np.ndarray,
                               holds_layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefill -> decode prediction for one layer.

    request_ids: [T] int; is_prefill: [T] bool; topk_layer: [T, K] int; holds_layer: [N, E] bool.
    Returns ([T, 2] int16 ranks, -1 for prefill tokens and requests without prefill rows;
    [T] float16 confidence).
    """
    T, K = topk_layer.shape
    uniq, req = np.unique(request_ids, return_inverse=True)
    pre = np.flatnonzero(is_prefill)
    A = count_matrix(np.repeat(req[pre], K), topk_layer[pre].reshape(-1), uniq.size, holds_layer.shape[1])
    R = local_counts(A, holds_layer)
    ranks, conf = _top2(R, np.bincount(req[pre], minlength=uniq.size) * float(K))
    out, c = ranks[req], conf[req]
    out[is_prefill] = -1
    c[is_prefill] = 0
    return out, c


def _prefer(counts: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    pref = np.argsort(-counts, axis=1, kind="stable")[:, : min(2, counts.shape[1])]
    return pref, (counts[np.arange(counts.shape[0]), pref[:, 0]] / top_k).astype(np.float32)


def prefer_ranks(expert_ranks: np.ndarray, num_ranks: int, block: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """The preference when a token's routing is known (the oracle, and what the served predictor
    ``router`` computes from vLLM's own gate): ranks by how many of its experts they hold, most
    first, lower rank on ties. expert_ranks: [T, K] int, the rank of each top-k expert.
    Returns (pref [T, min(2, N)] int64, conf [T] float32: the best rank's share of the K)."""
    T, K = expert_ranks.shape
    pref = np.zeros((T, min(2, num_ranks)), dtype=np.int64)
    conf = np.zeros(T, dtype=np.float32)
    for s in range(0, T, block):  # [block, N] counts at a time: memory bounded at any T
        er = expert_ranks[s: s + block].astype(np.int64)
        rows = np.repeat(np.arange(er.shape[0]) * num_ranks, K)
        counts = np.bincount(rows + er.reshape(-1), minlength=er.shape[0] * num_ranks).reshape(-1, num_ranks)
        pref[s: s + block], conf[s: s + block] = _prefer(counts, K)
    return pref, conf


def known_preferences(topk_layer: np.ndarray, holds_layer: np.ndarray, block: int = 1 << 16
                      ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`prefer_ranks` from a layer's actual routing, counting every copy (replicas too).
    topk_layer: [T, K] int; holds_layer: [N, E] bool."""
    if (holds_layer.sum(axis=0) == 1).all():
        return prefer_ranks(holds_layer.argmax(axis=0)[topk_layer], holds_layer.shape[0], block)
    T, K = topk_layer.shape
    pref = np.zeros((T, min(2, holds_layer.shape[0])), dtype=np.int64)
    conf = np.zeros(T, dtype=np.float32)
    for s in range(0, T, block):
        counts = holds_layer[:, topk_layer[s: s + block]].sum(axis=2).T  # [block, N]
        pref[s: s + block], conf[s: s + block] = _prefer(counts, K)
    return pref, conf


def predict_layer(tables: PredictorTables, layer: int, token_ids: np.ndarray,
                  prev_top1: np.ndarray | None = None,
                  request_pred: tuple[np.ndarray, np.ndarray] | None = None,
                  keys: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arbitrate the predictors for one layer.

    token_ids: [T] int; prev_top1: [T] int, the previous layer's top-1 expert (None at layer 0
    or when unknown); request_pred: output of :func:`request_prefill_candidates` (optional);
    keys: [T] int64 bigram keys (:func:`bigram_keys`; optional): a pair in the bigram table
    replaces its token's row (the pair is the more specific context).
    Returns (pref [T, 2] int16 ranks, conf [T] float32, source [T] int8 index into SOURCES).
    """
    T = token_ids.shape[0]
    tok_r, tok_c = tables.token2rank[layer][token_ids], tables.token_conf[layer][token_ids].astype(np.float32)
    if keys is not None:
        hit, r, c = bigram_lookup(tables, layer, keys)
        tok_r, tok_c = np.where(hit[:, None], r, tok_r), np.where(hit, c, tok_c)
    cands = [(tok_r, tok_c)]
    if prev_top1 is not None and layer > 0:
        cands.append((tables.markov2rank[layer][prev_top1], tables.markov_conf[layer][prev_top1].astype(np.float32)))
    else:
        cands.append((np.full((T, 2), -1, np.int16), np.zeros(T, np.float32)))
    if request_pred is not None:
        cands.append((request_pred[0], request_pred[1].astype(np.float32)))
    else:
        cands.append((np.full((T, 2), -1, np.int16), np.zeros(T, np.float32)))
    confs = np.stack([c for _, c in cands] + [np.full(T, -1.0, np.float32)])  # prior ranks last
    for i, (r, _) in enumerate(cands):
        confs[i][r[:, 0] < 0] = -2.0
    source = confs.argmax(axis=0).astype(np.int8)
    prefs = np.stack([r for r, _ in cands] + [np.broadcast_to(tables.prior2rank[layer], (T, 2))])
    pref = prefs[source, np.arange(T)]
    conf = np.maximum(confs[source, np.arange(T)], 0.0)
    return pref, conf, source
