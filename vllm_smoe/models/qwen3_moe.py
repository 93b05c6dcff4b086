"""Qwen3-MoE for ``mode: speculate`` (vLLM's attention with q/k norms; dense MLP layers kept)."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeForCausalLM, Qwen3MoeMLP

from ..speculative_moe import SpecRuntime
from .stack import Arch, init_causal_lm, load_weights


def _attention(vllm_config: VllmConfig, prefix: str):
    c = vllm_config.model_config.hf_text_config
    return Qwen3MoeAttention(
        hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        rope_parameters=c.rope_parameters, max_position_embeddings=getattr(c, "max_position_embeddings", 8192),
        rms_norm_eps=c.rms_norm_eps, qkv_bias=getattr(c, "attention_bias", False),
        head_dim=getattr(c, "head_dim", None), cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config, prefix=prefix,
        dual_chunk_attention_config=getattr(c, "dual_chunk_attention_config", None))


def _dense(vllm_config: VllmConfig, prefix: str):
    c = vllm_config.model_config.hf_text_config
    return Qwen3MoeMLP(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, hidden_act=c.hidden_act,
                       quant_config=vllm_config.quant_config, prefix=prefix)


QWEN3_MOE = Arch(attention=_attention, dense_mlp=_dense, moe_name="mlp",
                 proj_names=("gate_proj", "up_proj", "down_proj"),
                 expert_size=lambda c: c.moe_intermediate_size, renormalize=lambda c: bool(c.norm_topk_prob))


class SmoeQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3MoeForCausalLM with expert-parallel speculative MoE blocks."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", runtime: SpecRuntime):
        init_causal_lm(self, vllm_config, prefix, QWEN3_MOE, runtime)

    load_weights = load_weights
