"""The DeepSeek family end to end on the trained fixtures: MLA, a shared expert and a dense
first layer (V2); V3 adds sigmoid scores with a correction bias, group-limited top-k and a
routed scaling factor. With the plugin's fix of vLLM's CPU rotary embedding for MLA, vLLM
serves them as transformers computes them and recording equals transformers' own router;
smoe-place keeps V3's routing groups whole; a placement at load and speculate give the greedy
tokens of vLLM at TP=2 with the CPU fixes alone (`--plugin smoe`; fp32, 32 held-out prompts)."""

import numpy as np
import pytest
import yaml

from vllm_smoe.testbed import FIXTURES
from vllm_smoe.formats.trace import read_traces
from tests.support import built, heldout_prompts, transformers_greedy, vllm_runs
from tests.unit.test_deepseek import ARCHS, _config

ATOL = 1e-4  # fp32 summation order: experts whole on one rank vs split over TP ranks


def _prompts(arch, n):
    """n held-out requests of the fixture's trace, prompt lengths 3..34 tokens."""
    return heldout_prompts(n, trace=FIXTURES[arch][1]["heldout"])


def _group_derangement(cfg, path):
    """A placement at ep_size = E (one expert per rank) that moves every expert and, with
    grouped routing, keeps each group whole: groups trade places, experts rotate inside."""
    E, L = cfg["n_routed_experts"], cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    G = cfg.get("n_group") or 1
    S = E // G
    rows = [[((e // S + 1 + i) % G) * S + (e % S + 3) % S if G > 1 else (e + 3 + i) % E for e in range(E)]
            for i in range(L)]
    path.write_text(yaml.safe_dump({"smoe_placement": 1, "model": {"num_layers": L, "num_experts": E, "top_k": 4},
                                    "ep_size": E, "layers": [{"expert_to_rank": r} for r in rows]}))
    return path


@pytest.fixture(scope="module")
def recorded_one_rank(tmp_path_factory):
    """Both architectures at one rank, record mode with every expert moved, the engines one after
    another in one process: {arch: (prompts, result, record directory)}."""
    pytest.importorskip("vllm")
    d = tmp_path_factory.mktemp("rec")
    runs, out = [], {}
    for arch in ARCHS:
        prompts = _prompts(arch, 6)
        placement = _group_derangement(_config(arch), d / f"{arch}-moved.yaml")
        runs.append({"model": FIXTURES[arch][0], "prompts": prompts, "max_tokens": 6, "extra": {
            "smoe": {"mode": "record", "record": str(d / f"{arch}-rec"), "placement": str(placement)}}})
        out[arch] = (prompts, str(d / f"{arch}-rec"))
    return {arch: (prompts, res, rec) for (arch, (prompts, rec)), (res, _) in zip(out.items(), vllm_runs(runs, d))}


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_serves_and_records_what_transformers_computes(arch, recorded_one_rank):
    """One rank, record mode with every expert moved: vLLM's greedy tokens equal transformers'
    greedy generation, and the recorded top-k sets equal transformers' router on every token
    and MoE layer vLLM ran (V3: grouped top-k with the correction bias, in both)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.record import router_topk

    prompts, out, rec = recorded_one_rank[arch]
    model = AutoModelForCausalLM.from_pretrained(FIXTURES[arch][0], dtype=torch.float32).eval()
    for p, got in zip(prompts, out["tokens"]):
        assert got == transformers_greedy(model, p, 6)
    _, arr, _ = read_traces([rec])
    checked = mismatched = 0
    for r in np.unique(arr["request_ids"]):
        rows = np.flatnonzero(arr["request_ids"] == r)
        rows = rows[np.argsort(arr["positions"][rows])]
        seq = arr["token_ids"][rows]
        i = next(k for k, p in enumerate(prompts) if seq[: len(p)].tolist() == p)
        np.testing.assert_array_equal(seq, prompts[i] + out["tokens"][i][:-1])
        ids, _ = router_topk(model, torch.from_numpy(seq.astype(np.int64))[None], 4)
        got = np.sort(arr["topk_ids"][rows].astype(np.int32), -1)
        checked += got.shape[0] * got.shape[1]
        mismatched += int((got != np.sort(ids, -1)).any(-1).sum())
    assert checked > 0 and mismatched == 0, f"{mismatched} of {checked} (token, layer) top-k sets differ"


def _placement(arch, *extra):
    """smoe-place build of the fixture's training routing at EP 2 with --model (groups kept), once per test run."""
    model, traces = FIXTURES[arch]
    return built("place_cli", "build", "--trace", traces["train"], "--ep-size", 2, "--model", model, *extra)


# the TP=2 runs below: predictors per architecture (the order's code is the same for both members
# of the family, so each predictor runs on one)
PREDICTORS = {"deepseek_v2": ("tables", "random", "router"), "deepseek_v3": ("learned", "one-rank", "input-gate")}


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    """Every TP=2 engine of this module, one after another in one process (vLLM imported once):
    {(arch, name): (result, log)}; name "plain" (the CPU fixes alone, MLA's rope; no placement),
    a predictor of PREDICTORS (speculate + EP over a placement built with groups kept and the
    learned predictor), "plain-compiled" and "compiled" (V3, speculate with tables, vLLM's
    default compilation)."""
    pytest.importorskip("vllm")
    work = tmp_path_factory.mktemp("tp2")
    keys, runs = [], []
    for arch in ARCHS:
        placement = _placement(arch, "--learned")
        prompts = _prompts(arch, 32)
        run = {"model": FIXTURES[arch][0], "prompts": prompts, "max_tokens": 8}
        keys.append((arch, "plain"))
        runs.append({**run, "extra": {"smoe": {}}, "ep": False})
        for predictor in PREDICTORS[arch]:
            keys.append((arch, predictor))
            runs.append({**run, "ep": True, "extra": {"smoe": {"mode": "speculate", "placement": str(placement),
                                                               "predictor": predictor, "log_interval": 0.2}}})
        keys.append((arch, "step"))  # one order per step (stack_order step), the tables, recorded
        runs.append({**run, "ep": True, "extra": {"smoe": {"mode": "speculate", "placement": str(placement),
                                                           "stack_order": "step", "log_interval": 0.2,
                                                           "record": str(work / f"{arch}-step-rec")}}})
    placement = _placement("deepseek_v3")
    run = {"model": FIXTURES["deepseek_v3"][0], "prompts": _prompts("deepseek_v3", 8), "max_tokens": 6,
           "compiled": True}
    keys += [("deepseek_v3", "plain-compiled"), ("deepseek_v3", "compiled")]
    runs += [{**run, "extra": {"smoe": {}}, "ep": False},
             {**run, "extra": {"smoe": {"mode": "speculate", "placement": str(placement)}}, "ep": True}]
    out = dict(zip(keys, vllm_runs(runs, work, tp=2)))
    out.update({(arch, "step-rec"): work / f"{arch}-step-rec" for arch in ARCHS})
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_placement_and_speculate_give_plain_tp2_tokens(arch, tp2_runs):
    """TP=2 + EP, speculate over smoe's placement applied at load (built from the fixture's
    training routing, groups kept, with the learned predictor): plain TP=2's greedy tokens on 32
    held-out prompts, with an order per MoE layer (the split residual folded into the attention's
    reduce-scatter) and with one order per step. V2 runs the trained tables, a random order and
    router (exact: the gate's logits of each rank's folded partial rows, summed), V3 the learned
    predictor, an all-to-rank-0 order and input-gate (the gate on each MoE layer's split input,
    its ranks riding in vLLM's all-gather before the attention; V3's tables run compiled, below;
    V3's router, sigmoid with a correction bias, is refused at load)."""
    plain, _ = tp2_runs[arch, "plain"]
    layers = _config(arch)["num_hidden_layers"] - 1
    for predictor in PREDICTORS[arch] + ("step",):
        out, log = tp2_runs[arch, predictor]
        order = ("one order per step (stack_order: step), predictor tables" if predictor == "step" else
                 f"one order per layer (the split residual folded into the attention's reduce-scatter), "
                 f"predictor {predictor}" + (" (exact before the reduce" if predictor == "router" else ""))
        assert f"token order over 2 ranks around {layers} MoE blocks (DeepseekV2MoE), {order}" in log
        assert "of its expert activations locally" in log
        assert out["tokens"] == plain["tokens"], predictor
        np.testing.assert_allclose(out["logprobs"], plain["logprobs"], rtol=0, atol=ATOL, err_msg=predictor)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_recording_under_one_order_per_step_says_so(arch, tp2_runs):
    """The recorder writes speculate's order kind in each trace's meta (advise then keeps rank
    names agreeing across layers), and records every request of the step-ordered run."""
    meta, arr, _ = read_traces([str(tp2_runs[arch, "step-rec"])])
    assert meta.extra["token_order"] == "step"
    out, _ = tp2_runs[arch, "step"]
    assert len(np.unique(arr["request_ids"])) == len(out["tokens"])


def test_v3_speculate_compiled_gives_plain_compiled_tokens(tp2_runs):
    """The stack order's hooks (an order per MoE layer) under vLLM's default compilation
    (smoe's ops stay opaque): the same tokens as plain TP=2 compiled (compiled and eager differ in
    fp32 rounding, so each is compared with its own kind)."""
    plain, _ = tp2_runs["deepseek_v3", "plain-compiled"]
    spec, log = tp2_runs["deepseek_v3", "compiled"]
    assert "one order per layer (the split residual folded into the attention's reduce-scatter), predictor tables" \
        in log
    assert spec["tokens"] == plain["tokens"]
    np.testing.assert_allclose(spec["logprobs"], plain["logprobs"], rtol=0, atol=ATOL)
