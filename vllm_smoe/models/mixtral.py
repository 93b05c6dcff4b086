"""Mixtral for ``mode: speculate`` (every layer MoE; experts named w1 / w3 / w2; top-k renormalised)."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.mixtral import MixtralAttention, MixtralForCausalLM

from ..speculative_moe import SpecRuntime
from .stack import Arch, init_causal_lm, load_weights


def _attention(vllm_config: VllmConfig, prefix: str):
    c = vllm_config.model_config.hf_text_config
    return MixtralAttention(config=c, hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                            max_position=c.max_position_embeddings, num_kv_heads=c.num_key_value_heads,
                            cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                            prefix=prefix)


MIXTRAL = Arch(attention=_attention, dense_mlp=None, moe_name="block_sparse_moe", proj_names=("w1", "w3", "w2"),
               expert_size=lambda c: c.intermediate_size, renormalize=lambda c: True)


class SmoeMixtralForCausalLM(MixtralForCausalLM):
    """MixtralForCausalLM with expert-parallel speculative MoE blocks."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", runtime: SpecRuntime):
        init_causal_lm(self, vllm_config, prefix, MIXTRAL, runtime)

    load_weights = load_weights
