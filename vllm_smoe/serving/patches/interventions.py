"""smoe's changes to vLLM's behaviour that replace no symbol, listed beside :data:`PATCHES`.

A patch replaces a vLLM function; these change a value vLLM reads (an attribute of one of its
modules, a field of its forward context or MoE config), read vLLM's code as text, or hook its
modules. Each is an :class:`Intervention`: what changes, which smoe module does it, why, the
upstream issue, what vLLM would need to offer for it to go, and the facts about vLLM it relies
on as :class:`Check` s, tested at start for the modes that make it (:func:`mismatches`, run by
the plugin beside the patches' check) and in CI against the installed vLLM.

A check of a vLLM *model's* code (``model=True``) only says that smoe would refuse to order
that model; the model actually served is checked again at load, so it is logged, not refused.

To remove an intervention: delete its code and its entry; ``tests/unit/test_patches.py`` checks
that each listed ``where`` still names a module that exists.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass

from . import SUPPORTED_VLLM, _params, _resolve

logger = logging.getLogger("vllm.smoe")


@dataclass(frozen=True)
class Check:
    """One fact about vLLM an intervention relies on. target: ``module:Qualname`` (a class,
    function or method); ``attr``: an attribute or dataclass field it must have; ``source``:
    strings its source must contain; ``params``: its parameter names (as inspect gives them)."""
    target: str
    attr: str = ""
    source: tuple[str, ...] = ()
    params: tuple[str, ...] | None = None
    model: bool = False  # a model's code: logged, the served model is checked again at load

    def failure(self) -> str:
        """'' when the fact holds in this vLLM, else the line naming what differs."""
        try:
            owner, name = _resolve(self.target)
            obj = getattr(owner, name)
        except (ImportError, AttributeError) as e:
            return f"{self.target}: not in this vLLM ({type(e).__name__})"
        if self.attr and not (hasattr(obj, self.attr) or (dataclasses.is_dataclass(obj) and self.attr in
                                                            {f.name for f in dataclasses.fields(obj)})):
            return f"{self.target} has no attribute {self.attr!r}"
        if self.source:
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                return f"{self.target}: its source cannot be read"
            missing = [s for s in self.source if s not in src]
            if missing:
                return f"{self.target}'s source no longer contains {missing}"
        if self.params is not None and _params(obj) != self.params:
            return f"{self.target} has parameters {_params(obj)}, smoe was written for {self.params}"
        return ""


@dataclass(frozen=True)
class Intervention:
    id: str
    what: str  # the change, as docs/patches.md's table names it
    where: str  # smoe's module that makes it (relative to vllm_smoe/serving/)
    why: str
    upstream: str
    remove: str  # what vLLM would need to offer for it to go
    modes: tuple[str, ...]  # smoe modes (config ``mode``; "record" also: any mode with ``record`` set)
    checks: tuple[Check, ...] = ()
    checked_on: tuple[str, ...] = SUPPORTED_VLLM[:1]  # releases whose code the checks were run on


_QWEN3 = "vllm.model_executor.models.qwen3_moe"
_DEEPSEEK = "vllm.model_executor.models.deepseek_v2"

INTERVENTIONS: tuple[Intervention, ...] = (
    Intervention(
        id="attention_reduce_results",
        what="each ordered MoE layer's attention `o_proj.reduce_results` set to False (its all-reduce skipped)",
        where="speculate/seams.py (shuffle_seams), speculate/layout_block.py (ShuffledOrder.hook)",
        why="the shuffled reduce-scatter sums the attention's partial rows already in the token order where "
            "vLLM would all-reduce them: half the attention's bytes and no collective more",
        upstream="none filed",
        remove="vLLM's sequence-parallel MoE layers reduce-scatter the attention output into the block's chunks "
               "in an order a plugin may choose",
        modes=("speculate",),
        checks=(Check("vllm.model_executor.layers.linear:RowParallelLinear.forward",
                      source=("self.reduce_results",)),),
    ),
    Intervention(
        id="forward_context_is_padding",
        what="the forward context's `is_padding` during each speculate MoE block, from the order to its restore",
        where="speculate/token_order.py (_mark_padding)",
        why="vLLM's routers mask chunk row j by the step's row j, wrong once smoe orders the rows (CUDA's top-k "
            "kernels with VLLM_MOE_SKIP_PADDING); smoe points the mask at its chunk rows' own pad flags",
        upstream="none filed",
        remove="vLLM's sequence-parallel routers take their chunk's own rows of the mask",
        modes=("speculate",),
        checks=(Check("vllm.forward_context:ForwardContext", attr="is_padding"),
                Check("vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router:_get_padding_mask",
                      source=("is_padding[:num_tokens]",))),
    ),
    Intervention(
        id="one_row_gather",
        what="a one-token step's split rows all-gathered by smoe before each DeepSeek-family decoder layer "
             "and the final norm (stack order)",
        where="speculate/layout_stack.py (_one_row_layer, _one_row_final)",
        why="vLLM asks 'are my rows split?' as rows != positions.shape[0], false for one token, so the split "
            "row is taken as the whole step and the other ranks attend over padding",
        upstream="none filed",
        remove="vLLM's DeepSeek-family layers tell a split step from a whole one by a flag, not a row count",
        modes=("speculate",),
        checks=(Check(f"{_DEEPSEEK}:DeepseekV2DecoderLayer.forward", source=("!= full_num_tokens",), model=True),),
    ),
    Intervention(
        id="model_source",
        what="vLLM's model code read as text (`inspect.getsource`) to decide whether speculate can order a "
             "block, a decoder layer or a stack",
        where="speculate/seams.py (block_supported, stack_supported, shuffle_seams, exact_router_seams)",
        why="smoe orders rows around vLLM's own blocks without model code; only the code says whether a block "
            "chunks and all-gathers its rows itself or its layer splits them",
        upstream="none filed",
        remove="vLLM's MoE blocks and decoder layers declare their row layout (chunked in the block, split by "
               "the layer, residual handling) as attributes",
        modes=("speculate",),
        checks=(Check(f"{_QWEN3}:Qwen3MoeSparseMoeBlock.forward", source=("sequence_parallel_chunk(", "all_gather("),
                      model=True),
                Check(f"{_QWEN3}:Qwen3MoeDecoderLayer.forward", model=True,
                      source=("self.post_attention_layernorm(hidden_states, residual)", "self.mlp(hidden_states)",
                              "residual = hidden_states", "self.input_layernorm(hidden_states, residual)")),
                Check(f"{_DEEPSEEK}:DeepseekV2DecoderLayer.forward", model=True,
                      source=("already_sequence_parallel=True", "tensor_model_parallel_reduce_scatter("))),
    ),
    Intervention(
        id="forward_hooks",
        what="forward hooks on vLLM's modules (the model, MoE blocks, FusedMoE, attention, norms, decoder "
             "layers) that put smoe's custom ops into the forward",
        where="speculate/layout_block.py, speculate/layout_stack.py (each layout's hook)",
        why="the token order changes only the order of rows around vLLM's computation; hooks need no model code",
        upstream="none filed",
        remove="a vLLM seam to order a sequence-parallel MoE block's rows (a chunk permutation it applies and undoes)",
        modes=("speculate",),
        # what the hooks rely on is each model's layout, checked per model at load (model_source)
    ),
    Intervention(
        id="moe_max_num_tokens",
        what="each sequence-parallel FusedMoE's `moe_config.max_num_tokens` under speculate over "
             "`deepep_low_latency` / `nixl_ep`, capped to a rank's chunk (ceil(T / TP), a multiple of 4) before "
             "vLLM builds the MoE kernels",
        where="speculate/moe_buffers.py, applied by place/loader.py",
        why="vLLM sizes DeepEP's low-latency buffer and the batched experts' workspace by the step's token "
            "budget, though a sequence-parallel rank routes only its chunk (DeepSeek-V3 at EP 8: 122 + 39 GB)",
        upstream="vLLM sizes sequence-parallel MoE buffers by the chunk (vLLM PR #55105 does it for DeepEP v2)",
        remove="vLLM sizing sequence-parallel MoE buffers by the chunk for every backend",
        modes=("speculate",),
        checks=(Check("vllm.model_executor.layers.fused_moe.config:FusedMoEConfig", attr="max_num_tokens"),),
    ),
    Intervention(
        id="gate_routing_hook",
        what="a forward hook on a MoE block's gate that runs the router's `_compute_routing` again, where the "
             "kernel routes inside itself and reports nothing",
        where="record/capture.py (set_capture)",
        why="recording and speculate's counters need each row's experts; a monolithic kernel (OAI Triton MXFP4) "
            "gives neither vLLM's router capture nor its routing sink",
        upstream="none filed",
        remove="every monolithic MoE kernel fills vLLM's routing sink",
        modes=("record", "speculate"),
        checks=(Check("vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter._compute_routing",
                      params=("self", "hidden_states", "router_logits", "indices_type", "input_ids")),),
    ),
    Intervention(
        id="metrics_route",
        what="the `GET /metrics` route, only with several API servers (`PROMETHEUS_MULTIPROC_DIR`), through "
             "the endpoint plugin's route override",
        where="endpoints.py, observe/metrics.py",
        why="vLLM serves a per-process multiprocess registry there, which no plugin collector reaches",
        upstream="none filed",
        remove="vLLM lets plugins add collectors to the registry it serves",
        modes=("place", "record", "speculate"),
    ),
    Intervention(
        id="health_route",
        what="the `GET /health` route, through the endpoint plugin's route override: vLLM's own check, then "
             "503 while a live swap's move is past its deadline or has failed",
        where="endpoints.py, place/swap.py",
        why="vLLM's /health asks the engine only, which reads healthy while its weights are half-moved",
        upstream="none filed",
        remove="vLLM lets a plugin add a reason to /health",
        modes=("place", "record", "speculate"),
        checks=(Check("vllm.entrypoints.serve.instrumentator.health:health", params=("raw_request",)),),
    ),
)


def modes_of(cfg) -> set[str]:
    """The intervention modes a SmoeConfig makes: its mode, plus "record" when it records."""
    return {cfg.mode} | ({"record"} if getattr(cfg, "record", None) else set())


def mismatches(modes, models: bool = False) -> list[str]:
    """One line per fact an intervention of ``modes`` relies on that this vLLM does not hold,
    naming the intervention; with ``models``, the facts about vLLM's model code too (logged by
    the plugin, since the served model is checked again at load)."""
    out = []
    for iv in INTERVENTIONS:
        if not set(iv.modes) & set(modes):
            continue
        for c in iv.checks:
            if c.model and not models:
                continue
            line = c.failure()
            if line:
                out.append(f"{iv.id} ({iv.where}): {line}")
    return out


def model_mismatches(modes) -> list[str]:
    """The lines of :func:`mismatches` about vLLM's model code only."""
    every, general = mismatches(modes, models=True), set(mismatches(modes))
    return [line for line in every if line not in general]
