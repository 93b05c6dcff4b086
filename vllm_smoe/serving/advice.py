"""Start-up advice: where the configuration cannot pay, why and what does."""

from __future__ import annotations

from .exchange.transports import locality_advice


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
