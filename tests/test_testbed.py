import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_smoe.placement.stats import expert_usage, token_hotness
from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES
from vllm_smoe.trace import open_trace

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_fixture_traces_are_valid_and_labelled(split):
    t = open_trace(FIXTURE_TRACES[split], validate=True)
    cfg = json.load(open(os.path.join(FIXTURE_MODEL, "config.json")))
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k, t.meta.vocab_size) == (
        cfg["num_hidden_layers"], cfg.get("num_experts", cfg.get("num_local_experts")), cfg["num_experts_per_tok"], cfg["vocab_size"])
    assert t.meta.domains == ("python", "c", "prose", "math")
    assert set(np.unique(t["domain"])) == {0, 1, 2, 3}


def test_trained_fixture_is_hot_and_domain_specific():
    t = open_trace(FIXTURE_TRACES["heldout"])
    hot = token_hotness(t["token_ids"], t["topk_ids"])
    assert hot[0] > 0.7, hot
    # experts specialise: the domains' expert-usage vectors differ clearly at every layer
    u = expert_usage(t["topk_ids"], t.meta.num_experts, t["domain"], len(t.meta.domains))
    tv = 0.5 * np.abs(u[:, None] - u[None, :]).sum(-1)  # [D, D, L]
    off = tv[~np.eye(len(t.meta.domains), dtype=bool)]
    # same statistic with the domain labels shuffled: what sampling noise alone gives
    shuffled = np.random.default_rng(0).permutation(t["domain"])
    u0 = expert_usage(t["topk_ids"], t.meta.num_experts, shuffled, len(t.meta.domains))
    noise = (0.5 * np.abs(u0[:, None] - u0[None, :]).sum(-1)).max()
    assert off.min() > 0.15 and off.min() > 5 * noise, (off.min(), noise)


def test_recorded_routing_matches_transformers_router():
    """The committed trace is what the committed checkpoint routes (recomputed here)."""
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.record import router_topk

    t = open_trace(FIXTURE_TRACES["heldout"])
    req, tok, topk = t["request_ids"], t["token_ids"], t["topk_ids"]
    model = AutoModelForCausalLM.from_pretrained(FIXTURE_MODEL, dtype=torch.float32).eval()
    for r in (0, int(req.max())):
        rows = req == r
        ids, _ = router_topk(model, torch.from_numpy(tok[rows].astype(np.int64))[None], t.meta.top_k)
        # compare as sets: near-ties may order differently across CPUs
        np.testing.assert_array_equal(np.sort(ids, -1), np.sort(topk[rows].astype(np.int32), -1))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_build_random_checkpoint(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / arch
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.testbed.cli", "build", "--arch", arch, "-o", str(out),
                        "--layers", "2", "--experts", "8", "--top-k", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    o = m(torch.tensor([[5, 6, 7]]), output_router_logits=True)
    assert o.logits.shape[-1] == m.config.vocab_size
    assert o.router_logits[0].shape[-1] == 8
