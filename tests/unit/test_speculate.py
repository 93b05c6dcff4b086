"""vLLM's expert parallelism through the plugin and mode speculate on vLLM's CPU build: greedy
tokens identical to plain vLLM (fp32, 32 held-out prompts), logprobs within fp32 summation noise."""

import os

import numpy as np
import pytest

from vllm_smoe.serving.config import SmoeConfig
from tests.support import REPO

EP2 = os.path.join(REPO, "configs", "tiny-4dom-ep2.yaml")


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
                       ({"placement": EP2, "predictor": "random"}, "only apply to mode 'speculate'"),
                       ({"placement": EP2, "reduce_scatter": "on"}, "only apply to mode 'speculate'"),
                       ({"mode": "speculate", "placement": EP2, "reduce_scatter": False},
                        "field 'reduce_scatter' must be one of auto, on, off, got False"),
                       ({"placement": EP2, "stack_order": "step"}, "only apply to mode 'speculate'"),
                       ({"mode": "speculate", "placement": EP2, "stack_order": "block"},
                        "field 'stack_order' must be one of layer, step, got 'block'")]:
        with pytest.raises(ValueError, match=words):
            SmoeConfig.from_dict(bad)
    off = SmoeConfig.from_dict({"mode": "speculate", "placement": EP2, "reduce_scatter": "off"})
    assert off.reduce_scatter == "off" and SmoeConfig.from_dict(off.to_dict()) == off
    assert ok.reduce_scatter == "auto" and ok.stack_order == "layer"
    step = SmoeConfig.from_dict({"mode": "speculate", "placement": EP2, "stack_order": "step"})
    assert SmoeConfig.from_dict(step.to_dict()) == step and "stack_order" not in SmoeConfig().to_dict()
    import argparse

    from vllm_smoe.serving.plugin import _add_flags, _smoe_from_args

    p = argparse.ArgumentParser()
    _add_flags(p)
    assert _smoe_from_args(p.parse_args(["--plugin", "smoe", "--smoe-reduce-scatter", "on"])) == {
        "reduce_scatter": "on"}
    assert _smoe_from_args(p.parse_args(["--plugin", "smoe", "--smoe-stack-order", "step"])) == {"stack_order": "step"}


def test_bench_serve_combines_every_ranks_speculate_line():
    from vllm_smoe.tools.bench.common import SPEC_LINE as _SPEC_LINE, rank_numbers as _rank_numbers

    def line(rank, share, tokens, pairs, nbytes):
        return (f"(Worker_TP{rank} pid=1) INFO smoe: speculate (predictor tables-markov): rank {rank} served {share} "
                f"of its expert activations locally ({tokens} tokens); sparse all2all: {pairs} remote (token, rank) "
                f"pairs and {nbytes} B per token and MoE layer\n")

    lines = [line(0, 0.1, 10, 9.0, 900), line(0, 0.6, 100, 0.8, 800), line(1, 0.9, 300, 0.4, 400)]
    got = _rank_numbers(lines, _SPEC_LINE)  # each rank's last line, weighted by its tokens
    assert got["tokens_per_rank"] == {0: 100, 1: 300}
    np.testing.assert_allclose([got["local_share"], got["remote_pairs_per_token"], got["bytes_per_token_layer"]],
                               [0.825, 0.5, 500.0])
    plain = _rank_numbers(["speculate (predictor random): rank 1 served 0.5 of its expert activations locally "
                           "(3 tokens)"], _SPEC_LINE)  # vLLM's all2all: no byte counters
    assert plain == {"local_share": 0.5, "tokens_per_rank": {1: 3}}
    assert _rank_numbers([], _SPEC_LINE) == {}


@pytest.mark.parametrize("grouped", [False, True])
def test_router_predictor_uses_vllms_own_routing(grouped):
    """Predictor router: vLLM's gate and routing step on every row give the ranks of exactly the
    experts vLLM's router picks for them (softmax top-k, and grouped top-k with a correction bias)."""
    pytest.importorskip("vllm")
    import torch

    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm_smoe.placement.predict import prefer_ranks
    from vllm_smoe.serving.speculate.gates import route_ahead

    torch.manual_seed(0)
    E, K, H, T, N = 16, 4, 24, 37, 4
    gate = torch.nn.Linear(H, E, bias=False)
    kw = dict(use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
              e_score_correction_bias=torch.randn(E)) if grouped else {}
    router = CPURouter(top_k=K, global_num_experts=E, **kw)
    x = torch.randn(T, H)
    owner = torch.randperm(E) % N
    held = torch.zeros((N, E), dtype=torch.bool)
    held[owner, torch.arange(E)] = True
    pref, conf = route_ahead(gate, router, x, held)
    _, ids = router.select_experts(x, gate(x))
    want_pref, want_conf = prefer_ranks(owner[ids.long()].numpy(), N)
    np.testing.assert_array_equal(pref.numpy(), want_pref)
    np.testing.assert_allclose(conf.numpy(), want_conf)


def test_input_gate_routes_the_layer_input_through_the_post_attention_norm():
    """Predictor input-gate: the ranks of the experts vLLM's router would pick for the normed
    input rows, with the norm's and gate's own hooks (smoe's, on the real pass) not run."""
    pytest.importorskip("vllm")
    import torch

    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm_smoe.placement.predict import prefer_ranks
    from vllm_smoe.serving.speculate.gates import gate_ranks

    torch.manual_seed(1)
    E, K, H, T, N = 12, 3, 20, 29, 3
    norm, gate = torch.nn.RMSNorm(H, eps=1e-6), torch.nn.Linear(H, E, bias=False)
    torch.nn.init.uniform_(norm.weight, 0.5, 2.0)
    for m in (norm, gate):
        m.register_forward_hook(lambda *a: (_ for _ in ()).throw(AssertionError("a hook ran")))
    router = CPURouter(top_k=K, global_num_experts=E)
    x = 5 * torch.randn(T, H)
    owner = torch.randperm(E) % N
    held = torch.zeros((N, E), dtype=torch.bool)
    held[owner, torch.arange(E)] = True
    pref, conf = gate_ranks(norm, gate, router, x, held)
    xn = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * norm.weight
    _, ids = router.select_experts(xn, xn @ gate.weight.T)
    want_pref, want_conf = prefer_ranks(owner[ids.long()].numpy(), N)
    np.testing.assert_array_equal(pref.numpy(), want_pref)
    np.testing.assert_allclose(conf.numpy(), want_conf)


def _vc(tp=2, dp=1, ep=True, nnodes=1, dp_local=None, seqs=256):
    import types

    pc = types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
                               nnodes=nnodes, data_parallel_size_local=dp if dp_local is None else dp_local)
    return types.SimpleNamespace(parallel_config=pc, scheduler_config=types.SimpleNamespace(max_num_seqs=seqs))


def test_advice_says_where_a_configuration_cannot_pay():
    from vllm_smoe.serving.advice import advice

    spec = SmoeConfig(mode="speculate", placement=EP2)
    (line,) = advice(_vc(), spec, "cpu")
    assert "at 2 ranks" in line and "--mode dp" in line
    lines = advice(_vc(tp=4), spec, "cpu")
    assert len(lines) == 1 and "on one node" in lines[0] and "mode place" in lines[0]
    assert advice(_vc(tp=4, nnodes=2), spec, "cpu") == []  # across nodes: what speculate is for
    agrs = advice(_vc(tp=4, nnodes=2), SmoeConfig(mode="speculate", placement=EP2, all2all="vllm"), "cpu")
    assert len(agrs) == 1 and "allgather-reducescatter" in agrs[0]
    assert any("--max-num-seqs 2 < 4" in ln for ln in advice(_vc(tp=4, nnodes=2, seqs=2), spec, "cpu"))
    (place,) = advice(_vc(), SmoeConfig(placement=EP2), "cpu")
    assert "not what crosses the link" in place
    assert advice(_vc(tp=1, dp=2, dp_local=1), SmoeConfig(placement=EP2), "cpu") == []  # routed DP + EP pays
    (off,) = advice(_vc(tp=1, dp=2), SmoeConfig(placement=EP2, dp_routing=False), "cpu")
    assert "--smoe-dp-routing off" in off
    assert advice(_vc(), SmoeConfig(), "cpu") == []  # no placement: nothing to judge


def test_shuffled_reduce_scatter_seams():
    """Where the shuffled reduce-scatter may replace the attention's all-reduce: a decoder layer
    shaped like vLLM 0.32's Qwen3-MoE one (the served tests take vLLM's own), and the reasons it
    is not taken elsewhere."""
    import torch

    from vllm_smoe.serving.speculate import seams as to

    class Qwen3MoeSparseMoeBlock(torch.nn.Module):  # a name the token order trusts to read only its chunk
        pass

    class Linear(torch.nn.Module):
        def __init__(self, reduce_results=True, tp_size=2):
            super().__init__()
            self.reduce_results, self.tp_size = reduce_results, tp_size

    class Attention(torch.nn.Module):
        def __init__(self, **kw):
            super().__init__()
            self.o_proj = Linear(**kw)

        def forward(self, positions, hidden_states):
            output, _ = self.o_proj(hidden_states)
            return output

    class Layer(torch.nn.Module):
        def __init__(self, block, **kw):
            super().__init__()
            self.self_attn, self.post_attention_layernorm, self.mlp = Attention(**kw), torch.nn.Identity(), block

        def forward(self, positions, hidden_states, residual):
            hidden_states = self.self_attn(positions, hidden_states)
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
            return hidden_states, residual

    class Parallel(Layer):  # attention and MLP side by side: no residual between them to split
        def forward(self, positions, hidden_states, residual):
            return self.self_attn(positions, hidden_states) + self.mlp(hidden_states), residual

    class Stack(torch.nn.Module):
        def __init__(self, *layers):
            super().__init__()
            self.embed_tokens, self.norm, self.layers = torch.nn.Identity(), torch.nn.Identity(), torch.nn.ModuleList(layers)

    def seams(layer_cls=Layer, block=None, **kw):
        block = block or Qwen3MoeSparseMoeBlock()
        stack = Stack(torch.nn.Identity(), layer_cls(block, **kw))  # a dense layer, then a MoE layer
        found, why = to.shuffle_seams(stack, (1,), [(0, block, "fused")], 2)
        return [(layer, o is stack.layers[1].self_attn.o_proj, f) for layer, o, _, f in found], why

    assert seams() == ([(0, True, "fused")], "")
    for kw, words in [({"reduce_results": False}, "does not all-reduce over the 2"),
                      ({"tp_size": 4}, "does not all-reduce over the 2"),
                      ({"layer_cls": Parallel}, "does not add the attention output to the residual"),
                      ({"block": torch.nn.Identity()}, "is not one that reads only its chunk")]:
        found, why = seams(**kw)
        assert found == [] and words in why, why
