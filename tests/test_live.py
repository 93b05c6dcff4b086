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


def test_placement_endpoint_checks_prepares_then_applies(tmp_path, monkeypatch):
    """The route's protocol against a stand-in engine: a bad file never reaches the workers, a
    worker's refusal is answered and the ready ones free what they allocated, a swap answers
    with what moved and GET follows it, a failed apply refuses every later swap and stops."""
    import asyncio
    import time

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_smoe.serving import capability, endpoints
    from vllm_smoe.serving.live import file_digest

    old, new, bad = (tmp_path / n for n in ("old.yaml", "new.yaml", "bad.yaml"))
    for f in (old, new, bad):
        f.write_text(f"# {f.name}\n")

    def check(path, cfg, vc):
        if path.endswith("bad.yaml"):
            raise ValueError(f"{path}: field 'ep_size' = 4 but experts are split over 2 ranks")

    monkeypatch.setattr(capability, "check_served_placement", check)
    stopped = []
    monkeypatch.setattr(endpoints, "_stop_server", lambda: stopped.append(1))

    class Engine:
        def __init__(self):
            self.calls, self.refuse, self.fail = [], "", False

        async def collective_rpc(self, method, timeout=None, args=()):
            self.calls.append((method, args))
            if method == "smoe_prepare_placement":
                return ["", self.refuse]  # two workers, the second may refuse
            if method == "smoe_apply_placement":
                if self.fail:
                    raise RuntimeError("transfer failed")
                return [{"moved_slots": 7, "seconds": 0.01}, {"moved_slots": 7, "seconds": 0.02}]
            return [None, None]

    engine = Engine()
    app = FastAPI()
    endpoints.SmoeEndpoints().attach_router(app)
    app.state.smoe_live = {"engine": engine, "vllm_config": None, "cfg": None, "path": str(old),
                           "lock": asyncio.Lock(), "swaps": 0, "last": None, "refused": ""}
    with TestClient(app) as c:  # one event loop for every request, as in a server
        assert c.post("/smoe/placement", content=b"{").status_code == 400
        assert c.post("/smoe/placement", json={"path": str(new)}).status_code == 400
        r = c.post("/smoe/placement", json={"placement": str(bad)})
        assert r.status_code == 400 and "field 'ep_size'" in r.json()["detail"] and engine.calls == []
        engine.refuse = f"{new}: the file changed while it was being swapped in"
        r = c.post("/smoe/placement", json={"placement": str(new)})
        assert r.status_code == 400 and "changed" in r.json()["detail"]
        assert [m for m, _ in engine.calls] == ["smoe_prepare_placement", "smoe_cancel_placement"]
        assert c.get("/smoe/placement").json()["placement"] == str(old)
        engine.refuse, engine.calls = "", []
        r = c.post("/smoe/placement", json={"placement": str(new)})
        assert r.status_code == 200, r.text
        assert r.json()["previous"] == str(old) and r.json()["moved_slots"] == 7 and r.json()["worker_seconds"] == 0.02
        digest = file_digest(str(new))
        assert engine.calls == [("smoe_prepare_placement", (str(new), digest)), ("smoe_apply_placement", (digest,))]
        assert c.get("/smoe/placement").json()["placement"] == str(new) and c.get("/smoe/placement").json()["swaps"] == 1
        engine.fail = True
        r = c.post("/smoe/placement", json={"placement": str(old)})
        assert r.status_code == 500 and "stops" in r.json()["detail"]
        assert c.post("/smoe/placement", json={"placement": str(new)}).status_code == 409
        time.sleep(0.7)  # the stop is scheduled after the answer, on the server's loop
    assert stopped == [1]
