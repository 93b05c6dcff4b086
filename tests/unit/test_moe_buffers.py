"""Speculate over DeepEP low-latency sizes vLLM's MoE buffers to a rank's chunk (issue 62, item 1).

What vLLM 0.32 would allocate for DeepSeek-V3's shapes (256 experts, top-8, hidden 7168, MoE
intermediate 2048) at EP 8 and EP 64, computed through vLLM's own code: the batch default of
``EngineArgs`` (keyed on DP > 1), ``FusedMoEParallelConfig.make`` and ``FusedMoEConfig``,
``maybe_make_prepare_finalize`` (what it hands the all2all manager and the batched experts),
``DeepEPLLAll2AllManager._make_all2all_kwargs`` (the RDMA buffer) and
``BatchedDeepGemmExperts.workspace_shapes``; before smoe (the step: 8192 rows) and after its cap
(a rank's chunk), the latter equal to what smoe's start line says. No engine starts."""

import logging
import math
import sys
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm_smoe.serving.speculate import moe_buffers as mb

E, TOPK, HIDDEN, INTER = 256, 8, 7168, 2048  # DeepSeek-V3
GB = 10**9


def deep_ep_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    """REPRODUCED FROM DeepEP, which is not importable here (no CUDA): ``LowLatencyLayout`` and
    ``get_low_latency_rdma_size_hint`` in csrc/config.hpp of deepseek-ai/DeepEP at 73b6ea4 (the
    commit vLLM's tools/ep_kernels/install_python_libraries.sh builds), written out line by line.
    vLLM calls it as ``deep_ep.Buffer.get_low_latency_rdma_size_hint``."""
    num_scales = hidden // 128
    num_bytes_per_dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)  # sizeof(int4) + bf16 | fp8 + scales
    num_bytes_per_combine_msg = num_scales * 4 + hidden * 2  # nv_bfloat162 per 128 channels + bf16
    t = num_max_dispatch_tokens_per_rank
    send_buffer_bytes = max(t * num_bytes_per_dispatch_msg, num_experts * t * num_bytes_per_combine_msg)
    total_bytes = send_buffer_bytes * 2
    recv_buffer_bytes = max(num_experts * t * num_bytes_per_dispatch_msg, num_experts * t * num_bytes_per_combine_msg)
    total_bytes += recv_buffer_bytes * 2
    signaling_buffer_bytes = num_experts * 4  # sizeof(int)
    total_bytes += (signaling_buffer_bytes + 127) // 128 * 128 * 2
    return (total_bytes + 128) // 128 * 128  # NUM_BUFFER_ALIGNMENT_BYTES = 128


@pytest.fixture
def h100(monkeypatch):
    """vLLM's platform as an H100 (its batch defaults read the device), as TP and DP rank 0."""
    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.platforms import current_platform

    cls = type(current_platform)
    monkeypatch.setattr(cls, "is_cpu", lambda self=None: False)
    monkeypatch.setattr(cls, "get_device_total_memory", classmethod(lambda c, device_id=0: 80 * 2**30))
    monkeypatch.setattr(cls, "get_device_name", classmethod(lambda c, device_id=0: "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(moe_config, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(moe_config, "get_dp_group", lambda: types.SimpleNamespace(rank_in_group=0))


def _step_tokens(tp: int, dp: int) -> int:
    """``--max-num-batched-tokens`` as vLLM's EngineArgs defaults it for ``vllm serve``."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    kw = dict(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=True,
              all2all_backend="deepep_low_latency")
    ea = EngineArgs(model="m", **kw)
    ea.enable_chunked_prefill = True
    model = types.SimpleNamespace(max_model_len=163840, is_multimodal_model=False, is_mm_prefix_lm=False)
    ea._set_default_max_num_seqs_and_batched_tokens_args(UsageContext.OPENAI_API_SERVER, model, ParallelConfig(**kw))
    return ea.max_num_batched_tokens


def _moe_config(tp: int, max_num_tokens: int, backend: str = "deepep_low_latency", dp: int = 1):
    """vLLM's FusedMoEConfig of a DeepSeek-V3 MoE layer under sequence-parallel MoE at TP = EP = tp."""
    from vllm.config import ParallelConfig
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)

    pc = ParallelConfig.__new__(ParallelConfig)  # only the fields make() reads
    pc.__dict__.update(all2all_backend=backend, enable_expert_parallel=True, enable_eplb=False)
    par = FusedMoEParallelConfig.make(tp_size_=tp, pcp_size_=1, dp_size_=dp, sp_size_=tp if dp == 1 else 1,
                                      vllm_parallel_config=pc)
    return FusedMoEConfig(num_experts=E, experts_per_token=TOPK, hidden_dim=HIDDEN, intermediate_size=INTER,
                          num_local_experts=E // tp, num_logical_experts=E, activation=MoEActivation.SILU,
                          device="cpu", routing_method=RoutingMethodType.DeepSeekV3, moe_parallel_config=par,
                          in_dtype=torch.bfloat16, max_num_tokens=max_num_tokens)


def _vllm_allocates(moe, monkeypatch) -> dict:
    """Bytes vLLM's own code sizes from ``moe`` over DeepEP low-latency with FP8 block-quantized
    experts (DeepSeek-V3 on Hopper): the RDMA buffer and the batched DeepGEMM experts' workspace."""
    from vllm.distributed.device_communicators.all2all import DeepEPLLAll2AllManager
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import BatchedDeepGemmExperts
    from vllm.platforms import current_platform

    ranks = moe.moe_parallel_config.ep_size
    handle_args = {}

    class Manager:  # vLLM's EP all2all manager: only the sizes it is asked for
        world_size, rank, dp_world_size = ranks, 0, 1

        def get_handle(self, kwargs):
            handle_args.update(kwargs)
            return "buffer"

    class LowLatency:  # DeepEPLLPrepareAndFinalize, which vLLM imports only where deep_ep is
        def __init__(self, handle, max_tokens_per_rank, num_dispatchers, **_):
            self.max_tokens_per_rank, self.dispatchers = max_tokens_per_rank, num_dispatchers

        def max_num_tokens_per_rank(self):
            return self.max_tokens_per_rank

        def num_dispatchers(self):
            return self.dispatchers

    monkeypatch.setattr(all2all_utils, "DeepEPLLPrepareAndFinalize", LowLatency, raising=False)
    monkeypatch.setattr(all2all_utils, "DEEPEP_QUANT_BLOCK_SHAPE", [128, 128], raising=False)
    quant = types.SimpleNamespace(quant_dtype=current_platform.fp8_dtype(), block_shape=[128, 128])
    finalize = all2all_utils.maybe_make_prepare_finalize(moe, quant, all2all_manager=Manager())
    deep_ep = types.SimpleNamespace(Buffer=types.SimpleNamespace(
        get_low_latency_rdma_size_hint=deep_ep_low_latency_rdma_size_hint))
    monkeypatch.setitem(sys.modules, "deep_ep", deep_ep)
    rdma = DeepEPLLAll2AllManager._make_all2all_kwargs(
        types.SimpleNamespace(cpu_group=None, support_fault_tolerance=False), **handle_args)["num_rdma_bytes"]
    experts = BatchedDeepGemmExperts.__new__(BatchedDeepGemmExperts)  # its __init__ asks a GPU for DeepGEMM
    experts.max_num_tokens, experts.num_dispatchers = finalize.max_num_tokens_per_rank(), finalize.num_dispatchers()
    w13, w2, out = experts.workspace_shapes(experts.max_num_tokens, 2 * INTER, HIDDEN, TOPK, E, moe.num_local_experts,
                                            None, MoEActivation.SILU)
    # FusedMoEKernelModularImpl._allocate_buffers: workspace13 and the output share one buffer
    workspace = (max(math.prod(w13), math.prod(out)) + math.prod(w2)) * torch.bfloat16.itemsize
    return {"tokens": finalize.max_num_tokens_per_rank(), "rdma": rdma, "workspace": workspace,
            "workspace13": math.prod(w13) * torch.bfloat16.itemsize}


def _vllm_config(tp: int, step: int, backend: str = "deepep_low_latency"):
    hf = types.SimpleNamespace(hidden_size=HIDDEN, moe_intermediate_size=INTER, intermediate_size=18432,
                               n_routed_experts=E, num_hidden_layers=61)
    pc = types.SimpleNamespace(all2all_backend=backend, tensor_parallel_size=tp)
    return types.SimpleNamespace(parallel_config=pc,
                                 model_config=types.SimpleNamespace(hf_text_config=hf, model="deepseek-v3"),
                                 scheduler_config=types.SimpleNamespace(max_num_batched_tokens=step))


@pytest.mark.parametrize("ep", [8, 64])
def test_deepseek_v3_buffers_before_and_after_smoe(ep, h100, monkeypatch):
    step = _step_tokens(ep, dp=1)
    assert step == 8192  # vLLM's small default for batched backends needs DP > 1 ...
    assert _step_tokens(ep, dp=2) == 256  # ... which speculate (DP = 1) never has
    moe = _moe_config(ep, step)
    assert moe.use_deepep_ll_kernels and moe.moe_parallel_config.sp_size == ep
    before = _vllm_allocates(moe, monkeypatch)
    assert before["tokens"] == 8192
    assert before["workspace13"] == E * 8192 * HIDDEN * 2 > 30 * GB  # the issue's ~30 GB, at any EP size
    assert before["rdma"] > 120 * GB  # DeepEP's buffer alone would not fit an H100 or an H200

    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.moe_config = moe
    assert mb.cap_max_num_tokens(model, step) == {ep: 8192 // ep}
    after = _vllm_allocates(moe, monkeypatch)
    assert after["tokens"] == 8192 // ep

    said = mb.buffer_sizes(step, ep, E, HIDDEN, INTER, "deepep_low_latency")  # what the start line prints
    assert said["vllm"] == {k: before[k] for k in ("tokens", "rdma", "workspace")}
    assert said["smoe"] == {k: after[k] for k in ("tokens", "rdma", "workspace")}
    line = mb.start_line(_vllm_config(ep, step), E)
    for v in (after["rdma"], after["workspace"], before["rdma"], before["workspace"]):
        assert f"{v / 2**30:.2f}" in line
    assert f"max_num_tokens {8192 // ep} per rank (vLLM's: 8192" in line
    # the flag that gives each rank vLLM's own per-rank default (256 rows) where the chunk is larger
    assert (f"--max-num-batched-tokens {256 * ep} gives each rank the 256 rows" in line) == (8192 // ep > 256)

    # bounded: a rank's share of the step, as vLLM itself allocates per DP rank of that chunk
    assert after["workspace"] * ep == before["workspace"]
    assert after["rdma"] <= before["rdma"] / ep + 4096
    assert after["rdma"] + after["workspace"] <= {8: 21 * GB, 64: 2.7 * GB}[ep]
    print(f"EP {ep}: vLLM {before['rdma'] / GB:.1f} GB RDMA + {before['workspace'] / GB:.1f} GB workspace; "
          f"smoe {after['rdma'] / GB:.2f} GB + {after['workspace'] / GB:.2f} GB")


def test_the_cap_leaves_other_layers_alone_and_is_idempotent(h100):
    layers = {"ht": _moe_config(8, 8192, backend="deepep_high_throughput"),  # standard format, sized by rows
              "dp": _moe_config(8, 256, dp=2),  # vLLM's own DP: not sequence parallel here
              "ll": _moe_config(2, 8190)}
    model = torch.nn.Module()
    for name, moe in layers.items():
        setattr(model, name, torch.nn.Module())
        getattr(model, name).moe_config = moe
    assert mb.cap_max_num_tokens(model, 8190) == {2: 4096}  # ceil(8190 / 2) = 4095, to a multiple of 4
    assert mb.cap_max_num_tokens(model, 8190) == {2: 4096}
    assert [m.max_num_tokens for m in layers.values()] == [8192, 256, 4096]
    assert mb.chunk_tokens(3, 2) == 4 and mb.chunk_tokens(8192, 64) == 128
    tiny = _moe_config(2, 2)
    model.tiny = torch.nn.Module()
    model.tiny.moe_config = tiny
    mb.cap_max_num_tokens(model, 2)
    assert tiny.max_num_tokens == 2  # never above vLLM's own


def test_kernels_built_before_the_cap_are_named():
    def layer(rows, configured):
        finalize = types.SimpleNamespace(max_num_tokens_per_rank=lambda: rows)
        kernel = types.SimpleNamespace(prepare_finalize=finalize,
                                       moe_config=types.SimpleNamespace(max_num_tokens=configured))
        m = torch.nn.Module()
        m.quant_method = types.SimpleNamespace(moe_kernel=kernel)
        return m

    model = torch.nn.Module()
    model.a, model.b, model.c = layer(1024, 1024), layer(8192, 1024), layer(None, 1024)
    assert mb.built_before_cap(model) == ["b"]


def test_the_loader_caps_before_vllm_builds_the_kernels(h100, monkeypatch):
    import vllm.config as config_module
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from vllm_smoe.serving.place.loader import SmoeModelLoader

    seen = []
    monkeypatch.setattr(DefaultModelLoader, "load_weights",
                        lambda self, model, model_config: seen.append(model.experts.moe_config.max_num_tokens))
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.moe_config = _moe_config(8, 8192)
    loader = SmoeModelLoader.__new__(SmoeModelLoader)
    for mode in ("place", "speculate"):  # the config vLLM loads under (a draft's is the target's)
        current = types.SimpleNamespace(additional_config={"smoe": {"mode": mode, "placement": "/p.yaml"}},
                                        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8192))
        monkeypatch.setattr(config_module, "get_current_vllm_config", lambda: current)
        loader.load_weights(model, None)
    assert seen == [8192, 1024]  # place mode keeps vLLM's sizes


def test_start_line_only_for_batched_backends():
    assert mb.start_line(_vllm_config(8, 8192, backend="deepep_high_throughput"), E) is None
    line = mb.start_line(_vllm_config(8, 8192, backend="nixl_ep"), E)
    assert "--all2all-backend nixl_ep" in line and "RDMA" not in line and "max_num_tokens 1024 per rank" in line


def test_the_plugin_logs_the_sizes_at_start(monkeypatch, caplog):
    from vllm_smoe.serving import advice, plugin
    from vllm_smoe.serving.place import check
    from vllm_smoe.serving.observe import metrics
    from vllm_smoe.serving.config import SmoeConfig

    plan = types.SimpleNamespace(physical2expert=torch.zeros((3, E)), num_redundant=0)
    served = types.SimpleNamespace(plan=plan, placement=types.SimpleNamespace(predictor=object()))
    monkeypatch.setattr(check, "check_served_placement", lambda *a, **k: served)
    monkeypatch.setattr(advice, "advice", lambda *a, **k: [])
    monkeypatch.setattr(metrics, "server_metrics_dir", lambda cfg: None)
    vc = _vllm_config(8, 8192)
    vc.parallel_config.__dict__.update(worker_extension_cls=None, data_parallel_size=1, enable_expert_parallel=True)
    with caplog.at_level(logging.INFO, logger="vllm.smoe"):
        plugin._after_engine_config(None, SmoeConfig(mode="speculate", placement="/p.yaml"), vc)
    lines = [r.getMessage() for r in caplog.records if "MoE buffers sized" in r.getMessage()]
    assert lines == [mb.start_line(vc, E)]
