"""Live re-placement on one process: after a swap, every router row and expert slot holds what a
fresh load of the new placement would have put there (checked against the checkpoint tensors),
also where vLLM's CPU build packed the router weight away. The served swap under load, with
tokens compared to plain vLLM, is in test_speculate.py."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_smoe.serving.place.live import Swap, _move_experts, _reorder_routers
from vllm_smoe.serving.served import ServedPlacement, WorkerState  # noqa: E402
from vllm_smoe.serving.place.load_plan import LoadPlan, _physical_layout

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


class _Packing:  # vLLM's CPU gemm dispatch: packs the weight into a tensor its GEMM closure holds
    def process_weights_after_loading(self, layer):
        packed = layer.weight.detach().clone() * 2  # another layout than the rows
        layer.cpu_linear = lambda x, weight, bias: x @ (packed / 2).t()
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)


_GEMMS: dict[int, torch.Tensor] = {}  # a stand-in for oneDNN's handlers: pointer -> weight


class _Handler:  # vLLM's CPUDNNLGEMMHandler: the C++ pointer in a tensor, released on __del__
    def __init__(self, w):
        self.k, self.n = w.shape[1], w.shape[0]
        self.handler_tensor = torch.tensor(id(w), dtype=torch.int64)
        _GEMMS[id(w)] = w

    def __del__(self):
        _GEMMS.pop(int(self.handler_tensor.item()), None)


class _OneDnn:  # the fp32 path on CPUs without AMX: a oneDNN handler in the closure
    def process_weights_after_loading(self, layer):
        handler = _Handler(layer.weight.detach().clone())
        layer.cpu_linear = lambda x, weight, bias: x @ _GEMMS[int(handler.handler_tensor.item())].t()
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
                mlp.gate.quant_method = _Packing() if packed == "tensor" else _OneDnn()
                mlp.gate.quant_method.process_weights_after_loading(mlp.gate)
            layer.mlp = mlp
        layers.append(layer)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    return model


@pytest.mark.parametrize("packed", ["", "tensor", "onednn"], ids=["weights", "packed-gate", "onednn-gate"])
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
    served = WorkerState(model, vc, cfg, ServedPlacement("a.yaml", None, None, old),
                    gate_rows={m: gates[m] for m in range(L)} if packed else None)
    weights = [[model.model.layers[i].mlp.experts.w13] for i in (1, 3)]
    from vllm_smoe.serving.place.live import packed_tensor

    held = [packed_tensor(model.model.layers[i].mlp.gate) for i in (1, 3)]  # what a compiled graph reads
    assert all(t is not None for t in held) == bool(packed)
    moved = _move_experts(served, Swap(ServedPlacement("b.yaml", None, None, new), weights, None))
    _reorder_routers(served, new)
    assert moved == int((old.physical2expert != new.physical2expert).sum()) > 0
    for m, i in enumerate((1, 3)):
        mlp = model.model.layers[i].mlp
        if packed:  # refilled in place: what was held before the swap computes with the new rows
            if packed == "tensor":
                torch.testing.assert_close(held[m] / 2, gates[m][new.slot2expert[m]], rtol=0, atol=0)
            else:  # and the old GEMM was released (the fresh handler took its pointer and is gone)
                torch.testing.assert_close(_GEMMS[int(held[m].handler_tensor.item())], gates[m][new.slot2expert[m]])
            assert packed_tensor(mlp.gate) is held[m]
            x = torch.randn(4, H)
            torch.testing.assert_close(mlp.gate.cpu_linear(x, None, None), x @ gates[m][new.slot2expert[m]].t())
        else:
            torch.testing.assert_close(mlp.gate.weight, gates[m][new.slot2expert[m]], rtol=0, atol=0)
        torch.testing.assert_close(mlp.gate.e_score_correction_bias, gates[m][new.slot2expert[m], 0], rtol=0, atol=0)
        torch.testing.assert_close(mlp.experts.w13, experts[m][new.physical2expert[m]], rtol=0, atol=0)
    if packed == "onednn":
        import gc

        gc.collect()
        assert len(_GEMMS) == L  # one live GEMM per router: the replaced ones were released


def test_servers_that_cannot_swap_say_why():
    from vllm_smoe.serving.place.swap import EXTENSION, live_refused as _live_refused

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
    import time

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_smoe.formats.placement_file import read_snapshot
    from vllm_smoe.serving import endpoints
    from vllm_smoe.serving.place import check, swap

    old, new, bad = (tmp_path / n for n in ("old.yaml", "new.yaml", "bad.yaml"))
    for f in (old, new, bad):
        _tiny_placement(f)

    def check_fn(path, cfg, vc, snapshot=None):
        assert snapshot is not None and snapshot.path == path  # parsed from the bytes read once
        if path.endswith("bad.yaml"):
            raise ValueError(f"{path}: field 'ep_size' = 4 but experts are split over 2 ranks")

    monkeypatch.setattr(check, "check_served_placement", check_fn)
    stopped = []
    monkeypatch.setattr(swap, "_stop_server", lambda: stopped.append(1))

    class Engine:
        def __init__(self):
            self.calls, self.refuse, self.fail = [], "", False

        async def collective_rpc(self, method, timeout=None, args=()):
            self.calls.append((method, args))
            if method == "smoe_prepare_placement":  # two workers, the second may refuse
                return [{"reason": "", "bytes": 10**9}, {"reason": self.refuse, "bytes": 0}]
            if method == "smoe_apply_placement":
                self.deadline = timeout
                if self.fail:
                    raise TimeoutError("RPC call to smoe_apply_placement timed out.")
                return [{"moved_slots": 7, "seconds": 0.01}, {"moved_slots": 7, "seconds": 0.02}]
            return [None, None]

    engine = Engine()
    app = FastAPI()
    endpoints.SmoeEndpoints().attach_router(app)
    cfg = SimpleNamespace(placement_dirs=(str(tmp_path),))
    app.state.smoe_live = swap.LiveState(engine, None, cfg, str(old))
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
        assert r.json()["moved_bytes"] == 10**9  # both ranks' changing expert bytes
        snap = read_snapshot(str(new))
        assert engine.calls == [("smoe_prepare_placement", (str(new), snap.yaml, None, snap.sha256)),
                                ("smoe_apply_placement", (snap.sha256,))]
        assert engine.deadline == swap.apply_deadline(10**9) < 100  # the slowest rank's bytes, not 30 min
        assert c.get("/smoe/placement").json()["placement"] == str(new) and c.get("/smoe/placement").json()["swaps"] == 1
        engine.fail = True
        r = c.post("/smoe/placement", json={"placement": str(old)})
        assert r.status_code == 500 and "stops" in r.json()["detail"] and "deadline was 80 s" in r.json()["detail"]
        assert c.post("/smoe/placement", json={"placement": str(new)}).status_code == 409
        time.sleep(0.7)  # the stop is scheduled after the answer, on the server's loop
    assert stopped == [1]


def _tiny_placement(path, expert2rank=(0, 1, 0, 1), tables: bool = False):
    from vllm_smoe.formats.placement_file import write_placement

    e2r = np.asarray([expert2rank], dtype=np.int32)
    V, arrays = 8, None
    if tables:
        from vllm_smoe.placement.predict import PredictorTables

        arrays = PredictorTables(
            token2rank=np.zeros((1, V, 2), np.int16), token_conf=np.ones((1, V), np.float16),
            markov2rank=np.zeros((1, 4, 2), np.int16), markov_conf=np.ones((1, 4), np.float16),
            prior2rank=np.zeros((1, 2), np.int16), prior_conf=np.ones((1,), np.float16)).arrays()
    write_placement(str(path), expert2rank=e2r, ep_size=2, nodes=1, top_k=2, vocab_size=V, method="test",
                    capacity=1.1, tables=arrays)
    return path


def test_a_swap_reads_its_files_once_and_only_from_allowed_directories(tmp_path):
    """What the API server read is what every worker parses, whatever the path points at later;
    files (or tables) outside the allowed directories, also through a symlink, are refused."""
    from vllm_smoe.formats.placement_file import Snapshot, load_tables, read_snapshot

    served = tmp_path / "served"
    served.mkdir()
    a = _tiny_placement(served / "a.yaml", tables=True)
    link = served / "current.yaml"
    link.symlink_to(a)
    snap = read_snapshot(str(link), (str(served),))
    assert snap.path == str(a) and snap.tables is not None
    other = _tiny_placement(served / "b.yaml", (1, 0, 1, 0))
    link.unlink()
    link.symlink_to(other)  # flipped after the read: the snapshot still holds a
    assert (snap.placement().expert2rank == [[0, 1, 0, 1]]).all()
    worker = Snapshot(snap.path, snap.yaml, snap.tables)  # what a worker rebuilds from the bytes
    assert worker.sha256 == snap.sha256 and (worker.placement().expert2rank == [[0, 1, 0, 1]]).all()
    assert load_tables(worker.placement(), worker.tables).token2rank.shape == (1, 8, 2)
    assert Snapshot(snap.path, snap.yaml + b"\n", snap.tables).sha256 != snap.sha256
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    _tiny_placement(outside / "c.yaml")
    (served / "escape.yaml").symlink_to(outside / "c.yaml")
    for p in (outside / "c.yaml", served / "escape.yaml"):
        with pytest.raises(ValueError, match="not inside the directories"):
            read_snapshot(str(p), (str(served),))
    text = (served / "a.yaml").read_text()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("predictor:"))
    (outside / name).write_bytes((served / name).read_bytes())
    (served / "t.yaml").write_text(text.replace(f"predictor: {name}", f"predictor: ../elsewhere/{name}"))
    with pytest.raises(ValueError, match="field 'predictor': tables file .* not inside"):
        read_snapshot(str(served / "t.yaml"), (str(served),))
    assert read_snapshot(str(outside / "c.yaml"), None).path == str(outside / "c.yaml")


def test_worker_refuses_bytes_that_differ_from_the_digest(tmp_path, monkeypatch):
    from vllm_smoe.formats.placement_file import read_snapshot
    from vllm_smoe.serving.place import live

    snap = read_snapshot(str(_tiny_placement(tmp_path / "a.yaml")))
    from vllm_smoe.serving import served

    w = SimpleNamespace(pending={"x": 1}, placement=SimpleNamespace(path="a.yaml"))
    monkeypatch.setattr(served, "_WORKER", w)
    out = live.SmoeWorkerExtension().smoe_prepare_placement(snap.path, snap.yaml[:-3], None, snap.sha256)
    assert "arrived altered" in out["reason"] and w.pending == {}


def test_placement_dirs_setting(tmp_path):
    from vllm_smoe.serving.config import SmoeConfig
    from vllm_smoe.serving.plugin import _smoe_from_args

    p = str(tmp_path / "p.yaml")
    assert SmoeConfig.from_dict({"placement": p}).placement_dirs == (os.path.realpath(tmp_path),)
    given = SmoeConfig.from_dict({"placement": p, "placement_dirs": ["/srv/a", str(tmp_path)]})
    assert given.placement_dirs == ("/srv/a", os.path.realpath(tmp_path))
    assert SmoeConfig.from_dict(given.to_dict()) == given
    for bad, words in [({"placement": p, "placement_dirs": "/srv/a"}, "non-empty list"),
                       ({"placement": p, "placement_dirs": []}, "non-empty list"),
                       ({"placement_dirs": ["/srv/a"]}, "field 'placement' is not")]:
        with pytest.raises(ValueError, match=words):
            SmoeConfig.from_dict(bad)
    args = SimpleNamespace(plugin="smoe", smoe_placement=p, smoe_placement_dirs=f"/srv/a{os.pathsep}/srv/b")
    assert _smoe_from_args(args)["placement_dirs"] == ["/srv/a", "/srv/b"]


def test_a_live_swap_of_an_uneven_split_is_refused_before_anything_moves(monkeypatch):
    """vLLM's EPLB transfer assumes P / N slots per rank: 7 experts over 2 ranks (4 + 3) must be
    refused by the check (a 400), not fail half-way through the move."""
    from vllm_smoe.serving.place import check, live

    def plan(e2r):
        e2r = np.asarray(e2r)
        s2e = np.argsort(e2r, axis=1, kind="stable").astype(np.int64)
        e2s = np.argsort(s2e, axis=1, kind="stable").astype(np.int64)
        p2e, route = _physical_layout(e2r, np.full((1, 0, 2), -1), 2, e2s)
        return LoadPlan((1,), s2e, e2s, p2e, route)

    old, new = plan([[0, 0, 0, 0, 1, 1, 1]]), plan([[1, 0, 0, 0, 1, 1, 0]])
    assert [len(old.local_slots(r)) for r in range(2)] == [4, 3]
    monkeypatch.setattr(check, "check_served_placement",
                        lambda path, cfg, vc, snap: ServedPlacement(path, None, None, new))
    ep = SimpleNamespace(parallel_config=SimpleNamespace(enable_expert_parallel=True, tensor_parallel_size=2,
                                                         data_parallel_size=1))
    state = WorkerState(torch.nn.Module(), ep, SimpleNamespace(mode="place"), ServedPlacement("a.yaml", None, None, old))
    with pytest.raises(ValueError, match="7 experts over ep_size 2 .*restart with the new placement"):
        live.check_swap(state, SimpleNamespace(path="b.yaml"))
