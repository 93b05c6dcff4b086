"""What smoe reads of a model for the token order: its MoE blocks, decoder stack and the seams
(modules and their forwards' source) where the order's hooks go, each check saying why not.

Pure reading: nothing here hooks, allocates or changes a module."""

from __future__ import annotations

import inspect
import re

import torch

from .gates import exact_gate_scale

_LAYER = re.compile(r"\.layers\.(\d+)\.")
# MoE blocks whose forward reads its input only through sequence_parallel_chunk (vLLM 0.32
# qwen3_moe.py): the token order gathers just the rank's chunk for them
CHUNK_ONLY_BLOCKS = ("Qwen3MoeSparseMoeBlock",)


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

