"""Qwen3-MoE for ``mode: speculate``: vLLM's own attention, norms, embeddings and dense MLPs;
MoE blocks replaced by :class:`~vllm_smoe.speculative_moe.SpeculativeMoE` behind the opaque
``smoe::ep_moe`` op. Built by smoe's model loader (``create_model``), never registered as an
architecture, so vLLM's bookkeeping still sees ``Qwen3MoeForCausalLM``."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeForCausalLM, Qwen3MoeMLP, \
    Qwen3MoeModel
from vllm.model_executor.models.utils import extract_layer_index

from ..model_info import moe_layer_indices
from ..speculative_moe import SpecRuntime, SpeculativeMoE, register_layer


class SmoeQwen3MoeDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str, runtime: SpecRuntime, moe_index_of: dict):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3MoeAttention(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, rope_parameters=config.rope_parameters,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            rms_norm_eps=config.rms_norm_eps, qkv_bias=getattr(config, "attention_bias", False),
            head_dim=getattr(config, "head_dim", None), cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.self_attn",
            dual_chunk_attention_config=getattr(config, "dual_chunk_attention_config", None))
        layer_idx = extract_layer_index(prefix)
        self.is_moe = layer_idx in moe_index_of
        if self.is_moe:
            self.self_attn.o_proj.reduce_results = False  # the shuffled reduce-scatter sums instead
            self.mlp = SpeculativeMoE(
                hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                renormalize=config.norm_topk_prob, moe_index=moe_index_of[layer_idx], runtime=runtime,
                prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen3MoeMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                   hidden_act=config.hidden_act, quant_config=vllm_config.quant_config,
                                   prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_name = prefix
        register_layer(prefix, self)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        if not self.is_moe:
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual
        out = torch.ops.smoe.ep_moe(hidden_states, residual, token_ids, self.layer_name)
        # out already holds moe_output + residual; the next fused add-norm adds an exact zero
        return out, torch.zeros_like(out)


class SmoeQwen3MoeModel(Qwen3MoeModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", runtime: SpecRuntime):
        config = vllm_config.model_config.hf_text_config
        moe_index_of = {layer: k for k, layer in enumerate(moe_layer_indices(config))}
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=lambda vllm_config, prefix: SmoeQwen3MoeDecoderLayer(
                             vllm_config, prefix, runtime, moe_index_of))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        # without ids (embeddings given) the token table has nothing to look up: the layer prior
        # and the Markov table still predict
        token_ids = input_ids if input_ids is not None else torch.zeros(
            hidden_states.shape[0], dtype=torch.long, device=hidden_states.device)
        residual = None
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual, token_ids)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class SmoeQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3MoeForCausalLM with expert-parallel speculative MoE blocks."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", runtime: SpecRuntime):
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.utils import maybe_prefix

        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.config, self.quant_config = config, vllm_config.quant_config
        self.model = SmoeQwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                       runtime=runtime)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=self.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.moe_layers = []  # vLLM's EPLB bookkeeping: smoe places experts itself
        self.num_moe_layers = sum(1 for m in self.model.layers if getattr(m, "is_moe", False))
        self.num_expert_groups, self.num_shared_experts = 1, 0
        self.num_logical_experts = self.num_physical_experts = self.num_routed_experts = config.num_experts
        self.num_local_physical_experts = config.num_experts // runtime.size
        self.num_redundant_experts = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights)
