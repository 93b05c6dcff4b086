"""Routing traces: the interchange format between serving (record) and smoe-place.

One ``.npz`` (zip of ``.npy`` members, as ``numpy.savez_compressed`` writes), one row per token
the model processed. T = tokens, L = MoE layers, K = top-k.

=============== ======================== =====================================================
field           shape, dtype             meaning
=============== ======================== =====================================================
token_ids       [T] int32                input token id, 0 <= id < vocab_size
request_ids     [T] int32                request the token belongs to, >= 0
positions       [T] int32                position inside its request, >= 0
topk_ids        [T, L, K] int16|int32    logical expert ids chosen at each MoE layer
meta            0-d str (JSON, <= 2^20   num_experts, top_k, num_layers, vocab_size (required);
                chars)                   domains, model, hidden_size (optional); the
                                         recorder adds dp_rank and, speculating,
                                         token_order ("layer" | "step": one order
                                         per MoE layer or per engine step)
step_ids        [T] int32 (optional)     engine step (= batch) the token was scheduled in, >= 0
is_prefill      [T] bool (optional)      True for prompt tokens, False for decoded ones
domain          [T] int (optional)       index into meta["domains"]
topk_weights    [T, L, K] float16|32     router weights of topk_ids (optional), finite
=============== ======================== =====================================================

The format lives in modules beside this one, all re-exported here:

- ``trace_meta``: the fields' dtypes and ranks, and the ``meta`` header (:class:`TraceMeta`);
- ``trace_reader``: one trace opened lazily (:func:`open_trace`, :class:`Trace`), its rows
  streamed by :meth:`Trace.iter_chunks`, so traces larger than memory can be validated and scanned;
- ``trace_checks``: the fields' dtypes and shapes, and their values chunk by chunk;
- ``trace_writer``: :class:`TraceWriter` appends chunks to per-field spill files and assembles
  the ``.npz`` at :meth:`TraceWriter.close`, atomically (a reader never sees a half-written file);
- ``trace_spill``: the writer's spill directory, and the recovery of one whose writer died;
- ``trace_sets``: several traces named by paths, directories or globs, read as one.
"""

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
