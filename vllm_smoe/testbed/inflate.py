"""Lossless widening of a trained MoE checkpoint to production row sizes.

A tiny trained fixture routes like a real model (hot tokens, domain experts) but its rows are a
few hundred bytes and its weights sit in cache, so no link speed matters when it is served.
Widening keeps every function the model computes while the rows, expert FFNs and attention get
the sizes that make a serving step cost what it costs in production (the rules per tensor:
:func:`widen_tensor`).

Arrays in and out: tensors of any dtype keep it (RMSNorm scaling is done in fp32 and cast back)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

# Per model_type: the config keys of the routed expert FFN ("I") and the dense MLP ("D"); how
# the shared experts' FFN is sized ("S": a config key, "I" for the routed size, "I*key" for the
# routed size times a count, None: none); whether vLLM derives head_dim as hidden / heads (then a
# widened model keeps head_dim by growing the heads with the hidden size); a norm over the whole
# query / key projection (OLMoE's q_norm / k_norm, not per head); and the gate/up layout of
# stacked experts ("c": [gate | up] concatenated, "i": interleaved pairs); whether vLLM's CPU MoE
# kernel takes the expert FFN unpadded (GPT-OSS's activation), so it must be a multiple of 32.
ARCHS = {
    "qwen3_moe": dict(I="moe_intermediate_size", D="intermediate_size"),
    "qwen2_moe": dict(I="moe_intermediate_size", D="intermediate_size", S="shared_expert_intermediate_size",
                      derived_head_dim=True),
    "mixtral": dict(I="intermediate_size"),
    "olmoe": dict(I="intermediate_size", derived_head_dim=True, full_qk_norm=True),
    "granitemoe": dict(I="intermediate_size", derived_head_dim=True, stacked="c"),
    "gpt_oss": dict(I="intermediate_size", stacked="i", unpadded_ffn=True),
    "llama4_text": dict(I="intermediate_size", D="intermediate_size_mlp", S="I", stacked="c"),
    "glm4_moe": dict(I="moe_intermediate_size", D="intermediate_size", S="I*n_shared_experts"),
    "exaone_moe": dict(I="moe_intermediate_size", D="intermediate_size", S="I*num_shared_experts"),
    "deepseek_v2": dict(I="moe_intermediate_size", D="intermediate_size", S="I*n_shared_experts", mla=True),
    "deepseek_v3": dict(I="moe_intermediate_size", D="intermediate_size", S="I*n_shared_experts", mla=True),
}
SUPPORTED = tuple(ARCHS)

# (name pattern, kind of each dim) for the tensors every architecture names alike; kinds: "H"
# hidden, "I" routed expert FFN, "Ic" / "Ii" stacked gate and up (concatenated / interleaved), "S"
# shared expert FFN, "D" dense MLP, "Q:b" query heads x block b, "K:b" kv heads x block b, "N"
# RMSNorm over H, None unchanged (an expert or head-internal dim); and the tensor's role: "w"
# writes the residual stream, "q" / "k" feed a norm over all query / key heads (OLMoE), None
# neither. First match wins: the model type's own rules, then the shared ones.
_RULES = (
    (r"embed_tokens\.weight", (None, "H"), "e"),
    (r"lm_head\.weight", (None, "H"), None),
    (r"(input_layernorm|post_attention_layernorm|model\.norm)\.weight", ("N",), None),
    (r"self_attn\.(q_norm|k_norm|q_a_layernorm|kv_a_layernorm)\.weight", (None,), None),
    (r"self_attn\.q_proj\.weight", ("Q:q", "H"), None),
    (r"self_attn\.q_proj\.bias", ("Q:q",), None),
    (r"self_attn\.[kv]_proj\.weight", ("K:q", "H"), None),
    (r"self_attn\.[kv]_proj\.bias", ("K:q",), None),
    (r"self_attn\.o_proj\.weight", ("H", "Q:v"), "w"),
    (r"self_attn\.o_proj\.bias", ("H",), "w"),
    (r"self_attn\.sinks", ("Q:one",), None),
    (r"self_attn\.(kv_a_proj_with_mqa|q_a_proj)\.weight", (None, "H"), None),
    (r"self_attn\.kv_b_proj\.weight", ("Q:kv_b", None), None),
    (r"self_attn\.q_b_proj\.weight", ("Q:q", None), None),
    (r"(mlp|block_sparse_moe|feed_forward)\.(gate|router|router\.layer)\.weight", (None, "H"), None),
    (r"(mlp|feed_forward)\.(gate\.e_score_correction_bias|e_score_correction_bias|router\.bias)", (None,), None),
    (r"experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight", ("I", "H"), None),
    (r"experts\.\d+\.(down_proj|w2)\.weight", ("H", "I"), "w"),
    (r"experts\.down_proj", (None, "I", "H"), "w"),  # stacked [E, I, H]
    (r"experts\.down_proj_bias", (None, "H"), "w"),
    (r"shared_experts?\.(gate_proj|up_proj)\.weight", ("S", "H"), None),
    (r"shared_experts?\.down_proj\.weight", ("H", "S"), "w"),
    (r"shared_expert_gate\.weight", (None, "H"), None),
    (r"(mlp|feed_forward)\.(gate_proj|up_proj)\.weight", ("D", "H"), None),
    (r"(mlp|feed_forward)\.down_proj\.weight", ("H", "D"), "w"),
)


def _arch_rules(mt: str, spec: dict) -> tuple:
    """The rules of ``mt``: its own first (stacked gate/up layouts, whole-projection norms)."""
    own = []
    if spec.get("full_qk_norm"):  # q / k feed only these norms: scaled up, their mean square stays
        own += [(r"self_attn\.q_norm\.weight", ("Q:q",), "qn"), (r"self_attn\.k_norm\.weight", ("K:q",), "kn"),
                (r"self_attn\.q_proj\.weight", ("Q:q", "H"), "q"), (r"self_attn\.q_proj\.bias", ("Q:q",), "q"),
                (r"self_attn\.k_proj\.weight", ("K:q", "H"), "k"), (r"self_attn\.k_proj\.bias", ("K:q",), "k")]
    layout = spec.get("stacked")
    if layout:
        gu = "Ic" if layout == "c" else "Ii"
        own += [(r"experts\.gate_up_proj", (None, "H", gu), None), (r"experts\.gate_up_proj_bias", (None, gu), None),
                (r"block_sparse_moe\.input_linear\.weight", (None, gu, "H"), None),
                (r"block_sparse_moe\.output_linear\.weight", (None, "H", "I"), "w")]
    return tuple(own) + _RULES


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
    if mt not in ARCHS:
        raise ValueError(f"config.json: model_type {mt!r} cannot be widened; supported: {', '.join(SUPPORTED)}")
    spec = ARCHS[mt]
    nh = cfg["num_attention_heads"]
    s = dict(H=cfg["hidden_size"], nh=nh, nkv=cfg.get("num_key_value_heads") or nh, I=cfg[spec["I"]],
             mt=mt, spec=spec, mla=bool(spec.get("mla")))
    s["D"] = cfg.get(spec["D"], s["I"]) if spec.get("D") else s["I"]
    s["S"] = _shared(cfg, spec, s["I"]) or 0
    if s["mla"]:
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        s["blocks"] = {"q": nope + rope, "v": v, "kv_b": nope + v, "one": 1}
    else:
        hd = cfg.get("head_dim") if not spec.get("derived_head_dim") else None
        hd = hd or cfg["hidden_size"] // nh
        s.update(blocks={"q": hd, "v": hd, "one": 1}, hd=hd)
    return s


def _shared(cfg: dict, spec: dict, routed: int) -> int | None:
    """The shared experts' FFN size for a routed FFN size of ``routed`` (None: no shared experts)."""
    rule = spec.get("S")
    if rule is None:
        return None
    if rule == "I":
        return routed
    if rule.startswith("I*"):
        return routed * (cfg.get(rule[2:]) or 0)
    return cfg.get(rule)


def widen_config(cfg: dict, hidden: int, moe_intermediate: int, heads: int | None = None,
                 kv_heads: int | None = None, intermediate: int | None = None) -> tuple[dict, dict, dict]:
    """The widened config.json dict (embeddings untied), and the old and new sizes. Raises
    ValueError naming the option when a size would shrink or does not fit vLLM's CPU kernels."""
    old = _sizes(cfg)
    spec = old["spec"]
    if spec.get("derived_head_dim") and heads is None:  # vLLM takes head_dim = hidden / heads
        if hidden % old["hd"]:
            raise ValueError(f"--hidden {hidden}: {old['mt']} keeps head_dim = hidden / heads, so the hidden size must "
                             f"be a multiple of its head_dim {old['hd']}")
        heads = hidden // old["hd"]
        if kv_heads is None and old["nkv"] != old["nh"]:
            g = old["nh"] // old["nkv"]
            if heads % g:
                raise ValueError(f"--hidden {hidden}: {old['mt']} takes head_dim = hidden / heads, so this size gives "
                                 f"{heads} heads, which {g} query heads per kv head do not divide: choose a "
                                 f"multiple of {old['hd'] * g}, or name --kv-heads")
            kv_heads = heads // g
    heads = heads or old["nh"]
    kv_heads = heads if old["mla"] else (kv_heads or (heads if old["nkv"] == old["nh"] else old["nkv"]))
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
    if spec.get("unpadded_ffn") and moe_intermediate % 32:
        raise ValueError(f"--moe-intermediate {moe_intermediate}: vLLM's CPU MoE kernel takes {old['mt']}'s expert FFN "
                         f"unpadded, so it must be a multiple of 32 (of 32 x TP to serve it at tensor parallel size TP)")
    if not old["mla"] and (heads % kv_heads or heads // kv_heads < old["nh"] // old["nkv"]):
        raise ValueError(f"--heads {heads} / --kv-heads {kv_heads}: need a whole group size of at least the "
                         f"model's {old['nh'] // old['nkv']} query heads per kv head")
    if old["mla"] and hidden % heads:  # transformers' DeepSeek configs refuse it
        raise ValueError(f"--hidden {hidden} is not a multiple of --heads {heads}")
    if spec.get("derived_head_dim") and heads * old["hd"] != hidden:
        raise ValueError(f"--heads {heads}: {old['mt']} takes head_dim = hidden / heads, so keeping its head_dim "
                         f"{old['hd']} at --hidden {hidden} needs {hidden // old['hd']} heads"
                         + ("" if hidden % old["hd"] == 0 else f" (and a hidden size that is a multiple of {old['hd']})"))
    new = dict(old, H=hidden, I=moe_intermediate, D=intermediate, nh=heads, nkv=kv_heads)
    own_key = spec.get("S") is not None and not spec["S"].startswith("I")
    new["S"] = (max(old["S"], -(-old["S"] * moe_intermediate // old["I"])) if own_key  # grown as the routed FFN
                else _shared(cfg, spec, moe_intermediate) or 0)
    # the embedding carries the residual stream's scale, so it can no longer be the output layer
    out = dict(cfg, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
               tie_word_embeddings=False)
    out[spec["I"]] = moe_intermediate
    if spec.get("D"):
        out[spec["D"]] = intermediate
    if own_key:
        out[spec["S"]] = new["S"]
    if not old["mla"] and not spec.get("derived_head_dim"):
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
    if kind in ("Ic", "Ii"):
        if size != 2 * old["I"]:
            raise ValueError(f"tensor {name}: dim of {size}, config.json says 2 x {old['I']} (gate and up)")
        i = np.arange(old["I"])
        # concatenated: up moves behind the wider gate; interleaved: (gate, up) pairs keep their place
        return (np.concatenate([i, new["I"] + i]) if kind == "Ic" else np.arange(size)), 2 * new["I"]
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
    tensor no rule names: copying it unchanged could silently break the widening.

    - hidden H -> H': every tensor that reads the residual stream gets zero input columns
      (router, q/k/v, MLA down-projections, expert gate/up, lm_head), every tensor that writes it
      gets zero output rows (embedding, o_proj, down_proj). The residual stream is then the old one
      times c = sqrt(H'/H) followed by zeros: the writers' rows are scaled by c, so that every hidden
      RMSNorm sees the old mean(x^2) over its wider row and the eps keeps its weight (exact whatever
      the eps, including models whose eps vLLM fixes, OLMoE and GPT-OSS), and each norm's weight by
      1 / c. An embedding that is also the output layer is untied: the widened checkpoint gets its
      own ``lm_head.weight`` (the embedding unscaled) and ``tie_word_embeddings: false``. c is a power
      of two when H'/H is a power of four; otherwise a bf16 / fp16 checkpoint's scaled tensors are
      rounded once (exact to fp32 rounding for fp32 checkpoints).
    - expert FFN I -> I' (routed and shared experts, and the dense MLP): new rows of gate and up
      are zero, so silu(gate) * up is 0 there, and down_proj's new columns are zero.
    - attention heads nh -> nh' (and kv heads for GQA): new heads have zero q/k/v rows and zero
      o_proj columns; old query heads keep their kv head (head i moves to (i // g) * g' + i % g for
      group sizes g -> g'). MLA's latent sizes (``kv_lora_rank``, rope dims) stay, as vLLM's CPU
      kernel takes only those. Where vLLM derives head_dim as hidden / heads (Qwen2-MoE, OLMoE,
      Granite-MoE) the heads grow with the hidden size, so head_dim stays; OLMoE's q / k, read only by
      its norms over the whole projection, are scaled as the residual stream is; attention sinks of new heads
      are 0 (a head whose values are zero adds nothing whatever its sink).
    - stacked experts ([E, ...] tensors: GPT-OSS, Llama 4, Granite-MoE): the same per expert, with
      the gate / up halves kept apart (concatenated: up moves behind the wider gate; GPT-OSS's
      interleaved pairs keep their place); a zero gate row gives 0 in every activation used here
      (SiLU, GPT-OSS's clamped swish-GLU)."""
    import torch

    for pattern, kinds, role in _arch_rules(old["mt"], old["spec"]):
        if re.search(pattern + "$", name):
            break
    else:
        raise ValueError(f"tensor {name}: no widening rule for it (architectures: {', '.join(SUPPORTED)})")
    if t.dim() != len(kinds):
        raise ValueError(f"tensor {name}: shape {tuple(t.shape)} does not fit its rule")
    idx = [_index(k, old, new, n, name) for k, n in zip(kinds, t.shape)]
    out = torch.zeros([n for _, n in idx], dtype=t.dtype)
    scale = _scale(kinds, role, old, new)
    src = t if scale == 1.0 else (t.float() * scale).to(t.dtype)  # in fp32, cast back
    out[torch.meshgrid(*[torch.from_numpy(i) for i, _ in idx], indexing="ij")] = src
    return out


def _scale(kinds: tuple, role: str | None, old: dict, new: dict) -> float:
    """What a tensor's old entries are multiplied by. An RMSNorm over a row with zeros appended
    would see a smaller mean square: the residual stream's writers are scaled by c = sqrt(H'/H),
    so the mean square over H' is the old one over H and the eps keeps its weight (exact whatever
    the eps, also where vLLM fixes a model's eps), and each hidden norm's weight by 1 / c, since
    its output carries the c of its input. OLMoE's q / k (read only by their norms over all heads)
    the same way with sqrt(heads'/heads), their norms' weights with the inverse."""
    if kinds[0] == "N":
        return math.sqrt(old["H"] / new["H"])
    if role in ("w", "e"):
        return math.sqrt(new["H"] / old["H"])
    if role in ("q", "k", "qn", "kn"):
        n = "nh" if role[0] == "q" else "nkv"
        return math.sqrt(new[n] / old[n]) if len(role) == 1 else math.sqrt(old[n] / new[n])
    return 1.0


def inflate_checkpoint(src: str, dst: str, hidden: int, moe_intermediate: int, heads: int | None = None,
                       kv_heads: int | None = None, intermediate: int | None = None) -> dict:
    """Write the widened checkpoint of ``src`` (a save_pretrained directory) to ``dst``; returns
    a summary (old and new sizes, parameters). Tokenizer and other files are copied as they are."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    shards = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{src}: no .safetensors files")
    names = set()
    for shard in shards:
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            names.update(f.keys())
    new_cfg, old, new = widen_config(cfg, hidden, moe_intermediate, heads, kv_heads, intermediate)
    embed = [n for n in names if n.endswith("embed_tokens.weight")]
    untie = not any(n.endswith("lm_head.weight") for n in names)
    if untie and len(embed) != 1:
        raise ValueError(f"{src}: no lm_head.weight and {len(embed)} embed_tokens.weight tensors: cannot untie them")
    tensors, params = {}, [0, 0]
    for shard in shards:
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                tensors[name] = widen_tensor(name, t, old, new)
                params[0] += t.numel()
                params[1] += tensors[name].numel()
                if untie and name == embed[0]:  # the output layer keeps the embedding's old values
                    tensors["lm_head.weight"] = widen_tensor("lm_head.weight", t, old, new)
                    params[1] += tensors["lm_head.weight"].numel()
    os.makedirs(dst, exist_ok=True)
    for n in os.listdir(dst):  # an earlier checkpoint's shards (--force) would shadow this one
        if n.endswith(".safetensors") or n == "model.safetensors.index.json":
            os.remove(os.path.join(dst, n))
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
