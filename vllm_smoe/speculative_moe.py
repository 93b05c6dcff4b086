"""The vLLM side of ``mode: speculate``: an expert-parallel MoE block over the TP ranks.

Attention stays tensor parallel, but the MoE layer's ``o_proj`` skips its all-reduce. One opaque
custom op, ``torch.ops.smoe.ep_moe``, then runs on every rank:

    shuffled reduce-scatter by predicted rank (or, pipeline ``baseline``: all-reduce + slice)
    -> residual add + post-attention RMSNorm on this rank's tokens
    -> router -> local experts + one de-duplicated all-to-all round trip for mispredictions
    -> (shuffled) all-gather of ``expert output + residual`` back to the replicated token order.

The op's output shape equals its input shape, so ``torch.compile`` sees one opaque node with a
static-shaped fake; the data-dependent shapes and the collectives stay inside it. Each rank
holds whole experts: physical slots ``[r * E / N, (r + 1) * E / N)`` (the load plan orders slots
rank by rank as the placement says). Only the tensors here import torch and vLLM.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from .ep_layer import CommStats, ExpertShard, allreduce_slice, dispatch_combine, shuffled_all_gather, \
    shuffled_reduce_scatter
from .speculator import Speculator

logger = logging.getLogger("vllm.smoe")

# decoder layers by prefix, so the custom op (which can only take tensors and strings) finds them
_LAYERS: dict[str, nn.Module] = {}
_EXPERT_W = re.compile(r"^experts\.(?P<slot>\d+)\.(?P<proj>\w+)\.weight$")


class SpecRuntime:
    """Per-worker state shared by the MoE layers of one model: the speculator, the TP group,
    byte and locality counters, and the previous MoE layer's top-1 slots of this step."""

    def __init__(self, speculator: Speculator, pipeline: str, log_interval: float):
        from vllm.distributed import get_tp_group

        self.speculator, self.pipeline, self.log_interval = speculator, pipeline, log_interval
        self.tp = get_tp_group()
        self.rank, self.size = self.tp.rank_in_group, self.tp.world_size
        self.prev_top1: np.ndarray | None = None  # [T] int64 physical slot, from the last MoE layer
        self.stats = CommStats()
        self.local = 0  # (token, expert) activations served on the token's own rank
        self.activations = 0
        self.tokens = 0
        self._last_log = time.monotonic()

    def group(self, x: torch.Tensor):
        return self.tp.cpu_group if x.device.type == "cpu" else self.tp.device_group

    def token2rank(self, moe_index: int, token_ids: torch.Tensor) -> torch.Tensor:
        ids = token_ids.detach().cpu().numpy().astype(np.int64)
        prev = self.prev_top1 if self.prev_top1 is not None and self.prev_top1.shape[0] == ids.shape[0] else None
        t2r = self.speculator.token2rank(moe_index, ids, prev)
        return torch.from_numpy(t2r.astype(np.int64)).to(token_ids.device)

    def account(self, ids: torch.Tensor, expert2rank: torch.Tensor, moe_index: int) -> None:
        self.local += int((expert2rank[ids] == self.rank).sum())
        self.activations += ids.numel()
        if moe_index == 0:
            self.tokens += ids.shape[0]
        now = time.monotonic()
        if self.rank == 0 and now - self._last_log >= self.log_interval and self.activations:
            b = self.stats.bytes
            logger.info("smoe: speculate (%s, predictor %s): rank 0 served %.3f of its expert activations "
                        "locally; sent %.1f MB (dispatch+combine %.1f MB) for %d tokens", self.pipeline,
                        self.speculator.predictor, self.local / self.activations, self.stats.total / 1e6,
                        (b.get("dispatch", 0) + b.get("combine", 0)) / 1e6, self.tokens)
            self._last_log = now


class SpeculativeMoE(nn.Module):
    """Router + this rank's whole experts. gate: [E, H] (``gate.weight``, physical slot order);
    w13_weight: [E_loc, 2I, H] gate then up projection; w2_weight: [E_loc, H, I]."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, moe_index: int, runtime: SpecRuntime, prefix: str,
                 proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        from vllm.model_executor.layers.fused_moe import GateLinear

        super().__init__()
        N, rank = runtime.size, runtime.rank
        if num_experts % N:
            raise ValueError(f"smoe speculate: {num_experts} experts do not split evenly over {N} TP ranks")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.moe_index, self.runtime, self.proj_names = moe_index, runtime, proj_names
        self.local_experts = num_experts // N
        self.first_slot = rank * self.local_experts
        self.intermediate_size = I = intermediate_size
        self.gate = GateLinear(hidden_size, num_experts, quant_config=None, prefix=f"{prefix}.gate")
        self.w13_weight = nn.Parameter(torch.empty(self.local_experts, 2 * I, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.local_experts, hidden_size, I), requires_grad=False)
        slots = torch.arange(num_experts)
        self.register_buffer("expert2rank", slots // self.local_experts, persistent=False)
        local_of = torch.where(self.expert2rank == rank, slots - self.first_slot, torch.full_like(slots, -1))
        self.register_buffer("local_of", local_of, persistent=False)

    def shard(self) -> ExpertShard:
        return ExpertShard(self.w13_weight, self.w2_weight, self.expert2rank, self.local_of)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [m, K] int64 physical slots, topk_weights [m, K] float32): softmax over the
        router logits, top-k, renormalised when the model says so (Qwen3-MoE's router)."""
        logits, _ = self.gate(h)
        probs = torch.softmax(logits.float(), dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names relative to this block: ``gate.weight`` and per-expert
        ``experts.{slot}.{proj}.weight``, proj one of ``proj_names`` (gate, up, down), slots
        after the load plan's renaming; other ranks' experts are skipped."""
        loaded: set[str] = set()
        I = self.intermediate_size
        seen = np.zeros((self.local_experts, 3), bool)
        for name, w in weights:
            if name == "gate.weight":
                self.gate.weight_loader(self.gate.weight, w)
                loaded.add(name)
                continue
            m = _EXPERT_W.match(name)
            if m is None or m["proj"] not in self.proj_names:
                raise ValueError(f"smoe speculate: unexpected MoE weight {name!r} (per-expert gate/up/down "
                                 f"projections are supported; fused or quantized expert tensors are not)")
            j = int(m["slot"]) - self.first_slot
            if not 0 <= j < self.local_experts:
                continue
            p = self.proj_names.index(m["proj"])
            if p == 2:
                self.w2_weight.data[j].copy_(w)
            else:
                self.w13_weight.data[j, p * I:(p + 1) * I].copy_(w)
            seen[j, p] = True
        if seen.any():
            if not seen.all():
                j, p = map(int, np.argwhere(~seen)[0])
                raise ValueError(f"smoe speculate: checkpoint lacks expert slot {self.first_slot + j} "
                                 f"{self.proj_names[p]}")
            loaded.update({"w13_weight", "w2_weight"})
        return loaded


def ep_moe_forward(layer: nn.Module, x_partial: torch.Tensor, residual: torch.Tensor, token_ids: torch.Tensor
                   ) -> torch.Tensor:
    """One MoE decoder block after attention, on every TP rank. layer: the decoder layer
    (``post_attention_layernorm`` and ``moe``: a :class:`SpeculativeMoE`); x_partial: [T, H]
    this rank's un-reduced ``o_proj`` output; residual: [T, H] replicated; token_ids: [T].
    Returns ``moe_output + residual`` [T, H], replicated, as the next layer's hidden states."""
    mlp: SpeculativeMoE = layer.moe
    rt = mlp.runtime
    group = rt.group(x_partial)
    H = x_partial.shape[1]
    if rt.pipeline == "speculate":
        x_loc, sh = shuffled_reduce_scatter(x_partial, rt.token2rank(mlp.moe_index, token_ids), group, rt.stats)
        h, r = layer.post_attention_layernorm(x_loc, residual[sh.local_tokens])
    else:
        x, _, sh = allreduce_slice(x_partial, group, rt.stats)
        h, r = layer.post_attention_layernorm(x[sh.local_tokens], residual[sh.local_tokens])
    ids, w = mlp.route(h)
    y = dispatch_combine(h, ids, w, rt.rank, mlp.shard(), group, rt.stats)
    rt.account(ids, mlp.expert2rank, mlp.moe_index)
    # the top-1 slot rides along as two base-256 digits: exact in fp32, fp16 and bf16
    top1 = ids[:, :1]
    digits = torch.cat([top1 % 256, top1 // 256], dim=1).to(y.dtype)
    out = shuffled_all_gather(torch.cat([y + r, digits], dim=1), sh, group, rt.stats)
    d = out[:, H:].round().long()
    rt.prev_top1 = (d[:, 0] + 256 * d[:, 1]).cpu().numpy()
    return out[:, :H].contiguous()


@torch.library.custom_op("smoe::ep_moe", mutates_args=())
def ep_moe(x_partial: torch.Tensor, residual: torch.Tensor, token_ids: torch.Tensor, layer_name: str
           ) -> torch.Tensor:
    return ep_moe_forward(_LAYERS[layer_name], x_partial, residual, token_ids)


@ep_moe.register_fake
def _(x_partial, residual, token_ids, layer_name):
    return torch.empty_like(residual)


def register_layer(name: str, layer: nn.Module) -> None:
    _LAYERS[name] = layer
