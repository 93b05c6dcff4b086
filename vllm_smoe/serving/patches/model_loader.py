"""vLLM's expert-parallel weight filter, asked per layer: ``weight_utils.should_skip_weight`` is
handed the tensor's name and the loader's ``local_expert_ids`` and tests the expert id alone,
while a placement gives a rank other experts in each layer (:mod:`vllm_smoe.serving.place.expert_filter`)."""

from __future__ import annotations

from typing import Callable

from . import replace


def install(skip: Callable) -> bool:
    """``should_skip_weight(name, ids)`` as vLLM's safetensors iterators call it becomes
    ``skip(name, ids, vLLM's should_skip_weight)`` (idempotent). False where vLLM's differs from
    what this was written for: nothing replaced, vLLM's own test runs."""
    from vllm.model_executor.model_loader import weight_utils

    vllms = weight_utils.should_skip_weight

    def should_skip_weight(weight_name, local_expert_ids):
        return skip(weight_name, local_expert_ids, vllms)

    return replace("weight_utils_should_skip_weight", weight_utils, "should_skip_weight", should_skip_weight)
