"""Peers that need vLLM itself: its EPLB policy, called through vLLM (no replicas)."""

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


def place_eplb(expert_load: np.ndarray, ep_size: int, nodes: int = 1) -> np.ndarray:
    """vLLM's ``DefaultEplbPolicy.rebalance_experts`` on per-layer expert loads, one copy per
    expert. expert_load: [L, E] float. Returns expert2rank [L, E] int32."""
    import torch
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    L, E = expert_load.shape
    groups = nodes if nodes > 1 else 1
    phy2log = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(expert_load.astype(np.float32)), E, groups,
                                                  nodes, ep_size).numpy()
    per = E // ep_size
    e2r = np.empty((L, E), dtype=np.int32)
    for layer in range(L):
        e2r[layer, phy2log[layer]] = np.arange(E) // per
    return e2r
