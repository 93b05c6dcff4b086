"""A live swap and the tensors vLLM derives from a router after load: each is reordered with the
router's rows (routing after the swap is a fresh load's), and one with an expert-count extent
that smoe cannot tell to be derived refuses the swap by its attribute path before anything moves.
The stand-ins hold what vLLM 0.32's blocks hold: Qwen3-Next's FusedMoE fuses its two gates into
``_combined_gate_weight`` at the first forward, a ROCm fp32 gate keeps a bf16x3 split, DeepSeek's
router holds the gate's score bias by reference, a shared expert has an extent of E by chance."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_smoe.serving.place.live import Swap, apply_swap, check_swap
from vllm_smoe.serving.place.load_plan import LoadPlan, _physical_layout
from vllm_smoe.serving.served import ServedPlacement, WorkerState  # noqa: E402

L, E, N, H = 2, 8, 2, 16
MOE = (1, 3)


def _plan(expert2rank: np.ndarray) -> LoadPlan:
    slot2expert = np.argsort(expert2rank, axis=1, kind="stable").astype(np.int64)
    expert2slot = np.argsort(slot2expert, axis=1, kind="stable").astype(np.int64)
    p2e, route = _physical_layout(expert2rank, np.full((L, 0, 2), -1), N, expert2slot)
    return LoadPlan(MOE, slot2expert, expert2slot, p2e, route)


class _Router:  # vLLM's router object (not a module); DeepSeek's holds the gate's bias (deepseek_v2.py:390)
    def __init__(self, bias):
        self.e_score_correction_bias = bias

    def set_capture_fn(self, fn):
        pass


class _Runner(torch.nn.Module):
    """vLLM's MoERunner with both gates (moe_runner.py:280): the first forward caches
    cat([gate.weight, shared_expert_gate.weight]) and routes with that copy from then on."""

    def __init__(self, gate, shared_gate, w):
        super().__init__()
        self.gate, self.shared_expert_gate = gate, shared_gate
        self.router = _Router(gate.e_score_correction_bias)
        self.w13 = torch.nn.Parameter(w.clone(), requires_grad=False)
        self._combined_gate_weight = None

    def get_expert_weights(self):
        return [self.w13]

    def logits(self, x):
        if self._combined_gate_weight is None:
            self._combined_gate_weight = torch.cat([self.gate.weight, self.shared_expert_gate.weight], dim=0)
        return x @ self._combined_gate_weight.t()


def _model(old: LoadPlan, gates, shared, experts, bf16x3: bool = False):
    """Decoder layers 1 and 3 are Qwen3-Next-like MoE blocks, loaded as smoe's loader does for
    ``old`` and run once (the profile run builds the fused gate)."""
    from vllm.model_executor.layers.fused_moe.router.bf16x3_router_gemm_rocm import split_bf16x3

    layers = torch.nn.ModuleList()
    for i in range(4):
        layer = torch.nn.Module()
        if i in MOE:
            m = MOE.index(i)
            mlp = torch.nn.Module()
            mlp.gate = torch.nn.Linear(H, E, bias=False)
            mlp.gate.weight.data.copy_(gates[m][old.slot2expert[m]])
            mlp.gate.e_score_correction_bias = torch.nn.Parameter(gates[m][old.slot2expert[m], 0].clone())
            if bf16x3:  # ROCm gfx950's fp32 gate (gate_linear.py:330): [3, E, H] bf16 terms
                mlp.gate.register_buffer("_bf16x3_weight", split_bf16x3(mlp.gate.weight.data), persistent=False)
            mlp.shared_expert_gate = torch.nn.Linear(H, 1, bias=False)
            mlp.shared_expert_gate.weight.data.copy_(shared[m])
            mlp.shared_expert = torch.nn.Module()
            mlp.shared_expert.down_proj = torch.nn.Linear(E, H, bias=False)  # [H, E]: E by chance, not routed
            mlp.experts = _Runner(mlp.gate, mlp.shared_expert_gate, experts[m][old.physical2expert[m]])
            mlp.experts.logits(torch.randn(2, H))
            layer.mlp = mlp
        layers.append(layer)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    return model


def _setup(bf16x3=False, seed=0):
    rng = np.random.default_rng(seed)
    a, b = (np.stack([rng.permutation(np.repeat(np.arange(N), E // N)) for _ in range(L)]) for _ in range(2))
    old, new = _plan(a), _plan(b)
    assert (old.slot2expert != new.slot2expert).any()
    gates, shared, experts = torch.randn(L, E, H), torch.randn(L, 1, H), torch.randn(L, E, 5)
    model = _model(old, gates, shared, experts, bf16x3)
    vc = SimpleNamespace(parallel_config=SimpleNamespace(enable_expert_parallel=False, tensor_parallel_size=1,
                                                         data_parallel_size=1),
                         compilation_config=SimpleNamespace(mode=None, inductor_compile_config={}, cudagraph_mode=None))
    state = WorkerState(model, vc, SimpleNamespace(mode="place"), ServedPlacement("a.yaml", None, None, old))
    return state, old, new, gates, shared, experts


@pytest.mark.parametrize("bf16x3", [False, True], ids=["fused-gate", "fused-gate+bf16x3"])
def test_a_swap_reorders_the_copies_vllm_made_of_the_router(bf16x3, monkeypatch):
    state, old, new, gates, shared, experts = _setup(bf16x3)
    model = state.model
    held = [model.model.layers[i].mlp.experts._combined_gate_weight for i in MOE]
    swap = _checked(state, new, monkeypatch)
    apply_swap(state, swap)
    x = torch.randn(6, H)
    for m, i in enumerate(MOE):
        mlp = model.model.layers[i].mlp
        want = gates[m][new.slot2expert[m]]  # what a fresh load of the new placement routes with
        torch.testing.assert_close(mlp.gate.weight, want, rtol=0, atol=0)
        # the routing the block serves, through the copy made before the swap (same tensor: graphs keep it)
        assert mlp.experts._combined_gate_weight is held[m]
        fresh = torch.cat([want, shared[m]])  # what a fresh load's first forward would fuse
        torch.testing.assert_close(mlp.experts._combined_gate_weight, fresh, rtol=0, atol=0)
        torch.testing.assert_close(mlp.experts.logits(x), x @ fresh.t(), rtol=0, atol=0)
        # held by reference by the router: reordered once, with the gate
        assert mlp.experts.router.e_score_correction_bias is mlp.gate.e_score_correction_bias
        torch.testing.assert_close(mlp.gate.e_score_correction_bias, want[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(mlp.experts.w13, experts[m][new.physical2expert[m]], rtol=0, atol=0)
        if bf16x3:
            split = mlp.gate._bf16x3_weight
            torch.testing.assert_close(split[0], want.to(torch.bfloat16), rtol=0, atol=0)
            torch.testing.assert_close(split.float().sum(0), want, rtol=0, atol=1e-6)


def _checked(state, new, monkeypatch) -> Swap:
    from vllm_smoe.serving.place import check

    monkeypatch.setattr(check, "check_served_placement",
                        lambda path, cfg, vc, snap: ServedPlacement(path, None, None, new))
    return check_swap(state, SimpleNamespace(path="b.yaml"))


@pytest.mark.parametrize("where", ["experts", "gate", "block", "router"])
def test_a_tensor_with_an_expert_extent_smoe_cannot_place_refuses_the_swap(where, monkeypatch):
    state, old, new, *_ = _setup()
    mlp = state.model.model.layers[3].mlp
    mystery = torch.randn(E, 3)  # not the router's rows: e.g. a per-expert table vLLM built at load
    if where == "router":
        mlp.experts.router.table = mystery
        path = "model.layers.3.mlp.experts.router.table"
    elif where == "gate":
        mlp.gate.register_buffer("table", mystery)
        path = "model.layers.3.mlp.gate.table"
    else:
        setattr(mlp.experts if where == "experts" else mlp, "table", mystery)
        path = f"model.layers.3.mlp{'.experts' if where == 'experts' else ''}.table"
    before = mlp.gate.weight.clone()
    with pytest.raises(ValueError, match=rf"{path} \(shape \(8, 3\)\) has an extent of 8"):
        _checked(state, new, monkeypatch)
    torch.testing.assert_close(mlp.gate.weight, before, rtol=0, atol=0)  # nothing moved
