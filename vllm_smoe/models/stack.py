"""The decoder stack smoe builds for ``mode: speculate``, shared by every supported architecture.

vLLM's ``Qwen3MoeModel`` is a plain embed -> decoder layers -> norm stack with a
``decoder_layer_type`` seam (and vLLM's compile decorator); smoe uses that seam for every
architecture and supplies its own decoder layer: the architecture's vLLM attention, and in MoE
layers an un-reduced ``o_proj`` followed by the opaque ``smoe::ep_moe`` op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.model_executor.models.utils import extract_layer_index

from ..model_info import moe_layer_indices, num_experts, top_k
from ..speculative_moe import SpecRuntime, SpeculativeMoE, register_layer


@dataclass(frozen=True)
class Arch:
    """What differs between architectures. attention(vllm_config, prefix) -> module;
    dense_mlp(vllm_config, prefix) -> module for non-MoE layers (None: every layer is MoE);
    moe_name: the MoE block's attribute (checkpoint prefix); proj_names: checkpoint names of
    an expert's (gate, up, down) projections; expert_size(config): intermediate size of one
    expert; renormalize(config): renormalise the top-k router weights."""

    attention: Callable
    dense_mlp: Callable | None
    moe_name: str
    proj_names: tuple[str, str, str]
    expert_size: Callable
    renormalize: Callable


class SmoeDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str, arch: Arch, runtime: SpecRuntime,
                 moe_index_of: dict[int, int]):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.hidden_size = config.hidden_size
        self.self_attn = arch.attention(vllm_config, f"{prefix}.self_attn")
        layer_idx = extract_layer_index(prefix)
        self.is_moe = layer_idx in moe_index_of
        self.moe_name = arch.moe_name
        if self.is_moe:
            self.self_attn.o_proj.reduce_results = False  # the shuffled reduce-scatter sums instead
            setattr(self, arch.moe_name, SpeculativeMoE(
                hidden_size=config.hidden_size, intermediate_size=arch.expert_size(config),
                num_experts=num_experts(config), top_k=top_k(config), renormalize=arch.renormalize(config),
                moe_index=moe_index_of[layer_idx], runtime=runtime, proj_names=arch.proj_names,
                prefix=f"{prefix}.{arch.moe_name}"))
        else:
            setattr(self, arch.moe_name, arch.dense_mlp(vllm_config, f"{prefix}.{arch.moe_name}"))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_name = prefix
        register_layer(prefix, self)

    @property
    def moe(self) -> nn.Module:
        return getattr(self, self.moe_name)

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
            return self.moe(hidden_states), residual
        out = torch.ops.smoe.ep_moe(hidden_states, residual, token_ids, self.layer_name)
        # out already holds moe_output + residual; the next fused add-norm adds an exact zero
        return out, torch.zeros_like(out)


class SmoeMoeModel(Qwen3MoeModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", arch: Arch, runtime: SpecRuntime):
        config = vllm_config.model_config.hf_text_config
        moe_index_of = {layer: k for k, layer in enumerate(moe_layer_indices(config))}
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=lambda vllm_config, prefix: SmoeDecoderLayer(
                             vllm_config, prefix, arch, runtime, moe_index_of))

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


def init_causal_lm(self: nn.Module, vllm_config: VllmConfig, prefix: str, arch: Arch, runtime: SpecRuntime) -> None:
    """The body of a ``*ForCausalLM.__init__`` (vLLM's class is the base, for its interfaces,
    ``compute_logits`` and mappings): the smoe stack, the LM head, vLLM's MoE bookkeeping."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.utils import maybe_prefix

    nn.Module.__init__(self)
    config = vllm_config.model_config.hf_text_config
    self.config, self.quant_config = config, vllm_config.quant_config
    self.model = SmoeMoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), arch=arch,
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
    E = num_experts(config)
    self.num_logical_experts = self.num_physical_experts = self.num_routed_experts = E
    self.num_local_physical_experts = E // runtime.size
    self.num_redundant_experts = 0


def load_weights(self: nn.Module, weights) -> set[str]:
    from vllm.model_executor.models.utils import AutoWeightsLoader

    return AutoWeightsLoader(self).load_weights(weights)
