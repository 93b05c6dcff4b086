"""The served placement on the device: one object every consumer on a worker reads.

:class:`~.served.ServedPlacement` is the placement on the host (the YAML, its tables, the load
plan); :class:`DeviceLocation` holds what the forward reads of it on the device (SGLang's
``ExpertLocationMetadata``): slot -> expert, which rank holds what, route -> physical slot and
the predictor tables. The token order reads its tensors, the routers' EPLB state holds its
route tensors themselves, and the recorder maps slots through it. A live swap (:mod:`.place.live`)
moves the weights, reorders the routers' rows and calls :meth:`DeviceLocation.update`: every
tensor is rewritten in place, so captured CUDA graphs and every consumer read the new map.
"""

from __future__ import annotations

import numpy as np
import torch

from ..placement.learned import LEARNED_FIELDS

TABLE_NAMES = ("token2rank", "token_conf", "markov2rank", "markov_conf", "prior2rank")  # + bigrams when built


def device_tables(tables, device, learned: bool = False) -> dict[str, torch.Tensor]:
    """The predictor tables (``placement.predict.PredictorTables``) as the ops read them: name ->
    tensor on ``device``, floats as float32 (the learned predictor's per-id rows as float16); with
    ``learned``, the learned predictor's arrays too (the tables must carry them)."""
    names = TABLE_NAMES + (("bigram_keys", "bigram2rank", "bigram_conf") if tables.has_bigrams else ())
    if learned:
        names += tuple("learned_" + k for k in LEARNED_FIELDS)
    out = {k: torch.as_tensor(getattr(tables, k)).to(device) for k in names}
    # the learned predictor's per-id rows stay float16 (its largest arrays; read as float32)
    return {k: v.float() if v.is_floating_point() and not k.endswith("_proj") else v for k, v in out.items()}


def _holds(plan, ranks: int) -> np.ndarray:
    """[L, ranks, E] bool: rank r holds a copy (home or replica) of router output e."""
    return np.stack([plan.held(r) for r in range(ranks)], axis=1)


class DeviceLocation:
    """One worker's device copy of the served placement (``plan``: its
    :class:`~.place.load_plan.LoadPlan`).

    - ``slot2expert``: [L, E] int64 on the device, router output (slot) i of MoE layer l scores
      expert ``slot2expert[l, i]``; ``host_slot2expert``: the same on the host, a new tensor per
      update (a step queued before a swap keeps the map it was served with).
    - ``holds``: [L, N, E] bool, tensor-parallel rank r holds a copy (home or replica) of router
      output e; N: ``ranks``; None where the plan's ranks are fewer (no token order there).
    - ``routes``: per MoE layer, [E, 1] int64, the physical slot this expert-parallel rank
      (``ep_rank``) routes router output e to: the tensors the routers' EPLB state holds
      (``logical_to_physical_map``, set at load by :func:`.place.loader.set_route`); empty
      without redundant experts (vLLM then routes without a map).
    - ``tables``: name -> tensor (:func:`device_tables`), None when no table predictor serves.
    """

    def __init__(self, plan, device, ranks: int, ep_rank: int = 0, routers: list | None = None, tables=None,
                 learned: bool = False):
        self.ep_rank, self.learned = ep_rank, learned
        self.slot2expert = torch.as_tensor(plan.slot2expert, device=device)
        self.host_slot2expert = torch.as_tensor(plan.slot2expert)
        N = plan.route2physical.shape[1]
        self.holds = torch.as_tensor(_holds(plan, ranks), device=device) if ranks <= N else None
        self.routes = [r.eplb_state.logical_to_physical_map for r in routers or ()] if plan.num_redundant else []
        self.tables = None if tables is None else device_tables(tables, device, learned)

    @property
    def device(self) -> torch.device:
        return self.slot2expert.device

    def update(self, plan, tables=None) -> None:
        """A live re-placement, between two steps: every map and table rewritten in place (their
        addresses stay, so captured graphs read the new values); a table of another shape
        (bigrams) is replaced, which :func:`.place.live.check_swap` refuses under CUDA graphs."""
        if self.tables is not None:
            new = device_tables(tables, self.device, self.learned)
            for k, v in new.items():
                old = self.tables.get(k)
                if old is not None and old.shape == v.shape:
                    old.copy_(v)  # casts to the served dtype
                else:
                    self.tables[k] = v
            for k in set(self.tables) - set(new):
                del self.tables[k]
        self.slot2expert.copy_(torch.as_tensor(plan.slot2expert))
        self.host_slot2expert = torch.as_tensor(plan.slot2expert)
        if self.holds is not None:
            self.holds.copy_(torch.as_tensor(_holds(plan, self.holds.shape[1])))
        for layer, route in enumerate(self.routes):
            route.copy_(torch.as_tensor(plan.route2physical[layer, self.ep_rank])[:, None])


def location_for(model, vllm_config, cfg, served, ep_rank: int) -> DeviceLocation:
    """The loader's: ``served``'s plan on the model's device, the routers' route maps adopted,
    the tables parsed only where a table predictor serves them (the token order)."""
    from vllm.distributed import get_tp_group

    from .config import TABLE_PREDICTORS
    from .speculate.seams import find_moe_experts

    plan = served.plan
    routers = [e.router for _, _, e in find_moe_experts(model, plan.moe_layers)] if plan.num_redundant else []
    predicts = cfg.mode == "speculate" and cfg.predictor in TABLE_PREDICTORS
    return DeviceLocation(plan, next(model.parameters()).device, get_tp_group().world_size, ep_rank, routers,
                          served.tables if predicts else None, learned=cfg.predictor == "learned")
