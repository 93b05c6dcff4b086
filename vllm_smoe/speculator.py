"""Online token -> rank prediction for ``mode: speculate`` (numpy only, no torch, no vLLM).

The same table look-ups (:func:`placement.predict.predict_layer`) and the same capacity-capped
assignment (:func:`placement.assign.assign_tokens`) that ``smoe-place evaluate`` scores offline,
so what serving does is what the placement was measured on. The predictor only states a
preference; the assignment always caps every rank at ``capacity`` x its fair share of a step.

Predictors: ``tables`` (the placement's trained tables: token id, previous layer's top-1 expert
via the Markov table, layer prior, arbitrated by confidence); ``random`` (a hash of position,
layer and token id: identical on every rank, unrelated to routing); ``one-rank`` (every token
prefers rank 0). The last two exist to show that mispredictions cost bytes, never tokens.
"""

from __future__ import annotations

import numpy as np

from .config import PREDICTORS
from .placement.assign import assign_tokens
from .placement.predict import PredictorTables, predict_layer


class Speculator:
    """ep_size: ranks the experts are split over; capacity: >= 1.0, cap per rank as a multiple
    of T / ep_size; tables: needed for ``tables``; slot2expert: [L, E] int64, logical expert of
    each physical slot (top-1 experts arrive as slots and the Markov table is keyed by logical
    ids), None = identity."""

    def __init__(self, predictor: str, ep_size: int, capacity: float, tables: PredictorTables | None = None,
                 slot2expert: np.ndarray | None = None):
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {predictor!r}")
        if predictor == "tables" and tables is None:
            raise ValueError("predictor 'tables' needs the placement's predictor tables")
        if not capacity >= 1.0:
            raise ValueError(f"capacity must be >= 1.0, got {capacity!r}")
        self.predictor, self.ep_size, self.capacity = predictor, int(ep_size), float(capacity)
        self.tables, self.slot2expert = tables, slot2expert

    def preferences(self, layer: int, token_ids: np.ndarray, prev_top1: np.ndarray | None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(pref [T, 2] int, -1 = none; conf [T] float32) for MoE layer ``layer``.
        token_ids: [T] int; prev_top1: [T] int physical slot of the previous MoE layer's top-1
        expert, or None (first layer, or unknown)."""
        T = token_ids.shape[0]
        if self.predictor == "one-rank":
            return np.zeros((T, 1), np.int64), np.ones(T, np.float32)
        if self.predictor == "random":
            pos = np.arange(T, dtype=np.uint64)
            salt = np.uint64(((layer + 1) * 0x94D049BB133111EB) % (1 << 64))
            h = pos * np.uint64(0x9E3779B97F4A7C15) + token_ids.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + salt
            h ^= h >> np.uint64(31)
            return (h % np.uint64(self.ep_size)).astype(np.int64)[:, None], np.ones(T, np.float32)
        if prev_top1 is not None and layer > 0 and self.slot2expert is not None:
            prev_top1 = self.slot2expert[layer - 1][prev_top1]
        pref, conf, _ = predict_layer(self.tables, layer, token_ids, prev_top1)
        return pref, conf

    def token2rank(self, layer: int, token_ids: np.ndarray, prev_top1: np.ndarray | None = None) -> np.ndarray:
        """[T] int32 rank of every token of one engine step at MoE layer ``layer``; every rank
        computes the same answer from the same inputs."""
        pref, conf = self.preferences(layer, token_ids, prev_top1)
        return assign_tokens(pref, conf, np.zeros(token_ids.shape[0], np.int64), self.ep_size, self.capacity)
