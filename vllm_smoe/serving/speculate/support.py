"""Can ``mode: speculate`` serve this model under this vLLM config? ``(ok, reason)`` checks that
need only configs (no torch, no model), so a server refuses before it loads anything. What needs
the built model (the MoE block chunks and all-gathers its own rows) is checked at load
(:func:`vllm_smoe.serving.speculate.seams.block_supported`), before the first step."""

from __future__ import annotations

from ...formats.model_info import num_experts
from ..config import TABLE_PREDICTORS

# vLLM's all2all backends that send each row only to the ranks holding its experts, so the token
# order saves bytes on them; all are in vLLM's own whitelist for sequence-parallel MoE
# (ParallelConfig.use_sequence_parallel_moe, vLLM 0.32).
ORDERED_BACKENDS = ("deepep_low_latency", "deepep_high_throughput", "deepep_v2", "flashinfer_nvlink_one_sided",
                    "mori_low_latency", "mori_high_throughput", "nixl_ep")
# DeepEP high-throughput kernels cannot be captured in CUDA graphs; vLLM turns graphs off for them
# only with DP > 1 (CompilationConfig.set_splitting_ops_for_v1)
UNCAPTURABLE_BACKENDS = ("deepep_high_throughput",)


def speculate_transport(parallel_config, device_type: str, all2all: str | None) -> tuple[bool, str]:
    """``(ok, reason)``: does the expert-parallel transport under speculate honour token order?
    device_type: vLLM's platform ("cpu", "cuda", "rocm", ...); all2all: smoe's ``all2all`` setting
    (None = the platform's default). On CPU smoe's sparse manager sends each row once per rank
    holding one of its experts (``vllm``: vLLM's allgather-reducescatter, kept as a baseline).
    Elsewhere the transport is vLLM's ``--all2all-backend``: its default allgather-reducescatter
    all-gathers every row to every rank whatever the order, so speculate would add traffic and
    save none."""
    if device_type == "cpu":
        return True, ""
    if all2all == "sparse":
        return False, (f"field 'all2all' = 'sparse': smoe's sparse manager runs on vLLM's CPU build only; on "
                       f"{device_type} the transport is vLLM's --all2all-backend (one of {', '.join(ORDERED_BACKENDS)})")
    backend = getattr(parallel_config, "all2all_backend", "allgather_reducescatter")
    if backend not in ORDERED_BACKENDS:
        return False, (f"--all2all-backend {backend} ignores token order (allgather-reducescatter sends every row to "
                       f"every rank; the others are not sequence parallel in vLLM), so speculate would add traffic "
                       f"and save none: serve with --all2all-backend deepep_low_latency (or one of "
                       f"{', '.join(b for b in ORDERED_BACKENDS if b != 'deepep_low_latency')}; DeepEP's install: "
                       f"docs/cuda.md), or use mode place")
    return True, ""


def speculate_supported(vllm_config, placement, predictor: str = "tables", all2all: str | None = None,
                        device_type: str | None = None) -> tuple[bool, str]:
    """placement: the parsed :class:`~vllm_smoe.formats.placement_file.Placement`; predictor, all2all: the
    configured ones; device_type: vLLM's platform (None = the current one). Speculate orders tokens
    over the tensor-parallel ranks around vLLM's expert-parallel, sequence-parallel MoE, so EP must
    be on, ep_size must equal the TP size and the transport must honour the order."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type
    hf = mc.hf_text_config
    tp = pc.tensor_parallel_size
    if not pc.enable_expert_parallel:
        return False, "needs --enable-expert-parallel (smoe orders tokens around vLLM's expert-parallel MoE)"
    if tp < 2:
        return False, f"needs --tensor-parallel-size >= 2 (got {tp}): tokens are ordered over the TP ranks"
    if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
        return False, ("pipeline and data parallel size must be 1 (with --data-parallel-size > 1 use mode place: "
                       "smoe then routes whole requests to DP ranks: docs/dp-routing.md)")
    if getattr(pc, "expert_placement_strategy", "linear") != "linear":
        return False, (f"--expert-placement-strategy {pc.expert_placement_strategy!r}: smoe's placement is applied "
                       f"by the load plan on top of vLLM's linear split; drop the flag")
    if pc.enable_eplb:
        return False, "--enable-eplb moves experts at run time; the placement would no longer hold"
    if getattr(pc, "use_ubatching", False):
        return False, ("micro-batching (--enable-dbo / ubatch_size > 1) runs two forwards of a step at once, but "
                       "the token order keeps one permutation per layer; serve without it")
    ok, reason = speculate_transport(pc, device_type, all2all)
    if not ok:
        return False, reason
    cc = getattr(vllm_config, "compilation_config", None)
    moe_split = [op for op in (getattr(cc, "splitting_ops", None) or []) if "moe_forward" in op]
    graphs = (getattr(getattr(cc, "cudagraph_mode", None), "name", "NONE") != "NONE"
              and not getattr(mc, "enforce_eager", False))
    if device_type != "cpu" and moe_split and graphs:
        # the router's Python would run between the replayed pieces, where the token order's own
        # op (which points vLLM's pad-row mask at its chunk's rows) replays without Python
        return False, (f"compilation_config.splitting_ops {moe_split} runs vLLM's MoE outside the CUDA graphs, "
                       f"while smoe's token order replays inside them; drop those ops (or --enforce-eager)")
    if placement.ep_size != tp:
        return False, (f"{placement.path}: field 'ep_size' = {placement.ep_size} but mode speculate splits the "
                       f"experts over the {tp} tensor-parallel ranks; build the placement with --ep-size {tp}")
    if (getattr(hf, "shared_expert_intermediate_size", 0) or 0) > 0:
        return False, ("shared experts: vLLM's Qwen3-MoE-style blocks keep them tensor-parallel, and its "
                       "sequence-parallel MoE skips their all-reduce, which vLLM only runs with DP > 1")
    E = num_experts(hf)
    if E % tp and device_type != "cpu":
        return False, (f"{E} experts do not split evenly over {tp} ranks, which vLLM's all2all backends (DeepEP "
                       f"and the others that keep token order) need; use mode place, or smoe's exchange on the CPU "
                       f"build")
    if placement.vocab_size is not None and placement.vocab_size < hf.vocab_size:
        return False, (f"{placement.path}: field 'model.vocab_size' = {placement.vocab_size} but the model has "
                       f"{hf.vocab_size} token ids")
    if predictor not in ("router", "one-rank") and (getattr(mc, "enable_prompt_embeds", False)
                                                     or getattr(mc, "is_multimodal_model", False)):
        what = "--enable-prompt-embeds" if getattr(mc, "enable_prompt_embeds", False) else "a multimodal model"
        return False, (f"predictor {predictor!r} predicts from token ids, but with {what} a step's rows may come "
                       f"as embeddings; use predictor 'router' (vLLM's gate on the rows) or mode place")
    if predictor in TABLE_PREDICTORS and placement.predictor is None:
        return False, (f"{placement.path}: field 'predictor' is empty but predictor {predictor!r} needs the tables "
                       f"(rebuild with smoe-place build{' --learned' if predictor == 'learned' else ''}, or set "
                       f"predictor 'router' / 'random' / 'one-rank')")
    return True, ""
