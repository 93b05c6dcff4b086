"""Routing traces: the interchange format between serving (record) and smoe-place.

One ``.npz`` per trace, one row per token the model processed; its fields (shape, dtype,
meaning) are tabled in :class:`~.trace_reader.Trace` and docs/formats.md.

The format lives in modules beside this one, all re-exported here:

- ``trace_meta``: the fields' dtypes and ranks, and the ``meta`` header (:class:`TraceMeta`);
- ``trace_reader``: one trace opened lazily (:func:`open_trace`, :class:`Trace`), its rows
  streamed by :meth:`Trace.iter_chunks`, so traces larger than memory can be validated and scanned;
- ``trace_checks``: the fields' dtypes and shapes, and their values chunk by chunk;
- ``trace_writer``: :class:`TraceWriter` appends chunks to per-field spill files and assembles
  the ``.npz`` at :meth:`TraceWriter.close`, atomically (a reader never sees a half-written file);
- ``trace_spill``: the writer's spill directory, and the recovery of one whose writer died;
- ``trace_sets``: several traces named by paths, directories or globs, read as one."""

from .trace_meta import FORMAT_VERSION, OPTIONAL_FIELDS, REQUIRED_FIELDS, TraceMeta
from .trace_reader import Trace, open_trace, summary
from .trace_sets import expand_trace_paths, iter_traces, open_traces, read_traces
from .trace_spill import (SPILL_INDEX, SPILL_LOCK, SPILL_PREFIX, find_spills, recover_dead_spills, recover_spill,
                          spill_owner_alive)
from .trace_writer import TraceWriter, write_trace

__all__ = [
    "FORMAT_VERSION", "OPTIONAL_FIELDS", "REQUIRED_FIELDS", "SPILL_INDEX", "SPILL_LOCK", "SPILL_PREFIX", "Trace",
    "TraceMeta", "TraceWriter", "expand_trace_paths", "find_spills", "iter_traces", "open_trace", "open_traces",
    "read_traces", "recover_dead_spills", "recover_spill", "spill_owner_alive", "summary", "write_trace",
]
