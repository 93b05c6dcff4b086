"""Which decoder layers of a Hugging Face MoE config route to experts, and how many experts.

Works on a ``transformers`` config object or its ``to_dict()``; no torch, no vLLM.
"""

from __future__ import annotations


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def moe_layer_indices(cfg) -> list[int]:
    """Decoder layer indices holding a routed MoE block, in order."""
    n = int(_get(cfg, "num_hidden_layers"))
    mt = _get(cfg, "model_type", "")
    if mt in ("qwen3_moe", "qwen2_moe"):
        step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(_get(cfg, "mlp_only_layers", []) or [])
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if mt in ("deepseek_v2", "deepseek_v3"):
        first = int(_get(cfg, "first_k_dense_replace", 0) or 0)
        freq = int(_get(cfg, "moe_layer_freq", 1) or 1)
        return [i for i in range(n) if i >= first and i % freq == 0]
    return list(range(n))


def num_experts(cfg) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = _get(cfg, key)
        if v:
            return int(v)
    raise ValueError("config names no expert count (num_experts / num_local_experts / n_routed_experts)")


def top_k(cfg) -> int:
    return int(_get(cfg, "num_experts_per_tok"))


def expert_groups(cfg) -> int:
    """Groups of grouped top-k routing (DeepSeek-V3 style); 1 when routing is not grouped."""
    return int(_get(cfg, "n_group", 1) or 1)
