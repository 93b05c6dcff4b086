"""Architectures smoe has no trained fixture for, through the plugin at one rank: a placement at
load that moves every expert, and record mode. vLLM's greedy tokens equal transformers' own
generation, and the recorded top-k sets equal transformers' router, so recording and placement
work for them. Random checkpoints built in the test (8 experts, top-2, 3 decoder layers):
Mixtral (softmax top-2, no shared expert), Qwen2-MoE (a gated shared expert, top-k not
renormalised), OLMoE (query / key norms), GLM-4.5 (a dense first layer, a shared expert,
sigmoid grouped top-k with the correction bias: 2 MoE layers of 3), Llama 4's text model (top-1,
experts every second layer, stacked expert tensors, a sigmoid router named ``router``: 1 MoE
layer of 3), GPT-OSS (stacked experts with per-expert biases, a router with a bias, attention
sinks), Granite-MoE (stacked ``input_linear`` / ``output_linear``, a router named
``router.layer``), EXAONE-MoE (layer kinds listed, a dense first layer, a score bias straight
under the block: 2 MoE layers of 3). Speculate is refused for them where vLLM runs the block
without sequence parallelism (see tests/unit); GPT-OSS runs it so, and is served at TP=2 + EP
the README's way below."""

import numpy as np
import pytest
import yaml

from vllm_smoe.formats.trace import read_traces
from tests.support import heldout_prompts, transformers_greedy, vllm_runs

DECODER_LAYERS, EXPERTS = 3, 8
# -> (MoE layers, top-k): vLLM runs Llama 4 with top-1 only (its router weight applied on the input)
ARCHS = {"mixtral": (3, 2), "qwen2_moe": (3, 2), "olmoe": (3, 2), "glm4_moe": (2, 2), "llama4": (1, 1),
         "gpt_oss": (3, 2), "granitemoe": (3, 2), "exaone_moe": (2, 2)}


@pytest.fixture(scope="module")
def served_archs(tmp_path_factory):
    """Every architecture of ARCHS served at one rank in record mode with a placement at load, the
    engines one after another in one process (vLLM imported once): {arch: (model dir, prompts,
    result, record directory)}."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm_smoe.testbed import FIXTURE_MODEL
    from vllm_smoe.testbed.models import build_random

    d = tmp_path_factory.mktemp("archs")
    prompts = heldout_prompts(6, lambda i, r: 6 + 5 * i)
    runs = []
    for arch in sorted(ARCHS):
        LAYERS, TOP_K = ARCHS[arch]
        model_dir = str(d / arch)  # random weights, the fixture's tokenizer (as smoe-testbed build)
        build_random(arch, model_dir, FIXTURE_MODEL, num_layers=DECODER_LAYERS, num_experts=EXPERTS, top_k=TOP_K)
        moved = d / f"{arch}-moved.yaml"  # one expert per rank, every expert moved, differently per layer
        moved.write_text(yaml.safe_dump({
            "smoe_placement": 1, "model": {"num_layers": LAYERS, "num_experts": EXPERTS, "top_k": TOP_K},
            "ep_size": EXPERTS, "layers": [{"expert_to_rank": [(e + 3 + i) % EXPERTS for e in range(EXPERTS)]}
                                           for i in range(LAYERS)]}))
        extra = {"smoe": {"mode": "record", "record": str(d / f"{arch}-rec"), "placement": str(moved)}}
        runs.append({"model": model_dir, "prompts": prompts, "max_tokens": 6, "extra": extra, "ep": False,
                     "compiled": False})
    out = vllm_runs(runs, d, tp=1)
    return {arch: (str(d / arch), prompts, res, str(d / f"{arch}-rec")) for arch, (res, _) in zip(sorted(ARCHS), out)}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_placement_at_load_and_recording_equal_transformers(served_archs, arch):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.record import router_topk

    LAYERS, TOP_K = ARCHS[arch]
    model_dir, prompts, out, rec = served_archs[arch]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, got in zip(prompts, out["tokens"]):
        assert got == transformers_greedy(model, p, 6)
    meta, arr, _ = read_traces([rec])
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (LAYERS, EXPERTS, TOP_K)
    checked = mismatched = 0
    for q in np.unique(arr["request_ids"]):
        rows = np.flatnonzero(arr["request_ids"] == q)
        rows = rows[np.argsort(arr["positions"][rows])]
        seq = arr["token_ids"][rows]
        ids, _ = router_topk(model, torch.from_numpy(seq.astype(np.int64))[None], TOP_K)
        got = np.sort(arr["topk_ids"][rows].astype(np.int32), -1)
        checked += got.shape[0] * got.shape[1]
        mismatched += int((got != np.sort(ids, -1)).any(-1).sum())
    assert checked == LAYERS * (sum(map(len, prompts)) + 5 * len(prompts)) and mismatched == 0, \
        f"{mismatched} of {checked} (token, layer) top-k sets differ"


@pytest.fixture(scope="module")
def placed_tp2(tmp_path_factory):
    """The README's way (record, ``smoe-place build --ep-size 2``) for GPT-OSS, Mixtral and
    Qwen2-MoE, and every TP=2 engine of the two tests below one after another in one process:
    {arch: [(result, log), ...]} in each test's order."""
    pytest.importorskip("vllm")
    from tests.support import random_model_placed

    d = tmp_path_factory.mktemp("tp2")
    model, placement = random_model_placed(d, "gpt_oss", experts=8, top_k=2)
    prompts = heldout_prompts(6, length=lambda i, r: 5 + 3 * i)
    base = {"model": model, "prompts": prompts, "max_tokens": 10}
    spec = {"placement": placement, "mode": "speculate", "log_interval": 0.2}
    runs = {"gpt_oss": [dict(base, ep=False), dict(base, ep=True, extra={"smoe": spec}),
                        dict(base, ep=True, extra={"smoe": dict(spec, predictor="router")})]}
    prompts = heldout_prompts(4, length=lambda i, r: 5 + 3 * i)
    for arch, experts, k in (("mixtral", 8, 2), ("qwen2_moe", 12, 3)):
        model, placement = random_model_placed(d / arch, arch, experts=experts, top_k=k)
        base = {"model": model, "prompts": prompts, "max_tokens": 8}
        runs[arch] = [dict(base, ep=False), dict(base, ep=True, extra={"smoe": {"placement": placement}})]
    out = iter(vllm_runs([r for rs in runs.values() for r in rs], d, tp=2))
    return {arch: [next(out) for _ in rs] for arch, rs in runs.items()}


def test_gpt_oss_taken_the_readme_way_at_tp2_ep_gives_plain_tokens(placed_tp2):
    """GPT-OSS runs its MoE block sequence parallel, so speculate serves it: recorded routing,
    ``smoe-place build``, then TP=2 + EP with the tables' token order and with the router run
    ahead (its gate is the block's ``router``, with a bias). Greedy tokens equal plain TP=2."""
    (plain, _), (tables, tables_log), (router, router_log) = placed_tp2["gpt_oss"]
    assert tables["tokens"] == plain["tokens"]
    assert router["tokens"] == plain["tokens"]
    for log, predictor in ((tables_log, "tables"), (router_log, "router")):
        assert f"smoe: speculate (predictor {predictor}): rank 0 served" in log, log[-2000:]


def test_shared_expert_and_mixtral_placed_at_tp2_ep_give_plain_tokens(placed_tp2):
    """The README's way (record, ``smoe-place build --ep-size 2``, serve with the placement) at
    TP=2 + EP for two blocks vLLM runs without sequence parallelism: Mixtral's, and Qwen2-MoE's
    with its gated shared expert (which every rank computes whole). Greedy tokens equal plain TP=2."""
    for arch in ("mixtral", "qwen2_moe"):
        (plain, _), (placed, log) = placed_tp2[arch]
        assert placed["tokens"] == plain["tokens"], arch
        assert "smoe: placement applied" in log, log[-2000:]
