"""Live re-placement on one process: after a swap, every router row and expert slot holds what a
fresh load of the new placement would have put there (checked against the checkpoint tensors),
also where vLLM's CPU build packed the router weight away. The served swap under load, with
tokens compared to plain vLLM, is in test_speculate.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_smoe.serving.live import Served, Swap, _move_experts, _reorder_routers  # noqa: E402
from vllm_smoe.serving.load_plan import LoadPlan, _physical_layout  # noqa: E402

L, E, N, H = 2, 8, 2, 3


def _plan(expert2rank: np.ndarray) -> LoadPlan:
    slot2expert = np.argsort(expert2rank, axis=1, kind="stable").astype(np.int64)
    expert2slot = np.argsort(slot2expert, axis=1, kind="stable").astype(np.int64)
    p2e, route = _physical_layout(expert2rank, np.full((L, 0, 2), -1), N, expert2slot)
    return LoadPlan((1, 3), slot2expert, expert2slot, p2e, route)


class _Router:
    def set_capture_fn(self, fn):
        pass


class _Experts(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w13 = torch.nn.Parameter(w.clone(), requires_grad=False)
        self.router = _Router()

    def get_expert_weights(self):
        return [self.w13]


class _Packing:  # vLLM's CPU gemm dispatch: packs the weight elsewhere and leaves it empty
    def process_weights_after_loading(self, layer):
        layer.packed = layer.weight.detach().clone()
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)


def _model(old: LoadPlan, gates: torch.Tensor, experts: torch.Tensor, packed: bool):
    """Decoder layers 1 and 3 are MoE, loaded as smoe's loader does for plan ``old``."""
    layers = torch.nn.ModuleList()
    for i in range(4):
        layer = torch.nn.Module()
        if i in (1, 3):
            m = (1, 3).index(i)
            mlp = torch.nn.Module()
            mlp.gate = torch.nn.Linear(H, E, bias=False)
            mlp.gate.weight.data.copy_(gates[m][old.slot2expert[m]])
            mlp.gate.e_score_correction_bias = torch.nn.Parameter(gates[m][old.slot2expert[m], 0].clone())
            mlp.experts = _Experts(experts[m][old.physical2expert[m]])
            if packed:
                mlp.gate.quant_method = _Packing()
                mlp.gate.quant_method.process_weights_after_loading(mlp.gate)
            layer.mlp = mlp
        layers.append(layer)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    return model


@pytest.mark.parametrize("packed", [False, True], ids=["weights", "packed-gate"])
def test_swap_leaves_what_a_fresh_load_would(packed):
    rng = np.random.default_rng(0)
    a = np.stack([rng.permutation(np.repeat(np.arange(N), E // N)) for _ in range(L)])
    b = np.stack([rng.permutation(np.repeat(np.arange(N), E // N)) for _ in range(L)])
    old, new = _plan(a), _plan(b)
    assert (old.slot2expert != new.slot2expert).any()
    gates, experts = torch.randn(L, E, H), torch.randn(L, E, 5)
    model = _model(old, gates, experts, packed)
    cfg = SimpleNamespace(mode="place", placement="a.yaml")
    vc = SimpleNamespace(parallel_config=SimpleNamespace(enable_expert_parallel=False, tensor_parallel_size=1,
                                                         data_parallel_size=1))
    served = Served(model, vc, cfg, old, "a.yaml", gate_rows={m: gates[m] for m in range(L)} if packed else None)
    weights = [[model.model.layers[i].mlp.experts.w13] for i in (1, 3)]
    moved = _move_experts(served, Swap("b.yaml", new, None, None, weights, None))
    _reorder_routers(served, new)
    assert moved == int((old.physical2expert != new.physical2expert).sum()) > 0
    for m, i in enumerate((1, 3)):
        mlp = model.model.layers[i].mlp
        gate = mlp.gate.packed if packed else mlp.gate.weight
        torch.testing.assert_close(gate, gates[m][new.slot2expert[m]], rtol=0, atol=0)
        torch.testing.assert_close(mlp.gate.e_score_correction_bias, gates[m][new.slot2expert[m], 0], rtol=0, atol=0)
        torch.testing.assert_close(mlp.experts.w13, experts[m][new.physical2expert[m]], rtol=0, atol=0)


def test_servers_that_cannot_swap_say_why():
    from vllm_smoe.serving.endpoints import EXTENSION, _live_refused

    def vc(**kw):
        pc = dict(data_parallel_size=1, pipeline_parallel_size=1, enable_eplb=False, _api_process_count=1,
                  worker_extension_cls=EXTENSION)
        return SimpleNamespace(parallel_config=SimpleNamespace(**{**pc, **kw}))

    assert _live_refused(vc()) == ""
    for kw, words in [({"data_parallel_size": 2}, "--data-parallel-size 1"),
                      ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 1"),
                      ({"enable_eplb": True}, "--enable-eplb"), ({"_api_process_count": 2}, "--api-server-count 1"),
                      ({"worker_extension_cls": "my.Ext"}, "--worker-extension-cls my.Ext")]:
        assert words in _live_refused(vc(**kw))
