"""``load_format="smoe"``: vLLM's default loader, with experts renamed to their placed slots.

While weights stream from the checkpoint, ``...layers.{i}.<moe>.experts.{e}.*`` becomes
``experts.{expert2slot[e]}.*`` and the router's rows (and a per-expert score bias) are reordered
the same way, so physical slot s computes exactly what logical expert slot2expert[s] did: the
served model is the same function. Routing captured in record mode is mapped back to logical
ids. Imported only inside vLLM processes (it imports torch and vLLM).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Generator, Iterable

import numpy as np
import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..config import SmoeConfig
from .load_plan import LoadPlan, plan_for

logger = logging.getLogger("vllm.smoe")  # under vLLM's logger: same handlers and level

_EXPERT = re.compile(r"^(?P<pre>.*\.layers\.(?P<layer>\d+)\.(?:[^.]+\.)*?)experts\.(?P<e>\d+)\.(?P<rest>.+)$")
_FUSED = re.compile(r"^.*\.layers\.(?P<layer>\d+)\..*\.experts\.(?:gate_up_proj|down_proj)(?:\.weight)?$")
_ROUTER = re.compile(r"^.*\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.gate\.(?:weight|e_score_correction_bias)$")


def permute_weights(weights: Iterable[tuple[str, torch.Tensor]], plan: LoadPlan, counts: dict | None = None
                    ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Rename per-expert tensors to their slots; reorder router rows and fused expert tensors.
    ``counts`` (optional) tallies "renamed" and "reordered" tensors."""
    counts = counts if counts is not None else {}
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m is not None:
            layer = plan.layer_of(int(m["layer"]))
            if layer is not None:
                slot = int(plan.expert2slot[layer, int(m["e"])])
                name = f"{m['pre']}experts.{slot}.{m['rest']}"
                counts["renamed"] = counts.get("renamed", 0) + 1
            yield name, tensor
            continue
        m = _ROUTER.match(name) or _FUSED.match(name)
        if m is not None:
            layer = plan.layer_of(int(m["layer"]))
            if layer is not None:
                idx = torch.as_tensor(plan.slot2expert[layer], device=tensor.device)
                tensor = tensor.index_select(0, idx)
                counts["reordered"] = counts.get("reordered", 0) + 1
        yield name, tensor


class SmoeModelLoader(DefaultModelLoader):
    """DefaultModelLoader + the placement's slot permutation."""

    def __init__(self, load_config):
        inner = copy.copy(load_config)
        inner.load_format = "auto"  # the file discovery of the default loader
        super().__init__(inner)
        self.plan: LoadPlan | None = None

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        cfg = SmoeConfig.from_additional_config(vllm_config.additional_config)
        if cfg is not None and cfg.placement is not None:
            self.plan = plan_for(cfg.placement, vllm_config)
        model = super().load_model(vllm_config, model_config, prefix)
        if cfg is not None and cfg.mode == "record":
            from .recorder import install_recorder

            install_recorder(model, vllm_config, cfg, self.plan)
        if cfg is not None and cfg.mode == "speculate":
            from .token_order import install_token_order

            install_token_order(model, vllm_config, cfg, self.plan)
        return model

    def _init_ep_weight_filter(self, model_config) -> None:
        super()._init_ep_weight_filter(model_config)
        if self.plan is not None:
            # the filter selects experts by checkpoint id; after renaming, ids are slots
            self.local_expert_ids = None

    def get_all_weights(self, model_config, model):
        weights = super().get_all_weights(model_config, model)
        if self.plan is None:
            yield from weights
            return
        counts: dict = {}
        yield from permute_weights(weights, self.plan, counts)
        moved = int(np.count_nonzero(self.plan.slot2expert != np.arange(self.plan.slot2expert.shape[1])))
        logger.info("smoe: placement applied: %d expert tensors renamed, %d router/fused tensors reordered, "
                    "%d of %d expert slots changed", counts.get("renamed", 0), counts.get("reordered", 0), moved,
                    self.plan.slot2expert.size)


_registered = False


def register_loader() -> None:
    global _registered
    if not _registered:
        register_model_loader("smoe")(SmoeModelLoader)
        _registered = True
