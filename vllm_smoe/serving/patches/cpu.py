"""The CPU build's gaps (:mod:`vllm_smoe.serving.exchange.cpu_ep` says what each is), patched: vLLM's
experts honour ``expert_map``, its EPLB map works without Triton, 3-D rope inputs rotate
right, the MoE forward stays one opaque op under torch.compile, the communicator is smoe's, and
sequence-parallel MoE runs at DP = 1 for speculate. Each entry is in :data:`..PATCHES`.

:func:`at_start` runs in every process (the plugin); :func:`in_worker` when a worker asks for
its communicator under smoe. Everything stays vLLM's own unless the config being built asks for smoe.
"""

from __future__ import annotations

import torch

from ..exchange import cpu_ep
from . import replace, require

_FIXED = False


def fix_cpu_experts() -> None:
    """Make vLLM's unquantized CPU experts honour ``expert_map`` (idempotent).

    ``CPUUnquantizedExperts.apply`` hands the *global* ``topk_ids`` to ``cpu_fused_moe`` together
    with only this rank's expert weights: it ignores ``expert_map``, reads past the weights and
    crashes (or computes garbage) as soon as ``--enable-expert-parallel`` splits the experts.
    This patch maps the ids through ``expert_map`` and keeps only the local (token, expert) pairs
    (:func:`~vllm_smoe.serving.exchange.cpu_ep.local_pairs`), so nothing is computed for experts another rank holds."""
    global _FIXED
    if _FIXED:
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    orig = CPUUnquantizedExperts.apply

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs):
        if expert_map is None:
            return orig(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                        global_num_experts, expert_map, *args, **kwargs)
        rows, ids, weights = cpu_ep.local_pairs(topk_ids, topk_weights, expert_map)
        out = torch.empty((rows.shape[0], output.shape[1]), dtype=output.dtype, device=output.device)
        if rows.numel():
            orig(self, out, hidden_states.index_select(0, rows), w1, w2, weights.contiguous(), ids, activation,
                 global_num_experts, None, *args, **kwargs)
        output.zero_()
        output.index_add_(0, rows, out)

    require("cpu_experts_apply", CPUUnquantizedExperts, "apply", apply)
    _FIXED = True


_EPLB_MAP = False


def fix_cpu_eplb_map() -> None:
    """Where vLLM's router maps logical to physical experts with the identity (no Triton
    kernel for the platform), map with :func:`map_to_physical` (idempotent).

    The routers' logical -> physical expert map (``eplb_map_to_physical_and_record``, what EPLB
    and redundant expert slots rest on) is a Triton kernel on CUDA/ROCm/XPU and the identity
    everywhere else, so on CPU a redundant copy is never used (and a rearranged layout would
    compute the wrong experts). This patch puts the same mapping in torch there:
    the same replica choice (Knuth hash of the token index modulo the replica count) and the same
    load recording."""
    global _EPLB_MAP
    if _EPLB_MAP:
        return
    from vllm.model_executor.layers.fused_moe.router import base_router
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
        require("eplb_map_cpu", base_router, "eplb_map_to_physical_and_record", cpu_ep.map_to_physical)
    _EPLB_MAP = True


_ROPE = False


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous [T, heads * dim] rows (a copy unless it already is one)."""
    return x.reshape(x.shape[0], -1).contiguous()


def fix_cpu_rope() -> None:
    """Rotate MLA's 3-D queries and keys correctly on CPU (idempotent; must run before the
    model is built). Each ``RotaryEmbedding`` built under a vLLM config that asks for smoe hands
    vLLM's in-place op contiguous ``[T, heads * dim]`` rows and copies the result back; modules
    built without smoe, and 2-D inputs, keep vLLM's behaviour.

    The CPU ``rotary_embedding`` op rotates ``[T, heads * dim]`` rows (strided ones too) but not
    ``[T, heads, dim]`` ones: such a query it leaves as it is, such a strided key it rotates
    wrongly. DeepSeek's MLA hands it exactly those (``q[..., qk_nope_head_dim:]`` and the ``k_pe``
    slice of the latent projection), so MLA models whose rope is vLLM's plain
    ``RotaryEmbedding`` (rope_type default; the yarn-scaled one of the released DeepSeek
    checkpoints runs vLLM's pure-torch path on CPU) attend with wrong positions.
    This patch passes 3-D queries and keys as contiguous ``[T, heads * dim]`` rows and copies back.

    The fix is decided per rotary module when the model is built, from smoe's settings."""
    global _ROPE
    if _ROPE:
        return
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    orig_init, orig_cpu = RotaryEmbedding.__init__, RotaryEmbedding.forward_cpu

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        try:
            self._smoe_rope = cpu_ep.smoe_settings() is not None
        except AssertionError:  # built outside any vLLM config (vLLM's own unit tests): not asked
            self._smoe_rope = False

    def forward_cpu(self, positions, query, key=None):
        three_d = query.dim() == 3 or (key is not None and key.dim() == 3)
        # only one token per row of ``positions``, as MLA calls it; anything else stays vLLM's
        flat_positions = positions.dim() == 1 and 0 < positions.numel() == query.shape[0]
        if not (three_d and flat_positions and getattr(self, "_smoe_rope", False)):
            return orig_cpu(self, positions, query, key)
        q, k = _rows(query), None if key is None else _rows(key)
        orig_cpu(self, positions, q, k)
        if q.data_ptr() != query.data_ptr():  # rows were a copy (else rotated in place already)
            query.copy_(q.view_as(query))
        if key is not None and k.data_ptr() != key.data_ptr():
            key.copy_(k.view_as(key))
        return query, key

    replace("rope_init", RotaryEmbedding, "__init__", __init__)
    replace("rope_forward_cpu", RotaryEmbedding, "forward_cpu", forward_cpu)
    _ROPE = True


_OPAQUE = False


def opaque_moe_forward() -> None:
    """On CPU vLLM calls its fused-MoE forward directly, so torch.compile traces into the
    experts and the all2all; the expert-map fix and smoe's sparse exchange have data-dependent
    sizes, so under smoe the CPU takes the opaque ``vllm::moe_forward`` custom op that vLLM uses
    on GPUs (idempotent; must run before the model is built)."""
    global _OPAQUE
    if _OPAQUE:
        return
    from vllm.model_executor.layers.fused_moe.runner import moe_runner as mr

    orig = mr.MoERunner._select_forward

    def _select_forward(self):
        forward = orig(self)
        if forward is mr._moe_forward:
            return torch.ops.vllm.moe_forward
        if forward is mr._moe_forward_shared:
            return torch.ops.vllm.moe_forward_shared
        return forward

    require("moe_runner_select_forward", mr.MoERunner, "_select_forward", _select_forward)
    _OPAQUE = True


_INSTALLED = False


def at_start() -> None:
    """Hook the CPU platform's communicator choice and vLLM's sequence-parallel MoE switch
    (idempotent). Both stay vLLM's own unless the config being built asks for smoe."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.config import ParallelConfig
    from vllm.platforms.cpu import CpuPlatform

    orig_cls = CpuPlatform.get_device_communicator_cls.__func__

    def get_device_communicator_cls(cls) -> str:
        if cpu_ep.smoe_settings() is None:
            return orig_cls(cls)
        in_worker()  # asked for by a process that builds communicators: a worker
        return "vllm_smoe.serving.exchange.cpu_ep.SmoeCpuCommunicator"

    replace("cpu_platform_communicator_cls", CpuPlatform, "get_device_communicator_cls",
            classmethod(get_device_communicator_cls))
    fix_cpu_rope()  # only forward_cpu changes: other platforms never call it

    orig_sp = ParallelConfig.use_sequence_parallel_moe

    from ..speculate.support import ORDERED_BACKENDS

    def use_sequence_parallel_moe(self) -> bool:
        # smoe's token order needs vLLM's sequence-parallel MoE at DP=1 too (TP>1 + EP); vLLM
        # turns it on only with DP>1. The flag is set by the plugin from smoe's settings. vLLM's
        # backend whitelist still holds: off the CPU (whose communicator picks its own manager)
        # only the backends that honour token order, a subset of vLLM's list.
        if orig_sp.fget(self):
            return True
        if not (getattr(self, "smoe_sequence_parallel", False) and self.enable_expert_parallel
                and self.tensor_parallel_size > 1):
            return False
        from vllm.platforms import current_platform  # resolved by now: vLLM built this config for it

        return current_platform.is_cpu() or self.all2all_backend in ORDERED_BACKENDS

    replace("parallel_sequence_parallel_moe", ParallelConfig, "use_sequence_parallel_moe",
            property(use_sequence_parallel_moe))


def in_worker() -> None:
    """What a CPU worker needs once smoe's communicator exists (idempotent)."""
    fix_cpu_experts()
    fix_cpu_eplb_map()
    opaque_moe_forward()
