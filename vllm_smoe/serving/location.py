"""The served placement on the device: the tables the token order's predictors read.
"""

from __future__ import annotations

import torch

from ..placement.learned import LEARNED_FIELDS

TABLE_NAMES = ("token2rank", "token_conf", "markov2rank", "markov_conf", "prior2rank")  # + bigrams when built


def device_tables(tables, device, learned: bool = False) -> dict[str, torch.Tensor]:
    """The predictor tables (``placement.predict.PredictorTables``) as the ops read them: name ->
    tensor on ``device``, floats as float32 (the learned predictor's per-id rows as float16); with
    ``learned``, the learned predictor's arrays too (the tables must carry them)."""
    names = TABLE_NAMES + (("bigram_keys", "bigram2rank", "bigram_conf") if tables.has_bigrams else ())
    if learned:
        names += tuple("learned_" + k for k in LEARNED_FIELDS)
    out = {k: torch.as_tensor(getattr(tables, k)).to(device) for k in names}
    # the learned predictor's per-id rows stay float16 (its largest arrays; read as float32)
    return {k: v.float() if v.is_floating_point() and not k.endswith("_proj") else v for k, v in out.items()}
