"""Which decoder layers of a Hugging Face MoE config route to experts, and how many experts.

Works on a ``transformers`` config object or its ``to_dict()``; no torch, no vLLM.
"""

from __future__ import annotations


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def text_config(cfg):
    """The language model's config of a composite (vision-language) config: its ``text_config``
    (Llama 4, Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V) or ``language_config`` (DeepSeek-VL2), where
    the top level names no decoder layers itself (vLLM's ``hf_text_config``); else ``cfg``."""
    if _get(cfg, "num_hidden_layers") is None and _get(cfg, "n_layers") is None:
        for key in ("text_config", "language_config"):
            sub = _get(cfg, key)
            if sub is not None:
                return sub
    return cfg


def moe_layer_indices(cfg) -> list[int]:
    """Decoder layer indices holding a routed MoE block, in order, by the config keys vLLM's
    models read (not by ``model_type``, so kin architectures that share a key are counted alike):
    ``mlp_layer_types`` ("sparse" / "dense" per layer: EXAONE-MoE, Cohere2-MoE; for other models
    only where no key below is given),
    ``moe_layer_start_index`` / ``_end_index`` / ``_interval`` (ERNIE 4.5),
    ``interleave_moe_layer_step`` (Llama 4; vLLM reads it, not the config's ``moe_layers``),
    ``expert_layer_period`` / ``_offset`` (Jamba), ``num_dense_layers`` (LFM2-MoE, AFMoE),
    ``first_k_dense_replace`` with ``moe_layer_freq`` (DeepSeek, GLM-4.5, dots.llm1, Ling),
    ``decoder_sparse_step`` with ``mlp_only_layers`` (Qwen2/3-MoE); every layer otherwise
    (Mixtral, OLMoE, GPT-OSS, Granite-MoE, MiniMax). A composite config is read at its
    :func:`text_config`."""
    cfg = text_config(cfg)
    n = _get(cfg, "num_hidden_layers", _get(cfg, "n_layers"))  # n_layers: DBRX
    if n is None:
        raise ValueError("config names no decoder layer count (num_hidden_layers / n_layers)")
    n = int(n)
    kinds = _get(cfg, "mlp_layer_types")
    if kinds and _get(cfg, "model_type") in LAYER_KIND_MODELS:
        return _layer_kinds(kinds, n)
    if any(_get(cfg, k) is not None for k in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")):
        start = int(_get(cfg, "moe_layer_start_index", 0) or 0)
        end = _get(cfg, "moe_layer_end_index", n - 1)
        end = n - 1 if end is None or int(end) < 0 else int(end)
        every = int(_get(cfg, "moe_layer_interval", 1) or 1)
        return [i for i in range(n) if start <= i <= end and (i + 1) % every == 0]
    step = _get(cfg, "interleave_moe_layer_step")
    if step is not None:
        return [i for i in range(n) if int(step) > 0 and (i + 1) % int(step) == 0]
    period = _get(cfg, "expert_layer_period")
    if period is not None:
        offset = int(_get(cfg, "expert_layer_offset", 0) or 0)
        return [i for i in range(n) if int(period) > 0 and i % int(period) == offset]
    if _get(cfg, "num_dense_layers") is not None:
        return list(range(int(_get(cfg, "num_dense_layers") or 0), n))
    if _get(cfg, "first_k_dense_replace") is not None:
        first = int(_get(cfg, "first_k_dense_replace", 0) or 0)
        freq = int(_get(cfg, "moe_layer_freq", 1) or 1)
        return [i for i in range(n) if i >= first and i % freq == 0]
    if _get(cfg, "decoder_sparse_step") is not None or _get(cfg, "mlp_only_layers") is not None:
        step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(_get(cfg, "mlp_only_layers", []) or [])
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if kinds:
        return _layer_kinds(kinds, n)
    return list(range(n))


# models whose vLLM class reads ``mlp_layer_types`` before any other key; transformers also fills
# that list in for configs whose vLLM class reads other keys (and with other kinds), so elsewhere
# it counts only where no other key does
LAYER_KIND_MODELS = ("exaone_moe", "cohere2_moe", "laguna")


def _layer_kinds(kinds, n: int) -> list[int]:
    if len(kinds) < n or any(k not in ("sparse", "dense") for k in kinds[:n]):
        raise ValueError(f"config field 'mlp_layer_types' = {kinds!r}: expected 'sparse' or 'dense' for each of "
                         f"the {n} decoder layers")
    return [i for i in range(n) if kinds[i] == "sparse"]


def _ffn(cfg):
    """DBRX keeps its expert count and top-k in a nested ``ffn_config``."""
    ffn = _get(cfg, "ffn_config")
    return ffn if ffn is not None else {}


def num_experts(cfg) -> int:
    cfg = text_config(cfg)
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        v = _get(cfg, key)
        if v:
            return int(v)
    if _get(_ffn(cfg), "moe_num_experts"):
        return int(_get(_ffn(cfg), "moe_num_experts"))
    raise ValueError("config names no expert count (num_experts / num_local_experts / n_routed_experts / "
                     "moe_num_experts / ffn_config.moe_num_experts)")


def top_k(cfg) -> int:
    cfg = text_config(cfg)
    for key in ("num_experts_per_tok", "moe_k", "moe_topk"):
        v = _get(cfg, key)
        if v:
            return int(v)
    if _get(_ffn(cfg), "moe_top_k"):
        return int(_get(_ffn(cfg), "moe_top_k"))
    raise ValueError("config names no routed experts per token (num_experts_per_tok / moe_k / moe_topk / "
                     "ffn_config.moe_top_k)")


def expert_groups(cfg) -> int:
    """Groups of grouped top-k routing (DeepSeek-V3 style); 1 when routing is not grouped."""
    cfg = text_config(cfg)
    return int(_get(cfg, "n_group", 1) or 1)
