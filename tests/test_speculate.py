"""mode: speculate — the online predictor (numpy) and the served model (vLLM CPU build, TP=2)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.config import SmoeConfig
from vllm_smoe.placement.online import simulate
from vllm_smoe.placement_file import load_placement, load_tables
from vllm_smoe.speculator import Speculator
from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES
from vllm_smoe.trace import open_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EP2 = os.path.join(REPO, "configs", "tiny-4dom-ep2.yaml")
HELPER = os.path.join(os.path.dirname(__file__), "helpers", "vllm_generate.py")


def test_online_prediction_is_the_offline_simulation_of_one_step():
    """What serving computes per step equals what smoe-place evaluate scored, with the previous
    layer's top-1 arriving as a physical slot (weights reordered at load)."""
    p = load_placement(EP2)
    tables = load_tables(p)
    t = open_trace(FIXTURE_TRACES["heldout"])
    tok, topk = t["token_ids"][:300].astype(np.int64), t["topk_ids"][:300].astype(np.int64)
    want, _ = simulate(tables, p.holds(), tok, topk, np.zeros(300, np.int64), p.ep_size, p.capacity)
    slot2expert = np.argsort(p.expert2rank, axis=1, kind="stable")
    expert2slot = np.argsort(slot2expert, axis=1, kind="stable")
    spec = Speculator("tables", p.ep_size, p.capacity, tables, slot2expert)
    for layer in range(p.num_layers):
        prev = expert2slot[layer - 1][topk[:, layer - 1, 0]] if layer else None
        np.testing.assert_array_equal(spec.token2rank(layer, tok, prev), want[:, layer])


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 200), N=st.sampled_from([2, 3, 4, 8]), cap=st.floats(1.0, 3.0), seed=st.integers(0, 99))
def test_random_and_one_rank_predictors_respect_capacity(T, N, cap, seed):
    ids = np.random.default_rng(seed).integers(0, 5000, T)
    limit = np.ceil(T / N * cap - 1e-9)
    for name in ("random", "one-rank"):
        spec = Speculator(name, N, cap)
        t2r = spec.token2rank(1, ids)
        assert t2r.shape == (T,) and t2r.min() >= 0 and t2r.max() < N
        assert np.bincount(t2r, minlength=N).max() <= max(limit, -(-T // N))
        np.testing.assert_array_equal(t2r, Speculator(name, N, cap).token2rank(1, ids))  # same on every rank
    assert (Speculator("one-rank", N, float(N)).token2rank(0, ids) == 0).all()  # uncapped: all on rank 0


def test_speculate_settings_are_validated():
    ok = SmoeConfig.from_dict({"mode": "speculate", "placement": EP2, "predictor": "random", "capacity": 2})
    assert ok.capacity == 2.0 and ok.pipeline == "speculate"
    assert SmoeConfig.from_dict(ok.to_dict()) == ok
    assert "predictor" not in SmoeConfig.from_dict({"placement": EP2}).to_dict()
    for bad, words in [({"mode": "speculate"}, "needs field 'placement'"),
                       ({"mode": "speculate", "placement": EP2, "predictor": "oracle"}, "field 'predictor'"),
                       ({"mode": "speculate", "placement": EP2, "capacity": 0.5}, "field 'capacity'"),
                       ({"mode": "speculate", "placement": EP2, "pipeline": "x"}, "field 'pipeline'"),
                       ({"placement": EP2, "predictor": "random"}, "only apply to mode 'speculate'")]:
        with pytest.raises(ValueError, match=words):
            SmoeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="tables"):
        Speculator("tables", 2, 1.1)


def _prompts(n):
    """n held-out requests, prompt lengths 3..34 tokens."""
    t = open_trace(FIXTURE_TRACES["heldout"])
    tok, req = t["token_ids"], t["request_ids"]
    reqs = np.unique(req)
    return [tok[req == r][: 3 + i].tolist() for i, r in enumerate(reqs[:: max(1, len(reqs) // n)][:n])]


def _generate(prompts, extra, max_tokens=8, compiled=False, model=FIXTURE_MODEL):
    env = {**os.environ, "SMOE_TEST_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "SMOE_TEST_COMPILED": "1" if compiled else "0"}
    args = [sys.executable, HELPER, str(model), json.dumps(prompts), str(max_tokens)]
    r = subprocess.run(args + ([json.dumps(extra)] if extra else []), capture_output=True, text=True, timeout=900,
                       env=env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("SMOE_RESULT ")]
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-4000:]
    return json.loads(line[0][len("SMOE_RESULT "):]), r.stdout + r.stderr


@pytest.fixture(scope="module")
def plain_tp2():
    pytest.importorskip("vllm")
    prompts = _prompts(32)
    return prompts, _generate(prompts, None)[0]


# Logprob tolerance: speculate computes each expert whole on one rank, plain TP=2 splits its
# intermediate dimension over two ranks and all-reduces, so fp32 sums differ in order (~1e-6).
ATOL = 1e-4


@pytest.mark.vllm
@pytest.mark.parametrize("settings_,compiled", [
    ({"predictor": "tables"}, False),
    ({"predictor": "random"}, False),
    ({"predictor": "one-rank", "capacity": 2.0}, False),  # every token shuffled to rank 0
    ({"pipeline": "baseline"}, False),
    ({"predictor": "tables"}, True),  # torch.compile sees smoe::ep_moe as one opaque op
], ids=["tables", "random", "one-rank", "baseline", "tables-compiled"])
def test_speculate_tp2_gives_plain_tp2_tokens(plain_tp2, settings_, compiled):
    prompts, plain = plain_tp2
    out, log = _generate(prompts, {"smoe": {"mode": "speculate", "placement": EP2, "log_interval": 0.2,
                                            **settings_}}, compiled=compiled)
    want = settings_.get("predictor", "tables")
    assert f"SmoeQwen3MoeForCausalLM over 2 ranks, predictor {want}" in log  # the EP path really ran
    assert out["tokens"] == plain["tokens"]
    np.testing.assert_allclose(out["logprobs"], plain["logprobs"], rtol=0, atol=ATOL)


@pytest.mark.vllm
def test_speculate_refuses_a_placement_for_another_ep_size_before_serving():
    pytest.importorskip("vllm")
    env = {**os.environ, "SMOE_TEST_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    extra = {"smoe": {"mode": "speculate", "placement": os.path.join(REPO, "configs", "tiny-4dom-ep4.yaml")}}
    r = subprocess.run([sys.executable, HELPER, FIXTURE_MODEL, "[[1, 2, 3]]", "2", json.dumps(extra)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode != 0
    assert "field 'ep_size' = 4 but mode speculate splits the experts over the 2 tensor-parallel ranks" in r.stderr


@pytest.mark.vllm
def test_speculate_tp2_mixtral_gives_plain_tp2_tokens(tmp_path):
    """A second architecture (every layer MoE, experts named w1/w3/w2), a YAML without tables
    (random predictor), every expert moved to another slot."""
    pytest.importorskip("vllm")
    model = tmp_path / "mixtral"
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.testbed.cli", "build", "--arch", "mixtral", "-o", str(model),
                        "--layers", "2", "--experts", "8", "--top-k", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    placement = tmp_path / "ep2.yaml"
    placement.write_text(yaml.safe_dump({
        "smoe_placement": 1, "model": {"num_layers": 2, "num_experts": 8, "top_k": 2}, "ep_size": 2,
        "layers": [{"expert_to_rank": [(e + i) % 2 for e in range(8)]} for i in range(2)]}))
    prompts = _prompts(8)
    plain, _ = _generate(prompts, None, model=model)
    spec, log = _generate(prompts, {"smoe": {"mode": "speculate", "placement": str(placement), "predictor": "random"}},
                          model=model)
    assert "SmoeMixtralForCausalLM over 2 ranks" in log
    assert spec["tokens"] == plain["tokens"]
    np.testing.assert_allclose(spec["logprobs"], plain["logprobs"], rtol=0, atol=ATOL)
