"""Peers that need vLLM itself: its EPLB policy, called through vLLM."""

from __future__ import annotations

import numpy as np


def eplb_available() -> tuple[bool, str]:
    """(ok, reason): whether vLLM's EPLB policy can be imported here."""
    import importlib

    try:
        importlib.import_module("vllm.distributed.eplb.policy.default")
    except ImportError as e:
        return False, f"vLLM's EPLB policy is not importable ({e})"
    return True, ""


def place_eplb(expert_load: np.ndarray, ep_size: int, nodes: int = 1, replicas: int = 0
               ) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``DefaultEplbPolicy.rebalance_experts`` on per-layer expert loads, with
    ``replicas`` extra physical slots per layer (EPLB copies the hottest experts).
    expert_load: [L, E] float. Returns (expert2rank [L, E] int32: the rank of each expert's
    first physical slot, not necessarily E/N per rank when copies exist; replicas [L, R, 2]
    int32 (expert, rank): its other slots' ranks, once per rank, -1 = none)."""
    import torch
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    L, E = expert_load.shape
    P = E + replicas
    if P % ep_size:
        raise ValueError(f"eplb: {E} experts + {replicas} replicas must split evenly over ep_size {ep_size} "
                         f"(vLLM's EPLB needs as many slots on every rank)")
    groups = nodes if nodes > 1 else 1
    phy2log = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(expert_load.astype(np.float32)), P, groups,
                                                  nodes, ep_size).numpy()
    rank_of_slot = np.arange(P) // (P // ep_size)
    e2r = np.empty((L, E), dtype=np.int32)
    reps = np.full((L, replicas, 2), -1, dtype=np.int32)
    for layer in range(L):
        first = np.full(E, -1)
        extra = []
        for slot, e in enumerate(phy2log[layer]):
            r = rank_of_slot[slot]
            if first[e] < 0:
                first[e] = r
            elif r != first[e] and (e, r) not in extra:
                extra.append((e, r))
        e2r[layer] = first
        if extra:
            reps[layer, : len(extra)] = extra
    return e2r, reps
