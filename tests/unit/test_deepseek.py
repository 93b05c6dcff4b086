"""The DeepSeek family end to end on the trained fixtures: MLA, a shared expert and a dense
first layer (V2); V3 adds sigmoid scores with a correction bias, group-limited top-k and a
routed scaling factor. With the plugin's fix of vLLM's CPU rotary embedding for MLA, vLLM
serves them as transformers computes them and recording equals transformers' own router;
smoe-place keeps V3's routing groups whole; a placement at load and speculate give the greedy
tokens of vLLM at TP=2 with the CPU fixes alone (`--plugin smoe`; fp32, 32 held-out prompts)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_smoe.testbed import FIXTURES
from vllm_smoe.formats.trace import open_trace
from tests.support import built

ARCHS = ("deepseek_v2", "deepseek_v3")


def _config(arch):
    with open(os.path.join(FIXTURES[arch][0], "config.json")) as f:
        return json.load(f)


def _build(arch, out, ep_size, *extra):
    model, traces = FIXTURES[arch]
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.tools.place", "build", "--trace", traces["train"],
                        "--ep-size", str(ep_size), "--model", model, "-o", str(out), *extra],
                       capture_output=True, text=True)
    return r


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_shape_and_traces(arch):
    """The shipped checkpoint has the family's features, and its traces are what its router does:
    V3's tokens never use more than topk_group of its routing groups."""
    cfg = _config(arch)
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)  # the CPU MLA kernel's sizes
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]) == (32, 4, 1)
    assert cfg["first_k_dense_replace"] == 1
    for split in ("train", "heldout"):
        t = open_trace(FIXTURES[arch][1][split], validate=True)
        assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k) == (cfg["num_hidden_layers"] - 1, 32, 4)
        assert len(t.meta.domains) == 4
        if arch == "deepseek_v3":
            groups = t["topk_ids"].astype(np.int64) // (32 // cfg["n_group"])
            used = np.sort(groups, -1)
            distinct = 1 + (np.diff(used, axis=-1) != 0).sum(-1)
            assert distinct.max() <= cfg["topk_group"] and distinct.min() >= 1


def test_v3_placement_keeps_routing_groups_whole(tmp_path):
    """smoe-place reads n_group from --model: every layer keeps V3's groups whole at EP 2 (two
    groups per rank), 4 (one) and 8 (a group over two ranks), the YAML says so, and the loader's
    plan accepts it; the same placement built without groups is refused at load, naming the field."""
    from transformers import AutoConfig

    from vllm_smoe.placement.groups import broken_group
    from vllm_smoe.formats.placement_file import load_placement
    from vllm_smoe.serving.place.load_plan import make_load_plan

    model = FIXTURES["deepseek_v3"][0]
    cfg = AutoConfig.from_pretrained(model)
    for ep in (2, 4, 8):  # exit 0 checked by built; EP 2's is the one tests/vllm/test_deepseek serves
        p = load_placement(built("place_cli", "build", "--trace", FIXTURES["deepseek_v3"][1]["train"], "--ep-size",
                                 ep, "--model", model))
        assert p.groups == cfg.n_group
        assert all(broken_group(row, cfg.n_group) == -1 for row in p.expert2rank)
        make_load_plan(p.path, cfg, model, ep)
    r = _build("deepseek_v3", tmp_path / "bad.yaml", 4, "--groups", "2")
    assert r.returncode == 2 and "--groups 2" in r.stderr and "n_group" in r.stderr
    # built without the model (no groups): coclust splits groups, and the loader refuses it
    free = tmp_path / "free.yaml"
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.tools.place", "build", "--trace",
                        FIXTURES["deepseek_v3"][1]["train"], "--ep-size", "8", "-o", str(free)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.raises(ValueError, match=r"expert_to_rank' splits expert \d+'s routing group"):
        make_load_plan(str(free), cfg, model, 8)


@pytest.mark.parametrize("smoe_asked", [True, False])
def test_cpu_rope_fix_rotates_mla_queries_and_keys(smoe_asked):
    """MLA hands vLLM's CPU rotary op a [T, H, D] query slice and a strided [T, 1, D] key; with
    smoe asked for they are rotated as vLLM's own pure-torch path rotates them, without it the
    module is vLLM's (no change to plain vLLM). 2-D contiguous inputs take vLLM's op as they are."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from vllm_smoe.serving.patches.cpu import fix_cpu_rope

    fix_cpu_rope()
    cfg = VllmConfig(additional_config={"smoe": {}} if smoe_asked else {})
    with set_current_vllm_config(cfg):
        rope = RotaryEmbedding(64, 64, 512, 10000.0, False, torch.float32)  # get_rope would cache it
    assert rope._smoe_rope is smoe_asked
    T = 7
    pos = torch.arange(T) * 3
    q = torch.randn(T, 4, 96)
    kv = torch.randn(T, 576)
    want_q, want_k = rope.forward_native(pos, q[..., 32:].clone(), kv[:, 512:].unsqueeze(1).clone())
    q0, kv0 = q.clone(), kv.clone()
    q_slice, k_slice = q[..., 32:], kv[:, 512:].unsqueeze(1)
    got_q, got_k = rope.forward_cpu(pos, q_slice, k_slice)
    if not smoe_asked:  # vLLM's own op, as it is (it leaves such a query unrotated)
        from vllm import _custom_ops as ops

        q2, k2 = q0.clone(), kv0.clone()
        ops.rotary_embedding(pos, q2[..., 32:], k2[:, 512:].unsqueeze(1), 64,
                             rope.cos_sin_cache.to(torch.float32), False)
        torch.testing.assert_close(q[..., 32:], q2[..., 32:], rtol=0, atol=0)
        torch.testing.assert_close(kv, k2, rtol=0, atol=0)
    if smoe_asked:
        torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
        torch.testing.assert_close(q[..., 32:], want_q, rtol=0, atol=1e-5)  # in place, as vLLM's op
        torch.testing.assert_close(kv[:, 512:], want_k[:, 0], rtol=0, atol=1e-5)
    # one token: the key slice of the latent row counts as contiguous, and is rotated in place
    q1, k1 = torch.randn(1, 4, 96)[..., 32:], torch.randn(1, 576)[:, 512:].unsqueeze(1)
    n1q, n1k = rope.forward_native(pos[:1] + 5, q1.clone(), k1.clone())
    c1q, c1k = rope.forward_cpu(pos[:1] + 5, q1, k1)
    if smoe_asked:
        torch.testing.assert_close(c1q, n1q, rtol=0, atol=1e-5)
        torch.testing.assert_close(c1k, n1k, rtol=0, atol=1e-5)
        torch.testing.assert_close(q1, n1q, rtol=0, atol=1e-5)
        torch.testing.assert_close(k1, n1k, rtol=0, atol=1e-5)
    flat_q, flat_k = torch.randn(T, 256), torch.randn(T, 64)
    nq, nk = rope.forward_native(pos, flat_q.clone(), flat_k.clone())
    cq, ck = rope.forward_cpu(pos, flat_q, flat_k)
    torch.testing.assert_close(cq, nq, rtol=0, atol=1e-5)
    torch.testing.assert_close(ck, nk, rtol=0, atol=1e-5)


def test_mla_models_are_started_with_the_attention_backend_that_takes_fp32():
    """vLLM 0.32 picks AMX MLA on AMX CPUs and it refuses fp32: every MLA model smoe starts asks
    for CPU_MLA; other models get no flag."""
    from vllm_smoe.tools.server_process import attention_args
    from vllm_smoe.testbed import FIXTURE_MODEL

    for arch in ARCHS:
        assert attention_args(FIXTURES[arch][0]) == ("--attention-backend", "CPU_MLA")
    assert attention_args(FIXTURE_MODEL) == ()
    assert attention_args("/nonexistent") == ()
