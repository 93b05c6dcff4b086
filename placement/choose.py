"""Choosing among candidate placements: ``--method auto``'s pick among its solved candidates, and
``advise``'s fresh candidate named as the served placement's ranks, so that a live swap moves
only the expert slots that change.

Shapes: L layers, E experts, N = ep_size ranks, R copies per layer.
"""

from __future__ import annotations

import numpy as np

from .metrics import recommend
from .migrate import rank_names, rename_block, rename_ranks
from .predict import PredictorTables, named_ranks, rename_tables

AUTO_METHODS = ("coclust", "bytes")  # --method auto's candidates: the most local, the fewest rows
# the held-out expert load a build capped at --max-expert-load may reach (coclust caps it in sample)
LOAD_SLACK = 0.05


def auto_candidates(nodes: int, groups: int) -> tuple[tuple[str, ...], list[str]]:
    """(the methods --method auto solves, what rules the others out): bytes places on one level of
    ranks with experts free to move, so hierarchical and grouped builds keep coclust alone."""
    unsupported = [f for f, v in ((f"--nodes {nodes}", nodes > 1), (f"{groups} routing groups", groups > 1)) if v]
    return (AUTO_METHODS[:1] if unsupported else AUTO_METHODS), unsupported


def pick(scores: dict[str, dict[str, float]], max_expert_load: float) -> tuple[str, str]:
    """The candidate :func:`.metrics.recommend` picks from ``scores`` ({method: {lar,
    remote_unique_per_token, expert_load}}, judged on the same rows): the fewest rows per token
    within 2% of the best LAR at an expert load within ``max_expert_load`` (plus LOAD_SLACK);
    where every candidate loads its ranks more unevenly, the least uneven. Returns (method, why)."""
    methods = list(scores)
    i, why = recommend([scores[k]["lar"] for k in methods],
                       [scores[k]["remote_unique_per_token"] for k in methods],
                       [scores[k]["expert_load"] for k in methods], max_expert_load * (1 + LOAD_SLACK))
    if i < 0:  # the judge rows load every candidate unevenly (a workload they lack): the least uneven
        i = int(np.argmin([scores[k]["expert_load"] for k in methods]))
        why += f"; kept {methods[i]}, the lowest expert load"
    return methods[i], why


def renamed_candidate(served: np.ndarray, e2r: np.ndarray, reps: np.ndarray, tables: PredictorTables | None,
                      ep_size: int, nodes: int, groups: int, per_layer: bool
                      ) -> tuple[np.ndarray, np.ndarray, PredictorTables | None]:
    """The candidate (e2r [L, E] int, reps [L, R, 2] int (expert, rank), its tables or None) with
    its ranks renamed to agree with the ``served`` [L, E] placement's, per layer or once for the
    whole model (``per_layer`` False keeps its layers' rank names agreeing), inside the blocks
    nodes and routing groups allow (:func:`.migrate.rename_block`)."""
    names = rank_names(served, e2r, ep_size, per_layer, rename_block(ep_size, nodes, groups))
    e2r, reps = named_ranks(names, e2r), np.stack([reps[..., 0], named_ranks(names, reps[..., 1])], axis=-1)
    return e2r, reps, None if tables is None else rename_tables(tables, names)


def moved_slots(served: np.ndarray, e2r: np.ndarray, ep_size: int, renamed: bool) -> int:
    """Expert slots ([L, E] placements) a swap from ``served`` to ``e2r`` moves: as they stand
    (``renamed``: the candidate's ranks already agree with the served ones), else after naming
    the candidate's ranks as the served ones for the fewest moves."""
    return int((e2r != served).sum()) if renamed else int((rename_ranks(served, e2r, ep_size) != served).sum())
