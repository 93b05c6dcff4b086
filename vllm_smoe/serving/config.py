"""smoe's settings: one frozen object, parsed and validated once from ``additional_config``.

Sources, all ending in ``vllm_config.additional_config["smoe"]`` (which vLLM ships to every
process): ``vllm serve M --plugin smoe --smoe-placement P ...``, ``--additional-config
'{"smoe": {...}}'``, or ``LLM(..., additional_config={"smoe": {...}})``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from ..formats.bounded import short

MODES = ("place", "record", "speculate")


class SmoeSettingsError(ValueError):
    """A smoe setting (flag, additional_config field or a file it names) that cannot serve:
    ``vllm serve`` prints it as one line and exits 2 (:mod:`vllm_smoe.serving.plugin`)."""
_KEYS = ("mode", "placement", "placement_dirs", "record", "log_interval", "record_chunk_tokens", "predictor", "all2all", "dp_routing",
         "metrics_dir", "drift_threshold", "record_sample", "record_max_mb", "metrics", "reduce_scatter", "hierarchical",
         "stack_order", "auto_replace")
PREDICTORS = ("tables", "tables-markov", "learned", "router", "input-gate", "random", "one-rank")  # online token -> rank predictors (vllm_smoe.serving.speculate.predictors)
TABLE_PREDICTORS = ("tables", "tables-markov", "learned", "input-gate")  # those that read the placement's tables file
ALL2ALL = ("sparse", "vllm")
REDUCE_SCATTER = ("auto", "on", "off")  # speculate's shuffled reduce-scatter (SmoeConfig.reduce_scatter)
HIERARCHICAL = ("auto", "on", "off")  # the sparse all2all over nodes (SmoeConfig.hierarchical)
STACK_ORDERS = ("layer", "step")  # speculate on the DeepSeek family (SmoeConfig.stack_order)


@dataclass(frozen=True)
class SmoeConfig:
    """mode: ``place`` (apply a placement at load, if one is given; with none, smoe only fixes
    vLLM's CPU expert parallelism), ``record`` (write routing traces; a placement may be applied
    too), ``speculate`` (token order by predicted rank around vLLM's sequence-parallel MoE).
    placement: YAML from ``smoe-place build``; placement_dirs: directories a live swap
    (``POST /smoe/placement``) takes files from, resolved: the placement's own directory and those
    given (each must exist, checked at start);
    record: directory for trace chunks;
    log_interval: seconds between log lines; record_chunk_tokens: tokens per file;
    predictor: speculate's token -> rank predictor (every rank then takes exactly the
    ceil(T / N) rows of vLLM's sequence-parallel chunk: capacity 1.0); all2all: the expert-
    parallel all2all manager on vLLM's CPU build (``sparse`` = smoe's, the default there; ``vllm``
    = vLLM's allgather-reducescatter); None = the platform's default. On CUDA the transport is
    vLLM's ``--all2all-backend`` and ``sparse`` is refused (it would do nothing);
    dp_routing: with DP > 1 and a placement with tables, route each request to the DP engine its
    prompt's tokens score best (:mod:`vllm_smoe.serving.dp.router`); False = vLLM's balancer.
    metrics_dir: where workers publish their counters for ``/metrics`` once per log interval
    (:mod:`vllm_smoe.serving.observe.metrics`); the server makes a fresh one when none is given.
    drift_threshold: warn (and set ``smoe:drift``) when a window's local activation ratio falls
    below this share of the placement's own (its YAML's ``metrics.lar``).
    record_sample: share of requests recorded (whole requests, chosen by a hash of vLLM's
    request id), with ``record`` in any mode; record_max_mb: disk budget of the record
    directory's trace files, oldest removed first (None = no limit). metrics: False publishes
    nothing for /metrics and turns off speculate's device counters, log line and drift (the
    sparse all2all's own counters keep counting). reduce_scatter: speculate, where the decoder
    layer's seams allow it (:func:`vllm_smoe.serving.speculate.seams.shuffle_seams`): the attention
    output's all-reduce becomes a reduce-scatter of its rows already in the token order (s-MoE's
    shuffled reduce-scatter, half the attention's bytes over a network): ``auto`` where the
    tensor-parallel group spans nodes (within one, shared memory and NVLink's one-shot
    all-reduces cost no less), ``on`` wherever the seams allow, ``off`` never. hierarchical: the
    sparse all2all where a node holds more than one expert-parallel rank: a row crosses to another
    node once per node and fans out inside it (:class:`vllm_smoe.serving.exchange.sparse_a2a.SparseExchange`);
    ``auto`` where the exchange runs point to point (a network), ``on`` wherever a node holds more
    than one rank, ``off`` never (each row to each rank that needs it). stack_order: speculate on
    models whose decoder layers keep the rows split between layers (the DeepSeek family):
    ``layer`` orders each MoE layer's rows by its own prediction, the split residual folded into
    the attention's partial sums before the layer's reduce-scatter; ``step`` one order for the
    whole step (where ``layer`` cannot run, speculate takes ``step`` and its start line says why)."""

    mode: str = "place"
    placement: str | None = None
    placement_dirs: tuple[str, ...] | None = None
    record: str | None = None
    log_interval: float = 10.0
    record_chunk_tokens: int = 1 << 18
    predictor: str = "tables"
    all2all: str | None = None
    dp_routing: bool = True
    metrics_dir: str | None = None
    drift_threshold: float = 0.8
    record_sample: float = 1.0
    record_max_mb: float | None = None
    metrics: bool = True
    reduce_scatter: str = "auto"
    hierarchical: str = "auto"
    stack_order: str = "layer"
    auto_replace: "AutoSettings | None" = None  # noqa: F821 (place.auto's, imported where parsed)

    @property
    def needs_loader(self) -> bool:
        return self.placement is not None or self.record is not None

    def to_dict(self) -> dict:
        skip = (("predictor", "reduce_scatter", "stack_order") if self.mode != "speculate" else ()) + (
            ("record_sample",) if self.record is None else ())
        d = {k: v for k, v in asdict(self).items() if v is not None and k not in skip}
        if "placement_dirs" in d:  # JSON has lists, not tuples
            d["placement_dirs"] = list(d["placement_dirs"])
        return d

    @classmethod
    def from_dict(cls, d: object, where: str = "additional_config['smoe']") -> "SmoeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {', '.join(_KEYS)}")
        # a record directory always records: with a placement too (routing is mapped back to
        # logical experts), never silently ignored
        for key in ("placement", "record"):  # before the mode is inferred from them
            v = d.get(key)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{where}: field '{key}' must be a path, got {v!r}")
        mode = d.get("mode", "record" if d.get("record") else "place")
        if mode not in MODES:
            raise ValueError(f"{where}: field 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
        if d.get("record") is not None and mode == "place":
            raise ValueError(f"{where}: field 'record' is given but mode is 'place': mode 'record' applies a "
                             f"placement as well; drop the mode or set it to 'record'")
        placement = d.get("placement")
        record = d.get("record")
        if mode == "speculate" and placement is None:
            raise ValueError(f"{where}: mode 'speculate' needs field 'placement' (a YAML from smoe-place build)")
        if mode != "speculate":
            given = [k for k in ("predictor", "reduce_scatter", "stack_order") if k in d]
            if given:
                raise ValueError(f"{where}: field(s) {given} only apply to mode 'speculate', not {mode!r}")
        dirs = d.get("placement_dirs")
        if dirs is not None and (not isinstance(dirs, list) or not dirs
                                 or not all(isinstance(x, str) and x for x in dirs)):
            raise ValueError(f"{where}: field 'placement_dirs' must be a non-empty list of directories, got "
                             f"{short(dirs)}")
        if dirs is not None and placement is None:
            raise ValueError(f"{where}: field 'placement_dirs' is given but field 'placement' is not (live swaps "
                             f"replace a served placement)")
        if placement:  # those given add to the served placement's own directory
            own = os.path.realpath(os.path.dirname(os.path.abspath(placement)))
            dirs = tuple(dict.fromkeys([*(os.path.realpath(x) for x in dirs or ()), own]))
        predictor = d.get("predictor", "tables")
        if predictor not in PREDICTORS:
            raise ValueError(f"{where}: field 'predictor' must be one of {', '.join(PREDICTORS)}, got {predictor!r}")
        all2all = d.get("all2all")
        if all2all is not None and all2all not in ALL2ALL:
            raise ValueError(f"{where}: field 'all2all' must be one of {', '.join(ALL2ALL)}, got {all2all!r}")
        dp_routing = d.get("dp_routing", True)
        if not isinstance(dp_routing, bool):
            raise ValueError(f"{where}: field 'dp_routing' must be true or false, got {dp_routing!r}")
        if mode == "record" and record is None:
            raise ValueError(f"{where}: mode 'record' needs field 'record' (a directory for traces)")
        interval = d.get("log_interval", 10.0)
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not interval > 0 \
                or interval == float("inf"):
            raise ValueError(f"{where}: field 'log_interval' must be a positive number, got {interval!r}")
        metrics = d.get("metrics", True)
        if not isinstance(metrics, bool):
            raise ValueError(f"{where}: field 'metrics' must be true or false, got {metrics!r}")
        reduce_scatter = d.get("reduce_scatter", "auto")
        if reduce_scatter not in REDUCE_SCATTER:
            raise ValueError(f"{where}: field 'reduce_scatter' must be one of {', '.join(REDUCE_SCATTER)}, got "
                             f"{reduce_scatter!r}")
        hierarchical = d.get("hierarchical", "auto")
        if hierarchical not in HIERARCHICAL:
            raise ValueError(f"{where}: field 'hierarchical' must be one of {', '.join(HIERARCHICAL)}, got "
                             f"{hierarchical!r}")
        stack_order = d.get("stack_order", "layer")
        if stack_order not in STACK_ORDERS:
            raise ValueError(f"{where}: field 'stack_order' must be one of {', '.join(STACK_ORDERS)}, got "
                             f"{stack_order!r}")
        metrics_dir = d.get("metrics_dir")
        if metrics_dir is not None and (not isinstance(metrics_dir, str) or not metrics_dir):
            raise ValueError(f"{where}: field 'metrics_dir' must be a path, got {metrics_dir!r}")
        drift = d.get("drift_threshold", 0.8)
        if not isinstance(drift, (int, float)) or isinstance(drift, bool) or not 0 < drift <= 1:
            raise ValueError(f"{where}: field 'drift_threshold' must be a number in (0, 1], got {drift!r}")
        sample = d.get("record_sample", 1.0)
        if not isinstance(sample, (int, float)) or isinstance(sample, bool) or not 0 < sample <= 1:
            raise ValueError(f"{where}: field 'record_sample' must be a number in (0, 1], got {sample!r}")
        budget = d.get("record_max_mb")
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool)
                                   or not 0 < budget < float("inf")):
            raise ValueError(f"{where}: field 'record_max_mb' must be a positive number of MiB, got {budget!r}")
        for key in ("record_sample", "record_max_mb"):
            if key in d and record is None:
                raise ValueError(f"{where}: field '{key}' is given but field 'record' (a directory) is not")
        chunk = d.get("record_chunk_tokens", 1 << 18)
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise ValueError(f"{where}: field 'record_chunk_tokens' must be a positive integer, got {chunk!r}")
        from .place.auto_settings import AutoSettings

        auto = AutoSettings.from_value(d.get("auto_replace"), where)
        if auto is not None and (placement is None or record is None):
            raise ValueError(f"{where}: field 'auto_replace' needs field 'placement' (the served one it replaces) "
                             f"and field 'record' (the recording it builds candidates from)")
        return cls(mode=mode, placement=os.path.abspath(placement) if placement else None, placement_dirs=dirs,
                   record=os.path.abspath(record) if record else None, log_interval=float(interval),
                   record_chunk_tokens=chunk, predictor=predictor,
                   all2all=all2all, dp_routing=dp_routing,
                   metrics_dir=os.path.abspath(metrics_dir) if metrics_dir else None, drift_threshold=float(drift),
                   record_sample=float(sample), record_max_mb=None if budget is None else float(budget),
                   metrics=metrics, reduce_scatter=reduce_scatter, hierarchical=hierarchical,
                   stack_order=stack_order, auto_replace=auto)

    @classmethod
    def from_additional_config(cls, additional_config: object) -> "SmoeConfig | None":
        """None when smoe was not asked for (no ``smoe`` key)."""
        if not isinstance(additional_config, dict) or "smoe" not in additional_config:
            return None
        return cls.from_dict(additional_config["smoe"])

    def check_files(self) -> None:
        """Fail before serving: the placement parses, the directories live swaps take files from
        exist, the record directory is writable."""
        if self.placement is not None:
            from .served import placement_for

            placement_for(self)  # parsed once: what every later check in this process reads
        for d in self.placement_dirs or ():
            if not os.path.isdir(d):
                raise ValueError(f"{d}: field 'placement_dirs' (--smoe-placement-dirs) names "
                                 f"{'a file' if os.path.exists(d) else 'nothing'}, not a directory")
        if self.metrics_dir is not None and not (os.path.isdir(self.metrics_dir)
                                                 and os.access(self.metrics_dir, os.W_OK | os.X_OK)):
            raise ValueError(f"{self.metrics_dir}: field 'metrics_dir' is not a writable directory")
        if self.record is not None:  # tested for real (a file made and removed), nothing left behind
            from ..tools.cli_util import check_output_dir

            check_output_dir(self.record, "field 'record'")
