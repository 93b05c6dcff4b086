"""The placement a process serves: read and parsed once, then handed to whatever needs it.

Two objects, one per process each:

- :class:`ServedPlacement` (every process that serves a placement): the YAML, its predictor
  tables and, in workers, the load plan for this model. The API server's plugin reads it when
  it checks the engine arguments; the DP router and the HTTP routes take it from there. A worker
  reads it in smoe's loader (the exchange, built earlier with the communicator, reads the same
  one) and hands it to the token order and the recorder.
- :class:`Worker` (worker processes): what the loader built around the model: the token order,
  the recorder, the checkpoint-order router rows a live swap repacks, the swap under way.

A live swap replaces the placement whole (:meth:`Worker.serve`): nothing keeps a stale copy.
Access goes through :func:`placement_for` and :func:`worker`, never a module's globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..formats.placement_file import Placement, Snapshot, load_tables, read_snapshot


@dataclass(frozen=True)
class ServedPlacement:
    """One placement as served. ``tables`` is None when the YAML names no predictor file;
    ``plan`` (:class:`~.load_plan.LoadPlan`) is None outside workers (no model config needed)."""

    path: str  # as the user gave it (start) or as resolved (a live swap's file)
    placement: Placement
    tables: object | None  # PredictorTables
    plan: object | None = None  # LoadPlan
    sha256: str = ""  # of the bytes parsed

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, vllm_config=None) -> "ServedPlacement":
        """Parse ``snapshot`` (the bytes read once); with ``vllm_config``, also the load plan."""
        placement = snapshot.placement()
        tables = None if placement.predictor is None else load_tables(placement, snapshot.tables)
        plan = None
        if vllm_config is not None:
            from .load_plan import plan_for

            plan = plan_for(snapshot.path, vllm_config, placement)
        return cls(snapshot.path, placement, tables, plan, snapshot.sha256)

    @classmethod
    def read(cls, path: str, vllm_config=None) -> "ServedPlacement":
        return cls.from_snapshot(read_snapshot(path, resolve=False), vllm_config)


# path -> what this process parsed of it (with the plan when a worker asked)
_PARSED: dict[str, ServedPlacement] = {}
_WORKER: "Worker | None" = None


def placement_for(cfg, vllm_config=None) -> ServedPlacement | None:
    """The placement this process serves under ``cfg`` (a SmoeConfig; None = no placement),
    parsed on the first call and shared by every later one. ``vllm_config``: a worker's, when
    the load plan is needed (parsed once too). ValueError names the file and field."""
    if cfg is None or cfg.placement is None:
        return None
    if _WORKER is not None and _WORKER.placement is not None:
        return _WORKER.placement  # after a live swap, the swapped-in one
    have = _PARSED.get(cfg.placement)
    if have is None or (vllm_config is not None and have.plan is None):
        if have is not None:  # the YAML parsed once; only the plan is new
            from .load_plan import plan_for

            have = ServedPlacement(have.path, have.placement, have.tables,
                                   plan_for(have.path, vllm_config, have.placement), have.sha256)
        else:
            have = ServedPlacement.read(cfg.placement, vllm_config)
        _PARSED[cfg.placement] = have
    return have


@dataclass
class Worker:
    """What a worker serves, set up by smoe's loader once the weights are in place."""

    model: object  # torch.nn.Module
    vllm_config: object
    cfg: object  # SmoeConfig
    placement: ServedPlacement | None
    gate_rows: dict | None = None  # MoE ordinal -> router weight in checkpoint order (CPU build)
    order: object | None = None  # TokenOrder (mode speculate)
    recorder: object | None = None  # Recorder (record on)
    pending: dict = field(default_factory=dict)  # digest -> checked Swap, between prepare and apply

    def serve(self, placement: ServedPlacement) -> None:
        """After a live swap: the placement every consumer reads from now on."""
        self.placement = placement


def start_worker(w: Worker) -> Worker:
    """Called once by the loader: the worker state of this process."""
    global _WORKER
    _WORKER = w
    return w


def worker() -> Worker | None:
    """This process's worker state (None outside a worker that loaded with smoe)."""
    return _WORKER
