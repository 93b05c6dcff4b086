"""``mode: speculate``: s-TS as the token order around vLLM's own sequence-parallel MoE.

vLLM's sequence-parallel MoE blocks (Qwen3-MoE, Qwen3-Next, ...) take the replicated
post-attention rows, keep a contiguous ``ceil(T / N)`` slice per rank
(``sequence_parallel_chunk``), run FusedMoE on it (expert parallel) and all-gather the result.
smoe changes only the order of the rows around that block, with two opaque custom ops put in by
forward hooks (no model code):

    order_tokens:   predict each token's rank -> capped assignment (exactly the chunk sizes)
                    -> x[perm], so the contiguous chunk of rank r holds the tokens predicted for r
    restore_tokens: y[inv] back to the original order (+ this layer's top-1, all-gathered on the
                    TP group, for the next layer's Markov look-up)

Where the decoder layer allows it (:func:`shuffle_seams`; Qwen3-MoE's does) the attention's
all-reduce goes too, as in s-MoE's own step: smoe sets the layer's ``o_proj.reduce_results`` to
False at load (an attribute of vLLM's module, no symbol replaced) and reduce-scatters its
partial sums with the rows already in the token order (``reduce_scatter_tokens``); vLLM's add +
norm then runs exact on this rank's chunk rows, ``split_residual`` keeps the chunk's residual
and passes a zero one on, and ``add_residual`` adds it to the experts' output before the block's
own all-gather, which so carries every row's whole residual stream (the next layer adds zero).
Per MoE layer: a reduce-scatter where vLLM all-reduces, the same number of collectives and half
the attention's bytes. Predictor router orders a layer before its reduce from the gate's logits
of each rank's partial rows, all-gathered and summed (``note_layer_input`` at the layer's
input_layernorm, :func:`exact_router_seams`): one [T, E] all-gather more.

Everything runs on the device from device-resident tables with static shapes: no host
synchronisation, capturable by torch.compile and CUDA graphs. A misprediction only means the
token's experts sit elsewhere; vLLM's all2all (smoe's sparse manager by default on CPU) takes it
there and back. The block computes exactly what it computed before, row by row.

DeepSeek-family decoder layers (DeepSeek-V2/V3, Kimi K2, GLM-4.5, ...) split the rows themselves:
attention skips its all-reduce, the layer reduce-scatters into contiguous chunks, the MoE block
runs ``already_sequence_parallel`` and the residual stays split until the next layer all-gathers.
No per-block order fits there ("stack" order). By default smoe still orders each MoE layer: at
the layer's input_layernorm ``fold_residual`` takes the layer's residual rows as this rank holds
them and passes a zero residual on, and at the attention's output ``order_folded`` adds them to
this rank's partial sums and permutes the rows into this layer's order, so vLLM's own
reduce-scatter hands each rank its chunk of this layer's order, residual included (no
collective or byte more); attentions see their rows restored to the step's order, and the final
norm too. With ``stack_order: step`` the whole step is ordered once instead: the first decoder
layer's input rows are permuted (one prediction from every MoE layer's table), every attention
sees them in the original order (restore before, order after: row-wise ops commute with a
permutation), and the final norm gets them back in the original order.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import time

import numpy as np
import torch

from ...placement.learned import LEARNED_FIELDS
from . import device_predict as dp
from ..config import TABLE_PREDICTORS
from ..served import worker

logger = logging.getLogger("vllm.smoe")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
# MoE blocks whose forward reads its input only through sequence_parallel_chunk (vLLM 0.32
# qwen3_moe.py): the token order gathers just the rank's chunk for them
CHUNK_ONLY_BLOCKS = ("Qwen3MoeSparseMoeBlock",)
TABLE_NAMES = ("token2rank", "token_conf", "markov2rank", "markov_conf", "prior2rank")  # + bigrams when built


def find_moe_experts(model: torch.nn.Module, moe_layers: tuple[int, ...]
                     ) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """(MoE ordinal, block, FusedMoE) of every MoE block: the module that owns a FusedMoE (a
    child with a ``router`` that takes a capture function), in layer order."""
    found = {}
    for name, module in model.named_modules():
        for child in module.children():
            router = getattr(child, "router", None)
            if router is not None and hasattr(router, "set_capture_fn"):
                m = _LAYER.search("." + name + ".")
                if m is not None and int(m.group(1)) in moe_layers:
                    found[moe_layers.index(int(m.group(1)))] = (module, child)
    return [(layer, block, experts) for layer, (block, experts) in sorted(found.items())]


def gate_ahead(block: torch.nn.Module, experts: torch.nn.Module) -> tuple[bool, str, torch.nn.Module | None]:
    """``(ok, reason, gate)`` for predictor ``router``: the gate vLLM applies to this block's rows,
    held either by the FusedMoE runner (``router_logits`` is then the rows themselves) or by the
    block (``gate``; GPT-OSS and Llama 4 name it ``router``), and a router whose pure routing step
    (``_compute_routing``) smoe can call on them."""
    held = (getattr(experts, "gate", None), getattr(block, "gate", None), getattr(block, "router", None))
    gate = next((g for g in held if isinstance(g, torch.nn.Module)), None)
    if gate is None:
        return False, (f"{type(block).__name__} has no gate module (neither the block's gate or router nor its "
                       f"FusedMoE's gate)"), None
    if not callable(getattr(experts.router, "_compute_routing", None)):
        return False, f"{type(experts.router).__name__} has no _compute_routing (vLLM's BaseRouter API changed)", None
    return True, "", gate


def hookable_gate(block, experts, vllm_config):
    """The gate module of an MoE block whose forward hook sees each step's rows and logits as
    they are (:func:`.capability.set_capture`'s last resort), or None: only in an eager model (a
    compiled one would trace the hook and freeze the host values it reads), and not on ROCm
    (GPT-OSS calls its gate's weights directly there)."""
    from vllm.platforms import current_platform

    if not vllm_config.model_config.enforce_eager or current_platform.is_rocm():
        return None
    return gate_ahead(block, experts)[2]


# the children a decoder layer may have for the stack order: one attention, whose rows smoe
# restores and orders again, and row-wise modules that do not care about the order
_STACK_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def find_stack(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack: the module holding ``embed_tokens``, ``layers`` and ``norm``."""
    for module in model.modules():
        if all(hasattr(module, a) for a in ("embed_tokens", "layers", "norm")):
            return module
    return None


def stack_supported(model: torch.nn.Module, name: str) -> tuple[bool, str]:
    """Can one order per step, set at the first decoder layer and undone at the final norm, hold for this
    model? Every decoder layer must mix tokens only in ``self_attn``."""
    stack = find_stack(model)
    if stack is None:
        return False, f"{name} is called on rows its decoder layer already split, and no decoder stack " \
                      f"(embed_tokens, layers, norm) was found to order the whole step"
    # a stack that splits the step itself before its layers (vLLM 0.32's CUDA DeepSeek-V3.2 /
    # GLM-5 model: sp_shard, its own pad mask) or norms it fused with a collective: smoe's hooks
    # on the first layer, the attentions and the final norm would see other rows than they expect
    try:
        src = inspect.getsource(type(stack).forward)
    except (OSError, TypeError):  # no source to read (a compiled or generated class)
        return False, f"{name}: the source of {type(stack).__name__}.forward cannot be read to check how it splits rows"
    split = [w for w in ("sp_shard(", "sequence_parallel_chunk(", "fused_allreduce_rms_norm(") if w in src]
    if split:
        return False, (f"{name}: {type(stack).__name__}.forward splits or norms the step's rows itself "
                       f"({', '.join(w[:-1] for w in split)}), where smoe's one order per step cannot follow")
    for i, layer in enumerate(stack.layers):
        other = {n for n, _ in layer.named_children()} - _STACK_LAYER_CHILDREN
        if other or not hasattr(layer, "self_attn"):
            return False, (f"{name}: decoder layer {i} ({type(layer).__name__}) has modules {sorted(other)} "
                           f"besides attention and row-wise ones; smoe cannot order its rows without model code")
        # the layer must split its rows as vLLM's DeepSeek-V2 one does (reduce-scatter after the
        # attention, the MoE block told so), keyed on the attribute smoe's one-row fix reads
        try:
            src = inspect.getsource(type(layer).forward)
        except (OSError, TypeError):
            src = ""
        if not (hasattr(layer, "use_sequence_parallel_moe") and "already_sequence_parallel=True" in src
                and "tensor_model_parallel_reduce_scatter(" in src):
            return False, (f"{name}: decoder layer {i} ({type(layer).__name__}) does not reduce-scatter its rows "
                           f"after the attention and pass already_sequence_parallel=True as vLLM's DeepSeek-V2 "
                           f"layer does; smoe cannot order its rows without model code")
    return True, ""


def stack_order_kind(stack: torch.nn.Module, moe_layers: tuple[int, ...], wanted: str, dtype: torch.dtype
                     ) -> tuple[bool, str]:
    """``(step_order, reason)`` for a stack :func:`stack_supported` accepted: one order per step
    (True) where config ``stack_order`` asks for it or an order per MoE layer cannot follow the
    stack (the reason says why), else an order per MoE layer (False, ""). Per layer needs the
    layers that split their rows to be exactly the placement's MoE layers, and in fp16 no layer
    that rescales its attention output: vLLM's DeepSeek layers then divide it by the routed
    scaling factor and the residual only once, at layer 0, which a residual folded into the
    attention output would not follow."""
    if wanted == "step":
        return True, "stack_order: step"
    split = {i for i, d in enumerate(stack.layers) if getattr(d, "use_sequence_parallel_moe", False)}
    if split != set(moe_layers):
        return True, (f"the decoder layers that split their rows ({sorted(split)}) are not the placement's MoE "
                      f"layers ({list(moe_layers)})")
    # vLLM's DeepSeek layers in fp16 divide the attention output by routed_scaling_factor (not
    # DeepseekAttention's) and the residual once, at layer 0: a residual folded into the output
    # would be divided at every layer
    rescaled = [i for i, d in enumerate(stack.layers) if getattr(d, "routed_scaling_factor", 1.0) != 1.0
                and type(getattr(d, "self_attn", None)).__name__ != "DeepseekAttention"]
    if dtype == torch.float16 and rescaled:
        return True, (f"float16: decoder layers {rescaled[:4]}{'...' if len(rescaled) > 4 else ''} rescale the "
                      f"attention output apart from the residual, which an order per layer folds into it")
    return False, ""


def block_supported(block: torch.nn.Module, model: torch.nn.Module | None = None) -> tuple[bool, str, str]:
    """``(ok, reason, kind)``: kind "block" when the MoE block chunks, computes and all-gathers
    inside its own forward (ordered per layer around the block), "stack" when its decoder layer
    splits the rows and the whole step is ordered once (``model`` is then checked)."""
    name = type(block).__name__
    if not getattr(block, "is_sequence_parallel", False):
        return False, f"{name} does not run sequence parallel (vLLM's use_sequence_parallel_moe is off)", ""
    forward = type(block).forward
    if "already_sequence_parallel" in inspect.signature(forward).parameters:
        if model is None:
            return False, f"{name} is called on rows its decoder layer already split", ""
        ok, reason = stack_supported(model, name)
        return ok, reason, "stack" if ok else ""
    src = inspect.getsource(forward)
    if "sequence_parallel_chunk(" not in src or "all_gather(" not in src:
        return False, (f"{name}.forward does not chunk and all-gather its own rows (its decoder layer "
                       f"reduce-scatters instead), so smoe cannot order its tokens without model code"), ""
    return True, "", "block"


_O_PROJ_RETURNED = re.compile(r"(\w+)\s*(?:,\s*\w+)?\s*=\s*self\.o_proj\([^)]*\)\s*return\s+\1\s*$")


def shuffle_seams(model: torch.nn.Module, moe_layers: tuple[int, ...], experts: list, tp_size: int
                  ) -> tuple[list[tuple[int, torch.nn.Module, torch.nn.Module, torch.nn.Module]], str]:
    """``(seams, reason)``: per MoE ordinal, the modules the shuffled reduce-scatter hooks
    (``(layer, o_proj, post_attention_layernorm, FusedMoE)``), or ``[]`` and why not. It needs
    decoder layers that add the attention output to the residual in ``post_attention_layernorm``
    and return ``(mlp(hidden), residual)``, an attention whose output is its row-parallel
    ``o_proj``'s (all-reduced there, so smoe can reduce-scatter instead), and a MoE block that
    reads its rows only through its chunk (:data:`CHUNK_ONLY_BLOCKS`). experts: (ordinal, block,
    FusedMoE) as :func:`find_moe_experts` gives."""
    stack = find_stack(model)
    if stack is None:
        return [], "no decoder stack (embed_tokens, layers, norm) was found"
    seams = []
    for layer, block, fused in experts:
        decoder = stack.layers[moe_layers[layer]]
        name = type(decoder).__name__
        if getattr(decoder, "mlp", None) is not block or type(block).__name__ not in CHUNK_ONLY_BLOCKS:
            return [], f"{name}'s MoE block {type(block).__name__} is not one that reads only its chunk"
        attn, norm = getattr(decoder, "self_attn", None), getattr(decoder, "post_attention_layernorm", None)
        o_proj = getattr(attn, "o_proj", None)
        if norm is None or o_proj is None:
            return [], f"{name} has no self_attn.o_proj and post_attention_layernorm"
        if getattr(o_proj, "reduce_results", None) is not True or getattr(o_proj, "tp_size", None) != tp_size:
            return [], f"{name}'s o_proj does not all-reduce over the {tp_size} tensor-parallel ranks"
        src = inspect.getsource(type(decoder).forward)
        if ("self.post_attention_layernorm(hidden_states, residual)" not in src or
                "self.mlp(hidden_states)" not in src or not re.search(r"return\s+hidden_states,\s*residual", src)):
            return [], (f"{name}.forward does not add the attention output to the residual in "
                        f"post_attention_layernorm and return (mlp(hidden_states), residual)")
        if not _O_PROJ_RETURNED.search(inspect.getsource(type(attn).forward).rstrip()):
            return [], f"{type(attn).__name__}.forward does not return its o_proj's output as it is"
        seams.append((layer, o_proj, norm, fused))
    return seams, ""


def tp_spans_nodes(tp) -> bool:
    """Does the tensor-parallel group ``tp`` (vLLM's GroupCoordinator) cross a network? On vLLM's
    CPU build: its communicator is not on shared memory; elsewhere: a rank is on another node
    (vLLM's ``in_the_same_node_as``, a collective on the group's CPU side, once at start)."""
    comm = tp.device_communicator
    if hasattr(comm, "dist_module"):  # CpuCommunicator: shared memory within a node, else gloo
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

        return not isinstance(comm.dist_module, _CPUSHMDistributed)
    from vllm.distributed.parallel_state import in_the_same_node_as

    return not all(in_the_same_node_as(tp.cpu_group, source_rank=0))


def route_ahead(gate: torch.nn.Module, router, x: torch.Tensor, held: torch.Tensor,
                input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictor router: vLLM's own gate and routing step on a block's rows, which every rank
    holds whole before the block chunks them, so each token's ranks are known exactly rather than
    predicted. x: [T, H]; held: [N, E] bool, rank holds a copy of router output e (home or
    replica). Returns (pref [T, 2] int64, conf [T] float32) as :func:`device_predict.prefer_held`.
    Costs one more
    gate GEMM over T rows per layer (vLLM's own runs on the T / N rows of the chunk); the routing
    step is the pure one (no capture, no EPLB bookkeeping). The gate is called through
    ``forward``: its hooks (smoe's capture on a monolithic kernel's gate) belong to the block's
    own pass over its chunk."""
    _, ids = router._compute_routing(x, gate_logits(gate, x), None, input_ids=input_ids)
    return dp.prefer_held(ids, held)


def gate_ranks(norm: torch.nn.Module, gate: torch.nn.Module, router, x: torch.Tensor, held: torch.Tensor,
               input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictor input-gate on rows x [n, H] of a layer's input (the residual stream before its
    attention): :func:`route_ahead` on them after the layer's post-attention ``norm``, called
    through ``forward`` (its hook, smoe's shuffled reduce-scatter seam, belongs to the layer's own
    pass). Returns (pref [n, 2] int64, conf [n] float32) as :func:`device_predict.prefer_held`."""
    return route_ahead(gate, router, norm.forward(x), held, input_ids)


def gate_logits(gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gate's logits [n, E] of rows x [n, H], called through ``forward`` (its hooks belong to
    the block's own pass)."""
    logits = gate.forward(x)
    return logits[0] if isinstance(logits, tuple) else logits  # vLLM's linear layers: (output, bias)


def exact_gate_scale(norm: torch.nn.Module, gate: torch.nn.Module, router, hidden: int, dtype: torch.dtype,
                     device) -> tuple[torch.Tensor | None, str]:
    """``(w, reason)`` for predictor ``router`` under the shuffled reduce-scatter: the routed
    experts of a row x = residual + sum_r partial_r are the top-k of ``gate(norm(x))``; when the
    norm is a per-row positive scale times a per-channel weight (RMSNorm and its kin:
    ``norm(x) = s(x) * x * w``), the gate is linear without bias, and the routing step's top-k
    does not change when the logits are scaled (softmax or sigmoid top-k without a correction
    bias), they are also the top-k of ``sum_r gate(w * partial_r) + gate(w * residual)``, a sum
    of [T, E] terms each rank can compute before the reduce. Probes the modules once at load
    (a seeded random input) and returns w [H] in ``dtype`` (up to a common positive factor), or
    None and why not."""
    with torch.no_grad():
        one = norm.forward(torch.ones(1, hidden, dtype=dtype, device=device))
        w = (one[0] if isinstance(one, tuple) else one)[0]
        x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(0)).to(dtype=dtype, device=device)
        y = norm.forward(x)
        y = (y[0] if isinstance(y, tuple) else y).float()
        # y = c * x * w per row, c > 0 (least squares; channels a widened model pads with zero
        # weights are zero on both sides)
        xw = x.float() * w.float()
        c = (y * xw).sum(dim=1) / (xw * xw).sum(dim=1).clamp_min(1e-30)
        err = (y - c[:, None] * xw).norm(dim=1) / y.norm(dim=1).clamp_min(1e-30)
        if not bool(torch.all((c > 0) & (err <= 0.02) & (xw.abs().amax(dim=1) > 0))):
            return None, (f"{type(norm).__name__} is not a per-row scale times a per-channel weight, so the gate's "
                          f"logits cannot be summed from partial rows")
        g0 = gate_logits(gate, torch.zeros(1, hidden, dtype=dtype, device=device)).float()
        ga, gb, gab = (gate_logits(gate, v).float() for v in (x[:4], x[4:], x[:4] + x[4:]))
        if bool(g0.abs().amax() > 0) or not torch.allclose(gab, ga + gb, rtol=0.05,
                                                           atol=0.05 * float(gab.abs().amax())):
            return None, (f"{type(gate).__name__} is not linear without bias, so its logits are not a sum over "
                          f"partial rows")
        E = gate_logits(gate, x).shape[1]
        # float32, as served: the summed logits (unit_rows) reach the routing step in float32
        z = torch.randn(16, E, generator=torch.Generator().manual_seed(1)).to(device=device)
        h, ids = torch.zeros(16, hidden, dtype=dtype, device=device), torch.zeros(16, dtype=torch.long, device=device)
        want = router._compute_routing(h, z, None, input_ids=ids)[1].sort(dim=1).values
        for zz in (z * 0.25, z * 4.0, unit_rows(z)):  # unit_rows: what the routing step is given
            if not torch.equal(router._compute_routing(h, zz, None, input_ids=ids)[1].sort(dim=1).values, want):
                return None, (f"{type(router).__name__}'s experts change when the logits are scaled (a correction "
                              f"bias or a scale-dependent rule), so the norm's per-row scale cannot be left out")
    return w, ""


def exact_router_seams(model: torch.nn.Module, moe_layers: tuple[int, ...], gates: list, hidden: int,
                       dtype: torch.dtype, device) -> tuple[list[tuple[torch.nn.Module, torch.Tensor]], str]:
    """``(seams, reason)`` for predictor ``router`` under the shuffled reduce-scatter: per MoE
    ordinal, the decoder layer's ``input_layernorm`` (whose residual output is the layer's input,
    every row whole on every rank) and the post-attention norm's per-channel weight
    (:func:`exact_gate_scale`), or ``[]`` and why not. gates: (gate, router) per MoE ordinal."""
    stack = find_stack(model)
    seams = []
    for layer, (gate, router) in enumerate(gates):
        decoder = stack.layers[moe_layers[layer]]
        src = inspect.getsource(type(decoder).forward)
        if "residual = hidden_states" not in src or "self.input_layernorm(hidden_states, residual)" not in src:
            return [], (f"{type(decoder).__name__}.forward does not take its input's residual stream from "
                        f"input_layernorm(hidden_states, residual)")
        w, reason = exact_gate_scale(decoder.post_attention_layernorm, gate, router, hidden, dtype, device)
        if w is None:
            return [], reason
        seams.append((decoder.input_layernorm, w))
    return seams, ""


def unit_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, E] over each row's largest magnitude (a positive per-row factor, which
    :func:`exact_gate_scale` checked the routing step ignores): summed from partial rows they are
    the gate's logits times the row's RMS, which can reach 100 or more on residual streams with
    outliers, where a softmax or sigmoid in float32 rounds the weaker top-k to 0 or 1 and ties."""
    return logits / logits.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)


def sum_gathered(parts: torch.Tensor, N: int) -> torch.Tensor:
    """parts: [N * T, E] the ranks' terms after an all-gather -> [T, E] float32, summed rank by
    rank in rank order (the same bits on every rank, which the same assignment needs)."""
    parts = parts.view(N, -1, parts.shape[-1]).float()
    total = parts[0].clone()
    for r in range(1, N):
        total += parts[r]
    return total


class TokenOrder:
    """Per-worker state: device tables, the step's token ids, per-layer inverse permutations,
    the previous layer's top-1, and device-side counters read only when logging."""

    def __init__(self, model, vllm_config, cfg, tables, plan, expected: float | None = None):
        from vllm.distributed import get_tp_group

        self.tp = get_tp_group()
        self.N, self.rank = self.tp.world_size, self.tp.rank_in_group
        self.predictor, self.log_interval = cfg.predictor, cfg.log_interval
        device = next(model.parameters()).device
        experts = find_moe_experts(model, plan.moe_layers)
        self.blocks = [(layer, block, e.router) for layer, block, e in experts]
        if len(self.blocks) != len(plan.moe_layers):
            raise RuntimeError(f"smoe speculate: found {len(self.blocks)} MoE blocks, expected {len(plan.moe_layers)}")
        self.experts = [e for _, _, e in experts]  # where the counters' capture is bound
        kinds, checked = set(), {}
        for _, block, _ in self.blocks:  # once per block class: the stack check reads every layer's source
            if type(block) not in checked:
                checked[type(block)] = block_supported(block, model)
            ok, reason, kind = checked[type(block)]
            if not ok:
                raise ValueError(f"smoe mode speculate: {reason}")
            kinds.add(kind)
        if len(kinds) != 1:
            raise ValueError(f"smoe mode speculate: MoE blocks of mixed kinds {sorted(kinds)}")
        self.stack = kinds == {"stack"}
        stack = find_stack(model) if self.stack else None
        # the DeepSeek family: an order per MoE layer (the split residual folded into the
        # attention's partial sums before the layer's own reduce-scatter) where it can follow the
        # stack, else one order for the whole step (:func:`stack_order_kind`)
        self.step_order, self.step_reason = False, ""
        if self.stack:
            self.step_order, self.step_reason = stack_order_kind(
                stack, plan.moe_layers, cfg.stack_order, vllm_config.model_config.dtype)
        if self.stack and getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError(f"smoe mode speculate: speculative decoding with {type(self.blocks[0][1]).__name__}: its "
                             f"drafters read the stack's hidden states (MTP, EAGLE-3), which smoe keeps in its own "
                             f"order between layers")
        if self.stack and getattr(vllm_config, "lora_config", None) is not None:
            raise ValueError(f"smoe mode speculate: LoRA with {type(self.blocks[0][1]).__name__}: vLLM picks each "
                             f"row's adapter by its place in the step, and smoe keeps the rows in its own order "
                             f"between decoder layers, so the dense layers would take other tokens' adapters")
        if self.stack and cfg.predictor == "tables-markov":
            raise ValueError(f"smoe mode speculate: predictor 'tables-markov' orders each layer by the previous "
                             f"layer's top-1 experts of every row, but {type(self.blocks[0][1]).__name__}'s decoder "
                             f"layers keep their rows split between layers, so no rank holds them; use predictor "
                             f"'tables' or 'learned'")
        if self.step_order and cfg.predictor in ("router", "input-gate"):
            raise ValueError(f"smoe mode speculate: predictor {cfg.predictor!r} runs each MoE layer's gate on rows "
                             f"of that layer, but {type(self.blocks[0][1]).__name__}'s decoder layers keep their rows "
                             f"split between layers, with one order for the whole step ({self.step_reason}); use "
                             f"predictor 'tables' or 'learned'")
        # the TP group's broadcast on the device communicator (pynccl on the current stream on
        # CUDA, capturable like vLLM's other collectives; torch.distributed's elsewhere)
        comm = getattr(self.tp, "device_communicator", None)
        self.broadcast = comm.broadcast if comm is not None and hasattr(comm, "broadcast") else self.tp.broadcast
        self.gates = []  # predictors router, input-gate: (gate, router) per MoE layer
        if cfg.predictor in ("router", "input-gate"):
            for _, block, e in experts:
                ok, reason, gate = gate_ahead(block, e)
                if not ok:
                    raise ValueError(f"smoe mode speculate: predictor {cfg.predictor!r}: {reason}")
                self.gates.append((gate, e.router))
        L, E = plan.slot2expert.shape
        self.learned = cfg.predictor == "learned"
        self.tables = None if tables is None else device_tables(tables, device, self.learned)
        self.bigrams = self.tables is not None and "bigram_keys" in self.tables
        self.slot2expert = torch.as_tensor(plan.slot2expert, device=device)
        # [L, N, E]: rank r holds a copy (home or replica) of router output e
        self.holds = torch.as_tensor(np.stack([plan.held(r) for r in range(self.N)], axis=1), device=device)
        self.held = self.holds[:, self.rank]  # [L, E]: this rank's
        T = vllm_config.scheduler_config.max_num_batched_tokens
        self.ids = torch.zeros(T, dtype=torch.long, device=device)
        self.query = torch.full((T,), -1, dtype=torch.long, device=device)  # bigram keys of the step's rows
        self.prev = torch.full((T,), -1, dtype=torch.long, device=device)  # learned: previous row's id, -1 = none
        self.perm = torch.zeros((L, T), dtype=torch.long, device=device)
        self.inv = torch.zeros((L, T), dtype=torch.long, device=device)
        c = -(-T // self.N)
        # this rank's chunk, router outputs (before vLLM's logical -> physical map)
        self.top1 = torch.zeros(c, dtype=torch.long, device=device)
        self.prev_top1 = torch.zeros(T, dtype=torch.long, device=device)
        # per MoE layer, served steps only: local activations, activations, tokens, hits (tokens
        # with an expert on their rank; metrics.ORDER_FIELDS), then local activations,
        # activations and tokens of the steps the order can act on (T >= N: what drift judges, as
        # a step with fewer tokens than ranks keeps them all in rank 0's chunk whatever the
        # prediction); read back once per log interval
        self.counts = torch.zeros((L, 7), dtype=torch.long, device=device)
        from ..observe.metrics import Drift, metrics_dir

        self.metrics_dir = metrics_dir(cfg)
        # the placement's own ratio is what a trained predictor should reach; random and one-rank
        # orders are not judged against it
        self.count = cfg.metrics  # off: no device counters, no log line, no drift
        self.judged = cfg.predictor in TABLE_PREDICTORS + ("router",)
        self.drift = Drift(expected if self.judged else None, cfg.drift_threshold)
        self.steps = self.small_steps = 0  # served steps; those with fewer tokens than ranks
        self.rows = 0  # rows of the current step, pad rows included (host int, from the op's input shape)
        # the step's real tokens (the rest of the rows are vLLM's padding), written before each
        # served step outside the forward (runner_hooks), 0 otherwise: a replayed CUDA graph and
        # a warm-up run count exactly what they should
        self.num_real = torch.zeros((), dtype=torch.long, device=device)
        # vLLM's pad-row mask for the rows of this rank's ordered chunk (_mark_padding), and the
        # runner's step mask it stands in for between an order and its restore
        self.chunk_pad = torch.ones(c, dtype=torch.bool, device=device)
        self.step_pad = None
        # the block reads only its chunk of the ordered rows: blocks whose forward was read to
        # touch nothing else before vLLM's sequence_parallel_chunk (others get every row)
        self.chunk_only = not self.stack and all(type(b).__name__ in CHUNK_ONLY_BLOCKS for _, b, _ in self.blocks)
        # s-MoE's shuffled reduce-scatter (config reduce_scatter): the attention's partial sums
        # reduce-scatter straight into the token order, and the residual added to this rank's
        # chunk travels in the MoE block's own all-gather; predictor router, which needs the
        # reduced rows' gate logits before the reduce, sums them from each rank's partial rows
        # (exact_router_seams) where the norm, gate and routing step allow, else keeps the all-reduce
        self.shuffled, why = [], "reduce_scatter: off"
        self.exact = []
        if cfg.reduce_scatter != "off" and self.N > 1 and not self.stack:
            if getattr(vllm_config, "lora_config", None) is not None:
                # vLLM wraps o_proj for LoRA after the load: the wrapper would skip both the
                # all-reduce (it reads reduce_results) and smoe's hook on the module it wraps
                why = "LoRA wraps the attention's o_proj after the load"
            elif cfg.reduce_scatter == "auto" and not tp_spans_nodes(self.tp):
                why = ("reduce_scatter: auto, and the tensor-parallel group is on one node, where vLLM's all-reduce "
                       "costs no more")
            else:
                self.shuffled, why = shuffle_seams(model, plan.moe_layers, experts, self.N)
            if self.shuffled and cfg.predictor == "router":
                self.exact, why = exact_router_seams(model, plan.moe_layers, self.gates,
                                                     vllm_config.model_config.get_hidden_size(),
                                                     vllm_config.model_config.dtype, device)
                if not self.exact:
                    self.shuffled, why = [], f"predictor 'router': {why}"
        self.shuffle_reason = why if not self.shuffled else ""
        if self.stack and cfg.predictor == "router":
            # the DeepSeek family ordered per layer: each rank's attention partial sums carry its
            # residual rows (order_folded), so the gate's logits of the reduced rows are their sum
            # over the ranks, where the post-attention norm, gate and routing step allow it
            for layer, (gate, router) in enumerate(self.gates):
                decoder = stack.layers[plan.moe_layers[layer]]
                w, why = exact_gate_scale(decoder.post_attention_layernorm, gate, router,
                                          vllm_config.model_config.get_hidden_size(), vllm_config.model_config.dtype,
                                          device)
                if w is None:
                    raise ValueError(f"smoe mode speculate: predictor 'router' on {type(decoder).__name__}, which "
                                     f"keeps its rows split between layers, sums the gate's logits from each rank's "
                                     f"partial rows before the reduce, but {why}; use predictor 'input-gate', "
                                     f"'tables' or 'learned'")
                self.exact.append((None, w))
        # predictor input-gate: with the shuffled reduce-scatter, layer l's order is needed before
        # its attention output is reduced, so its gate runs on the layer's input instead (after the
        # layer's post-attention norm): each rank on its own chunk rows at the end of the previous
        # MoE block (their output plus the kept residual), the ranks and confidence riding as three
        # more columns in that block's all-gather, so every rank assigns from the same bytes (no
        # collective more, none of rank 0's broadcast); the first MoE layer takes the tables, the
        # others the tables' guess where it is the more confident (measured: BENCHMARKS.md). Where
        # the rows are whole before the block (no shuffled reduce-scatter) the gate sees the exact
        # rows: it is predictor router there.
        # The DeepSeek family ordered per layer: each rank runs the gate on its chunk of the
        # layer's input at input_layernorm, the ranks riding as three more columns in the
        # layer's own all-gather before its attention (a MoE layer whose input is whole, after
        # a dense layer or the first, takes the tables).
        self.ahead = cfg.predictor == "input-gate" and (bool(self.shuffled) or self.stack)
        if self.ahead:
            if self.tables is None:
                raise ValueError("smoe mode speculate: predictor 'input-gate' takes the first MoE layer's order from "
                                 "the placement's tables, and it has none")
            self.next_norm = ({layer: norm for layer, _, norm, _ in self.shuffled} if self.shuffled else
                              {layer: stack.layers[i].post_attention_layernorm
                               for layer, i in enumerate(plan.moe_layers)})
            self.next_pref = torch.full((T, 2), -1, dtype=torch.long, device=device)
            self.next_conf = torch.zeros(T, dtype=torch.float32, device=device)
            self.table_pref = torch.full((L, T, 2), -1, dtype=torch.long, device=device)
            self.table_conf = torch.zeros((L, T), dtype=torch.float32, device=device)
        if self.exact:
            # [T, E] float32: the gate's logits of the layer input's rows this rank adds (its
            # contiguous share of the rows; zero elsewhere), written at input_layernorm
            self.base = torch.zeros((T, self.holds.shape[2]), dtype=torch.float32, device=device)
        if self.shuffled or (self.stack and not self.step_order):
            hidden = vllm_config.model_config.get_hidden_size()
            # shuffled: the residual of this rank's chunk rows, between the norm and the experts'
            # output; stack per layer: the layer input's rows this rank adds to its attention
            # partial sums (its chunk of the previous order, or its share of whole rows)
            self.kept = torch.zeros((c, hidden), dtype=vllm_config.model_config.dtype, device=device)
        # tables-markov: each layer waits for the previous one's top-1 (one extra all-gather per
        # layer); the others predict every layer at the first MoE layer of the step
        self.markov = cfg.predictor == "tables-markov"
        self.per_layer = self.markov or cfg.predictor == "router" or (cfg.predictor == "input-gate" and not self.ahead)
        self._last_log = time.monotonic()
        model.register_forward_pre_hook(self._step_ids, with_kwargs=True)
        from .. import runner_hooks

        runner_hooks.attach(before=self._before_step, after=self._after_step)
        from vllm.platforms import current_platform

        runner_hooks.check_attached(vllm_config, current_platform.device_type)  # else counters would read 0
        from ..record.capture import set_capture

        for (layer, block, _), experts in zip(self.blocks, self.experts):
            set_capture(experts, functools.partial(self._capture, layer), "smoe mode speculate",
                        hookable_gate(block, experts, vllm_config))
        last = len(self.blocks) - 1
        for layer, block, router in self.blocks:
            if not self.stack:
                block.register_forward_pre_hook(self._pre(layer, predict=not self.shuffled), with_kwargs=True)
                block.register_forward_hook(self._post(layer, ahead=self.ahead and layer < last))
        for layer, (in_norm, _) in enumerate(self.exact):
            if in_norm is not None:  # the stack folds the layer's input into the partial sums instead
                in_norm.register_forward_hook(self._layer_input(layer), with_kwargs=True)
        for layer, o_proj, norm, fused in self.shuffled:
            o_proj.reduce_results = False  # its partial sums: the reduce-scatter below sums them
            o_proj.register_forward_hook(self._attn_partial(layer))
            norm.register_forward_hook(self._norm_out(layer))
            fused.register_forward_hook(self._experts_out(layer, ahead=self.ahead and layer < last))
        if self.stack:
            self._hook_stack(stack, plan.moe_layers)

    def _hook_stack(self, stack: torch.nn.Module, moe_layers: tuple[int, ...]) -> None:
        """The hooks of the DeepSeek family's order. One order per step: the first decoder
        layer's input permuted, every attention's rows restored before it and ordered after it,
        the final norm's restored. An order per MoE layer: the rows stay in the step's order up
        to the first MoE layer; there each MoE layer's input_layernorm hands its residual rows to
        smoe (``fold_residual``: a zero residual goes on) and its attention's output comes out
        ordered for this layer with them added (``order_folded``), so vLLM's own reduce-scatter
        gives each rank the chunk of this layer's order, residual included; a later attention
        (MoE or dense) gets its rows back in the step's order, a dense layer's output the order
        its residual is in, and the final norm the step's order."""
        split = [bool(getattr(d, "use_sequence_parallel_moe", False)) for d in stack.layers]
        for i, decoder_layer in enumerate(stack.layers):
            if i > 0 and split[i - 1]:
                decoder_layer.register_forward_pre_hook(self._one_row_layer, with_kwargs=True)
        if self.step_order:
            # on the first layer's input, not on embed_tokens: drafters may share the embedding
            stack.layers[0].register_forward_pre_hook(self._first_layer, with_kwargs=True)
            for decoder_layer in stack.layers:
                decoder_layer.self_attn.register_forward_pre_hook(self._attn_in(0), with_kwargs=True)
                decoder_layer.self_attn.register_forward_hook(self._attn_out(0))
            stack.norm.register_forward_pre_hook(self._one_row_final(0) if split[-1] else self._final(0))
            return
        stack.layers[0].register_forward_pre_hook(self._first_residual(split[0]), with_kwargs=True)
        cur = -1  # the order the rows entering layer i are in (-1: the step's)
        self.gated = set()  # input-gate: the MoE layers ordered by the gate on their split input
        for i, decoder_layer in enumerate(stack.layers):
            whole = not (i > 0 and split[i - 1])
            gated = split[i] and self.ahead and not whole
            if cur >= 0:
                decoder_layer.self_attn.register_forward_pre_hook(self._attn_in(cur, ahead=gated), with_kwargs=True)
            if split[i]:
                layer = moe_layers.index(i)
                if gated:
                    self.gated.add(layer)
                decoder_layer.input_layernorm.register_forward_hook(
                    self._fold_in(layer, whole, prev=cur if gated else None))
                decoder_layer.self_attn.register_forward_hook(self._attn_fold(layer, cur, whole, gated))
                cur = layer
            elif cur >= 0:
                decoder_layer.self_attn.register_forward_hook(self._attn_out(cur))
        if self.ahead and not self.gated:
            raise ValueError(f"smoe mode speculate: predictor 'input-gate' orders a MoE layer by its gate on its "
                             f"split input, but no MoE layer of {type(stack).__name__} follows another one (each "
                             f"would take the tables); use predictor 'tables'")
        if cur >= 0:
            stack.norm.register_forward_pre_hook(self._one_row_final(cur) if split[-1] else self._final(cur))

    def step_hooks(self) -> tuple:
        """The runner hooks this order attached (:func:`.runner_hooks.attach`)."""
        return self._before_step, self._after_step

    def _before_step(self, runner, scheduler_output) -> None:
        self.before_step(scheduler_output)

    def _after_step(self, runner, scheduler_output, step) -> None:
        self.after_step()

    def swap(self, plan, placement, tables=None) -> None:
        """A live re-placement (:mod:`.live`), between two steps: the new placement's tables,
        slot map and held experts, copied into the tensors the ops read (their addresses stay, so
        captured graphs read the new values); a table of another shape (bigrams) is replaced,
        which :func:`.live.check_swap` refuses under CUDA graphs. Drift restarts its window
        against the new placement's own ratio."""
        if self.tables is not None:
            new = device_tables(tables, self.slot2expert.device, self.learned)
            for k, v in new.items():
                old = self.tables.get(k)
                if old is not None and old.shape == v.shape:
                    old.copy_(v)  # casts to the served dtype
                else:
                    self.tables[k] = v
            for k in set(self.tables) - set(new):
                del self.tables[k]
            self.bigrams = "bigram_keys" in self.tables
        self.slot2expert.copy_(torch.as_tensor(plan.slot2expert))
        self.holds.copy_(torch.as_tensor(np.stack([plan.held(r) for r in range(self.N)], axis=1)))  # held: a view
        from ..observe.metrics import Drift

        self.drift = Drift(placement.metrics.get("lar") if self.judged else None, self.drift.threshold)
        rows = self.counts.tolist()  # between steps, once per swap: the new window starts here
        local, acts, tokens = (sum(row[i] for row in rows) for i in (4, 5, 6))
        self.drift.restart(local, acts, tokens // len(rows))

    def _step_ids(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if positions is not None and positions.dim() == 2:  # M-RoPE: [3, T], text rows alike
            positions = positions[0]
        if ids is None:
            # rows given as embeddings (refused at start for predictors that need ids): predict
            # as token 0, which costs bytes, never correctness
            if positions is not None:
                self.ids[: positions.shape[0]].zero_()
                self.query[: positions.shape[0]].fill_(-1)
                self.prev[: positions.shape[0]].fill_(-1)
            return
        self.ids[: ids.shape[0]].copy_(ids)
        if self.learned:
            self.prev[: ids.shape[0]].copy_(dp.previous_ids(ids, positions))
        if self.bigrams:
            self.query[: ids.shape[0]].copy_(dp.bigram_query(ids, positions, self.tables["token2rank"].shape[1]))

    def before_step(self, scheduler_output) -> None:
        """Host side, before a served step's forward: its real token count on the device."""
        n = int(scheduler_output.total_num_scheduled_tokens)
        self.num_real.fill_(n)
        self.step_pad = None  # a step that failed between an order and its restore left its mask
        self.steps += 1
        self.small_steps += 0 < n < self.N  # every token sits in rank 0's chunk: the order cannot move it

    def after_step(self) -> None:
        self.num_real.fill_(0)  # anything run outside a served step (warm-up, capture) counts nothing
        self._maybe_log()  # the steps' counters, outside the forward (replayed graphs run no Python)

    @staticmethod
    def _pre(layer: int, predict: bool = True):
        def hook(module, args, kwargs):  # the rows come first, positional or as hidden_states=
            if args:
                return (torch.ops.smoe.order_tokens(args[0], layer, predict), *args[1:]), kwargs
            return args, {**kwargs,
                          "hidden_states": torch.ops.smoe.order_tokens(kwargs["hidden_states"], layer, predict)}
        return hook

    @staticmethod
    def _layer_input(layer: int):
        def hook(module, args, kwargs, output):
            # input_layernorm(hidden) -> normed (the first layer: its input is hidden), or
            # input_layernorm(hidden, residual) -> (normed, hidden + residual)
            if isinstance(output, tuple):
                return (torch.ops.smoe.note_layer_input(output[0], output[1], layer), *output[1:])
            return torch.ops.smoe.note_layer_input(output, args[0] if args else kwargs["x"], layer)
        return hook

    # shuffled reduce-scatter: o_proj's partial sums -> this rank's chunk of reduced rows (placed
    # at their rows, the rest zero) -> vLLM's add + norm (exact on those rows) -> the chunk's
    # residual kept, a zero residual passed on -> the experts' output plus the kept residual ->
    # the block's all-gather: every row's new residual stream, the next layer adds zero to it
    @staticmethod
    def _attn_partial(layer: int):
        def hook(module, args, output):
            if isinstance(output, tuple):  # (output, bias) of vLLM's linear layers
                return (torch.ops.smoe.reduce_scatter_tokens(output[0], layer), *output[1:])
            return torch.ops.smoe.reduce_scatter_tokens(output, layer)
        return hook

    @staticmethod
    def _norm_out(layer: int):
        def hook(module, args, output):  # post_attention_layernorm(hidden, residual) -> (normed, residual)
            normed, residual = output
            return torch.ops.smoe.split_residual(normed, residual, layer)
        return hook

    @staticmethod
    def _experts_out(layer: int, ahead: bool = False):
        def hook(module, args, output):
            if not isinstance(output, torch.Tensor):
                raise RuntimeError(f"smoe speculate: {type(module).__name__} returned {type(output).__name__}, not "
                                   f"one tensor; set additional_config smoe.reduce_scatter to false")
            if ahead:  # plus the next MoE layer's ranks of these rows, as columns for the all-gather
                return torch.ops.smoe.add_residual_ahead(output, layer)
            return torch.ops.smoe.add_residual(output, layer)
        return hook

    @staticmethod
    def _no_residual(args, kwargs) -> None:
        """The first decoder layer's call (positions, hidden_states, residual=None, ...) must carry
        no residual: with one, the stack is not the whole model (pipeline parallel)."""
        if (args[2] if len(args) > 2 else kwargs.get("residual")) is not None:
            raise RuntimeError("smoe speculate: the first decoder layer got a residual (pipeline parallel?)")

    # stack order, one per step: predict at the first layer's input, keep the order through the stack
    @staticmethod
    def _first_layer(module, args, kwargs):  # layer(positions, hidden_states, residual=None, ...)
        TokenOrder._no_residual(args, kwargs)
        if len(args) > 1:
            return (args[0], torch.ops.smoe.order_tokens(args[1], 0, True), *args[2:]), kwargs
        return args, {**kwargs, "hidden_states": torch.ops.smoe.order_tokens(kwargs["hidden_states"], 0, True)}

    @staticmethod
    def _first_residual(split: bool):
        def hook(module, args, kwargs):  # layer(positions, hidden_states, residual=None, ...)
            TokenOrder._no_residual(args, kwargs)
            if not split:
                return None
            # a first MoE layer: its residual (the embedding) must reach input_layernorm's output,
            # where smoe takes it, not be chunked by vLLM after the reduce-scatter; x + 0 is exact
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            if len(args) > 1:
                return (*args[:2], torch.zeros_like(hidden), *args[3:]), {k: v for k, v in kwargs.items()
                                                                          if k != "residual"}
            return args, {**kwargs, "residual": torch.zeros_like(hidden)}
        return hook

    @staticmethod
    def _attn_in(layer: int, ahead: bool = False):
        # ahead: the rows carry input-gate's three columns (fold_residual_ahead), kept for the order
        restore = torch.ops.smoe.restore_tokens_ahead if ahead else torch.ops.smoe.restore_tokens

        def hook(module, args, kwargs):  # attention(positions, hidden_states, ...)
            if len(args) >= 2:
                return (args[0], restore(args[1], layer), *args[2:]), kwargs
            return args, {**kwargs, "hidden_states": restore(kwargs["hidden_states"], layer)}
        return hook

    @staticmethod
    def _attn_out(layer: int):
        def hook(module, args, output):
            return torch.ops.smoe.order_tokens(output, layer, False)
        return hook

    @staticmethod
    def _final(layer: int):
        def hook(module, args):  # norm(hidden_states, residual)
            return tuple(torch.ops.smoe.restore_tokens(a, layer) if isinstance(a, torch.Tensor) else a for a in args)
        return hook

    # stack order per MoE layer
    @staticmethod
    def _fold_in(layer: int, whole: bool, prev: int | None = None):
        def hook(module, args, output):  # input_layernorm(hidden, residual) -> (normed, hidden + residual)
            if not isinstance(output, tuple):
                raise RuntimeError(f"smoe speculate: {type(module).__name__} returned no residual at MoE layer {layer}")
            if prev is not None:  # input-gate: the chunk's ranks for this layer, as columns of the normed rows
                return torch.ops.smoe.fold_residual_ahead(output[0], output[1], layer, prev)
            return torch.ops.smoe.fold_residual(output[0], output[1], layer, whole)
        return hook

    @staticmethod
    def _attn_fold(layer: int, prev: int, whole: bool, gated: bool):
        def hook(module, args, output):
            return torch.ops.smoe.order_folded(output, layer, prev, whole, gated)
        return hook

    # vLLM bug (0.32, DeepSeek-family decoder layers and stack): "are my rows split?" is asked as
    # rows != positions.shape[0], which is false for one token (ceil(1 / N) = 1; for N >= 2 only
    # T <= 1), so with a single decode token the split row (on rank 0; zero padding elsewhere) is
    # taken as the whole step: the other ranks attend over padding and the next layers read it.
    # For one token, smoe all-gathers the split rows itself before such a layer and before the
    # final norm. Eager only in effect: compiled with vLLM's (backed, guard-free) dynamic shapes
    # both vLLM's test and this one are fixed at trace time on the general path.
    def _gather_one_row(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = self.tp.all_gather(torch.cat([hidden, residual], dim=-1), 0)[:1]
        return both[:, : hidden.shape[1]].contiguous(), both[:, hidden.shape[1]:].contiguous()

    def _one_row_layer(self, module, args, kwargs):  # layer(positions, hidden_states, residual, ...)
        positions = args[0] if args else kwargs["positions"]
        if positions.shape[0] != 1:
            return None
        if len(args) < 3:  # vLLM's stack passes them positionally; anything else is a new model
            raise RuntimeError(f"smoe speculate: {type(module).__name__} called without positional "
                               f"(positions, hidden_states, residual)")
        rest = args[1:]
        hidden, residual = self._gather_one_row(rest[0], rest[1])
        return (positions, hidden, residual, *rest[2:]), kwargs

    def _one_row_final(self, layer: int):
        final = self._final(layer)

        def hook(module, args):  # after a split last layer: norm(hidden_states, residual)
            if len(args) >= 2 and args[0].shape[0] == 1:
                args = (*self._gather_one_row(args[0], args[1]), *args[2:])
            return final(module, args)
        return hook

    @staticmethod
    def _post(layer: int, ahead: bool = False):
        def hook(module, args, output):
            if ahead:  # the columns _experts_out added come off here, kept for the next layer
                return torch.ops.smoe.restore_tokens_ahead(output, layer)
            return torch.ops.smoe.restore_tokens(output, layer)
        return hook

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        n, K = topk_ids.shape
        self.top1[:n].copy_(topk_ids[:, 0])
        if not self.count or self.rows == 0:
            return
        # which rows of the chunk are real tokens: the chunk's own padding (past T) is not, nor
        # are vLLM's pad rows (step rows at or past num_real) wherever the order put them; on the
        # device, from static shapes, so a replayed graph counts the step it replays
        T = self.rows
        real = chunk_real(self.perm[0 if self.step_order else layer], T, self.rank, n, self.num_real)
        local = (self.held[layer][topk_ids.long()] & real[:, None]).sum(dim=1)  # [n]
        tokens = real.sum()
        add = torch.stack([local.sum(), tokens * K, tokens, (local > 0).sum()])
        # whether the order can act is a shape fact (a CUDA graph's T is fixed): decided in Python
        judged = add[:3] if T >= self.N else torch.zeros_like(add[:3])
        self.counts[layer] += torch.cat([add, judged])

    def gather_rows(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Recording: [c, K] router outputs of this rank's chunk -> [T, K] for every row of the
        step, in its original order (one all-gather on the TP group; static shapes)."""
        T = self.rows
        rows = self.tp.all_gather(topk_ids.contiguous(), 0)[:T]
        return rows.index_select(0, self.inv[0 if self.step_order else layer, :T])

    def preferences(self, layers: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pref [len(layers), T, P], conf [len(layers), T]) for the step's token ids."""
        if self.step_order:  # one order for every layer
            if self.predictor == "random":
                pref, conf = dp.predict_random(ids, 0, self.N)
            elif self.predictor == "one-rank":
                pref, conf = dp.predict_one_rank(ids)
            elif self.learned:  # expected local activations summed over every layer
                pref, conf = dp.learned_step(self._learned_logits(ids), self.N)
            else:
                t = self.tables
                pref, conf = dp.vote(*dp.predict_token_tables(t["token2rank"], t["token_conf"], t["prior2rank"], ids,
                                                              self._bigram(ids.shape[0])), self.N)
            return pref[None], conf[None]
        if self.predictor == "random":
            both = [dp.predict_random(ids, layer, self.N) for layer in layers]
            return torch.stack([p for p, _ in both]), torch.stack([c for _, c in both])
        if self.predictor == "one-rank":
            pref, conf = dp.predict_one_rank(ids)
            return pref.expand(len(layers), -1, -1), conf.expand(len(layers), -1)
        t = self.tables
        if self.learned:  # the network, or the token tables where they are the more confident
            tables = dp.predict_token_tables(t["token2rank"], t["token_conf"], t["prior2rank"], ids,
                                             self._bigram(ids.shape[0]))
            return dp.learned_or_tables(*tables, *dp.learned_layers(self._learned_logits(ids), self.N))
        if not self.markov:  # always every layer: whole tables, no index copies
            return dp.predict_token_tables(t["token2rank"], t["token_conf"], t["prior2rank"], ids,
                                           self._bigram(ids.shape[0]))
        (layer,) = layers
        prev = self.slot2expert[layer - 1][self.prev_top1[: ids.shape[0]]] if layer > 0 else None
        pref, conf = dp.predict_tables(*(t[k][layer] for k in ("token2rank", "token_conf", "markov2rank",
                                                               "markov_conf", "prior2rank")), ids, prev,
                                       self._bigram(ids.shape[0], layer))
        return pref[None], conf[None]

    def _learned_logits(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.tables
        return dp.learned_logits(*(t["learned_" + k] for k in LEARNED_FIELDS), ids, self.prev[: ids.shape[0]])

    def _bigram(self, T: int, layer: int | None = None) -> tuple | None:
        """:func:`device_predict.bigram_override`'s argument for the step's T rows (every layer, or one)."""
        if not self.bigrams:
            return None
        t = self.tables
        sl = slice(None) if layer is None else slice(layer, layer + 1)
        return t["bigram_keys"], t["bigram2rank"][sl], t["bigram_conf"][sl], self.query[:T]

    def reduce_scatter(self, partial: torch.Tensor, layer: int) -> torch.Tensor:
        """:func:`shuffled_reduce_scatter` on the TP group, predicting the order first where
        the block would have (the first MoE layer, or every layer for a per-layer predictor)."""
        T = partial.shape[0]
        if self.exact:
            self._exact_order(partial, layer)
        elif self.ahead and layer > 0:
            # the ranks the previous block's all-gather brought (equal on every rank), or the
            # tables' where they are the more confident
            pref, conf = dp.learned_or_tables(self.table_pref[layer: layer + 1, :T], self.table_conf[layer: layer + 1, :T],
                                              self.next_pref[:T][None], self.next_conf[:T][None])
            dp.assign_permute(pref, conf, dp.chunk_caps(T, self.N, partial.device), self.perm[layer: layer + 1],
                              self.inv[layer: layer + 1])
        elif self.per_layer or layer == 0:
            self._predict(partial, layer)
        return shuffled_reduce_scatter(partial, self.perm[layer, :T], self.rank, self.N,
                                       lambda x: self.tp.reduce_scatter(x, 0))

    def note_layer_input(self, normed: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Predictor router under the shuffled reduce-scatter, at the layer's input_layernorm: x
        [T, H] the layer's input (every row whole): the gate's logits of this rank's contiguous
        share of the rows (:func:`chunk_rows`) into ``base``, zero elsewhere, so each row's term
        is added once over the ranks. Returns a copy of normed (the op's output carries the order
        of the ops: the reduce-scatter that reads ``base`` depends on it)."""
        T = x.shape[0]
        if T == 1:  # reduce_scatter orders a one-row step without it
            return normed.clone()
        start, stop = chunk_rows(T, self.rank, self.N)
        self.base[:T].zero_()
        if stop > start:
            gate, _ = self.gates[layer]
            self.base[start:stop].copy_(gate_logits(gate, x[start:stop] * self.exact[layer][1]))
        return normed.clone()

    def _exact_order(self, partial: torch.Tensor, layer: int, with_base: bool = True) -> None:
        """The exact order of ``layer`` before its reduce: each rank's gate logits of its partial
        rows (plus, ``with_base``, its share of the input's, ``base``; the stack's partial rows
        carry their share of the input themselves: :meth:`order_folded`), all-gathered and summed rank by rank into
        the gate's logits over the reduced rows up to each row's positive norm scale, which the
        routing step's top-k ignores (:func:`exact_gate_scale`); its experts' ranks ->
        ``perm`` / ``inv``. Every rank sums the same bytes in the same order: the same
        assignment, no broadcast. One all-gather of [T, E] float32: each term is the gate's output
        (in its dtype), the sums over terms and ranks are float32, where a bf16 gather would round
        each rank's sum once more."""
        T = partial.shape[0]
        self.rows = T
        if T == 1:
            self._one_row(slice(layer, layer + 1))
            return
        gate, router = self.gates[layer]
        mine = gate_logits(gate, partial * self.exact[layer][1]).float()
        if with_base:
            mine += self.base[:T]
        logits = unit_rows(sum_gathered(self.tp.all_gather(mine, 0), self.N))
        # rows for the routing step alike on every rank (its experts decide which rows each rank
        # reduces; the partial rows differ): zeros of their shape, no memory, as in the probe
        rows = partial.new_zeros(()).expand(T, partial.shape[1])
        _, ids = router._compute_routing(rows, logits, None, input_ids=self.ids[:T])
        pref, conf = dp.prefer_held(ids, self.holds[layer])
        dp.assign_permute(pref[None], conf[None], dp.chunk_caps(T, self.N, partial.device),
                          self.perm[layer: layer + 1], self.inv[layer: layer + 1])

    def fold_residual(self, normed: torch.Tensor, residual: torch.Tensor, layer: int, whole: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack order per layer, at MoE layer ``layer``'s input_layernorm: residual [R, H] the
        layer's input (the residual stream) as this rank holds it: ``whole`` (every row, R = T, in
        the order the stack's rows are in) or split (this rank's chunk of the previous MoE
        layer's order, R = ceil(T / N)). Keeps the rows this rank adds to its attention partial
        sums (its contiguous share of whole rows, or its chunk) in ``kept``. Returns (a copy of
        normed: the attention depends on it, which orders this op before ``order_folded``; a
        zero residual for vLLM's add after the reduce-scatter, exact: the rows arrive summed)."""
        self._keep(residual, whole)
        return normed.clone(), torch.zeros_like(residual)

    def _keep(self, residual: torch.Tensor, whole: bool) -> None:
        """The rows of residual [R, H] this rank adds (its :func:`chunk_rows` share of whole
        rows, or all of its chunk) into ``kept``, as :meth:`order_folded` reads them back."""
        R = residual.shape[0]
        start, stop = chunk_rows(R, self.rank, self.N) if whole else (0, R)
        self.kept[: stop - start].copy_(residual[start:stop])

    def fold_residual_ahead(self, normed: torch.Tensor, residual: torch.Tensor, layer: int, prev: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`fold_residual` of split rows (this rank's chunk of MoE layer ``prev``'s order),
        and predictor input-gate's ranks of them for ``layer``: [c, H + 3] the normed rows, this
        layer's two preferred ranks (-1 = none) and the confidence (:func:`gate_ranks` on the
        rows, which are the layer's input) in normed's dtype, for vLLM's all-gather before the
        attention; every rank then reads the same bytes (``restore_ahead``)."""
        self._keep(residual, False)
        # the step's rows: set at its first MoE layer. One row (smoe's one-row fix gathered it,
        # vLLM gathers nothing more): each rank keeps its own columns, and they may differ, but a
        # one-row order is the identity whatever they say (chunk_caps(1, N) = [1, 0, ...])
        c, T = residual.shape[0], self.rows
        q = (torch.arange(c, device=residual.device) + self.rank * c).clamp(max=T - 1)  # padding: dropped later
        gate, router = self.gates[layer]
        pref, conf = gate_ranks(self.next_norm[layer], gate, router, residual, self.holds[layer],
                                self.ids.index_select(0, self.perm[prev].index_select(0, q)))
        return (torch.cat([normed, pref.to(normed.dtype), conf.to(normed.dtype)[:, None]], dim=1),
                torch.zeros_like(residual))

    def order_folded(self, partial: torch.Tensor, layer: int, prev: int, whole: bool, gated: bool
                     ) -> torch.Tensor:
        """Stack order per layer, at the attention's output of MoE layer ``layer``: partial [T,
        H] this rank's attention partial sums in the step's order (summed over ranks by vLLM's
        reduce-scatter next); prev: the MoE layer whose order ``fold_residual``'s rows are in (-1:
        the step's; then every layer's order is predicted here, once per step); whole: as
        ``fold_residual`` was told (its rows: this rank's share of T, or its chunk); gated: input-gate's
        ranks for this layer rode in with the layer's input (``fold_residual_ahead``). Returns [T, H]
        in this layer's order, plus this rank's kept residual rows at their places, so each row's
        residual is added once over the ranks and each rank's reduced chunk is the rows this
        layer's order gives it, residual included. Static shapes, no host read."""
        T = partial.shape[0]
        dev = partial.device
        c = -(-T // self.N)
        start, stop = chunk_rows(T, self.rank, self.N) if whole else (self.rank * c, self.rank * c + c)
        q = torch.arange(start, stop, device=dev)
        rows = self.kept[: stop - start].to(partial.dtype)
        if not whole:  # the chunk's padding past T adds zero to the last row
            rows = torch.where((q < T)[:, None], rows, 0)
            q = q.clamp(max=T - 1)
        src = q if prev < 0 else self.perm[prev].index_select(0, q)  # the step rows they are
        if self.exact:  # router: the order from the gate's logits of the folded rows, summed over ranks
            full = partial.index_add(0, src, rows)
            self._exact_order(full, layer, with_base=False)  # full carries the layer input's rows
            out = full.index_select(0, self.perm[layer, :T])
        else:
            if prev < 0:
                self._predict(partial, layer)
            elif gated:  # input-gate's ranks, or the tables' where they are the more confident
                pref, conf = dp.learned_or_tables(self.table_pref[layer: layer + 1, :T],
                                                  self.table_conf[layer: layer + 1, :T],
                                                  self.next_pref[:T][None], self.next_conf[:T][None])
                dp.assign_permute(pref, conf, dp.chunk_caps(T, self.N, dev), self.perm[layer: layer + 1],
                                  self.inv[layer: layer + 1])
            out = partial.index_select(0, self.perm[layer, :T])
            out.index_add_(0, self.inv[layer].index_select(0, src), rows)
        self.rows = T
        self._mark_padding(layer, T)
        return out

    def split_residual(self, x: torch.Tensor, residual: torch.Tensor, layer: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        return keep_chunk_residual(x, residual, self.perm[layer, :T], self.rank, self.N, self.kept)

    def add_residual(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """y: [c, H] the experts' output of this rank's chunk: plus its kept residual rows."""
        return y + self.kept[: y.shape[0]].to(y.dtype)

    def add_residual_ahead(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """:meth:`add_residual`, then three columns more: [c, H + 3], the next MoE layer's two
        preferred ranks (-1 = none) and confidence for these rows (:func:`gate_ranks` on the
        rows, which are that layer's input), in y's dtype (small integers stay exact; every rank
        reads the same bytes after the all-gather, so the confidence need not be exact)."""
        x = self.add_residual(y, layer)
        c, T = x.shape[0], self.rows
        nxt = layer + 1
        # the step rows of this chunk (the chunk's padding past T reads the last row: dropped later)
        src = self.perm[layer].index_select(0, (torch.arange(c, device=x.device) + self.rank * c).clamp(max=T - 1))
        gate, router = self.gates[nxt]
        pref, conf = gate_ranks(self.next_norm[nxt], gate, router, x, self.holds[nxt], self.ids.index_select(0, src))
        return torch.cat([x, pref.to(x.dtype), conf.to(x.dtype)[:, None]], dim=1)

    def restore_ahead(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """y: [T, H + 3] the all-gathered rows of :meth:`add_residual_ahead`, in the token
        order. Returns [T, H] in the step's order; keeps the columns for the next layer's order."""
        z = self.restore(y, layer)
        T, H = z.shape[0], z.shape[1] - 3
        self.next_pref[:T].copy_(z[:, H: H + 2].round().long())
        self.next_conf[:T].copy_(z[:, H + 2].float())
        return z[:, :H].contiguous()

    def order(self, x: torch.Tensor, layer: int, predict: bool) -> torch.Tensor:
        T = x.shape[0]
        if predict and (self.step_order or self.per_layer or layer == 0):
            self._predict(x, layer)
        self._mark_padding(layer, T)
        if self.chunk_only:
            # the block keeps only this rank's chunk (vLLM's sequence_parallel_chunk): gather just
            # those rows; the others are never read
            start, stop = chunk_rows(T, self.rank, self.N)
            out = torch.empty_like(x)
            torch.index_select(x, 0, self.perm[layer, start:stop], out=out[start:stop])
            return out
        return x.index_select(0, self.perm[layer, :T])

    def _mark_padding(self, layer: int, T: int) -> None:
        """vLLM's routers (with ``VLLM_MOE_SKIP_PADDING``, on by default: the CUDA top-k kernels
        and the grouped top-k) mask the experts of chunk row j when step row j is padding
        (``forward_context.is_padding[:c]``), which holds for vLLM's contiguous chunks, whose pad
        rows come last; in the token order a real token may sit at any chunk row, and masked it
        would lose its experts' output. So the forward context's mask points, until
        :meth:`restore`, at smoe's own buffer holding this rank's ordered chunk rows' pad flags
        (:func:`chunk_padding`); the runner's step mask stays as vLLM wrote it for every other
        reader (smoe's own routing of whole steps, drafters). Device ops on static shapes: a
        captured graph holds the buffer's address and the copy, so a replay (no Python) masks
        the rows it replays."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        fc = get_forward_context() if is_forward_context_available() else None
        pad = None if fc is None else fc.is_padding
        if pad is None and self.step_pad is None:
            return
        if pad is not None and pad.data_ptr() != self.chunk_pad.data_ptr():  # the runner's, not ours
            self.step_pad = pad
        if self.step_pad.shape[0] < T:  # not a mask of this step's rows: route every row (always right)
            fc.is_padding = None
            return
        c = -(-T // self.N)
        mine = self.chunk_pad[:c]  # the block routes its c rows: vLLM reads is_padding[:c]
        # from the runner's own mask (not num_real): vLLM routes every row of its profile run and
        # none of a capture, and a replay reads the mask the runner wrote for the step
        mine.copy_(chunk_padding(self.perm[0 if self.step_order else layer], T, self.rank, c, self.step_pad))
        fc.is_padding = mine

    def _one_row(self, rows: slice) -> None:
        """The order of a one-row step for the layers ``rows``: the identity. The row sits in rank
        0's chunk whatever the order, so the predictors that make a collective for theirs skip it."""
        self.perm[rows, :1].zero_()
        self.inv[rows, :1].zero_()

    def _predict(self, x: torch.Tensor, layer: int) -> None:
        """The step's token order for ``layer`` (every layer at the first, unless per layer):
        ``perm`` / ``inv`` written in place. x: [T, H] the rows (read by predictor router only)."""
        T = x.shape[0]
        self.rows = T
        layers = [layer] if self.per_layer or self.step_order else list(range(self.perm.shape[0]))
        rows = slice(layers[0], layers[-1] + 1)
        caps = dp.chunk_caps(T, self.N, x.device)
        agreed = bool(self.gates and not self.ahead) or self.learned  # rank 0's assignment, broadcast
        if agreed and T == 1:  # no gate and no broadcast for it
            self._one_row(rows)
        elif agreed:
            # floats each rank computes itself: the gate's rows are equal across ranks only if
            # the attention all-reduce is bitwise deterministic (vLLM's FlashInfer one is not),
            # and the network's GEMM need not round alike on every rank (thread counts,
            # kernels), so rank 0's assignment is the step's (4 bytes a token and layer)
            if self.gates:
                gate, router = self.gates[layer]
                pref, conf = route_ahead(gate, router, x, self.holds[layer], self.ids[:T])
                pref, conf = pref[None], conf[None]
            else:
                pref, conf = self.preferences(layers, self.ids[:T])
            perm, inv = dp.permutation(agree(dp.assign(pref, conf, caps), self.broadcast))
            self.perm[rows, :T].copy_(perm)
            self.inv[rows, :T].copy_(inv)
        else:
            pref, conf = self.preferences(layers, self.ids[:T])
            if self.ahead:  # the tables' guesses kept for the layers the gate then orders
                self.table_pref[:, :T].copy_(pref)
                self.table_conf[:, :T].copy_(conf)
                if not self.stack:  # the first layer's order now (the stack: every layer's, some redone)
                    pref, conf, rows = pref[:1], conf[:1], slice(0, 1)
            dp.assign_permute(pref, conf, caps, self.perm[rows], self.inv[rows])

    def restore(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        if self.step_pad is not None:  # the runner's step mask back in the forward context
            from vllm.forward_context import get_forward_context, is_forward_context_available

            if is_forward_context_available():
                get_forward_context().is_padding = self.step_pad
            self.step_pad = None
        T = y.shape[0]
        inv = self.inv[layer, :T]
        if self.markov and layer + 1 < self.inv.shape[0]:
            c = -(-T // self.N)
            top1 = self.tp.all_gather(self.top1[:c].contiguous(), 0)[:T]  # sorted order -> original
            self.prev_top1[:T].copy_(top1.index_select(0, inv))
        return y.index_select(0, inv)

    def _read_counts(self) -> list | None:
        """The device counters as lists, once per log interval. On CUDA without waiting for the
        device: a pinned copy started at one interval is read at the next (so values lag one
        interval; None until the first copy has landed)."""
        if self.counts.device.type != "cuda":
            return self.counts.tolist()
        pending = getattr(self, "_pending", None)
        host = torch.empty(self.counts.shape, dtype=self.counts.dtype, pin_memory=True)
        host.copy_(self.counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)
        if pending is None or not pending[1].query():
            return None
        return pending[0].tolist()

    def _maybe_log(self) -> None:
        if not self.count:
            return
        now = time.monotonic()
        if now - self._last_log < self.log_interval:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # reading device counters would break a CUDA graph capture
        self._last_log = now
        rows = self._read_counts()
        if rows is None:
            return
        layers = [row[:4] for row in rows]  # what metrics publish: every served token
        local, acts, tokens = (sum(row[i] for row in layers) for i in range(3))
        if not acts:
            return
        window = self.drift.update(*(sum(row[i] for row in rows) for i in (4, 5)),
                                   sum(row[6] for row in rows) // len(rows))
        if window is not None and window["drifted"]:
            logger.warning("smoe: drift: rank %d kept %.3f of its last %d tokens' expert activations local, below "
                           "%.2f x the placement's %.3f: the workload may have moved (smoe-place advise)",
                           self.rank, window["ratio"], window["tokens"], self.drift.threshold, self.drift.expected)
        if self.metrics_dir is not None:
            from ..observe.metrics import publish

            try:
                publish(self.metrics_dir, "order", self.rank, {"layers": layers, "drift": self.drift.snapshot()})
            except OSError as e:  # the server is shutting down and took its directory along
                logger.warning("smoe: metrics not published any more: %s", e)
                self.metrics_dir = None
        from vllm.distributed import get_ep_group

        exchange = getattr(getattr(get_ep_group().device_communicator, "all2all_manager", None), "exchange", None)
        wire = ""
        if exchange is not None:
            c = exchange.counters()
            if c["tokens"]:
                wire = (f"; sparse all2all: {c['pairs'] / c['tokens']:.3f} remote (token, rank) pairs and "
                        f"{c['bytes'] / c['tokens']:.0f} B per token and MoE layer")
        if self.small_steps:
            wire += (f"; {self.small_steps / self.steps:.0%} of {self.steps} steps had fewer tokens than ranks (the "
                     f"order cannot move them)")
        logger.info("smoe: speculate (predictor %s): rank %d served %.3f of its expert activations locally "
                    "(%d tokens)%s", self.predictor, self.rank, local / acts, tokens // self.inv.shape[0], wire)


# The two ops keep per-step state on TokenOrder (perm, inv, top-1, counters) rather than in their
# signatures; their order is fixed by data: restore_tokens consumes what order_tokens fed the block.
@torch.library.custom_op("smoe::order_tokens", mutates_args=())
def order_tokens(x: torch.Tensor, layer: int, predict: bool) -> torch.Tensor:
    return worker().order.order(x, layer, predict)


@order_tokens.register_fake
def _(x, layer, predict):
    return torch.empty_like(x)


@torch.library.custom_op("smoe::restore_tokens", mutates_args=())
def restore_tokens(y: torch.Tensor, layer: int) -> torch.Tensor:
    return worker().order.restore(y, layer)


@restore_tokens.register_fake
def _(y, layer):
    return torch.empty_like(y)


@torch.library.custom_op("smoe::reduce_scatter_tokens", mutates_args=())
def reduce_scatter_tokens(partial: torch.Tensor, layer: int) -> torch.Tensor:
    return worker().order.reduce_scatter(partial, layer)


@reduce_scatter_tokens.register_fake
def _(partial, layer):
    return torch.empty_like(partial)


@torch.library.custom_op("smoe::note_layer_input", mutates_args=())
def note_layer_input(normed: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
    return worker().order.note_layer_input(normed, x, layer)


@note_layer_input.register_fake
def _(normed, x, layer):
    return torch.empty_like(normed)


@torch.library.custom_op("smoe::fold_residual", mutates_args=())
def fold_residual(normed: torch.Tensor, residual: torch.Tensor, layer: int, whole: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return worker().order.fold_residual(normed, residual, layer, whole)


@fold_residual.register_fake
def _(normed, residual, layer, whole):
    return torch.empty_like(normed), torch.empty_like(residual)


@torch.library.custom_op("smoe::fold_residual_ahead", mutates_args=())
def fold_residual_ahead(normed: torch.Tensor, residual: torch.Tensor, layer: int, prev: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return worker().order.fold_residual_ahead(normed, residual, layer, prev)


@fold_residual_ahead.register_fake
def _(normed, residual, layer, prev):
    return normed.new_empty((normed.shape[0], normed.shape[1] + 3)), torch.empty_like(residual)


@torch.library.custom_op("smoe::order_folded", mutates_args=())
def order_folded(partial: torch.Tensor, layer: int, prev: int, whole: bool, gated: bool) -> torch.Tensor:
    return worker().order.order_folded(partial, layer, prev, whole, gated)


@order_folded.register_fake
def _(partial, layer, prev, whole, gated):
    return partial.new_empty(partial.shape)  # contiguous, as index_select's


@torch.library.custom_op("smoe::split_residual", mutates_args=())
def split_residual(x: torch.Tensor, residual: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return worker().order.split_residual(x, residual, layer)


@split_residual.register_fake
def _(x, residual, layer):
    return torch.empty_like(x), torch.empty_like(residual)


@torch.library.custom_op("smoe::add_residual", mutates_args=())
def add_residual(y: torch.Tensor, layer: int) -> torch.Tensor:
    return worker().order.add_residual(y, layer)


@add_residual.register_fake
def _(y, layer):
    return torch.empty_like(y)


@torch.library.custom_op("smoe::add_residual_ahead", mutates_args=())
def add_residual_ahead(y: torch.Tensor, layer: int) -> torch.Tensor:
    return worker().order.add_residual_ahead(y, layer)


@add_residual_ahead.register_fake
def _(y, layer):
    return y.new_empty((y.shape[0], y.shape[1] + 3))


@torch.library.custom_op("smoe::restore_tokens_ahead", mutates_args=())
def restore_tokens_ahead(y: torch.Tensor, layer: int) -> torch.Tensor:
    return worker().order.restore_ahead(y, layer)


@restore_tokens_ahead.register_fake
def _(y, layer):
    return y.new_empty((y.shape[0], y.shape[1] - 3))


def chunk_rows(T: int, rank: int, N: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [start, stop) of T rows split as vLLM's sequence_parallel_chunk does
    (ceil(T / N) each, the last ones short or empty)."""
    c = -(-T // N)
    start = min(rank * c, T)
    return start, min(start + c, T)


def chunk_real(perm: torch.Tensor, T: int, rank: int, n: int, num_real: torch.Tensor) -> torch.Tensor:
    """Which of rank ``rank``'s ``n`` chunk rows of the token order are real tokens: [n] bool.
    perm: [>= T] int64, row i of the order is step row perm[i]; the chunk's rows past T are its
    padding, and step rows at or past ``num_real`` (a 0-d device tensor) are vLLM's pad rows,
    wherever the order put them. Static shapes, no host read."""
    q, src = _chunk_sources(perm, T, rank, n)
    return (q < T) & (src < num_real)


def chunk_padding(perm: torch.Tensor, T: int, rank: int, n: int, step_pad: torch.Tensor) -> torch.Tensor:
    """vLLM's pad-row mask for rank ``rank``'s ``n`` chunk rows of the token order: [n] bool, True
    where the row is the chunk's own padding (past T) or a step row ``step_pad`` (vLLM's [>= T]
    bool mask of the step, in step order) marks. Static shapes, no host read."""
    q, src = _chunk_sources(perm, T, rank, n)
    return (q >= T) | step_pad.index_select(0, src)


def _chunk_sources(perm: torch.Tensor, T: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, src): [n] int64 rank ``rank``'s chunk rows' places in the token order, and the step
    rows they hold (the chunk's padding past T reads the last row)."""
    q = torch.arange(n, device=perm.device) + rank * n
    return q, perm.index_select(0, q.clamp(max=T - 1))


def shuffled_reduce_scatter(partial: torch.Tensor, perm: torch.Tensor, rank: int, N: int, reduce_scatter
                            ) -> torch.Tensor:
    """s-MoE's shuffled reduce-scatter of one tensor-parallel partial sum. partial: [T, H] this
    rank's share (summed over ranks it is the all-reduce's result); perm: [T] int64, row i of the
    token order is step row perm[i]; reduce_scatter: ``[N * c, H] -> [c, H]`` summed over the
    group, c = ceil(T / N). Returns [T, H]: this rank's chunk of the token order, reduced, at the
    step rows it came from (``perm[start:stop]``); every other row zero. Static shapes."""
    T, H = partial.shape
    c = -(-T // N)
    rows = partial.new_zeros((N * c, H))
    torch.index_select(partial, 0, perm, out=rows[:T])
    mine = reduce_scatter(rows)
    start, stop = chunk_rows(T, rank, N)
    out = partial.new_zeros((T, H))
    out.index_copy_(0, perm[start:stop], mine[: stop - start])
    return out


def keep_chunk_residual(x: torch.Tensor, residual: torch.Tensor, perm: torch.Tensor, rank: int, N: int,
                        kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After the add + norm on :func:`shuffled_reduce_scatter`'s output: x, residual [T, H], exact
    on this rank's chunk rows. Writes the chunk's residual rows, in chunk order, to
    ``kept[:ceil(T / N)]`` (zero past them; kept: [>= ceil(T / N), H]) for the experts' output to
    add before the block's all-gather. Returns (x's chunk rows at their step rows, the rest zero;
    a zero residual: the all-gathered rows then carry the whole residual stream)."""
    T = x.shape[0]
    start, stop = chunk_rows(T, rank, N)
    src = perm[start:stop]
    kept[: -(-T // N)].zero_()
    kept[: stop - start].copy_(residual.index_select(0, src))
    out = torch.zeros_like(x)
    out.index_copy_(0, src, x.index_select(0, src))
    return out, torch.zeros_like(residual)


def agree(token2rank: torch.Tensor, broadcast) -> torch.Tensor:
    """Rank 0's assignment on every rank. token2rank: [T] or [L, T] int64; broadcast: the TP
    group's ``broadcast(tensor, src)`` (in place). Returns the same shape, int64."""
    t = token2rank.to(torch.int32).contiguous()
    return broadcast(t, 0).long()


def device_tables(tables, device, learned: bool = False) -> dict[str, torch.Tensor]:
    """The predictor tables (``placement.predict.PredictorTables``) as the ops read them: name ->
    tensor on ``device``, floats as float32 (the learned predictor's per-id rows as float16); with
    ``learned``, the learned predictor's arrays too (the tables must carry them)."""
    names = TABLE_NAMES + (("bigram_keys", "bigram2rank", "bigram_conf") if tables.has_bigrams else ())
    if learned:
        names += tuple("learned_" + k for k in LEARNED_FIELDS)
    out = {k: torch.as_tensor(getattr(tables, k)).to(device) for k in names}
    # the learned predictor's per-id rows stay float16 (its largest arrays; read as float32)
    return {k: v.float() if v.is_floating_point() and not k.endswith("_proj") else v for k, v in out.items()}


def install_token_order(model, vllm_config, cfg, served) -> TokenOrder:
    """Called by smoe's model loader once the weights are in place; ``served``: the process's
    :class:`~.served.ServedPlacement` (its tables and load plan)."""
    tables = served.tables if cfg.predictor in TABLE_PREDICTORS else None
    order = TokenOrder(model, vllm_config, cfg, tables, served.plan, expected=served.placement.metrics.get("lar"))
    logger.info("smoe: mode speculate: token order over %d ranks around %d MoE blocks (%s), %s, predictor %s; "
                "attention output: %s", order.N, len(order.blocks), type(order.blocks[0][1]).__name__,
                (f"one order per step ({order.step_reason})" if order.step_order else
                 "one order per layer (the split residual folded into the attention's reduce-scatter)"
                 if order.stack else "one order per layer"),
                cfg.predictor + (" (as router: the rows are whole before each block)"
                                 if cfg.predictor == "input-gate" and not order.ahead else
                                 " (exact before the reduce: the gate's logits of each rank's partial rows "
                                 "all-gathered)" if order.exact else ""),
                f"reduce-scattered in the token order at {len(order.shuffled)} MoE layers" if order.shuffled
                else "reduce-scattered by the decoder layer" if order.stack
                else f"vLLM's all-reduce ({order.shuffle_reason})")
    return order
