"""What smoe does on vLLM's CUDA build, checked on CPU: the per-step hooks attach to whichever
model runner vLLM's worker would build (V1 or Model Runner V2), speculate is refused on
transports that ignore token order, every rank builds one permutation even from perturbed rows,
counters exclude pad rows on the device, and a step without token ids does not crash."""

import os
import types

import numpy as np
import pytest
import torch

from vllm_smoe.serving.speculate import device_predict

vllm = pytest.importorskip("vllm")

from vllm_smoe.serving import runner_hooks as rh  # noqa: E402
from vllm_smoe.serving.speculate.support import ORDERED_BACKENDS, speculate_transport


# ---------------------------------------------------------------- runners

def test_hooks_attach_to_the_runner_vllm_builds_for_cuda_and_cpu():
    rh.attach()
    for v2 in (False, True):
        cfg = types.SimpleNamespace(use_v2_model_runner=v2)
        for device in ("cuda", "cpu"):
            path = rh.runner_class_for(cfg, device)
            assert path == {(True, "cuda"): rh.V2, (False, "cuda"): rh.V1, (True, "cpu"): rh.CPU_V2,
                            (False, "cpu"): rh.CPU_V1}[(v2, device)]
            assert rh.attached_to(path), path  # CPU runners inherit the wrapped execute_model
            rh.check_attached(cfg, device)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    assert not issubclass(V2, V1)  # why both are wrapped


def test_an_unhooked_runner_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(rh, "runner_class_for", lambda cfg, device: "collections:OrderedDict")
    with pytest.raises(ValueError, match="collections:OrderedDict"):
        rh.check_attached(types.SimpleNamespace(use_v2_model_runner=True), "cuda")


class _Runner:
    def __init__(self):
        self.calls = []

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.calls.append(("forward", dummy_run))
        return "out"


def _listed(monkeypatch, patch_id, cls, attr):
    """A stand-in class's method as a listed patch target (``patches.replace`` takes only those)."""
    import inspect

    from vllm_smoe.serving import patches

    target = f"{cls.__module__}:{cls.__qualname__}.{attr}"
    params = tuple(inspect.signature(getattr(cls, attr)).parameters)
    monkeypatch.setitem(patches._BY_ID, patch_id, patches.Patch(patch_id, target, "method", params, "tests", "-",
                                                                "-", "-"))


def test_wrapper_runs_hooks_around_served_steps_only(monkeypatch):
    from vllm_smoe.serving.patches import runners

    seen = []
    before = lambda runner, so: seen.append(("before", so.total_num_scheduled_tokens))  # noqa: E731
    after = lambda runner, so, step: seen.append(("after", step))  # noqa: E731
    _listed(monkeypatch, "test_runner", _Runner, "execute_model")
    runners.wrap_runner(_Runner, "test_runner", rh._served)
    rh.attach(before=before, after=after)
    serving = rh._SERVING[0]

    class _Worker:
        def compile_or_warm_up_model(self):
            r.execute_model(so)  # V2's kernel warm-up: made-up requests through execute_model
            return "times"

    try:
        r = _Runner()
        so = types.SimpleNamespace(total_num_scheduled_tokens=0)
        rh._SERVING[0] = False
        _listed(monkeypatch, "test_worker", _Worker, "compile_or_warm_up_model")
        runners.wrap_worker(_Worker, "test_worker", rh._warmed_up)
        assert _Worker().compile_or_warm_up_model() == "times"
        assert seen == [] and r.calls == [("forward", False)] and rh.serving()
        assert r.execute_model(so, dummy_run=True) == "out"  # V2's dummy runs and capture
        assert seen == []
        assert r.execute_model(so) == "out"
        assert seen == [("before", 0), ("after", None)]  # nothing scheduled: no step view
    finally:
        rh.detach(before, after)
        rh._SERVING[0] = serving


def test_step_view_of_model_runner_v2_and_v1():
    ids, pos = torch.arange(10, 20), torch.arange(10)
    batch = types.SimpleNamespace(req_ids=["b", "a"], num_scheduled_tokens=np.array([3, 4, 0]),
                                  input_ids=ids, positions=pos)
    v2 = types.SimpleNamespace(input_buffers=object(), execute_model_state=types.SimpleNamespace(input_batch=batch))
    so = types.SimpleNamespace(total_num_scheduled_tokens=7, num_scheduled_tokens={"a": 4, "b": 3})
    step = rh.step_of(v2, so)
    assert step.req_ids == ["b", "a"] and step.counts.tolist() == [3, 4]
    assert step.input_ids.tolist() == list(range(10, 17)) and step.positions.shape == (7,)
    assert rh.step_of(types.SimpleNamespace(input_buffers=object(), execute_model_state=None), so) is None
    v1 = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["a", "b"]),
                               input_ids=types.SimpleNamespace(gpu=ids), positions=pos, enable_prompt_embeds=False)
    step = rh.step_of(v1, so)
    assert step.counts.tolist() == [4, 3] and step.input_ids.shape == (7,)
    v1.enable_prompt_embeds = True
    assert rh.step_of(v1, so).input_ids is None  # rows may be vectors: never recorded as token ids


# ---------------------------------------------------------------- transports

@pytest.mark.parametrize("backend,ok", [("allgather_reducescatter", False), ("naive", False), ("passthrough", False),
                                        ("flashinfer_nvlink_two_sided", False), ("moonep", False)]
                         + [(b, True) for b in ORDERED_BACKENDS])
def test_speculate_transport_on_cuda(backend, ok):
    got, reason = speculate_transport(types.SimpleNamespace(all2all_backend=backend), "cuda", None)
    assert got == ok
    if not ok:
        assert f"--all2all-backend {backend}" in reason and "deepep_low_latency" in reason and "mode place" in reason


def test_sparse_is_cpu_only_and_cpu_takes_any_backend():
    pc = types.SimpleNamespace(all2all_backend="deepep_low_latency")
    ok, reason = speculate_transport(pc, "cuda", "sparse")
    assert not ok and "CPU build only" in reason and "field 'all2all'" in reason
    assert speculate_transport(types.SimpleNamespace(all2all_backend="allgather_reducescatter"), "cpu", None)[0]


def _parallel(backend, monkeypatch, cpu):
    from vllm.config import ParallelConfig
    from vllm.platforms import current_platform

    from vllm_smoe.serving.patches import cpu as cpu_patches

    cpu_patches.at_start()
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: cpu)
    pc = ParallelConfig.__new__(ParallelConfig)  # no validation: only the fields the property reads
    pc.__dict__.update(all2all_backend=backend, enable_expert_parallel=True, tensor_parallel_size=2,
                       data_parallel_size=1, smoe_sequence_parallel=True)
    return pc


@pytest.mark.parametrize("backend,cpu,on", [("allgather_reducescatter", True, True),
                                            ("allgather_reducescatter", False, False),
                                            ("flashinfer_nvlink_two_sided", False, False),
                                            ("deepep_low_latency", False, True)])
def test_sequence_parallel_moe_keeps_vllms_whitelist_off_cpu(backend, cpu, on, monkeypatch):
    assert _parallel(backend, monkeypatch, cpu).use_sequence_parallel_moe is on


def test_engine_args_checks(monkeypatch):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_smoe.serving.config import SmoeConfig
    from vllm_smoe.serving.plugin import _check_engine_args

    spec = SmoeConfig(mode="speculate", placement="/x.yaml")
    ea = EngineArgs(model="m", enable_return_routed_experts=True)
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        _check_engine_args(ea, spec)
    _check_engine_args(ea, SmoeConfig())  # place mode: vLLM's capture stays the user's
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    ea = EngineArgs(model="m", all2all_backend="deepep_high_throughput")
    _check_engine_args(ea, spec)
    assert ea.compilation_config.cudagraph_mode == CUDAGraphMode.NONE  # vLLM does this only for DP > 1
    ea = EngineArgs(model="m", all2all_backend="deepep_low_latency")
    _check_engine_args(ea, spec)
    assert ea.compilation_config.cudagraph_mode != CUDAGraphMode.NONE  # LL kernels capture
    with pytest.raises(ValueError, match="--smoe-all2all sparse"):
        _check_engine_args(ea, SmoeConfig(all2all="sparse"))


# ---------------------------------------------------------------- agreement under perturbed rows

WORLD, T, H, E, K, N = 2, 64, 16, 8, 2, 2


def _agree_worker(rank, port, results):
    import torch.distributed as dist

    from vllm_smoe.serving.speculate.comm import agree

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(H, E, generator=g)
    x = torch.randn(T, H, generator=g)
    held = (torch.arange(E) % N)[None, :] == torch.arange(N)[:, None]  # [N, E]
    # what a non-deterministic all-reduce does: rows equal up to the last bits, rank by rank
    x = x + (rank + 1) * 1e-3 * torch.randn(T, H, generator=torch.Generator().manual_seed(rank + 7))
    ids = torch.topk(x @ gate, K, dim=1).indices
    pref, conf = device_predict.prefer_held(ids, held)
    t2r = device_predict.assign(pref, conf, device_predict.chunk_caps(T, N))

    def broadcast(t, src):
        dist.broadcast(t, src)
        return t

    agreed = agree(t2r, broadcast)
    results[rank] = (t2r.tolist(), device_predict.permutation(agreed)[0].tolist())
    dist.destroy_process_group()


def test_router_predictor_ranks_build_one_permutation_from_perturbed_rows(gloo_spawn):
    results = gloo_spawn(_agree_worker, WORLD)
    (own0, perm0), (own1, perm1) = results[0], results[1]
    assert own0 != own1  # the perturbation alone makes the ranks disagree (rows computed twice or never)
    assert perm0 == perm1  # agreed: one permutation
    assert sorted(perm0) == list(range(T))


# ---------------------------------------------------------------- counters and missing ids

def _order(T, N, rank, num_real, perm):
    from vllm_smoe.serving.speculate.token_order import TokenOrder

    o = TokenOrder.__new__(TokenOrder)
    c = -(-T // N)
    o.__dict__.update(top1=torch.zeros(c, dtype=torch.long), count=True, rows=T, rank=rank, N=N, stack=False, step_order=False,
                      perm=perm[None], num_real=torch.tensor(num_real), held=torch.ones((1, E), dtype=torch.bool),
                      counts=torch.zeros((1, 7), dtype=torch.long))
    return o, c


def test_counters_skip_pad_rows_wherever_the_order_put_them():
    T, Nr = 7, 2
    perm = torch.tensor([6, 0, 5, 1, 2, 3, 4])  # rows 5, 6 are vLLM's padding (num_real 5)
    for rank, want in ((0, 2), (1, 3)):  # rank 0: rows 6, 0, 5, 1 -> 2 real; rank 1: 2, 3, 4 (+ chunk pad)
        o, c = _order(T, Nr, rank, 5, perm)
        o._capture(0, torch.zeros((c, K), dtype=torch.long))
        assert o.counts[0, 2].item() == want, rank
        assert o.counts[0, 1].item() == want * K
        assert o.counts[0, 4:].tolist() == o.counts[0, :3].tolist()  # T >= N: drift judges it
    o, c = _order(1, Nr, 0, 1, torch.tensor([0]))  # one token, two ranks: counted, not judged
    o._capture(0, torch.zeros((c, K), dtype=torch.long))
    assert o.counts[0, 2].item() == 1 and o.counts[0, 4:].tolist() == [0, 0, 0]
    o, c = _order(T, Nr, 0, 0, perm)  # outside a served step (warm-up, capture)
    o._capture(0, torch.zeros((c, K), dtype=torch.long))
    assert o.counts.sum().item() == 0


def test_a_step_without_token_ids_is_ordered_not_refused():
    from vllm_smoe.serving.speculate.token_order import TokenOrder

    o = TokenOrder.__new__(TokenOrder)
    from vllm_smoe.serving.speculate.predictors import Learned

    o.__dict__.update(ids=torch.full((8,), 5), query=torch.zeros(8, dtype=torch.long),
                      prev=torch.zeros(8, dtype=torch.long), bigrams=True, predictor=Learned())
    o._step_ids(None, (), {"input_ids": None, "positions": torch.arange(3), "inputs_embeds": torch.zeros(3, 4)})
    assert o.ids.tolist() == [0, 0, 0, 5, 5, 5, 5, 5] and o.query[:3].tolist() == [-1, -1, -1]
    assert o.prev[:3].tolist() == [-1, -1, -1]  # learned: no previous ids either


def _speculate_setup(num_experts=8, backend="allgather_reducescatter", **model):
    """(vllm_config, placement) stand-ins for capability.speculate_supported at TP=2 + EP."""
    hf = types.SimpleNamespace(shared_expert_intermediate_size=0, num_experts=num_experts, vocab_size=100)
    mc = types.SimpleNamespace(hf_text_config=hf, **model)
    pc = types.SimpleNamespace(enable_expert_parallel=True, tensor_parallel_size=2, pipeline_parallel_size=1,
                               data_parallel_size=1, enable_eplb=False, all2all_backend=backend)
    placement = types.SimpleNamespace(ep_size=2, vocab_size=None, predictor=object(), path="p.yaml")
    return types.SimpleNamespace(model_config=mc, parallel_config=pc), placement


def test_speculate_refuses_id_predictors_when_rows_may_be_embeddings():
    from vllm_smoe.serving.speculate.support import speculate_supported

    cfg, placement = _speculate_setup(enable_prompt_embeds=True, is_multimodal_model=False)
    ok, reason = speculate_supported(cfg, placement, "tables", device_type="cpu")
    assert not ok and "--enable-prompt-embeds" in reason and "predictor 'router'" in reason
    assert speculate_supported(cfg, placement, "router", device_type="cpu") == (True, "")


def test_speculate_refuses_micro_batches_and_monolithic_kernels():
    from vllm_smoe.serving.record.capture import monolithic
    from vllm_smoe.serving.speculate.support import speculate_supported

    cfg, placement = _speculate_setup(backend="deepep_low_latency")
    cfg.parallel_config.use_ubatching = True
    ok, reason = speculate_supported(cfg, placement, "tables", device_type="cuda")
    assert not ok and "micro-batching" in reason
    cfg.parallel_config.use_ubatching = False
    assert speculate_supported(cfg, placement, "tables", device_type="cuda") == (True, "")
    # vLLM's MoE split out of the CUDA graphs: its router would read the pad mask smoe's replayed op set
    cfg.compilation_config = types.SimpleNamespace(splitting_ops=["vllm::unified_attention", "vllm::moe_forward"],
                                                   cudagraph_mode=types.SimpleNamespace(name="PIECEWISE"))
    cfg.model_config.enforce_eager = False
    ok, reason = speculate_supported(cfg, placement, "tables", device_type="cuda")
    assert not ok and "splitting_ops ['vllm::moe_forward']" in reason
    cfg.model_config.enforce_eager = True
    assert speculate_supported(cfg, placement, "tables", device_type="cuda") == (True, "")
    fused = types.SimpleNamespace(quant_method=types.SimpleNamespace(is_monolithic=True))
    assert monolithic(fused) and not monolithic(types.SimpleNamespace(quant_method=None))


class _Kernel:
    """A monolithic kernel as vLLM 0.32 holds it (quant_method.moe_kernel.impl.fused_experts)."""

    def __init__(self, replay):
        self.replay = replay
        self.moe_config = types.SimpleNamespace(ep_size=1, use_ep=False, dp_size=1, max_num_tokens=8,
                                                experts_per_token=2, device="cpu")

    def supports_routing_replay_capture(self):
        return self.replay


class _CaptureRouter:
    capture_fn = None

    def set_capture_fn(self, fn):
        self.capture_fn = fn


class _MoELayer:
    """vLLM 0.32's FusedMoE (MoERunner): the quant method on routed_experts, not on the layer."""

    def __init__(self, mono, replay=True):
        quant = types.SimpleNamespace(is_monolithic=mono, moe_kernel=types.SimpleNamespace(
            impl=types.SimpleNamespace(fused_experts=_Kernel(replay))))
        self.routed_experts = types.SimpleNamespace(quant_method=quant, routing_sink=None)
        self.router = _CaptureRouter()

    @property
    def is_monolithic(self):
        return self.routed_experts.quant_method.is_monolithic


def test_routing_is_captured_where_vllm_routes_modular_or_monolithic():
    """smoe's counters and recorder see the ids each MoE layer routes to: through the router's
    capture function on modular kernels, through vLLM's routing sink on monolithic kernels that
    fill it (FlashInfer TRT-LLM on Blackwell), through a hook on the block's gate where the kernel
    reports nothing (vLLM 0.32's OAI Triton MXFP4 on Hopper), and refuse, naming the kernel, where
    there is neither. Before, smoe looked for ``quant_method`` on the
    layer itself, which vLLM 0.32 keeps on ``routed_experts``: every kernel read as modular, and a
    monolithic one would have recorded nothing but zeros."""
    import inspect

    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsSink
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from vllm_smoe.serving.record.capture import current_capture, monolithic, set_capture

    assert isinstance(inspect.getattr_static(MoERunner, "is_monolithic"), property)  # what smoe reads
    assert "quant_method" not in dir(MoERunner)  # the attribute smoe read before is not on the layer
    seen = []
    modular = _MoELayer(mono=False)
    assert not monolithic(modular)
    set_capture(modular, seen.append, "test")
    assert modular.router.capture_fn == seen.append and current_capture(modular) == seen.append

    mono = _MoELayer(mono=True)
    assert monolithic(mono)
    set_capture(mono, lambda ids: seen.append(("first", ids.tolist())), "test")
    prev = current_capture(mono)
    set_capture(mono, lambda ids: (prev(ids), seen.append(("second", ids.tolist()))), "test")  # chained
    sink = mono.routed_experts.routing_sink
    assert isinstance(sink, RoutedExpertsSink) and sink.buffer.shape == (8, 2) and mono.router.capture_fn is None
    sink.buffer[:3] = torch.tensor([[0, 5], [7, 1], [2, 3]], dtype=torch.int16)  # what the kernel writes
    sink.capture_fn(sink.buffer[:3])  # what vLLM calls after the kernel
    assert seen == [("first", [[0, 5], [7, 1], [2, 3]]), ("second", [[0, 5], [7, 1], [2, 3]])]

    # a monolithic kernel that reports nothing (the OAI Triton MXFP4 one): the block's gate is
    # hooked and the router's pure routing step picks the ids again from its rows and logits
    silent = _MoELayer(mono=True, replay=False)
    silent.router._compute_routing = lambda x, logits, dtype: tuple(torch.topk(logits, 2, dim=-1))  # (weights, ids)
    gate = torch.nn.Linear(16, 6, bias=False)
    got = []
    set_capture(silent, got.append, "smoe record", gate)
    x = torch.randn(5, 16)
    logits = gate(x)
    assert len(got) == 1 and torch.equal(got[0], torch.topk(logits, 2, dim=-1).indices)
    assert silent.routed_experts.routing_sink is None
    with pytest.raises(ValueError, match=r"smoe record: the MoE kernel _Kernel routes inside itself"):
        set_capture(_MoELayer(mono=True, replay=False), seen.append, "smoe record")
    # under EP (or DP) the kernel's input, and so the sink, holds every rank's gathered rows: not taken
    gathered = _MoELayer(mono=True)
    gathered.routed_experts.quant_method.moe_kernel.impl.fused_experts.moe_config.use_ep = True
    with pytest.raises(ValueError, match="this rank's rows only"):
        set_capture(gathered, seen.append, "smoe record")
    assert gathered.routed_experts.routing_sink is None


def test_the_gate_is_hooked_only_in_an_eager_model_off_rocm(monkeypatch):
    """A compiled model would trace the gate's hook (freezing the host values the capture reads);
    on ROCm GPT-OSS calls its gate's weights without the module."""
    from vllm.platforms import current_platform

    from vllm_smoe.serving.speculate.seams import hookable_gate

    block = types.SimpleNamespace(router=torch.nn.Linear(4, 3))
    layer = _MoELayer(mono=True, replay=False)
    layer.router._compute_routing = lambda *a, **k: None
    eager = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=True))
    compiled = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False))
    assert hookable_gate(block, layer, eager) is block.router
    assert hookable_gate(block, layer, compiled) is None
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    assert hookable_gate(block, layer, eager) is None


def test_speculate_with_an_uneven_split_serves_on_cpu_and_is_refused_on_cuda():
    """vLLM's token-order all2all backends (DeepEP, ...) size every rank's experts as E / N; smoe's
    own exchange on the CPU build follows vLLM's uneven split."""
    from vllm_smoe.serving.speculate.support import speculate_supported

    cfg, placement = _speculate_setup(num_experts=15, backend="deepep_low_latency")
    ok, reason = speculate_supported(cfg, placement, "tables", device_type="cuda")
    assert not ok and "15 experts do not split evenly over 2 ranks" in reason and "mode place" in reason
    cfg.parallel_config.all2all_backend = "allgather_reducescatter"
    assert speculate_supported(cfg, placement, "tables", device_type="cpu") == (True, "")
