"""A placement's predictor tables completed from sample rows: the bigram table and the learned
predictor, each learned for the placement's ``holds`` ([L, N, E] bool: which rank holds a copy
of which expert) on rows sorted by engine step, the previous id taken within each step as
serving takes it."""

from __future__ import annotations

import dataclasses

import numpy as np

from .learned import layer_targets, train_predictor
from .predict import PredictorTables, bigram_keys, bigram_table, previous_ids
from .stream import by_step


def with_bigrams(tables: PredictorTables, rows: dict[str, np.ndarray], holds: np.ndarray, vocab_size: int,
                 max_pairs: int, batch_tokens: int) -> PredictorTables:
    """``tables`` plus the bigram table learned from ``rows`` (token_ids, positions, topk_ids and
    step_ids or ``batch_tokens`` windows); max_pairs: at most this many pairs, -1 = as many as fit
    in the token table's bytes, 0 = none (``tables`` as they are)."""
    if max_pairs == 0 or not rows:
        return tables
    arr, batch = by_step(rows, batch_tokens)
    tok = arr["token_ids"].astype(np.int64)
    keys = bigram_keys(previous_ids(tok, arr["positions"], batch), tok, vocab_size)
    L = tables.token2rank.shape[0]
    # default: the pairs fit in the token table's bytes (6 per id and layer; a pair: 8 + 6 per layer)
    budget = vocab_size * 6 * L // (8 + 6 * L) if max_pairs < 0 else max_pairs
    bk, b2r, bconf = bigram_table(keys, arr["topk_ids"], holds, tables.token2rank, budget)
    return dataclasses.replace(tables, bigram_keys=bk, bigram2rank=b2r, bigram_conf=bconf)


def with_learned(tables: PredictorTables, rows: dict[str, np.ndarray], holds: np.ndarray, vocab_size: int,
                 embeddings: np.ndarray | None, width: int, batch_tokens: int, seed: int) -> PredictorTables:
    """``tables`` plus the learned predictor (:mod:`.learned`) of hidden ``width`` trained on
    ``rows``; embeddings: [V, H] input embeddings, or None for per-id rows."""
    if not rows:
        raise ValueError("--learned: no training rows")
    arr, batch = by_step(rows, batch_tokens)
    tok = arr["token_ids"].astype(np.int64)
    prev = previous_ids(tok, arr["positions"], batch)
    model = train_predictor(tok, prev, layer_targets(arr["topk_ids"], holds), vocab_size, embeddings, width=width,
                            seed=seed)
    return dataclasses.replace(tables, **model.arrays())
