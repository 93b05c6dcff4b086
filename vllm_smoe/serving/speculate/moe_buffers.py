"""Speculate over a batched all2all backend (DeepEP low-latency, NIXL-EP): vLLM's MoE buffers
sized to a rank's chunk of the step, and said at start.

vLLM sizes those buffers by ``FusedMoEConfig.max_num_tokens``, the most rows one rank dispatches,
which it sets to ``--max-num-batched-tokens`` (``fused_moe/layer.py``); DeepEP's low-latency RDMA
buffer (``DeepEPLLAll2AllManager``: about 4 x experts x tokens x hidden x 2 bytes), DeepEP's
per-call receive tensor and the batched experts' workspace (local experts x tokens x EP ranks x
max(K, N)) all grow with it. vLLM keeps that number small (256) for these backends only with
DP > 1 (``ParallelConfig.use_batched_dp_moe``, read by ``EngineArgs``'s batch defaults), and
speculate turns sequence-parallel MoE on at DP = 1 after those defaults are picked, so a node
keeps 8192 (an H100's server default): over 100 GiB for DeepSeek-V3's shapes. Under sequence
parallelism each rank dispatches only its chunk of the step, ceil(T / TP) rows, so smoe lowers
``max_num_tokens`` of each such layer to that before vLLM builds the MoE kernels (in the model
loader, :func:`cap_max_num_tokens`); the scheduler keeps its token budget.
"""

from __future__ import annotations

from ...formats.model_info import text_config

# vLLM 0.32's backends whose experts run in the batched format, with buffers sized by
# max_num_tokens per dispatching rank (ParallelConfig.use_batched_dp_moe,
# FusedMoEParallelConfig.use_batched_activation_format)
BATCHED_BACKENDS = ("deepep_low_latency", "nixl_ep")
_GIB = 1 << 30


def chunk_tokens(max_num_batched_tokens: int, ranks: int) -> int:
    """The most rows one of ``ranks`` sequence-parallel ranks routes in a step of at most
    ``max_num_batched_tokens``: vLLM's ``sequence_parallel_chunk`` pads the step to a multiple of
    the ranks and smoe's token order gives each ceil(T / N) rows. Rounded up to a multiple of 4:
    DeepEP's low-latency dispatch asserts ranks x max tokens % 4 == 0 (its TMA copies,
    ``Buffer::low_latency_dispatch``)."""
    rows = -(-max_num_batched_tokens // ranks)
    return -(-rows // 4) * 4


def cap_max_num_tokens(model, max_num_batched_tokens: int) -> dict[int, int]:
    """In a worker, after vLLM built the model and before it builds the MoE kernels (at
    ``process_weights_after_loading``, which hands ``max_num_tokens`` to the all2all manager and
    the batched experts): each sequence-parallel FusedMoE over a batched backend takes a rank's
    chunk. Returns {sequence-parallel size: rows} of the layers capped (empty: none). Idempotent."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    capped: dict[int, int] = {}
    for module in model.modules():
        moe = getattr(module, "moe_config", None)
        if not isinstance(moe, FusedMoEConfig):
            continue
        par = moe.moe_parallel_config
        if not (par.use_all2all_kernels and par.is_sequence_parallel and par.all2all_backend in BATCHED_BACKENDS):
            continue
        moe.max_num_tokens = min(moe.max_num_tokens, chunk_tokens(max_num_batched_tokens, par.sp_size))
        capped[par.sp_size] = moe.max_num_tokens
    return capped


def built_before_cap(model) -> list[str]:
    """The MoE layers whose kernel vLLM built for more rows per rank than their config now says:
    built before :func:`cap_max_num_tokens` ran (a vLLM that builds them before loading weights),
    so their buffers hold the whole step."""
    out, seen = [], set()
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        finalize = getattr(kernel, "prepare_finalize", None)
        if finalize is None or id(kernel) in seen:
            continue
        seen.add(id(kernel))
        rows = finalize.max_num_tokens_per_rank()
        if rows is not None and rows > kernel.moe_config.max_num_tokens:
            out.append(name)
    return out


def ll_rdma_bytes(tokens: int, hidden: int, ranks: int, experts: int) -> int:
    """DeepEP's ``Buffer.get_low_latency_rdma_size_hint``, the RDMA buffer vLLM's
    ``DeepEPLLAll2AllManager`` allocates: DeepEP's ``LowLatencyLayout`` (csrc/config.hpp at
    73b6ea4, the commit vLLM's tools/ep_kernels/install_python_libraries.sh builds), computed here
    so the start line needs no DeepEP (its import would start CUDA in the API server)."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)  # int4 header + bf16 or fp8 + scales
    combine_msg = scales * 4 + hidden * 2
    send = max(tokens * dispatch_msg, experts * tokens * combine_msg)
    recv = max(experts * tokens * dispatch_msg, experts * tokens * combine_msg)
    signal = -(-experts * 4 // 128) * 128
    total = 2 * (send + recv + signal)  # odd / even buffers
    return (total + 128) // 128 * 128


def workspace_bytes(tokens: int, ranks: int, local_experts: int, hidden: int, intermediate: int,
                    dtype_bytes: int = 2) -> int:
    """The batched experts' workspace vLLM allocates: ``BatchedDeepGemmExperts.workspace_shapes``
    (FP8 block-quantized experts on Hopper, e.g. DeepSeek-V3's) gives workspace13 [local experts,
    tokens x ranks, max(K, N)], workspace2 [.., N / 2] and the output [.., K], and
    ``FusedMoEKernel._allocate_buffers`` keeps workspace13 and the output in one buffer."""
    rows = local_experts * tokens * ranks
    n = 2 * intermediate  # gate and up projections
    return rows * (max(hidden, n) + n // 2) * dtype_bytes


def buffer_sizes(max_num_batched_tokens: int, ranks: int, experts: int, hidden: int, intermediate: int,
                 backend: str) -> dict[str, dict[str, int]]:
    """{"vllm": ..., "smoe": ...}, each {"tokens", "rdma" (DeepEP low-latency only), "workspace"}
    in bytes: what vLLM would size with ``max_num_tokens`` = the step, and with a rank's chunk."""
    out = {}
    for who, tokens in (("vllm", max_num_batched_tokens),
                        ("smoe", min(max_num_batched_tokens, chunk_tokens(max_num_batched_tokens, ranks)))):
        sizes = {"tokens": tokens, "workspace": workspace_bytes(tokens, ranks, experts // ranks, hidden, intermediate)}
        if backend == "deepep_low_latency":
            sizes["rdma"] = ll_rdma_bytes(tokens, hidden, ranks, experts)
        out[who] = sizes
    return out


def start_line(vllm_config, experts: int) -> str | None:
    """The line speculate logs at start over a batched backend (None elsewhere): the rows each
    rank's buffers hold and the bytes that follow, next to what vLLM alone would allocate.
    experts: the physical expert slots per layer (the placement's, replicas included)."""
    pc = vllm_config.parallel_config
    backend = pc.all2all_backend
    if backend not in BATCHED_BACKENDS:
        return None
    hf = text_config(vllm_config.model_config.hf_text_config)
    intermediate = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    T, N = vllm_config.scheduler_config.max_num_batched_tokens, pc.tensor_parallel_size
    s = buffer_sizes(T, N, experts, hf.hidden_size, intermediate, backend)
    old, new = s["vllm"], s["smoe"]
    parts = [f"max_num_tokens {new['tokens']} per rank (vLLM's: {old['tokens']}, --max-num-batched-tokens {T} "
             f"over {N} ranks)"]
    if "rdma" in new:
        parts.append(f"DeepEP low-latency RDMA buffer {new['rdma'] / _GIB:.2f} GiB (vLLM's: {old['rdma'] / _GIB:.2f})")
    parts.append(f"batched experts' workspace {new['workspace'] / _GIB:.2f} GiB (vLLM's: "
                 f"{old['workspace'] / _GIB:.2f}; DeepGEMM's shapes, bf16)")
    line = (f"smoe mode speculate over --all2all-backend {backend}: MoE buffers sized to a rank's chunk of the step: "
            + "; ".join(parts))
    from vllm.config import SchedulerConfig

    rows = SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP  # vLLM's per-rank default with DP > 1
    if new["tokens"] > rows:
        small = buffer_sizes(rows * N, N, experts, hf.hidden_size, intermediate, backend)["smoe"]
        line += (f"; --max-num-batched-tokens {rows * N} gives each rank the {rows} rows vLLM gives these backends "
                 f"under DP ({(small.get('rdma', 0) + small['workspace']) / _GIB:.2f} GiB)")
    return line
