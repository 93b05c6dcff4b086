"""Can ``mode: speculate`` serve this model under this vLLM config? ``(ok, reason)`` checks that
need only configs (no torch, no model), so a server refuses before it loads anything. What needs
the built model (the MoE block chunks and all-gathers its own rows) is checked at load
(:func:`vllm_smoe.serving.token_order.block_supported`), before the first step."""

from __future__ import annotations

from ..model_info import num_experts


def speculate_supported(vllm_config, placement, predictor: str = "tables") -> tuple[bool, str]:
    """placement: the parsed :class:`~vllm_smoe.placement_file.Placement`; predictor: the
    configured one. Speculate orders tokens over the tensor-parallel ranks around vLLM's
    expert-parallel, sequence-parallel MoE, so EP must be on and ep_size must equal the TP size."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    hf = mc.hf_text_config
    tp = pc.tensor_parallel_size
    if not pc.enable_expert_parallel:
        return False, "needs --enable-expert-parallel (smoe orders tokens around vLLM's expert-parallel MoE)"
    if tp < 2:
        return False, f"needs --tensor-parallel-size >= 2 (got {tp}): tokens are ordered over the TP ranks"
    if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
        return False, ("pipeline and data parallel size must be 1 (with --data-parallel-size > 1 use mode place: "
                       "smoe then routes whole requests to DP ranks, see the README)")
    if getattr(pc, "expert_placement_strategy", "linear") != "linear":
        return False, (f"--expert-placement-strategy {pc.expert_placement_strategy!r}: smoe's placement is applied "
                       f"by the load plan on top of vLLM's linear split; drop the flag")
    if pc.enable_eplb:
        return False, "--enable-eplb moves experts at run time; the placement would no longer hold"
    if placement.ep_size != tp:
        return False, (f"{placement.path}: field 'ep_size' = {placement.ep_size} but mode speculate splits the "
                       f"experts over the {tp} tensor-parallel ranks; build the placement with --ep-size {tp}")
    if (getattr(hf, "shared_expert_intermediate_size", 0) or 0) > 0:
        return False, ("shared experts: vLLM's Qwen3-MoE-style blocks keep them tensor-parallel, and its "
                       "sequence-parallel MoE skips their all-reduce, which vLLM only runs with DP > 1")
    E = num_experts(hf)
    if E % tp:
        return False, f"{E} experts do not split evenly over {tp} ranks"
    if placement.vocab_size is not None and placement.vocab_size < hf.vocab_size:
        return False, (f"{placement.path}: field 'model.vocab_size' = {placement.vocab_size} but the model has "
                       f"{hf.vocab_size} token ids")
    if predictor.startswith("tables") and placement.predictor is None:
        return False, (f"{placement.path}: field 'predictor' is empty but predictor 'tables' needs the tables "
                       f"(rebuild with smoe-place build, or set predictor 'router' / 'random' / 'one-rank')")
    return True, ""
