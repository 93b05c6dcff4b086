"""Grouped top-k routing (DeepSeek's ``n_group``): which placements keep the routing unchanged.

Grouped top-k scores contiguous blocks of E/groups expert ids and lets a token choose among its
best ``topk_group`` blocks. Loading a placement lays experts out rank by rank (by id inside a
rank), so the routing is unchanged exactly when every block of slots holds one whole group:
a rank holds whole groups, or a block of ranks holds one group.
"""

from __future__ import annotations

import numpy as np


def check_groups(num_experts: int, ep_size: int, nodes: int, groups: int) -> None:
    """Grouped top-k routing (DeepSeek's ``n_group``) scores contiguous blocks of experts, so a
    lossless reordering keeps every group whole: a rank holds whole groups, or a block of
    ranks holds one group."""
    if groups < 1 or num_experts % groups:
        raise ValueError(f"groups {groups} must be positive and divide num_experts {num_experts}")
    if groups > 1 and groups % ep_size and ep_size % groups:
        raise ValueError(f"ep_size {ep_size} and {groups} routing groups: one must divide the other, or ranks "
                         f"would hold parts of several groups")
    if groups > 1 and ep_size > groups and nodes > 1 and groups % nodes and nodes % groups:
        raise ValueError(f"nodes {nodes} and {groups} routing groups: one must divide the other")


def broken_group(expert2rank: np.ndarray, groups: int) -> int:
    """First expert whose group is not kept whole by ``expert2rank`` ([E] int, experts laid out
    rank by rank, by id inside a rank, as the loader does), -1 if every group stays whole: each
    block of E/groups consecutive slots must hold exactly one group."""
    E = expert2rank.shape[0]
    size = E // groups
    slot2expert = np.argsort(expert2rank, kind="stable")
    blocks = (slot2expert // size).reshape(groups, size)
    mixed = np.flatnonzero((blocks != blocks[:, :1]).any(axis=1))
    if mixed.size == 0:
        return -1
    b = blocks[mixed[0]]
    return int(slot2expert.reshape(groups, size)[mixed[0]][np.flatnonzero(b != b[0])[0]])
