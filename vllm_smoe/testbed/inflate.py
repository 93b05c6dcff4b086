"""Lossless widening of a trained MoE checkpoint to production row sizes.

A tiny trained fixture routes like a real model (hot tokens, domain experts) but its rows are a
few hundred bytes and its weights sit in cache, so no link speed matters when it is served.
Widening keeps every function the model computes while the rows, expert FFNs and attention get
the sizes that make a serving step cost what it costs in production:

- hidden H -> H': every tensor that reads the residual stream gets zero input columns
  (router, q/k/v, MLA down-projections, expert gate/up, lm_head), every tensor that writes it
  gets zero output rows (embedding, o_proj, down_proj). The residual stream is then the old one
  followed by zeros. Each hidden RMSNorm sees mean(x^2) shrunk by H/H', so its weight is scaled
  by sqrt(H/H') and ``rms_norm_eps`` by H/H' (the eps is shared with the per-head norms, whose
  inputs are unchanged: the one inexact step, ~eps relative).
- expert FFN I -> I' (routed and shared experts, and the dense MLP): new rows of gate and up
  are zero, so silu(gate) * up is 0 there, and down_proj's new columns are zero.
- attention heads nh -> nh' (and kv heads for GQA): new heads have zero q/k/v rows and zero
  o_proj columns; old query heads keep their kv head (head i moves to (i // g) * g' + i % g for
  group sizes g -> g'). MLA's latent sizes (``kv_lora_rank``, rope dims) stay, as vLLM's CPU
  kernel takes only those.

Arrays in and out: tensors of any dtype keep it (RMSNorm scaling is done in fp32 and cast back).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

SUPPORTED = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")

# (name pattern, kind of dim 0, kind of dim 1): "H" hidden, "I" routed expert FFN, "S" shared
# expert FFN, "D" dense MLP, "Q" query heads x block, "K" kv heads x block, "N" RMSNorm over H,
# None unchanged. First match wins: experts before the dense MLP's names.
_RULES = (
    (r"embed_tokens\.weight", None, "H"),
    (r"lm_head\.weight", None, "H"),
    (r"(input_layernorm|post_attention_layernorm|model\.norm)\.weight", "N", None),
    (r"self_attn\.(q_norm|k_norm|q_a_layernorm|kv_a_layernorm)\.weight", None, None),
    (r"self_attn\.q_proj\.(weight|bias)", "Q:q", "H"),
    (r"self_attn\.[kv]_proj\.(weight|bias)", "K:q", "H"),
    (r"self_attn\.o_proj\.weight", "H", "Q:v"),
    (r"self_attn\.(kv_a_proj_with_mqa|q_a_proj)\.weight", None, "H"),
    (r"self_attn\.kv_b_proj\.weight", "Q:kv_b", None),
    (r"self_attn\.q_b_proj\.weight", "Q:q", None),
    (r"(mlp|block_sparse_moe)\.gate\.weight", None, "H"),
    (r"mlp\.gate\.e_score_correction_bias", None, None),
    (r"experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight", "I", "H"),
    (r"experts\.\d+\.(down_proj|w2)\.weight", "H", "I"),
    (r"shared_experts\.(gate_proj|up_proj)\.weight", "S", "H"),
    (r"shared_experts\.down_proj\.weight", "H", "S"),
    (r"mlp\.(gate_proj|up_proj)\.weight", "D", "H"),
    (r"mlp\.down_proj\.weight", "H", "D"),
)


def head_positions(num_heads: int, num_kv_heads: int, new_heads: int, new_kv_heads: int):
    """Where each old query head sits among the new ones: int64 [num_heads], values in
    [0, new_heads). Old head i keeps kv head i // g (g = num_heads / num_kv_heads) under the new
    grouping g' = new_heads / new_kv_heads: it moves to (i // g) * g' + i % g."""
    import numpy as np

    g, g2 = num_heads // num_kv_heads, new_heads // new_kv_heads
    i = np.arange(num_heads)
    return (i // g) * g2 + i % g


def _sizes(cfg: dict) -> dict:
    """The dims the rules name, from a config.json dict (old sizes)."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(f"config.json: model_type {mt!r} cannot be widened; supported: {', '.join(SUPPORTED)}")
    nh = cfg["num_attention_heads"]
    s = dict(H=cfg["hidden_size"], nh=nh, nkv=cfg.get("num_key_value_heads") or nh)
    if mt.startswith("deepseek"):
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        s.update(I=cfg["moe_intermediate_size"], D=cfg["intermediate_size"],
                 S=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                 blocks={"q": nope + rope, "v": v, "kv_b": nope + v}, mla=True)
    else:
        hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
        inter = cfg["intermediate_size"] if mt == "mixtral" else cfg["moe_intermediate_size"]
        s.update(I=inter, D=cfg.get("intermediate_size", inter), S=0, blocks={"q": hd, "v": hd}, mla=False, hd=hd)
    return s


def widen_config(cfg: dict, hidden: int, moe_intermediate: int, heads: int | None = None,
                 kv_heads: int | None = None, intermediate: int | None = None) -> tuple[dict, dict, dict]:
    """The widened config.json dict, and the old and new sizes. Raises ValueError naming the
    option when a size would shrink or does not fit vLLM's CPU kernels."""
    old = _sizes(cfg)
    heads = heads or old["nh"]
    kv_heads = heads if old["mla"] else (kv_heads or old["nkv"])
    if intermediate is None:  # dense MLP: widen in the proportion of the hidden size
        intermediate = max(old["D"], round(old["D"] * hidden / old["H"]))
    checks = (("--hidden", hidden, old["H"]), ("--moe-intermediate", moe_intermediate, old["I"]),
              ("--heads", heads, old["nh"]), ("--kv-heads", kv_heads, old["nkv"]),
              ("--intermediate", intermediate, old["D"]))
    for flag, new, was in checks:
        if new < was:
            raise ValueError(f"{flag} {new} is smaller than the model's {was}: widening only grows a model")
    if hidden % 32:
        raise ValueError(f"--hidden {hidden}: vLLM's CPU kernels need a multiple of 32")
    if not old["mla"] and (heads % kv_heads or heads // kv_heads < old["nh"] // old["nkv"]):
        raise ValueError(f"--heads {heads} / --kv-heads {kv_heads}: need a whole group size of at least the "
                         f"model's {old['nh'] // old['nkv']} query heads per kv head")
    if old["mla"] and hidden % heads:  # transformers' DeepSeek configs refuse it
        raise ValueError(f"--hidden {hidden} is not a multiple of --heads {heads}")
    new = dict(old, H=hidden, I=moe_intermediate, D=intermediate, nh=heads, nkv=kv_heads)
    if old["mla"]:
        new["S"] = moe_intermediate * (cfg.get("n_shared_experts") or 0)
    out = dict(cfg, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
               rms_norm_eps=cfg.get("rms_norm_eps", 1e-6) * old["H"] / hidden)
    if cfg["model_type"] == "mixtral":
        out.update(intermediate_size=moe_intermediate, head_dim=old["hd"])
    else:
        out.update(moe_intermediate_size=moe_intermediate, intermediate_size=intermediate)
        if not old["mla"]:
            out["head_dim"] = old["hd"]
    return out, old, new


def _index(kind: str | None, old: dict, new: dict, size: int, name: str):
    """int64 [size]: where each old index of a dim of ``kind`` lands in the new dim, and the new
    dim's length."""
    import numpy as np

    if kind is None:
        return np.arange(size), size
    if kind in ("H", "N", "I", "S", "D"):
        key = "H" if kind == "N" else kind
        if size != old[key]:
            raise ValueError(f"tensor {name}: dim of {size}, config.json says {old[key]} ({kind})")
        return np.arange(size), new[key]
    heads, block = kind.split(":")
    b = old["blocks"][block]
    if heads == "Q":
        n_old, n_new = old["nh"], new["nh"]
        pos = np.arange(n_old) if old["mla"] else head_positions(old["nh"], old["nkv"], new["nh"], new["nkv"])
    else:
        n_old, n_new, pos = old["nkv"], new["nkv"], np.arange(old["nkv"])
    if size != n_old * b:
        raise ValueError(f"tensor {name}: dim of {size}, config.json says {n_old} heads x {b}")
    return (pos[:, None] * b + np.arange(b)[None, :]).reshape(-1), n_new * b


def widen_tensor(name: str, t, old: dict, new: dict):
    """The widened copy of one checkpoint tensor (torch, any dtype). Raises ValueError for a
    tensor no rule names: copying it unchanged could silently break the widening."""
    import torch

    for pattern, k0, k1 in _RULES:
        if re.search(pattern + "$", name):
            break
    else:
        raise ValueError(f"tensor {name}: no widening rule for it (architectures: {', '.join(SUPPORTED)})")
    kinds = (k0, k1)[: t.dim()]
    if t.dim() > 2 or (t.dim() == 1 and k1 is not None):
        raise ValueError(f"tensor {name}: shape {tuple(t.shape)} does not fit its rule")
    idx = [_index(k, old, new, n, name) for k, n in zip(kinds, t.shape)]
    out = torch.zeros([n for _, n in idx], dtype=t.dtype)
    src = t
    if k0 == "N":
        src = (t.float() * math.sqrt(old["H"] / new["H"])).to(t.dtype)
    if t.dim() == 1:
        out[torch.from_numpy(idx[0][0])] = src
    else:
        out[torch.from_numpy(idx[0][0])[:, None], torch.from_numpy(idx[1][0])[None, :]] = src
    return out


def inflate_checkpoint(src: str, dst: str, hidden: int, moe_intermediate: int, heads: int | None = None,
                       kv_heads: int | None = None, intermediate: int | None = None) -> dict:
    """Write the widened checkpoint of ``src`` (a save_pretrained directory) to ``dst``; returns
    a summary (old and new sizes, parameters). Tokenizer and other files are copied as they are."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    new_cfg, old, new = widen_config(cfg, hidden, moe_intermediate, heads, kv_heads, intermediate)
    shards = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{src}: no .safetensors files")
    tensors, params = {}, [0, 0]
    for shard in shards:
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                tensors[name] = widen_tensor(name, t, old, new)
                params[0] += t.numel()
                params[1] += tensors[name].numel()
    os.makedirs(dst, exist_ok=True)
    for n in os.listdir(src):  # tokenizer, generation config, ...
        if not n.endswith(".safetensors") and n not in ("config.json", "model.safetensors.index.json") \
                and os.path.isfile(os.path.join(src, n)):
            shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(new_cfg, f, indent=2)
    keys = ("H", "I", "S", "D", "nh", "nkv")
    summary = {"source": os.path.abspath(src), "old": {k: old[k] for k in keys}, "new": {k: new[k] for k in keys},
               "parameters": {"old": params[0], "new": params[1]}}
    with open(os.path.join(dst, "smoe-inflate.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
