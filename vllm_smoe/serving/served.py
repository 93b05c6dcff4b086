"""The placement a process serves: read and parsed once, then handed to whatever needs it.

Two objects, one per process each:

- :class:`ServedPlacement` (every process that serves a placement): the YAML, its predictor
  tables and, in workers, the load plan for this model (who reads it: its docstring);
- :class:`WorkerState` (worker processes): what the loader built around the model.

A live swap replaces a worker's placement whole (:meth:`WorkerState.serve`); the API server keeps the
one it started with (its DP router and ``/smoe/route`` score with those tables until a restart).
Access goes through :func:`placement_for` and :func:`worker`, never a module's globals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..formats.placement_file import Placement, Snapshot, load_placement, load_tables


class ServedPlacement:
    """One placement as served: the parsed YAML, its predictor tables (parsed on first use, None
    when the YAML names no file: a server that never predicts never reads them, as before) and
    ``plan`` (:class:`~.load_plan.LoadPlan`; None outside workers, no model config needed).

    The API server's plugin reads it when it checks the engine arguments; the DP router and the
    HTTP routes take it from there. A worker reads it in smoe's loader (the exchange, built earlier
    with the communicator, reads the same one) and hands it to the token order and the recorder."""

    def __init__(self, path: str, placement: Placement | None, tables_bytes: bytes | None = None, plan=None,
                 sha256: str = "", tables=None):
        self.path = path  # as the user gave it (start) or as resolved (a live swap's file)
        self.placement = placement
        self.plan = plan
        self.sha256 = sha256  # of the bytes parsed (live swaps), "" when read from the path
        self._tables_bytes = tables_bytes  # as read with the YAML (live swaps), else the file is read
        self._tables = tables

    @property
    def tables(self):
        """PredictorTables, parsed once (ValueError naming the file, as ``load_tables``)."""
        if self._tables is None and self.placement is not None and self.placement.predictor is not None:
            self._tables = load_tables(self.placement, self._tables_bytes)
            self._tables_bytes = None
        return self._tables

    def with_plan(self, vllm_config) -> "ServedPlacement":
        """The same placement with the load plan for ``vllm_config`` (the YAML is not parsed again)."""
        from .place.load_plan import plan_for

        return ServedPlacement(self.path, self.placement, self._tables_bytes,
                               plan_for(self.path, vllm_config, self.placement), self.sha256, self._tables)

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, vllm_config=None) -> "ServedPlacement":
        """Parse ``snapshot`` (the bytes read once: a live swap); with ``vllm_config``, also the
        load plan."""
        served = cls(snapshot.path, snapshot.placement(), snapshot.tables, sha256=snapshot.sha256)
        return served if vllm_config is None else served.with_plan(vllm_config)


# (path, mtime, size) -> what this process parsed of it; a file rebuilt in place is read anew
_PARSED: dict[tuple, ServedPlacement] = {}
_WORKER: "WorkerState | None" = None


def placement_for(cfg, vllm_config=None) -> ServedPlacement | None:
    """The placement this process serves under ``cfg`` (a SmoeConfig; None = no placement),
    parsed on the first call and shared by every later one for the same file. ``vllm_config``:
    with the load plan for it (computed from the parsed placement, never the file). ValueError
    names the file and field."""
    if cfg is None or cfg.placement is None:
        return None
    try:
        st = os.stat(cfg.placement)
        key = (cfg.placement, st.st_mtime_ns, st.st_size)
    except OSError:
        key = (cfg.placement, None, None)  # load_placement names what is wrong with it
    have = _PARSED.get(key)
    if have is None:
        have = _PARSED[key] = ServedPlacement(cfg.placement, load_placement(cfg.placement))
    return have if vllm_config is None else have.with_plan(vllm_config)


@dataclass
class WorkerState:
    """What a worker serves, set up by smoe's loader once the weights are in place: the
    placement's device copy (:class:`~.location.DeviceLocation`, which the token order, the
    routers and the recorder read), the token order, the recorder, the checkpoint-order router
    rows a live swap repacks, the swap under way."""

    model: object  # torch.nn.Module
    vllm_config: object
    cfg: object  # SmoeConfig
    placement: ServedPlacement | None
    gate_rows: dict | None = None  # MoE ordinal -> router weight in checkpoint order (CPU build)
    location: object | None = None  # DeviceLocation (a placement served): the maps every consumer reads
    order: object | None = None  # TokenOrder (mode speculate)
    recorder: object | None = None  # Recorder (record on)
    pending: dict = field(default_factory=dict)  # digest -> checked Swap, between prepare and apply

    def serve(self, placement: ServedPlacement) -> None:
        """After a live swap: the placement every consumer reads from now on."""
        self.placement = placement


def start_worker(w: WorkerState) -> WorkerState:
    """Called by the loader once a model is in place: the worker state of this process. A model
    loaded after it (a second engine in the process) takes over, and the one before stops
    hooking the runner's steps."""
    global _WORKER
    old = _WORKER
    if old is not None and old is not w:
        from . import runner_hooks

        for component in (old.order, old.recorder):
            if component is not None:
                runner_hooks.detach(*component.step_hooks())
    _WORKER = w
    return w


def worker() -> WorkerState | None:
    """This process's worker state (None outside a worker that loaded with smoe)."""
    return _WORKER
