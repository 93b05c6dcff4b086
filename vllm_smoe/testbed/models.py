"""Tiny MoE checkpoints in the ``save_pretrained`` layout vLLM loads, built offline.

Shapes respect what vLLM's CPU build needs: head_dim 32/64/..., hidden a multiple of 32, fp32.
"""

from __future__ import annotations

import os

from ..formats.model_info import moe_layer_indices, num_experts, top_k

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "qwen2_moe", "olmoe", "glm4_moe", "llama4", "gpt_oss",
         "granitemoe", "exaone_moe")
TRAINABLE = ("qwen3_moe", "deepseek_v2", "deepseek_v3")

# The trained multi-domain fixture and the random fixtures share these sizes.
TINY = dict(vocab_size=4096, hidden_size=128, num_layers=4, num_experts=32, top_k=4, moe_intermediate_size=64)


def make_config(arch: str, vocab_size: int, hidden_size: int = 128, num_layers: int = 4,
                num_experts: int = 32, top_k: int = 4, moe_intermediate_size: int = 64,
                max_position_embeddings: int = 1024, bos_token_id: int = 1, eos_token_id: int = 0):
    """A transformers config object of ``arch`` (one of ARCHS)."""
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32, max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common, num_key_value_heads=max(1, hidden_size // 64), head_dim=32,
            intermediate_size=4 * hidden_size, moe_intermediate_size=moe_intermediate_size,
            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01,
            output_router_logits=False,
        )
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            **common, num_key_value_heads=max(1, hidden_size // 64), head_dim=32,
            intermediate_size=moe_intermediate_size, num_local_experts=num_experts,
            num_experts_per_tok=top_k, router_aux_loss_coef=0.01,
        )
    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config

        # vLLM 0.32's CPU MLA decode kernel takes only kv_lora_rank 512 with qk_rope_head_dim 64
        # (head 576); one dense layer first, as DeepSeek-V2 has.
        return DeepseekV2Config(
            **common, num_key_value_heads=hidden_size // 32, intermediate_size=4 * hidden_size,
            moe_intermediate_size=moe_intermediate_size, n_routed_experts=num_experts,
            n_shared_experts=1, num_experts_per_tok=top_k, first_k_dense_replace=1, moe_layer_freq=1,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            n_group=1, topk_group=1, topk_method="greedy", routed_scaling_factor=1.0,
            norm_topk_prob=False, scoring_func="softmax",
        )
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        # DeepSeek-V3's routing: sigmoid scores plus the balancing bias (e_score_correction_bias,
        # "noaux_tc"), group-limited top-k (4 groups of 8 at 32 experts, 2 groups per token),
        # normalised weights scaled by 2.5; a low-rank query (q_lora_rank) as V3 has.
        return DeepseekV3Config(
            **common, num_key_value_heads=hidden_size // 32, intermediate_size=4 * hidden_size,
            moe_intermediate_size=moe_intermediate_size, n_routed_experts=num_experts,
            n_shared_experts=1, num_experts_per_tok=top_k, first_k_dense_replace=1,
            kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            n_group=max(1, num_experts // 8), topk_group=min(2, max(1, num_experts // 8)),
            routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
            num_mtp_layers=0,
        )
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        # a shared expert behind a sigmoid gate beside the routed ones; softmax top-k, not renormalised
        return Qwen2MoeConfig(
            **common, num_key_value_heads=max(1, hidden_size // 64), intermediate_size=4 * hidden_size,
            moe_intermediate_size=moe_intermediate_size, shared_expert_intermediate_size=2 * moe_intermediate_size,
            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[], router_aux_loss_coef=0.01, output_router_logits=False,
        )
    if arch == "olmoe":
        from transformers import OlmoeConfig

        # query / key norms over the whole projection; softmax top-k, not renormalised
        return OlmoeConfig(
            **common, num_key_value_heads=hidden_size // 32, intermediate_size=moe_intermediate_size,
            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=False,
            router_aux_loss_coef=0.01, output_router_logits=False,
        )
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        # GLM-4.5's shape: dense first layer(s), a shared expert, DeepSeek-V3's sigmoid grouped
        # top-k with the correction bias, half-rotary GQA attention with query / key norms
        return Glm4MoeConfig(
            **common, num_key_value_heads=max(1, hidden_size // 64), head_dim=32,
            intermediate_size=4 * hidden_size, moe_intermediate_size=moe_intermediate_size,
            n_routed_experts=num_experts, n_shared_experts=1, num_experts_per_tok=top_k,
            first_k_dense_replace=1, n_group=max(1, num_experts // 8),
            topk_group=min(2, max(1, num_experts // 8)), routed_scaling_factor=2.5, norm_topk_prob=True,
            use_qk_norm=True,
        )
    if arch == "llama4":
        from transformers import Llama4TextConfig

        # Llama 4's text model: experts every second layer (interleave_moe_layer_step), a shared
        # expert, a sigmoid router over stacked expert tensors; top-k as given (Llama 4 uses 1)
        return Llama4TextConfig(
            **common, num_key_value_heads=max(1, hidden_size // 64), head_dim=32,
            intermediate_size=moe_intermediate_size, intermediate_size_mlp=4 * hidden_size,
            num_local_experts=num_experts, num_experts_per_tok=top_k, interleave_moe_layer_step=2,
        )
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        # GPT-OSS's shape: stacked experts with per-expert biases, a router with a bias, attention
        # sinks, sliding and full attention layers alternating (unquantized here, not MXFP4)
        return GptOssConfig(
            **common, num_key_value_heads=max(1, hidden_size // 64), head_dim=32,
            intermediate_size=moe_intermediate_size, num_local_experts=num_experts, num_experts_per_tok=top_k,
            sliding_window=64, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(num_layers)],
        )
    if arch == "granitemoe":
        from transformers import GraniteMoeConfig

        # Granite-MoE: stacked experts (input_linear / output_linear), a router named router.layer
        return GraniteMoeConfig(
            **common, num_key_value_heads=max(1, hidden_size // 64), intermediate_size=moe_intermediate_size,
            num_local_experts=num_experts, num_experts_per_tok=top_k,
        )
    if arch == "exaone_moe":
        from transformers import AutoConfig

        # EXAONE-MoE: layer kinds listed (mlp_layer_types, a dense first layer), sigmoid routing with
        # a score bias straight under the block (mlp.e_score_correction_bias), a shared expert
        return AutoConfig.for_model(
            "exaone_moe", **common, num_key_value_heads=max(1, hidden_size // 64), head_dim=32,
            intermediate_size=4 * hidden_size, moe_intermediate_size=moe_intermediate_size,
            num_experts=num_experts, num_experts_per_tok=top_k, num_shared_experts=1, first_k_dense_replace=1,
            mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1),
            layer_types=["sliding_attention"] * num_layers,
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def moe_shape(config) -> dict[str, int]:
    """num_layers (MoE layers), num_experts, top_k of a transformers config."""
    return dict(num_layers=len(moe_layer_indices(config)), num_experts=num_experts(config), top_k=top_k(config))


def build_random(arch: str, out_dir: str, tokenizer_dir: str, seed: int = 0, **sizes) -> str:
    """Random-weight checkpoint of ``arch`` with the tokenizer from ``tokenizer_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    cfg = make_config(arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir

