"""From a placement YAML and a model config to the slot permutation applied at load.

Physical slots are ordered rank by rank: slot2expert[l] lists rank 0's experts (ascending
logical id), then rank 1's, ... so that vLLM's contiguous expert split (E/N slots per EP rank)
puts on each rank exactly the experts the YAML gives it. No torch here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..model_info import expert_groups, moe_layer_indices, num_experts, top_k
from ..placement.groups import broken_group
from ..placement_file import Placement, load_placement, model_fingerprint


@dataclass(frozen=True)
class LoadPlan:
    """moe_layers: decoder layer index of each MoE layer, [L]; slot2expert: [L, E] int64,
    logical expert held by each physical slot; expert2slot: [L, E] int64, its inverse."""

    moe_layers: tuple[int, ...]
    slot2expert: np.ndarray
    expert2slot: np.ndarray

    def layer_of(self, decoder_layer: int) -> int | None:
        """MoE ordinal of a decoder layer index, None for dense layers."""
        try:
            return self.moe_layers.index(decoder_layer)
        except ValueError:
            return None


def _checkpoint_config(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def make_load_plan(placement_path: str, hf_config, model_dir: str, ep_ranks: int | None) -> LoadPlan:
    """Validate ``placement_path`` against the served model and build its slot permutation.

    hf_config: the model's transformers config; model_dir: checkpoint directory (for the
    fingerprint); ep_ranks: ranks the experts are split over (None when every rank holds all
    experts). Raises ValueError naming the file and field on any mismatch.
    """
    p: Placement = load_placement(placement_path)
    where = f"{placement_path}"
    layers = moe_layer_indices(hf_config)
    E, K = num_experts(hf_config), top_k(hf_config)
    if p.num_layers != len(layers):
        raise ValueError(f"{where}: field 'model.num_layers' = {p.num_layers} but the model has {len(layers)} "
                         f"MoE layers")
    if p.num_experts != E:
        raise ValueError(f"{where}: field 'model.num_experts' = {p.num_experts} but the model has {E} experts")
    if p.top_k != K:
        raise ValueError(f"{where}: field 'model.top_k' = {p.top_k} but the model routes to {K} experts")
    if p.fingerprint:
        cfg = _checkpoint_config(model_dir)
        if cfg is not None and model_fingerprint(cfg) != p.fingerprint:
            raise ValueError(f"{where}: field 'model.fingerprint' = {p.fingerprint} does not match the model at "
                             f"{model_dir} ({model_fingerprint(cfg)}): built for another checkpoint")
    if ep_ranks is not None and ep_ranks > 1 and p.ep_size != ep_ranks:
        raise ValueError(f"{where}: field 'ep_size' = {p.ep_size} but experts are split over {ep_ranks} ranks")
    if (p.replicas[..., 0] >= 0).any():
        raise ValueError(f"{where}: field 'layers[].replicas': redundant expert copies cannot be applied at load "
                         f"yet; build the placement without --replicas")
    slot2expert = np.argsort(p.expert2rank, axis=1, kind="stable").astype(np.int64)
    expert2slot = np.argsort(slot2expert, axis=1, kind="stable").astype(np.int64)
    groups = expert_groups(hf_config)
    if groups > 1:
        for layer in range(p.num_layers):
            e = broken_group(p.expert2rank[layer], groups)
            if e >= 0:
                raise ValueError(f"{where}: field 'layers[{layer}].expert_to_rank' splits expert {e}'s routing "
                                 f"group ({groups} groups of {E // groups}: a rank must hold whole groups, or a "
                                 f"block of ranks one group); grouped top-k routing would change. Build the "
                                 f"placement with --model {model_dir} (reads n_group) or --groups {groups}")
    return LoadPlan(tuple(layers), slot2expert, expert2slot)


def plan_for(placement_path: str, vllm_config) -> LoadPlan:
    """:func:`make_load_plan` for a vLLM config: experts are split over TP x DP ranks only when
    vLLM's expert parallelism is on."""
    pc = vllm_config.parallel_config
    ep = pc.tensor_parallel_size * pc.data_parallel_size if pc.enable_expert_parallel else None
    mc = vllm_config.model_config
    return make_load_plan(placement_path, mc.hf_config, mc.model, ep)
