"""Can ``mode: speculate`` serve this model under this vLLM config? ``(ok, reason)`` checks that
need only configs (no torch, no model), so a server refuses before it loads anything."""

from __future__ import annotations

from .model_info import num_experts

# architecture -> "module:class" of smoe's speculative model class
SPECULATE_MODELS = {
    "Qwen3MoeForCausalLM": "vllm_smoe.models.qwen3_moe:SmoeQwen3MoeForCausalLM",
    "MixtralForCausalLM": "vllm_smoe.models.mixtral:SmoeMixtralForCausalLM",
}


def speculate_supported(vllm_config, placement, predictor: str = "tables") -> tuple[bool, str]:
    """placement: the parsed :class:`~vllm_smoe.placement_file.Placement`; predictor: the
    configured one. The experts are split over the tensor-parallel ranks, so the placement's
    ep_size must equal the TP size."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    arch = mc.architecture
    if arch not in SPECULATE_MODELS:
        return False, f"architecture {arch} is not supported (supported: {', '.join(SPECULATE_MODELS)})"
    hf = mc.hf_text_config
    if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
        return False, "only tensor parallelism is supported (pipeline and data parallel size must be 1)"
    if pc.enable_expert_parallel:
        return False, ("drop --enable-expert-parallel: smoe splits the experts over the TP ranks itself, by the "
                       "placement")
    if vllm_config.quant_config is not None or mc.quantization is not None:
        return False, f"quantized models are not supported (quantization {mc.quantization!r})"
    if (getattr(hf, "shared_expert_intermediate_size", 0) or 0) > 0:
        return False, "shared experts are not supported"
    tp = pc.tensor_parallel_size
    if placement.ep_size != tp:
        return False, (f"{placement.path}: field 'ep_size' = {placement.ep_size} but mode speculate splits the "
                       f"experts over the {tp} tensor-parallel ranks; build the placement with --ep-size {tp}")
    E = num_experts(hf)
    if E % tp:
        return False, f"{E} experts do not split evenly over {tp} ranks"
    if placement.vocab_size is not None and placement.vocab_size < hf.vocab_size:
        return False, (f"{placement.path}: field 'model.vocab_size' = {placement.vocab_size} but the model has "
                       f"{hf.vocab_size} token ids")
    if predictor == "tables" and placement.predictor is None:
        return False, (f"{placement.path}: field 'predictor' is empty but predictor 'tables' needs the tables "
                       f"(rebuild with smoe-place build, or set predictor 'random' / 'one-rank')")
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() and not mc.enforce_eager:
        return False, ("on GPUs mode speculate needs --enforce-eager: the shuffle's sizes depend on the "
                       "predictions and cannot be captured in CUDA graphs")
    return True, ""
