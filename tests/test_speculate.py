"""vLLM's expert parallelism through the plugin and mode speculate on vLLM's CPU build: greedy
tokens identical to plain vLLM (fp32, 32 held-out prompts), logprobs within fp32 summation noise."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from vllm_smoe.config import SmoeConfig
from vllm_smoe.server_process import VllmServer
from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES
from vllm_smoe.trace import open_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EP2 = os.path.join(REPO, "configs", "tiny-4dom-ep2.yaml")
HELPER = os.path.join(os.path.dirname(__file__), "helpers", "vllm_generate.py")


def test_speculate_settings_are_validated():
    ok = SmoeConfig.from_dict({"mode": "speculate", "placement": EP2, "predictor": "random", "all2all": "vllm"})
    assert ok.predictor == "random" and ok.all2all == "vllm"
    assert SmoeConfig.from_dict(ok.to_dict()) == ok
    assert "predictor" not in SmoeConfig.from_dict({"placement": EP2}).to_dict()
    assert SmoeConfig.from_dict({}) == SmoeConfig()  # --plugin smoe alone: vLLM's EP fixed on CPU, no placement
    for bad, words in [({"mode": "speculate"}, "needs field 'placement'"),
                       ({"mode": "speculate", "placement": EP2, "predictor": "oracle"}, "field 'predictor'"),
                       ({"mode": "speculate", "placement": EP2, "capacity": 1.1}, "unknown field"),
                       ({"all2all": "deepep"}, "field 'all2all'"),
                       ({"placement": EP2, "predictor": "random"}, "only apply to mode 'speculate'")]:
        with pytest.raises(ValueError, match=words):
            SmoeConfig.from_dict(bad)


def _prompts(n):
    """n held-out requests, prompt lengths 3..34 tokens."""
    t = open_trace(FIXTURE_TRACES["heldout"])
    tok, req = t["token_ids"], t["request_ids"]
    reqs = np.unique(req)
    return [tok[req == r][: 3 + i].tolist() for i, r in enumerate(reqs[:: max(1, len(reqs) // n)][:n])]


def _generate(prompts, extra, max_tokens=8, compiled=False, model=FIXTURE_MODEL, ep=False):
    env = {**os.environ, "SMOE_TEST_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "SMOE_TEST_COMPILED": "1" if compiled else "0", "SMOE_TEST_EP": "1" if ep else "0"}
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


# Logprob tolerance: with expert parallelism each expert runs whole on one rank, plain TP=2 splits
# its intermediate dimension over two ranks and all-reduces, so fp32 sums differ in order (~1e-6).
ATOL = 1e-4
SPEC = {"mode": "speculate", "placement": EP2, "log_interval": 0.2}


@pytest.mark.vllm
@pytest.mark.parametrize("smoe,compiled,says", [
    ({"all2all": "vllm"}, False, None),  # vLLM's own EP, experts fixed by the plugin (no SP at DP=1)
    ({**SPEC, "predictor": "tables"}, False, "predictor tables"),
    ({**SPEC, "predictor": "tables-markov"}, False, "predictor tables-markov"),
    ({**SPEC, "predictor": "random"}, False, "predictor random"),
    ({**SPEC, "predictor": "one-rank"}, False, "predictor one-rank"),  # rank 0 full, the rest anywhere
    ({**SPEC, "predictor": "tables", "all2all": "vllm"}, False, "predictor tables"),  # vLLM's allgather-RS
    ({**SPEC, "predictor": "tables"}, True, "predictor tables"),  # torch.compile keeps smoe's ops opaque
], ids=["vllm-ep", "tables", "tables-markov", "random", "one-rank", "tables-agrs", "tables-compiled"])
def test_tp2_ep_gives_plain_tp2_tokens(plain_tp2, smoe, compiled, says):
    prompts, plain = plain_tp2
    out, log = _generate(prompts, {"smoe": smoe}, compiled=compiled, ep=True)
    if says:  # the token order really ran, around vLLM's own MoE blocks, and tokens moved
        assert f"token order over 2 ranks around 4 MoE blocks (Qwen3MoeSparseMoeBlock), one order per layer, {says}" in log
        assert "of its expert activations locally" in log
    if smoe.get("all2all", "sparse") == "sparse" and "mode" in smoe:
        assert "sparse de-duplicated all2all manager on group ep" in log
    assert out["tokens"] == plain["tokens"]
    np.testing.assert_allclose(out["logprobs"], plain["logprobs"], rtol=0, atol=ATOL)


@pytest.mark.vllm
@pytest.mark.parametrize("smoe,ep,words", [
    ({**SPEC, "placement": os.path.join(REPO, "configs", "tiny-4dom-ep4.yaml")}, True,
     "field 'ep_size' = 4 but experts are split over 2 ranks"),
    (SPEC, False, "needs --enable-expert-parallel"),
])
def test_speculate_refuses_before_serving(smoe, ep, words):
    pytest.importorskip("vllm")
    env = {**os.environ, "SMOE_TEST_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "SMOE_TEST_EP": "1" if ep else "0"}
    r = subprocess.run([sys.executable, HELPER, FIXTURE_MODEL, "[[1, 2, 3]]", "2", json.dumps({"smoe": smoe})],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode != 0
    assert words in r.stderr


@pytest.mark.vllm
def test_dp2_ep_serves_plain_tokens(tmp_path):
    """vllm serve --data-parallel-size 2 --enable-expert-parallel --plugin smoe, with vLLM's own
    allgather-reducescatter (which needs the communicator's all_gatherv / reduce_scatterv on CPU)
    and with smoe's sparse all2all, against plain single-rank vLLM; prompts one at a time."""
    pytest.importorskip("vllm")
    prompts = _prompts(8)
    with VllmServer(FIXTURE_MODEL, log=tmp_path / "plain.log") as s:
        plain = s.complete(prompts)
    args = ("--data-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe")
    for all2all in ("vllm", "sparse"):
        with VllmServer(FIXTURE_MODEL, *args, "--smoe-all2all", all2all, log=tmp_path / f"dp2-{all2all}.log",
                        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as s:
            dp2 = s.complete(prompts)
        assert [t for t, _ in dp2] == [t for t, _ in plain], all2all
        sparse_used = "sparse de-duplicated all2all manager on group ep" in open(tmp_path / f"dp2-{all2all}.log").read()
        assert sparse_used == (all2all == "sparse")
        np.testing.assert_allclose([lp for _, lp in dp2], [lp for _, lp in plain], rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory):
    """A random tiny DeepSeek-V2: MLA (kv_lora_rank 512, rope 64), one shared expert, first
    layer dense, 32 routed experts top-4."""
    pytest.importorskip("vllm")
    model = tmp_path_factory.mktemp("dsv2") / "model"
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.testbed.cli", "build", "--arch", "deepseek_v2", "-o",
                        str(model), "--layers", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return model


def _synthetic_placement(model, out, ep_size=2):
    """A placement with predictor tables for ``model`` from a synthetic trace (each token id
    routes to a fixed expert set per layer): lossless serving does not depend on its quality."""
    import json as _json

    from vllm_smoe.trace import TraceMeta, write_trace

    cfg = _json.loads((model / "config.json").read_text())
    L = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    E, K, V = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["vocab_size"]
    rng = np.random.default_rng(0)
    T = 4000
    tok = rng.integers(0, V, T).astype(np.int32)
    base = (tok.astype(np.int64)[:, None, None] * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K)) % E
    trace = write_trace(out.with_suffix(".npz"), TraceMeta(num_experts=E, top_k=K, num_layers=L, vocab_size=V),
                        token_ids=tok, request_ids=(np.arange(T) // 100).astype(np.int32),
                        positions=(np.arange(T) % 100).astype(np.int32), topk_ids=base.astype(np.int16))
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.place_cli", "build", "--trace", str(trace),
                        "--ep-size", str(ep_size), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.vllm
def test_deepseek_v2_tp2_ep_and_speculate_give_plain_tp2_tokens(deepseek_v2, tmp_path):
    """vLLM's own EP through the plugin, and speculate with the tables, a random and an
    all-to-one-rank predictor, on an architecture with MLA, a shared expert, a dense first layer
    and decoder layers that keep their rows split between layers (one token order per step).
    Random weights give near-tied logits, so prompts go one at a time."""
    prompts = _prompts(6)
    tp2, env = ("--tensor-parallel-size", "2"), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with VllmServer(str(deepseek_v2), *tp2, log=tmp_path / "plain.log", env=env) as s:
        plain = s.complete(prompts)
    placement = _synthetic_placement(deepseek_v2, tmp_path / "ep2.yaml")
    ep = (*tp2, "--enable-expert-parallel", "--plugin", "smoe")
    runs = {"vllm-ep": (*ep, "--smoe-all2all", "vllm")}
    for predictor in ("tables", "random", "one-rank"):
        runs[predictor] = (*ep, "--smoe-mode", "speculate", "--smoe-placement", str(placement),
                           "--smoe-predictor", predictor, "--smoe-log-interval", "0.2")
    for name, args in runs.items():
        with VllmServer(str(deepseek_v2), *args, log=tmp_path / f"{name}.log", env=env) as s:
            out = s.complete(prompts)
        log = open(tmp_path / f"{name}.log").read()
        if name != "vllm-ep":
            assert (f"token order over 2 ranks around 2 MoE blocks (DeepseekV2MoE), one order per step, "
                    f"predictor {name}") in log
            assert "of its expert activations locally" in log
        assert [t for t, _ in out] == [t for t, _ in plain], name
        np.testing.assert_allclose([lp for _, lp in out], [lp for _, lp in plain], rtol=0, atol=ATOL, err_msg=name)


def test_bench_serve_reads_the_numbers_of_speculate_log_line():
    from vllm_smoe.bench import _log_numbers

    line = ("speculate (predictor tables): rank 0 served 0.648 of its expert activations locally (1512 tokens); "
            "sparse all2all: 0.773 remote (token, rank) pairs and 816 B per token and MoE layer")
    assert _log_numbers(line) == {"local_share": 0.648, "remote_pairs_per_token": 0.773, "bytes_per_token_layer": 816.0}
    assert _log_numbers("speculate (predictor random): rank 0 served 0.5 of its expert activations locally (3 tokens)"
                        ) == {"local_share": 0.5}
    assert _log_numbers(None) == {}


@pytest.mark.vllm
def test_deepseek_v2_speculate_compiled_gives_plain_compiled_tokens(deepseek_v2, tmp_path):
    """The stack order's hooks under vLLM's default compilation (smoe's ops stay opaque): the
    same tokens as plain TP=2 compiled (compiled and eager differ from each other in fp32
    rounding, so each is compared with its own kind)."""
    prompts = _prompts(4)
    placement = _synthetic_placement(deepseek_v2, tmp_path / "ep2.yaml")
    plain, _ = _generate(prompts, None, max_tokens=6, compiled=True, model=deepseek_v2)
    spec, log = _generate(prompts, {"smoe": {"mode": "speculate", "placement": str(placement)}}, max_tokens=6,
                          compiled=True, model=deepseek_v2, ep=True)
    assert "one order per step, predictor tables" in log
    assert spec["tokens"] == plain["tokens"]
    np.testing.assert_allclose(spec["logprobs"], plain["logprobs"], rtol=0, atol=ATOL)
