"""Everything a server checks of a placement before serving it, at start and before a live swap."""

from __future__ import annotations

from ..config import TABLE_PREDICTORS
from ..speculate.support import speculate_supported


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
    from ...formats.placement_file import load_tables
    from ..served import ServedPlacement, placement_for

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
