"""Replay a trace through the online path: predict each token's rank, then cap per batch.

This is the loop the engine runs per MoE layer (prediction from tables + capacity-capped
assignment), applied to a whole trace to measure a placement.
"""

from __future__ import annotations

import numpy as np

from .assign import assign_tokens
from .learned import forward, preferences, with_tables
from .predict import (SOURCES, PredictorTables, bigram_keys, known_preferences, predict_layer, previous_ids,
                      request_prefill_candidates)

# offline twins of the served predictors (vllm_smoe.serving.config.PREDICTORS) that learn from a trace
# (input-gate has none: it reads hidden states a trace does not hold; benchmarks/predictor_probes.py hidden)
PREDICTORS = ("tables-markov", "tables", "learned", "router")
LEARNED_BLOCK = 1 << 16  # rows the learned predictor scores at a time


def simulate(tables: PredictorTables | None, holds: np.ndarray, token_ids: np.ndarray, topk_ids: np.ndarray,
             batch_ids: np.ndarray, ep_size: int, capacity: float = 1.10,
             request_ids: np.ndarray | None = None, is_prefill: np.ndarray | None = None,
             predictor: str = "tables-markov", positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """token2rank: [T, L] int32 and source: [T, L] int8 (index into predict.SOURCES).

    holds: [L, N, E] bool; topk_ids: [T, L, K]. predictor: ``tables-markov`` arbitrates the token
    table, the Markov table (the previous layer's actual top-1 expert, known online by the time
    layer l is reached) and, for decode tokens when request_ids and is_prefill are given, the
    request's prefill prediction; ``tables`` uses the token table alone (the served default);
    ``router`` knows each token's routing (the served predictor that runs vLLM's gate ahead, and
    the capped oracle of a placement: tables may be None); ``learned`` runs the tables' learned
    predictor (:mod:`.learned`) on each row's id and previous id, deferring to the token (and
    bigram) tables where they are the more confident. With ``positions`` ([T] int) and
    a bigram table, the table predictors look up each row's (previous id, id) pair first, the
    previous id taken as serving takes it (:func:`~.predict.previous_ids`).
    """
    if predictor not in PREDICTORS:
        raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {predictor!r}")
    T, L, _ = topk_ids.shape
    token2rank = np.empty((T, L), dtype=np.int32)
    source = np.empty((T, L), dtype=np.int8)
    tok = token_ids.astype(np.int64)
    markov = predictor == "tables-markov"
    model = None
    if predictor == "learned":
        model = tables.learned if tables is not None else None
        if model is None:
            raise ValueError("predictor 'learned': these tables hold no learned predictor (smoe-place build --learned)")
    keys = None
    if predictor != "router" and positions is not None and tables.has_bigrams:
        keys = bigram_keys(previous_ids(tok, positions, batch_ids), tok, tables.token2rank.shape[1])
    has_decode = markov and is_prefill is not None and request_ids is not None and not is_prefill.all()
    learned_pref = None
    if model is not None:  # in blocks of rows: the logits of a long trace need not fit at once
        prev = previous_ids(tok, positions, batch_ids) if positions is not None else np.full(T, -1, np.int64)
        learned_pref = (np.empty((L, T, min(2, ep_size)), np.int64), np.empty((L, T), np.float32))
        for s in range(0, T, LEARNED_BLOCK):
            rows = slice(s, s + LEARNED_BLOCK)
            learned_pref[0][:, rows], learned_pref[1][:, rows] = preferences(forward(model, tok[rows], prev[rows]),
                                                                            ep_size)
    for layer in range(L):
        if learned_pref is not None:  # the network, or the tables where they are the more confident
            tab_pref, tab_conf, tab_src = predict_layer(tables, layer, tok, None, None, keys)
            pref, conf = with_tables(tab_pref, tab_conf, learned_pref[0][layer], learned_pref[1][layer])
            src = np.where(conf > learned_pref[1][layer], tab_src, SOURCES.index("learned")).astype(np.int8)
        elif predictor == "router":
            pref, conf = known_preferences(topk_ids[:, layer].astype(np.int64), holds[layer])
            src = np.full(T, SOURCES.index("router"), dtype=np.int8)
        else:
            prev = topk_ids[:, layer - 1, 0].astype(np.int64) if (layer > 0 and markov) else None
            req = (request_prefill_candidates(request_ids, is_prefill, topk_ids[:, layer], holds[layer])
                   if has_decode else None)
            pref, conf, src = predict_layer(tables, layer, tok, prev, req, keys)
        token2rank[:, layer] = assign_tokens(pref, conf, batch_ids, ep_size, capacity)
        source[:, layer] = src
    return token2rank, source
