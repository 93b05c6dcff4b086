"""Tensors vLLM derives from a router's rows, found by a rule (:func:`derived_tensors`), so that a
live swap (:mod:`.live`) reorders them with the router or refuses, naming them.

A load is not at risk: vLLM derives them from the rows smoe's loader already put in router
order. A live swap reorders the router's parameters in place later, and a copy made before keeps
the old order (a silent change of routing). vLLM 0.32 makes two:

- ``MoERunner._combined_gate_weight`` (layers/fused_moe/runner/moe_runner.py:353, built at the first
  forward, :908): ``cat([gate.weight, shared_expert_gate.weight])``, [E + 1, hidden], in a FusedMoE
  given both gates: Qwen3-Next with AITER's fused shared expert, or with none (models/qwen3_next.py:242);
- ``GateLinear._bf16x3_weight`` (layers/fused_moe/router/gate_linear.py:330): an fp32 gate split
  into three bf16 terms, [3, E, hidden], on ROCm gfx950 (MiniMax-M2, HunYuan-V3).

DeepSeek's score bias (the routers' ``e_score_correction_bias``, models/deepseek_v2.py:390) is
shared by reference, so reordering the parameter in place reorders it everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Derived:
    """A copy of a router's rows: entries [0, E) of ``tensor`` along ``dim`` are in router order."""

    path: str
    tensor: torch.Tensor
    dim: int

    def permute(self, idx: torch.Tensor) -> None:
        """Entry i becomes old entry idx[i], in place (the address, which graphs hold, stays)."""
        rows = self.tensor.detach().narrow(self.dim, 0, idx.numel())
        rows.copy_(rows.index_select(self.dim, idx.to(rows.device)))


def _held(obj) -> list[tuple[str, torch.Tensor]]:
    """(attribute, tensor) held directly by a module or plain object."""
    out = []
    if isinstance(obj, torch.nn.Module):
        out += [(k, v) for k, v in obj._parameters.items() if v is not None]
        out += [(k, v) for k, v in obj._buffers.items() if v is not None]
    return out + [(k, v) for k, v in getattr(obj, "__dict__", {}).items() if isinstance(v, torch.Tensor)]


def _storage(t: torch.Tensor) -> int | None:
    return t.untyped_storage().data_ptr() if t.numel() else None  # empty tensors share pointer 0


def _holds_rows(t: torch.Tensor, dim: int, rows: torch.Tensor) -> bool:
    E, w = rows.shape
    entries = t.detach().narrow(dim, 0, E).movedim(dim, 0).reshape(E, -1)
    if entries.shape[1] % w:
        return False
    r = rows.to(device=t.device, dtype=t.dtype)
    return any(torch.equal(entries[:, j:j + w], r) for j in range(0, entries.shape[1], w))


def derived_tensors(holders: list[tuple[str, object]], references: list[torch.Tensor], skip: list[torch.Tensor],
                    num_experts: int, num_slots: int) -> list[Derived]:
    """The derived tensors of one MoE layer under the rule below; ValueError naming the first
    tensor with an expert-count extent that is not derived.

    The rule. Scope: the tensors (parameters, buffers, plain attributes)
    held directly by an MoE block, its FusedMoE, the FusedMoE's router object and each module that
    holds a router parameter; not their submodules': routed experts are indexed by physical slot,
    which a swap keeps (it moves their weights), and shared experts are not routed, while their
    extents can equal E by chance (Qwen3-Next's shared ``down_proj`` is [2048, 512], with 512
    experts). Each tensor there, other than a router parameter, an expert weight or a tensor sharing
    storage with one, is
    - *derived* when along some dimension its first E entries hold the router's rows (a router
      parameter, as [E, -1], cast to the tensor's dtype: each entry, flattened, holds its row as one
      aligned block): those E entries are permuted with the router;
    - refused, by attribute path, when an extent is E (logical experts) or the physical slot count;
    - else left alone (not indexed by expert).
    Not seen: tensors only a closure holds (vLLM's CPU build packs gates so; :func:`.live._repack`
    rebuilds them) or kept in containers, and copies held outside the MoE block.

    holders: (path, module or object) whose own tensors are in scope; references: the router's
    parameters in their current order, [E, ...]; skip: the router parameters and expert weights
    (what a swap reorders or moves itself)."""
    E = num_experts
    # a reference whose rows are all equal (a zero bias) orders nothing and would match anything
    rows = [r.detach().reshape(E, -1) for r in references if r.numel()]
    rows = [r for r in rows if not torch.equal(r, r[:1].expand_as(r))]
    known = {_storage(t) for t in skip} - {None}
    out, seen = [], set()
    for prefix, holder in holders:
        for attr, t in _held(holder):
            if id(t) in seen or not t.numel() or _storage(t) in known:  # empty: nothing to order
                continue
            seen.add(id(t))
            path = f"{prefix}.{attr}" if prefix else attr
            dim = next((d for d, n in enumerate(t.shape) if n >= E and any(_holds_rows(t, d, r) for r in rows)), None)
            if dim is not None:
                out.append(Derived(path, t, dim))
            elif E in t.shape or num_slots in t.shape:
                raise ValueError(
                    f"smoe live placement: {path} (shape {tuple(t.shape)}) has an extent of "
                    f"{E if E in t.shape else num_slots}, the expert count, beside an MoE router, and is not a copy "
                    f"of the router's rows that smoe can reorder; a swap would leave it in the old order and "
                    f"change the routing. Restart with the new placement, or report the tensor")
    return out
