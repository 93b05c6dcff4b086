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

SOURCES = ("token", "markov", "request", "prior")


@dataclass(frozen=True)
class PredictorTables:
    """token2rank: [L, V, 2] int16, best/second rank per token id, -1 = unseen.
    token_conf: [L, V] float16, expected local share on the best rank (0 for unseen).
    markov2rank: [L, E, 2] int16, best/second rank given the previous layer's top-1 expert,
    -1 = no data (layer 0 is always -1). markov_conf: [L, E] float16.
    prior2rank: [L, 2] int16 and prior_conf: [L] float16, for tokens nothing else covers."""

    token2rank: np.ndarray
    token_conf: np.ndarray
    markov2rank: np.ndarray
    markov_conf: np.ndarray
    prior2rank: np.ndarray
    prior_conf: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays().values()))


def _top2(scores: np.ndarray, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores: [M, N] float; totals: [M] float (activations per row). Returns ([M, 2] int16
    best/second rank, -1 where the row has no data; [M] float16 best share)."""
    M, N = scores.shape
    order = np.argsort(-scores, axis=1, kind="stable")[:, :2]
    if N == 1:
        order = np.concatenate([order, order], axis=1)
    best = np.take_along_axis(scores, order[:, :1], axis=1)[:, 0]
    conf = np.divide(best, totals, out=np.zeros(M), where=totals > 0)
    out = order.astype(np.int16)
    out[totals <= 0] = -1
    return out, conf.astype(np.float16)


def _nearest_seen(embeddings: np.ndarray, seen: np.ndarray, block: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """For every id, the most cosine-similar seen id. embeddings: [V, H]; seen: [V] bool.
    Returns ([V] int64 nearest seen id, [V] float cosine)."""
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


def build_predictor(token_ids: np.ndarray, topk_ids: np.ndarray, holds: np.ndarray, vocab_size: int,
                    embeddings: np.ndarray | None = None, min_count: int = 1) -> PredictorTables:
    """Count the training trace into predictor tables for a placement.

    token_ids: [T] int; topk_ids: [T, L, K] int; holds: [L, N, E] bool (rank holds expert);
    embeddings: [V, H] float input embeddings for the unseen-token fallback (optional);
    min_count: occurrences below which a token id counts as unseen.
    """
    T, L, K = topk_ids.shape
    _, N, E = holds.shape
    V = vocab_size
    tok = token_ids.astype(np.int64)
    occ = np.bincount(tok, minlength=V).astype(np.float64)
    seen = occ >= min_count
    if embeddings is not None:
        if embeddings.shape[0] < V:
            raise ValueError(f"embeddings have {embeddings.shape[0]} rows, fewer than vocab_size {V}")
        nn, sim = _nearest_seen(embeddings[:V], seen)
    token2rank = np.full((L, V, 2), -1, dtype=np.int16)
    token_conf = np.zeros((L, V), dtype=np.float16)
    markov2rank = np.full((L, E, 2), -1, dtype=np.int16)
    markov_conf = np.zeros((L, E), dtype=np.float16)
    prior2rank = np.zeros((L, 2), dtype=np.int16)
    prior_conf = np.zeros(L, dtype=np.float16)
    rows = np.repeat(tok, K)
    for layer in range(L):
        h = holds[layer].T.astype(np.float64)  # [E, N]
        e = topk_ids[:, layer, :].reshape(-1).astype(np.int64)
        A = sp.csr_matrix((np.ones(e.size), (rows, e)), shape=(V, E))
        R = np.asarray(A @ h)  # [V, N] activations local on each rank
        t2r, conf = _top2(R, occ * K)
        t2r[~seen], conf[~seen] = -1, 0
        if embeddings is not None:
            fill = ~seen & seen.any()
            t2r[fill] = t2r[nn[fill]]
            conf[fill] = (conf[nn[fill]].astype(np.float32) * np.clip(sim[fill], 0, 1)).astype(np.float16)
        token2rank[layer], token_conf[layer] = t2r, conf
        tot = R.sum(axis=0)
        order = np.argsort(-tot, kind="stable")[:2]
        prior2rank[layer] = np.resize(order, 2)
        prior_conf[layer] = tot[order[0]] / max(1.0, T * K)
        if layer > 0:
            prev = topk_ids[:, layer - 1, 0].astype(np.int64)
            P = sp.csr_matrix((np.ones(e.size), (np.repeat(prev, K), e)), shape=(E, E))
            M = np.asarray(P @ h)
            markov2rank[layer], markov_conf[layer] = _top2(M, np.bincount(prev, minlength=E) * float(K))
    return PredictorTables(token2rank, token_conf, markov2rank, markov_conf, prior2rank, prior_conf)


def request_prefill_candidates(request_ids: np.ndarray, is_prefill: np.ndarray, topk_layer: np.ndarray,
                               holds_layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefill -> decode prediction for one layer.

    request_ids: [T] int; is_prefill: [T] bool; topk_layer: [T, K] int; holds_layer: [N, E] bool.
    Returns ([T, 2] int16 ranks, -1 for prefill tokens and requests without prefill rows;
    [T] float16 confidence).
    """
    T, K = topk_layer.shape
    N = holds_layer.shape[0]
    uniq, req = np.unique(request_ids, return_inverse=True)
    pre = np.flatnonzero(is_prefill)
    h = holds_layer.T.astype(np.float64)  # [E, N]
    A = sp.csr_matrix((np.ones(pre.size * K), (np.repeat(req[pre], K), topk_layer[pre].reshape(-1))),
                      shape=(uniq.size, h.shape[0]))
    R = np.asarray(A @ h)
    ranks, conf = _top2(R, np.bincount(req[pre], minlength=uniq.size) * float(K))
    out, c = ranks[req], conf[req]
    out[is_prefill] = -1
    c[is_prefill] = 0
    return out, c


def predict_layer(tables: PredictorTables, layer: int, token_ids: np.ndarray,
                  prev_top1: np.ndarray | None = None,
                  request_pred: tuple[np.ndarray, np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arbitrate the predictors for one layer.

    token_ids: [T] int; prev_top1: [T] int, the previous layer's top-1 expert (None at layer 0
    or when unknown); request_pred: output of :func:`request_prefill_candidates` (optional).
    Returns (pref [T, 2] int16 ranks, conf [T] float32, source [T] int8 index into SOURCES).
    """
    T = token_ids.shape[0]
    cands = [(tables.token2rank[layer][token_ids], tables.token_conf[layer][token_ids].astype(np.float32))]
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
