"""`smoe-testbed inflate`: a widened checkpoint computes what its source computes.

Checked against transformers (logits, every MoE layer's top-k, argmax) for every shipped
architecture, and in vLLM (greedy tokens of the source and the widened model, fp32)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_smoe.testbed import FIXTURES
from vllm_smoe.testbed.inflate import head_positions, inflate_checkpoint, widen_config
from vllm_smoe.formats.trace import open_trace

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# (hidden, expert FFN, heads, kv heads): irregular multiples, a new GQA group size for Qwen3
# (other architectures: random checkpoints; None where the default is the only choice: heads that
# grow with the hidden size where vLLM derives head_dim from it)
WIDE = {"qwen3_moe": (224, 96, 12, 4), "deepseek_v2": (192, 80, 6, None), "deepseek_v3": (160, 72, 5, None),
        "mixtral": (160, 96, 8, 4), "qwen2_moe": (192, 80, None, None), "olmoe": (224, 72, None, None),
        "granitemoe": (192, 96, None, None), "gpt_oss": (224, 96, 6, 3), "llama4": (192, 72, 8, 4),
        "glm4_moe": (160, 96, 6, 3), "exaone_moe": (224, 80, 8, 4)}


def _ids(arch, n=2, length=40):
    t = open_trace(FIXTURES.get(arch, FIXTURES["qwen3_moe"])[1]["heldout"])
    tok, req = t["token_ids"], t["request_ids"]
    return np.stack([tok[req == r][:length] for r in np.unique(req)[:: 7][:n]]).astype(np.int64)


def _source(arch, tmp_path):
    if arch in FIXTURES:
        return FIXTURES[arch][0]
    from vllm_smoe.testbed.models import build_random

    return build_random(arch, str(tmp_path / "src"), FIXTURES["qwen3_moe"][0], num_layers=2, num_experts=8, top_k=2)


@pytest.mark.parametrize("arch", sorted(WIDE))
def test_widened_model_computes_the_same(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.record import router_topk

    hidden, inter, heads, kv = WIDE[arch]
    src, dst = _source(arch, tmp_path), str(tmp_path / "wide")
    s = inflate_checkpoint(src, dst, hidden, inter, heads=heads, kv_heads=kv)
    assert s["parameters"]["new"] > s["parameters"]["old"]
    cfg = json.load(open(os.path.join(dst, "config.json")))
    was = json.load(open(os.path.join(src, "config.json")))
    # heads not given: they grow with the hidden size, keeping head_dim = hidden / heads
    want = heads or hidden * was["num_attention_heads"] // was["hidden_size"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"]) == (hidden, want)
    ids = torch.from_numpy(_ids(arch))
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert sum(p.numel() for p in b.state_dict().values()) == s["parameters"]["new"]
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert (la - lb).abs().max().item() < 1e-4 * max(1.0, la.abs().max().item())
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
    k = a.config.num_experts_per_tok
    np.testing.assert_array_equal(router_topk(a, ids, k)[0], router_topk(b, ids, k)[0])


def test_cli_refusals(tmp_path):
    src = FIXTURES["qwen3_moe"][0]

    def run(*args):
        return subprocess.run([sys.executable, "-m", "vllm_smoe.tools.testbed_cli", "inflate", src, *args],
                              capture_output=True, text=True)

    out = str(tmp_path / "w")
    for args, said in ((("--hidden", "64", "--moe-intermediate", "64"), "--hidden 64 is smaller"),
                       (("--hidden", "200", "--moe-intermediate", "64"), "multiple of 32"),
                       (("--hidden", "256", "--moe-intermediate", "64", "--heads", "6", "--kv-heads", "4"),
                        "whole group size"),
                       (("--hidden", "256", "--moe-intermediate", "32"), "--moe-intermediate 32 is smaller")):
        r = run("-o", out, *args)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not os.path.exists(os.path.join(out, "model.safetensors"))
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "x"), "w").close()
    r = run("-o", out, "--hidden", "256", "--moe-intermediate", "64")
    assert r.returncode == 2 and "non-empty" in r.stderr
    r = run("-o", src, "--hidden", "256", "--moe-intermediate", "64")
    assert r.returncode == 2 and "must differ" in r.stderr


def test_unknown_tensor_refused(tmp_path):
    from safetensors.torch import save_file

    from vllm_smoe.testbed.inflate import widen_tensor

    cfg = json.load(open(os.path.join(FIXTURES["qwen3_moe"][0], "config.json")))
    _, old, new = widen_config(cfg, 256, 64)
    with pytest.raises(ValueError, match="model.layers.0.mlp.router_bias: no widening rule"):
        widen_tensor("model.layers.0.mlp.router_bias", torch.zeros(32), old, new)
    with pytest.raises(ValueError, match="config.json says 128"):
        widen_tensor("model.layers.0.mlp.gate.weight", torch.zeros(32, 100), old, new)
    bad = tmp_path / "bad"
    os.makedirs(bad)
    json.dump(dict(cfg, model_type="dbrx"), open(bad / "config.json", "w"))
    save_file({"x": torch.zeros(1)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="model_type 'dbrx' cannot be widened"):
        inflate_checkpoint(str(bad), str(tmp_path / "o"), 256, 64)


@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 4), st.integers(0, 3))
def test_head_positions_keep_each_query_heads_kv_head(nkv, g, grow_g, grow_kv):
    nh, nkv2, g2 = nkv * g, nkv + grow_kv, g + grow_g - 1
    pos = head_positions(nh, nkv, nkv2 * g2, nkv2)
    assert len(set(pos.tolist())) == nh and pos.max() < nkv2 * g2
    np.testing.assert_array_equal(pos // g2, np.arange(nh) // g)


def test_heads_follow_the_hidden_size_where_vllm_derives_head_dim():
    cfg = {"model_type": "olmoe", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 64, "rms_norm_eps": 1e-5}
    out, _, new = widen_config(cfg, 192, 64)
    assert (out["num_attention_heads"], out["num_key_value_heads"], new["nh"], new["nkv"]) == (6, 3, 6, 3)
    assert "head_dim" not in out  # vLLM's OLMoE ignores it: hidden / heads is the head dim
    with pytest.raises(ValueError, match="--hidden 144: olmoe keeps head_dim = hidden / heads"):
        widen_config(cfg, 144, 64)
    with pytest.raises(ValueError, match="--hidden 160: olmoe takes head_dim = hidden / heads, so this size gives 5 "
                                         "heads, which 2 query heads per kv head do not divide: choose a multiple of 64"):
        widen_config(cfg, 160, 64)
    with pytest.raises(ValueError, match="--heads 8: olmoe takes head_dim = hidden / heads.*needs 6 heads"):
        widen_config(cfg, 192, 64, heads=8, kv_heads=4)
    # a shared expert sized by its own key grows with the routed FFN (Qwen2-MoE)
    q2 = dict(cfg, model_type="qwen2_moe", moe_intermediate_size=64, shared_expert_intermediate_size=96,
              intermediate_size=512)
    out, _, new = widen_config(q2, 192, 100)
    assert out["shared_expert_intermediate_size"] == new["S"] == 150 and out["moe_intermediate_size"] == 100


def test_stacked_gate_up_layouts():
    from vllm_smoe.testbed.inflate import widen_tensor

    cfg = {"model_type": "gpt_oss", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 32, "intermediate_size": 2}
    with pytest.raises(ValueError, match="--moe-intermediate 3: vLLM's CPU MoE kernel takes gpt_oss's expert FFN"):
        widen_config(cfg, 96, 3)
    _, old, new = widen_config(dict(cfg, model_type="llama4_text", intermediate_size_mlp=8), 96, 3)
    t = torch.arange(1, 2 * 64 * 4 + 1, dtype=torch.float32).view(2, 64, 4)  # [E, H, 2I]: gate, up interleaved
    # GPT-OSS's pairs: the rule is the model type's (checked on the sizes above, which its CPU kernel refuses)
    w = widen_tensor("model.layers.0.mlp.experts.gate_up_proj", t, dict(old, mt="gpt_oss", spec={"stacked": "i"}),
                     new)
    assert w.shape == (2, 96, 6) and torch.equal(w[:, :64, :4], t) and not w[:, 64:].any() and not w[..., 4:].any()
    w = widen_tensor("model.layers.1.feed_forward.experts.gate_up_proj", t, old, new)
    # [gate | up] concatenated: gate keeps columns 0-1, up moves from 2-3 to 3-4 behind the wider gate
    assert torch.equal(w[:, :64, :2], t[..., :2]) and torch.equal(w[:, :64, 3:5], t[..., 2:])
    assert not w[..., 2].any() and not w[..., 5].any()


@pytest.mark.parametrize("arch", ["qwen3_moe", "granitemoe"])
def test_tied_embeddings_are_untied_and_widen_exactly(tmp_path, arch):
    """An embedding that is also the output layer cannot carry the residual stream's scale: the
    widened checkpoint gets its own lm_head (the embedding's old values), eps untouched."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.models import build_random

    src = build_random(arch, str(tmp_path / "src"), FIXTURES["qwen3_moe"][0], num_layers=2, num_experts=8, top_k=2)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump(dict(cfg, tie_word_embeddings=True), open(os.path.join(src, "config.json"), "w"))
    dst = tmp_path / "wide"
    os.makedirs(dst)
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # an earlier run's shard (--force)
    s = inflate_checkpoint(src, str(dst), 192, 96)
    wide = json.load(open(dst / "config.json"))
    assert wide["tie_word_embeddings"] is False and wide["rms_norm_eps"] == cfg["rms_norm_eps"]
    assert sorted(n for n in os.listdir(dst) if n.endswith(".safetensors")) == ["model.safetensors"]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        head, emb = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(head[:, :128], tensors["model.embed_tokens.weight"]) and not head[:, 128:].any()
    assert torch.allclose(emb[:, :128], tensors["model.embed_tokens.weight"] * 1.5 ** 0.5)
    ids = torch.from_numpy(_ids("qwen3_moe"))
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval()
    assert sum(p.numel() for p in b.state_dict().values()) == s["parameters"]["new"]
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert (la - lb).abs().max().item() < 1e-4 * max(1.0, la.abs().max().item())
