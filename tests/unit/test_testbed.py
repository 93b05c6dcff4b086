import json
import os

import numpy as np
import pytest

from vllm_smoe.placement.stats import expert_usage, token_hotness
from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES
from vllm_smoe.formats.trace import open_trace

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
def test_build_random_checkpoint(arch):
    from transformers import AutoModelForCausalLM

    from tests.support import random_model

    out = random_model(arch, 8, 2, layers=2)  # smoe-testbed build --layers 2 --experts 8 --top-k 2, once per run
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    o = m(torch.tensor([[5, 6, 7]]), output_router_logits=True)
    assert o.logits.shape[-1] == m.config.vocab_size
    assert o.router_logits[0].shape[-1] == 8


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_training_balances_its_routers(tmp_path, arch):
    """A few steps of the DeepSeek fixtures' training: V2 adds the Switch loss computed from its
    routers, V3 moves each router's correction bias by +-rate per step towards the less used
    experts (never by anything else); the checkpoint loads back with its bias."""
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.corpus import load_corpus
    from vllm_smoe.testbed.train import train_model

    split = load_corpus(chars_per_domain=100_000, heldout_chars=10_000)
    last = train_model(split, FIXTURE_MODEL, str(tmp_path / arch), steps=3, batch=4, seq_len=32, arch=arch,
                       log_every=1, bias_rate=0.25)
    assert last["step"] == 2 and np.isfinite(last["loss"]) and last["aux_loss"] > 0
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / arch), dtype=torch.float32)
    gates = [layer.mlp.gate for layer in m.model.layers[1:]]
    if arch == "deepseek_v3":
        for gate in gates:
            steps = gate.e_score_correction_bias / 0.25  # three moves of -1, 0 or +1 each
            assert torch.equal(steps, steps.round()) and steps.abs().max() <= 3 and steps.abs().sum() > 0
    else:
        assert not any(hasattr(gate, "e_score_correction_bias") for gate in gates)
