"""The plan of a worker's token order: which layout, which predictor and why, decided once at
load from the model, the settings and the placement. No buffers and no hooks: what
:func:`plan_order` refuses it refuses with ValueError naming why, and the start line is read
from the plan (:meth:`OrderPlan.start_line`).

Layouts (one class each, :mod:`.layout_block`, :mod:`.layout_stack`):

- ``block``: an order per MoE layer around each MoE block that chunks and all-gathers its rows
  itself (Qwen3-MoE, ...), the attention's all-reduce as vLLM runs it;
- ``shuffled``: the same, with the attention's partial sums reduce-scattered straight into the
  token order (s-MoE's shuffled reduce-scatter, config ``reduce_scatter``);
- ``stack-layer``: the DeepSeek family, whose decoder layers split the rows: an order per MoE
  layer folded into the attention's partial sums before the layer's own reduce-scatter;
- ``stack-step``: the DeepSeek family with one order for the whole step (``stack_order: step``,
  or where an order per layer cannot follow the stack).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .gates import exact_gate_scale
from .seams import (CHUNK_ONLY_BLOCKS, block_supported, exact_router_seams, find_moe_experts, find_stack,
                    gate_ahead, shuffle_seams, stack_order_kind, tp_spans_nodes)


@dataclass(frozen=True, eq=False)
class OrderPlan:
    """How one worker orders its tokens.

    N, rank: the TP group's size and this rank; predictor: the settings' name; predicts: the
    predictor class composed (:func:`.predictors.make_predictor`: the name, or ``router`` for
    input-gate on whole rows, ``summed-router`` for router before the reduce); layout: one of the
    module docstring's; blocks: (MoE ordinal, block, router) per MoE layer; experts: the FusedMoE
    per MoE layer; stack: the decoder stack (stack layouts; None otherwise); gates: (gate,
    router) per MoE layer (router, input-gate); shuffled: (ordinal, o_proj,
    post_attention_layernorm, FusedMoE) per MoE layer (layout shuffled); exact: (input_layernorm
    or None, w [H]) per MoE layer (summed-router); next_norm: MoE ordinal -> the norm input-gate
    runs its gate after; chunk_only: the blocks read only their chunk of the ordered rows;
    step_reason / shuffle_reason: why one order per step / why the attention keeps vLLM's
    all-reduce."""

    N: int
    rank: int
    predictor: str
    predicts: str
    layout: str
    moe_layers: tuple[int, ...]
    blocks: tuple
    experts: tuple
    stack: object = None
    gates: tuple = ()
    shuffled: tuple = ()
    exact: tuple = ()
    next_norm: dict = field(default_factory=dict)
    chunk_only: bool = False
    step_reason: str = ""
    shuffle_reason: str = ""

    def start_line(self) -> str:
        """The worker's start line (logged once by :func:`.install.install_token_order`)."""
        layout = {"stack-step": f"one order per step ({self.step_reason})",
                  "stack-layer": "one order per layer (the split residual folded into the attention's reduce-scatter)"
                  }.get(self.layout, "one order per layer")
        how = (" (as router: the rows are whole before each block)" if self.predictor == "input-gate"
               and self.predicts == "router" else " (exact before the reduce: the gate's logits of each rank's "
               "partial rows all-gathered)" if self.predicts == "summed-router" else "")
        attention = (f"reduce-scattered in the token order at {len(self.shuffled)} MoE layers" if self.shuffled
                     else "reduce-scattered by the decoder layer" if self.layout.startswith("stack")
                     else f"vLLM's all-reduce ({self.shuffle_reason})")
        return (f"smoe: mode speculate: token order over {self.N} ranks around {len(self.blocks)} MoE blocks "
                f"({type(self.blocks[0][1]).__name__}), {layout}, predictor {self.predictor + how}; attention "
                f"output: {attention}")


def _refuse(why: str):
    raise ValueError(f"smoe mode speculate: {why}")


def plan_order(model, vllm_config, cfg, moe_layers: tuple[int, ...], tp, has_tables: bool, device) -> OrderPlan:
    """The plan for ``model`` under ``cfg`` (SmoeConfig) on the TP group ``tp`` (vLLM's
    GroupCoordinator); has_tables: the placement's predictor tables are on the device. Reads the
    model's modules and their forwards' source, probes the norms and gates router needs, changes
    nothing; ValueError (RuntimeError where the model is not what the placement says) names why
    the model cannot be ordered so."""
    N, rank = tp.world_size, tp.rank_in_group
    found = find_moe_experts(model, moe_layers)
    blocks = tuple((layer, block, e.router) for layer, block, e in found)
    if len(blocks) != len(moe_layers):
        raise RuntimeError(f"smoe speculate: found {len(blocks)} MoE blocks, expected {len(moe_layers)}")
    kinds, checked = set(), {}
    for _, block, _ in blocks:  # once per block class: the stack check reads every layer's source
        if type(block) not in checked:
            checked[type(block)] = block_supported(block, model)
        ok, reason, kind = checked[type(block)]
        if not ok:
            _refuse(reason)
        kinds.add(kind)
    if len(kinds) != 1:
        _refuse(f"MoE blocks of mixed kinds {sorted(kinds)}")
    name = type(blocks[0][1]).__name__
    mc = vllm_config.model_config
    stack = find_stack(model) if kinds == {"stack"} else None
    step_order, step_reason = False, ""
    if stack is not None:
        # the DeepSeek family: an order per MoE layer (the split residual folded into the
        # attention's partial sums before the layer's own reduce-scatter) where it can follow the
        # stack, else one order for the whole step (:func:`stack_order_kind`)
        step_order, step_reason = stack_order_kind(stack, moe_layers, cfg.stack_order, mc.dtype)
        if getattr(vllm_config, "speculative_config", None) is not None:
            _refuse(f"speculative decoding with {name}: its drafters read the stack's hidden states (MTP, EAGLE-3), "
                    f"which smoe keeps in its own order between layers")
        if getattr(vllm_config, "lora_config", None) is not None:
            _refuse(f"LoRA with {name}: vLLM picks each row's adapter by its place in the step, and smoe keeps the "
                    f"rows in its own order between decoder layers, so the dense layers would take other tokens' "
                    f"adapters")
        if cfg.predictor == "tables-markov":
            _refuse(f"predictor 'tables-markov' orders each layer by the previous layer's top-1 experts of every "
                    f"row, but {name}'s decoder layers keep their rows split between layers, so no rank holds them; "
                    f"use predictor 'tables' or 'learned'")
    if step_order and cfg.predictor in ("router", "input-gate"):
        _refuse(f"predictor {cfg.predictor!r} runs each MoE layer's gate on rows of that layer, but {name}'s decoder "
                f"layers keep their rows split between layers, with one order for the whole step ({step_reason}); "
                f"use predictor 'tables' or 'learned'")
    gates = []  # predictors router, input-gate: (gate, router) per MoE layer
    if cfg.predictor in ("router", "input-gate"):
        for _, block, e in found:
            ok, reason, gate = gate_ahead(block, e)
            if not ok:
                _refuse(f"predictor {cfg.predictor!r}: {reason}")
            gates.append((gate, e.router))
    # s-MoE's shuffled reduce-scatter (config reduce_scatter): the attention's partial sums
    # reduce-scatter straight into the token order, and the residual added to this rank's
    # chunk travels in the MoE block's own all-gather; predictor router, which needs the
    # reduced rows' gate logits before the reduce, sums them from each rank's partial rows
    # (exact_router_seams) where the norm, gate and routing step allow, else keeps the all-reduce
    shuffled, exact, why = [], [], "reduce_scatter: off"
    if cfg.reduce_scatter != "off" and N > 1 and stack is None:
        if getattr(vllm_config, "lora_config", None) is not None:
            # vLLM wraps o_proj for LoRA after the load: the wrapper would skip both the
            # all-reduce (it reads reduce_results) and smoe's hook on the module it wraps
            why = "LoRA wraps the attention's o_proj after the load"
        elif cfg.reduce_scatter == "auto" and not tp_spans_nodes(tp):
            why = ("reduce_scatter: auto, and the tensor-parallel group is on one node, where vLLM's all-reduce "
                   "costs no more")
        else:
            shuffled, why = shuffle_seams(model, moe_layers, found, N)
        if shuffled and cfg.predictor == "router":
            exact, why = exact_router_seams(model, moe_layers, gates, mc.get_hidden_size(), mc.dtype, device)
            if not exact:
                shuffled, why = [], f"predictor 'router': {why}"
    if stack is not None and cfg.predictor == "router":
        # the DeepSeek family ordered per layer: each rank's attention partial sums carry its
        # residual rows (order_folded), so the gate's logits of the reduced rows are their sum
        # over the ranks, where the post-attention norm, gate and routing step allow it
        for layer, (gate, router) in enumerate(gates):
            decoder = stack.layers[moe_layers[layer]]
            w, why_not = exact_gate_scale(decoder.post_attention_layernorm, gate, router, mc.get_hidden_size(),
                                          mc.dtype, device)
            if w is None:
                _refuse(f"predictor 'router' on {type(decoder).__name__}, which keeps its rows split between "
                        f"layers, sums the gate's logits from each rank's partial rows before the reduce, but "
                        f"{why_not}; use predictor 'input-gate', 'tables' or 'learned'")
            exact.append((None, w))
    # predictor input-gate ahead of the rows (:class:`.predictors.InputGate`) where the order is
    # needed before they are whole: the shuffled reduce-scatter, or the DeepSeek family ordered
    # per layer (each rank runs the gate on its chunk of the layer's input at input_layernorm,
    # the ranks riding as three more columns in the layer's own all-gather before its attention;
    # a MoE layer whose input is whole, after a dense layer or the first, takes the tables).
    # Where the rows are whole before the block the gate sees the exact rows: predictor router.
    predicts = {"router": "summed-router" if exact else "router"}.get(cfg.predictor, cfg.predictor)
    next_norm = {}
    if cfg.predictor == "input-gate":
        predicts = "input-gate" if shuffled or stack is not None else "router"
    if predicts == "input-gate":
        if not has_tables:
            _refuse("predictor 'input-gate' takes the first MoE layer's order from the placement's tables, and it "
                    "has none")
        next_norm = ({layer: norm for layer, _, norm, _ in shuffled} if shuffled else
                     {layer: stack.layers[i].post_attention_layernorm for layer, i in enumerate(moe_layers)})
    layout = ("stack-step" if step_order else "stack-layer") if stack is not None else \
        "shuffled" if shuffled else "block"
    if layout == "stack-layer" and predicts == "input-gate":
        split = [bool(getattr(d, "use_sequence_parallel_moe", False)) for d in stack.layers]
        if not any(split[i] and i > 0 and split[i - 1] for i in range(len(split))):
            _refuse(f"predictor 'input-gate' orders a MoE layer by its gate on its split input, but no MoE layer of "
                    f"{type(stack).__name__} follows another one (each would take the tables); use predictor "
                    f"'tables'")
    # the block reads only its chunk of the ordered rows: blocks whose forward was read to
    # touch nothing else before vLLM's sequence_parallel_chunk (others get every row)
    chunk_only = stack is None and all(type(b).__name__ in CHUNK_ONLY_BLOCKS for _, b, _ in blocks)
    return OrderPlan(N, rank, cfg.predictor, predicts, layout, tuple(moe_layers), blocks,
                     tuple(e for _, _, e in found), stack, tuple(gates), tuple(shuffled), tuple(exact), next_norm,
                     chunk_only, step_reason, why if not shuffled else "")
