"""Which node each expert-parallel rank runs on, from vLLM's parallel settings alone.

vLLM's expert-parallel group is its DP x TP ranks (``parallel_state``: data-parallel rank
major), so EP rank ``e`` is DP rank ``e // tp`` and TP rank ``e % tp``. DP ranks fill nodes
``data_parallel_size_local`` at a time (``--data-parallel-size-local``, one API server or
headless node each), and one DP replica's TP ranks span ``nnodes_within_dp`` nodes (``--nnodes``)
in equal runs. Known at start on every rank, with no collective.
"""

from __future__ import annotations


def ep_rank2node(tp: int, dp: int, dp_local: int, nnodes_within_dp: int = 1) -> list[int]:
    """[dp * tp] int: the node of each expert-parallel rank (0-based, in rank order).
    dp_local <= 0 (no local engines, e.g. a front end) or >= dp: every DP rank on one node
    group."""
    if tp <= 0 or dp <= 0 or nnodes_within_dp <= 0 or tp % nnodes_within_dp:
        raise ValueError(f"no node layout for tensor parallel {tp} over {nnodes_within_dp} nodes, data parallel {dp}")
    per_node = tp // nnodes_within_dp
    local = dp if dp_local <= 0 else min(dp_local, dp)
    return [(e // tp // local) * nnodes_within_dp + (e % tp) // per_node for e in range(dp * tp)]


def ep_rank2node_of(parallel_config) -> list[int]:
    """:func:`ep_rank2node` for vLLM's ``ParallelConfig``."""
    pc = parallel_config
    return ep_rank2node(pc.tensor_parallel_size, pc.data_parallel_size, pc.data_parallel_size_local,
                        pc.nnodes_within_dp)
