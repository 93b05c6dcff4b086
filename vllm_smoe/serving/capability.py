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


def _check_replicas(placement: str, vllm_config) -> None:
    """A placement with replicas serves only where each MoE row is routed on exactly one rank
    (which then picks its own copy) and nothing moves experts at run time."""
    pc = vllm_config.parallel_config
    if vllm_config.speculative_config is not None or pc.pipeline_parallel_size > 1:
        raise ValueError(f"{placement}: field 'layers[].replicas': copies are not supported with speculative "
                         f"decoding or pipeline parallelism yet; build the placement without --replicas")
    if pc.enable_eplb:
        raise ValueError(f"{placement}: field 'layers[].replicas': --enable-eplb rearranges experts at run time, "
                         f"which would undo smoe's copies; drop --enable-eplb or build without --replicas")
    if pc.tensor_parallel_size > 1 and not pc.use_sequence_parallel_moe:
        raise ValueError(f"{placement}: field 'layers[].replicas': with --tensor-parallel-size "
                         f"{pc.tensor_parallel_size} every rank routes every row, so copies would compute a token "
                         f"twice; serve replicas with mode speculate (rows split over the TP ranks) or with "
                         f"--data-parallel-size and TP 1, or build without --replicas")


def check_served_placement(path: str, cfg, vllm_config):
    """Everything a server checks of a placement before serving it (at start and before a live
    swap): it fits the model and the parallel layout, its copies can be served, speculate can
    order tokens with it, its tables load. Returns its :class:`~.load_plan.LoadPlan`; raises
    ValueError naming the file and field."""
    from ..placement_file import load_placement, load_tables
    from .load_plan import plan_for

    plan = plan_for(path, vllm_config)
    if plan.num_redundant:
        _check_replicas(path, vllm_config)
    placement = load_placement(path)
    if cfg.mode == "speculate":
        ok, reason = speculate_supported(vllm_config, placement, cfg.predictor)
        if not ok:
            raise ValueError(f"smoe mode speculate: {reason}")
        if cfg.predictor.startswith("tables"):
            load_tables(placement)  # everything a worker will index with, before any worker starts
    pc = vllm_config.parallel_config
    if placement.method == "dp-coclust" and pc.tensor_parallel_size > 1:
        raise ValueError(f"{path}: field 'method' = dp-coclust: placements from smoe-place build --mode dp put one "
                         f"expert-parallel rank on each DP rank (TP = 1), but --tensor-parallel-size is "
                         f"{pc.tensor_parallel_size}")
    return plan
