"""Can ``mode: speculate`` serve this model under this vLLM config? ``(ok, reason)`` checks that
need only configs (no torch, no model), so a server refuses before it loads anything. What needs
the built model (the MoE block chunks and all-gathers its own rows) is checked at load
(:func:`vllm_smoe.serving.token_order.block_supported`), before the first step."""

from __future__ import annotations

from ..formats.model_info import num_experts
from .config import TABLE_PREDICTORS
from .transports import locality_advice

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
                       f"{', '.join(b for b in ORDERED_BACKENDS if b != 'deepep_low_latency')}; see the README's "
                       f"DeepEP install), or use mode place")
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
                       "smoe then routes whole requests to DP ranks, see the README)")
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


def monolithic(experts) -> bool:
    """Does this FusedMoE route inside its fused kernel? Then vLLM's router never runs its
    capture function (see :func:`set_capture`). vLLM 0.32's FusedMoE (``MoERunner``) says so in
    ``is_monolithic`` and keeps its quant method on ``routed_experts``; earlier layers held
    ``quant_method`` themselves."""
    flag = getattr(experts, "is_monolithic", None)
    if isinstance(flag, bool):
        return flag
    routed = getattr(experts, "routed_experts", experts)
    return bool(getattr(getattr(routed, "quant_method", None), "is_monolithic", False))


def _kernel(experts):
    """The fused-experts kernel of a FusedMoE, found the way vLLM's own routed-experts capturer
    finds it (``bind_routed_experts_capturer``), else its quant method (to name it)."""
    quant = getattr(getattr(experts, "routed_experts", experts), "quant_method", None)
    fused = getattr(getattr(getattr(quant, "moe_kernel", None), "impl", None), "fused_experts", None)
    return quant if fused is None else fused


def _replay_kernel(experts):
    """The monolithic kernel of ``experts`` when it writes the ids it routes to into vLLM's
    routing sink (``supports_routing_replay_capture``: FlashInfer's TRT-LLM kernels) and that
    sink holds this rank's rows only, else None."""
    fused = _kernel(experts)
    supports = getattr(fused, "supports_routing_replay_capture", None)
    if not (callable(supports) and supports()):
        return None
    cfg = fused.moe_config
    # under EP or DP the kernel's input (and so the sink) holds every rank's rows, gathered before it
    return None if getattr(cfg, "use_ep", False) or getattr(cfg, "dp_size", 1) > 1 else fused


def current_capture(experts):
    """The function :func:`set_capture` would replace (to chain it), None when there is none."""
    if not monolithic(experts):
        return getattr(experts.router, "capture_fn", None)
    sink = getattr(experts.routed_experts, "routing_sink", None)
    return None if sink is None else sink.capture_fn


def set_capture(experts, fn, who: str, gate=None) -> None:
    """Have ``fn(topk_ids)`` called with the router outputs ([n, K] int) each forward of this
    FusedMoE routes its rows to. A modular kernel: vLLM's router capture function. A monolithic
    one: vLLM's routing sink, which the kernel fills (vLLM's routed-experts capture takes the same
    seam), where the kernel supports it and holds only this rank's rows (no EP, DP = 1); else,
    given the block's ``gate`` module (:func:`.token_order.hookable_gate`), a forward hook on it that runs the
    router's pure routing step on the gate's rows and logits (one more top-k per layer: vLLM
    0.32's OAI Triton MXFP4 kernel, GPT-OSS's default on Hopper, routes inside and reports
    nothing); ValueError naming the kernel otherwise, rather than count or record nothing."""
    if not monolithic(experts):
        experts.router.set_capture_fn(fn)
        return
    fused = _replay_kernel(experts)
    if fused is not None:
        routed = experts.routed_experts
        if routed.routing_sink is None:
            from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsSink

            routed.routing_sink = RoutedExpertsSink(fused.moe_config, fn)
        else:
            routed.routing_sink.capture_fn = fn
        return
    if gate is not None:  # hookable_gate's: the router has a pure routing step
        router = experts.router

        def routed_ids(module, args, out):
            logits = out[0] if isinstance(out, tuple) else out  # vLLM's linear layers: (output, bias)
            fn(router._compute_routing(args[0], logits, None)[1])

        gate.register_forward_hook(routed_ids)
        return
    raise ValueError(f"{who}: the MoE kernel {type(_kernel(experts)).__name__} routes inside itself and reports no "
                     f"routing smoe can read here (vLLM's routing replay, with this rank's rows only); serve with "
                     f"a modular MoE backend (--moe-backend) for this mode, or with --enforce-eager, where smoe "
                     f"routes the block's gate output again")


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


def check_served_placement(path: str, cfg, vllm_config, snapshot=None):
    """Everything a server checks of a placement before serving it (at start and before a live
    swap): it fits the model and the parallel layout, its copies can be served, speculate can
    order tokens with it, its tables load. Returns it as a :class:`~.served.ServedPlacement`
    (with its load plan); raises ValueError naming the file and field. ``snapshot``: the file as
    read once (:class:`~vllm_smoe.formats.placement_file.Snapshot`; then ``path`` only names
    it); None: the placement this process serves (``path`` is ``cfg.placement``)."""
    from ..formats.placement_file import load_tables
    from .served import ServedPlacement, placement_for

    served = (ServedPlacement.from_snapshot(snapshot, vllm_config) if snapshot is not None
              else placement_for(cfg, vllm_config))
    placement, plan = served.placement, served.plan
    if plan.num_redundant:
        _check_replicas(path, vllm_config)
    if cfg.mode == "speculate":
        ok, reason = speculate_supported(vllm_config, placement, cfg.predictor, cfg.all2all)
        if not ok:
            raise ValueError(f"smoe mode speculate: {reason}")
        if cfg.predictor in TABLE_PREDICTORS and served.tables is None:
            load_tables(placement)  # no tables file: its own error, naming the field
        if cfg.predictor == "learned" and served.tables.learned is None:
            raise ValueError(f"{placement.predictor}: these tables hold no learned predictor, which predictor "
                             f"'learned' needs (rebuild {path} with smoe-place build --learned)")
    pc = vllm_config.parallel_config
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    # with TP > 1 a DP engine holds TP expert-parallel ranks, and the router scores engines: the
    # co-clustering must have put requests on engines first (one placement node per engine)
    if placement.method == "dp-coclust" and tp > 1 and placement.nodes != dp:
        raise ValueError(f"{path}: field 'nodes' = {placement.nodes}: with --tensor-parallel-size {tp} each of the "
                         f"{dp} DP engines holds {tp} expert-parallel ranks, and a --mode dp placement must put "
                         f"requests on engines first: build it with smoe-place build --mode dp --ep-size {tp * dp} "
                         f"--nodes {dp}")
    return served


def advice(vllm_config, cfg, device_type: str) -> list[str]:
    """Where the configuration cannot pay, why and what does (measured in BENCHMARKS.md; a
    placement against its all2all transport: :func:`.transports.locality_advice`): one line
    each, logged at start. Configs only; nothing is refused here. cfg: the SmoeConfig."""
    pc = vllm_config.parallel_config
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    local_dp = getattr(pc, "data_parallel_size_local", dp) or dp
    one_node = getattr(pc, "nnodes", 1) == 1 and local_dp >= dp
    out = []
    if cfg.mode == "speculate":
        if device_type == "cpu" and cfg.all2all == "vllm":
            out.append("mode speculate over vLLM's allgather-reducescatter (all2all: vllm): every row reaches every "
                       "rank whatever the order, so the order adds work and saves no bytes; drop all2all: vllm "
                       "(smoe's sparse exchange) or serve mode place")
        if tp == 2:
            out.append("mode speculate at 2 ranks: it makes more collectives per layer than plain TP's two "
                       "all-reduces, and at 2 ranks bytes save little (measured across two emulated nodes with the "
                       "shuffled reduce-scatter: 0.90x plain TP's wire bytes, 1.2-1.4x its TPOT); what pays at "
                       "this size is attention DP + EP with a DP placement and request routing (smoe-place build "
                       "--mode dp, --data-parallel-size, 0.52-0.55x vLLM DP+EP's bytes) or mode place")
        elif one_node:
            out.append("mode speculate on one node: the exchange runs over shared memory, where each collective is "
                       "latency bound, so it saves bytes that cost little (measured 1.2-1.4x plain TP per token on "
                       "the CPU build); it is meant for slow expert-parallel links (across nodes); here mode place "
                       "serves the same tokens at vLLM's speed")
        seqs = getattr(vllm_config.scheduler_config, "max_num_seqs", None)
        if seqs is not None and seqs < tp:
            out.append(f"--max-num-seqs {seqs} < {tp} ranks: every decode step has fewer tokens than ranks, so the "
                       f"static order cannot move a decode token")
    else:  # a placement's locality against what carries the rows (transports.py)
        out += locality_advice(vllm_config, cfg, device_type)
    return out
