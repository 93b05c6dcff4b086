"""Builds the token order a worker serves: its plan (:mod:`.plan`), its predictor
(:mod:`.predictors`) and the layout class that owns the hooks (:mod:`.layout_block`,
:mod:`.layout_stack`), which all share :class:`~.token_order.TokenOrder`'s device state."""

from __future__ import annotations

import logging

from .token_order import TokenOrder

logger = logging.getLogger("vllm.smoe")


def install_token_order(model, vllm_config, cfg, served, location) -> TokenOrder:
    """Called by smoe's model loader once the weights are in place; ``served``: the process's
    :class:`~.served.ServedPlacement` (its load plan and expected ratio), ``location``: its
    :class:`~..location.DeviceLocation` (the maps and tables on the device)."""
    from vllm.distributed import get_tp_group

    from .layout_block import BlockOrder, ShuffledOrder
    from .layout_stack import StackLayerOrder, StackStepOrder
    from .plan import plan_order
    from .predictors import make_predictor

    device = next(model.parameters()).device
    plan = plan_order(model, vllm_config, cfg, served.plan.moe_layers, get_tp_group(), location.tables is not None,
                      device)
    layout = {"block": BlockOrder, "shuffled": ShuffledOrder, "stack-layer": StackLayerOrder,
              "stack-step": StackStepOrder}[plan.layout]
    order = layout(model, vllm_config, cfg, plan, location, make_predictor(plan),
                   expected=served.placement.metrics.get("lar"))
    logger.info("%s", plan.start_line())
    return order
