"""Reading the experts a FusedMoE routes each row to, through vLLM's own seams (its router's
capture function, its routing sink), for the recorder and the token order alike."""

from __future__ import annotations


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
    given the block's ``gate`` module (:func:`..speculate.seams.hookable_gate`), a forward hook on it that runs the
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
