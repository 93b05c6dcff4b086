"""What carries a server's expert-parallel rows, and whether tokens sitting with their experts
move fewer bytes on it. A placement and DP routing raise the share of a token's experts on its
own rank; only a transport that sends a row per destination rank turns that into fewer bytes.
Read from vLLM 0.32.0's sources (paths under ``vllm/``); bytes per backend are projected by
``smoe-place evaluate --cluster`` (placement/a2a_cost.py, docs/cluster-model.md)."""

from __future__ import annotations

from dataclasses import dataclass

PER_DESTINATION = "per-destination"  # a row goes only to the ranks holding its experts
EVERY_ROW = "every-row"  # every row reaches every expert-parallel rank
FIXED_SLOTS = "fixed-slots"  # a fixed number of rows per rank, whatever the routing
IN_KERNEL = "in-kernel"  # the MoE kernel dispatches itself; smoe cannot see what it sends

A2A = "distributed/device_communicators/all2all.py"
PF = "model_executor/layers/fused_moe/prepare_finalize"


@dataclass(frozen=True)
class Transport:
    moves: str
    model: str | None  # its name in placement/a2a_cost.py's BACKENDS, where the cost model has it
    source: str


# keys: vLLM's --all2all-backend values (config/parallel.py l.44-59), and smoe's CPU exchange.
# "Per destination" is where vLLM hands the library the top-k ids to dispatch by; what the
# library then sends was read for DeepEP only (docs/cluster-model.md, "Byte rules").
TRANSPORTS = {
    "allgather_reducescatter": Transport(EVERY_ROW, "allgather-rs", f"{A2A} l.67-172: AgRsAll2AllManager, dispatch "
                                         f"= all_gatherv of every row, combine = reduce_scatterv; the default, "
                                         f"config/parallel.py l.219"),
    "naive": Transport(EVERY_ROW, "allgather-rs", "config/parallel.py l.533-539: removed, falls back to "
                       "allgather_reducescatter"),
    "pplx": Transport(EVERY_ROW, "allgather-rs", "config/parallel.py l.533-539: removed, falls back to "
                      "allgather_reducescatter"),
    "deepep_high_throughput": Transport(PER_DESTINATION, "deepep-ht", f"{A2A} l.267; {PF}/deepep_ht.py l.134-160 "
                                        f"(get_dispatch_layout, dispatch by topk_idx)"),
    "deepep_low_latency": Transport(PER_DESTINATION, "deepep-ll", f"{A2A} l.326; {PF}/deepep_ll.py l.294 "
                                    f"(low_latency_dispatch by topk ids)"),
    "deepep_v2": Transport(PER_DESTINATION, None, f"{A2A} l.1106 (DeepEP v2 ElasticBuffer); {PF}/deepep_v2.py "
                           f"l.215-217 (dispatch by topk_idx)"),
    "mori_high_throughput": Transport(PER_DESTINATION, None, f"{A2A} l.995; {PF}/mori.py l.108 (dispatch by "
                                      f"topk_ids)"),
    "mori_low_latency": Transport(PER_DESTINATION, None, f"{A2A} l.995; {PF}/mori.py l.108 (dispatch by topk_ids)"),
    "nixl_ep": Transport(PER_DESTINATION, None, f"{A2A} l.436; {PF}/nixl_ep.py l.250-253 (dispatch by topk ids)"),
    "flashinfer_nvlink_two_sided": Transport(PER_DESTINATION, None, f"{A2A} l.662; {PF}/flashinfer_nvlink_two_sided"
                                             f".py l.149-180 (mnnvl_moe_alltoallv planned from topk_ids)"),
    "flashinfer_all2allv": Transport(PER_DESTINATION, None, "config/parallel.py l.55: alias of "
                                     "flashinfer_nvlink_two_sided"),
    "flashinfer_nvlink_one_sided": Transport(PER_DESTINATION, None, f"{A2A} l.767; {PF}/flashinfer_nvlink_one_"
                                             f"sided.py l.121-122 (dispatch by token_selected_experts)"),
    "moonep": Transport(FIXED_SLOTS, None, f"{A2A} l.1197-1209: every rank receives S x K slots whatever the "
                        f"routing, with redundant experts planned at run time"),
    "passthrough": Transport(IN_KERNEL, None, "config/kernel.py l.193-221: the FlashInfer MoE-EP megakernels "
                             "dispatch and combine themselves"),
    # vLLM's CPU build keeps allgather_reducescatter whatever is asked
    # (distributed/device_communicators/cpu_communicator.py l.56-69); smoe's communicator puts its
    # own manager there unless told all2all: vllm (serving/cpu_ep.py)
    "smoe_sparse": Transport(PER_DESTINATION, "smoe-p2p", "vllm_smoe/serving/sparse_a2a.py: one row per (token, "
                             "remote rank); smoe-hier where a node holds several ranks"),
}


def served_transport(parallel_config, device_type: str, all2all: str | None, mode: str) -> str | None:
    """The key of :data:`TRANSPORTS` (or vLLM's unknown backend name) that carries this server's
    MoE rows between expert-parallel ranks; None where no all2all runs. vLLM runs one when EP is
    on and DP > 1, or MoE is sequence parallel (smoe's speculate turns that on at DP = 1), or
    prefill context parallelism is on (``ParallelConfig.use_all2all``, config/parallel.py l.784);
    otherwise every rank routes every row and the MoE output is all-reduced."""
    pc = parallel_config
    if not pc.enable_expert_parallel:
        return None
    if not (pc.data_parallel_size > 1 or mode == "speculate" or getattr(pc, "prefill_context_parallel_size", 1) > 1):
        return None
    if device_type == "cpu":
        return "allgather_reducescatter" if all2all == "vllm" else "smoe_sparse"
    return getattr(pc, "all2all_backend", "allgather_reducescatter")


def _evaluate(cfg, backends: str) -> str:
    return (f"smoe-place evaluate --trace REC --placement {cfg.placement} --cluster h100x8-ndr400 --backend "
            f"{backends} (REC: a recording of this traffic; any shipped cluster or a YAML) shows the bytes each "
            f"moves (docs/cluster-model.md)")


def locality_advice(vllm_config, cfg, device_type: str) -> list[str]:
    """Where a placement (or DP routing) saves no all-to-all bytes on this layout's transport:
    one line each, with the transports that would. Mode place and record; speculate over a
    transport that ignores order is refused instead (:func:`.capability.speculate_transport`)."""
    pc = vllm_config.parallel_config
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    if cfg.placement is None or not pc.enable_expert_parallel or cfg.mode == "speculate":
        return []
    cpu = device_type == "cpu"
    if cpu:
        better = "smoe's sparse exchange" + (" (drop --smoe-all2all vllm)" if cfg.all2all == "vllm" else "")
    else:
        better = ("a per-destination --all2all-backend: deepep_high_throughput (prefill-heavy) or "
                  "deepep_low_latency (decode)")
    key = served_transport(pc, device_type, cfg.all2all, cfg.mode)
    if key is None:
        if tp == 1 and dp == 1:
            return []  # one expert-parallel rank: nothing moves
        return [f"a placement at TP {tp} + EP with DP = 1: there is no all-to-all to shrink (vLLM routes every row "
                f"on every rank and all-reduces the MoE output), so the expert order changes which rank computes, "
                f"not what crosses the link (it still sets each rank's expert load); locality pays with "
                f"--data-parallel-size > 1 and request routing over {better}, or with mode speculate across nodes"]
    t = TRANSPORTS.get(key)
    what = "the placement and DP routing save" if cfg.dp_routing and dp > 1 else "the placement saves"
    name = "--smoe-all2all vllm (vLLM's allgather_reducescatter)" if cpu else f"--all2all-backend {key}"
    if key in ("naive", "pplx") and not cpu:
        name += " (removed: vLLM serves allgather_reducescatter)"
    models = "allgather-rs,smoe-p2p" if cpu else "allgather-rs,deepep-ht,deepep-ll"
    if t is None:
        return [f"--all2all-backend {key!r} is unknown to smoe, so what a placement saves on it is unknown; "
                f"{better} would save bytes; {_evaluate(cfg, models)}"]
    if t.moves == PER_DESTINATION:
        if dp > 1 and not cfg.dp_routing:
            return ["--smoe-dp-routing off: requests land on DP ranks by vLLM's load balancer, so a DP placement's "
                    "locality is left to chance (measured with routing: 0.61-0.67 of activations local at DP=2)"]
        return []
    # the reordering is lossless, and which rank computes which expert is all it changes here
    load = "(the reordering still sets each rank's expert load)"
    if t.moves == EVERY_ROW:
        why = f"{name} at DP {dp}: every MoE row reaches every expert-parallel rank whatever its experts"
    elif t.moves == FIXED_SLOTS:
        why = (f"{name}: every rank receives a fixed number of rows whatever the routing, and it plans redundant "
               f"experts at run time")
    else:
        return [f"{name}: the MoE kernel dispatches rows itself and smoe cannot see which, so whether the placement "
                f"saves all-to-all bytes here is unknown; {better} would save them; {_evaluate(cfg, models)}"]
    return [f"{why}, so {what} no all-to-all bytes here {load}; {better} would save them; "
            f"{_evaluate(cfg, models)}"]
