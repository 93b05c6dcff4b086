"""``load_format="smoe"``: vLLM's default loader, with experts renamed to their placed slots.

While weights stream from the checkpoint, ``...layers.{i}.<moe>.experts.{e}.*`` becomes
``experts.{expert2slot[e]}.*`` and the router's rows (and a per-expert score bias) are reordered
the same way, so physical slot s computes exactly what logical expert slot2expert[s] did: the
served model is the same function. Routing captured in record mode is mapped back to logical
ids.

Replicas: vLLM allocates redundant expert slots only for its EPLB, so while the model is built
the loader asks for them as EPLB does (``enable_eplb`` and ``num_redundant_experts``, for the
construction only: EPLB's run-time rearrangement stays off). Each rank loads its own slots
(home experts, then copies), and each router's EPLB layer state gets smoe's static
logical -> physical map of this rank (one replica per expert: the copy on this rank, else the
home slot), which vLLM's own mapping applies after top-k. Imported only inside vLLM processes
(it imports torch and vLLM).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Generator, Iterable

import numpy as np
import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..config import SmoeConfig
from .draft import is_draft, log_draft
from .expert_filter import ReadTally, needed_slots, placed_experts
from .load_plan import EXPERT_PARAM as _EXPERT
from .load_plan import MOE_BLOCK_PARAM, ROUTER_PARAM, LoadPlan, initial_physical_names
from ..served import WorkerState, placement_for, start_worker

logger = logging.getLogger("vllm.smoe")  # under vLLM's logger: same handlers and level

# experts stacked in one tensor per projection, [E, ...]: Llama 4 and GPT-OSS (``experts.gate_up_proj``,
# with GPT-OSS's per-expert biases and its MXFP4 ``_blocks`` / ``_scales``), Granite-MoE
# (``input_linear`` / ``output_linear`` straight under the block)
_FUSED = re.compile(r"^.*\.layers\.(?P<layer>\d+)\.(?:.*\.experts\.(?:gate_up_proj|down_proj)(?:_bias|_blocks|_scales)?"
                    r"|block_sparse_moe\.(?:input_linear|output_linear))(?:\.weight)?$")


def _slot_names(plan: LoadPlan, slots: range | None) -> list[list[list[int]]]:
    """[L][E] lists: the names (checkpoint ids vLLM's loader reads into a slot) under which
    logical expert e is handed out, one per slot of ``slots`` holding it (None = every slot)."""
    L, P = plan.physical2expert.shape
    E = plan.slot2expert.shape[1]
    names = initial_physical_names(E, P)
    slots = range(P) if slots is None else slots
    # vLLM loads a name into each of this rank's slots carrying it: names must not repeat here
    assert len({int(names[p]) for p in slots}) == len(slots), "slot names repeat on one rank"
    out = [[[] for _ in range(E)] for _ in range(L)]
    for layer in range(L):
        for p in slots:
            out[layer][int(plan.physical2expert[layer, p])].append(int(names[p]))
    return out


def permute_weights(weights: Iterable[tuple[str, torch.Tensor]], plan: LoadPlan, slots: range | None = None,
                    counts: dict | None = None, gate_rows: dict | None = None, covered: np.ndarray | None = None
                    ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Rename per-expert tensors to their slots (a tensor once per slot of ``slots`` holding its
    expert: this rank's slots with replicas, None = every slot); reorder router rows and fused
    expert tensors. ``counts`` (optional) tallies "renamed" and "reordered" tensors;
    ``gate_rows`` (optional) keeps each MoE layer's router weight in checkpoint order, by MoE
    ordinal (for a live re-placement where vLLM drops the loaded weight, see :mod:`.live`);
    ``covered`` (optional, [L, 2] bool, updated in place): MoE layer l had its router weight
    reordered (column 0) and its experts renamed or reordered (column 1), for :func:`check_covered`."""
    counts = counts if counts is not None else {}
    targets = _slot_names(plan, slots)
    E = plan.slot2expert.shape[1]
    covered = covered if covered is not None else np.zeros((len(plan.moe_layers), 2), dtype=bool)
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m is not None:
            layer = plan.layer_of(int(m["layer"]))
            if layer is None:
                yield name, tensor
                continue
            covered[layer, 1] = True
            for slot in targets[layer][int(m["e"])]:
                counts["renamed"] = counts.get("renamed", 0) + 1
                yield f"{m['pre']}experts.{slot}.{m['rest']}", tensor
            continue
        m = ROUTER_PARAM.match(name) or _FUSED.match(name)
        if m is not None:
            layer = plan.layer_of(int(m["layer"]))
            if layer is not None and plan.num_redundant and _FUSED.match(name):
                raise ValueError(f"{name}: experts stored stacked in one tensor cannot take replicas yet; build the "
                                 f"placement without --replicas")
            if layer is not None:
                is_router = ROUTER_PARAM.match(name) is not None
                if is_router and name.endswith(".weight"):
                    covered[layer, 0] = True
                    if gate_rows is not None:
                        gate_rows[layer] = tensor
                covered[layer, 1] |= not is_router
                idx = torch.as_tensor(plan.slot2expert[layer], device=tensor.device)
                tensor = tensor.index_select(_expert_dim(name, tensor, E), idx)
                counts["reordered"] = counts.get("reordered", 0) + 1
            yield name, tensor
            continue
        m = MOE_BLOCK_PARAM.match(name)
        if (m is not None and plan.layer_of(int(m["layer"])) is not None and E in tuple(tensor.shape)
                and "shared_expert" not in m["rest"]):
            raise ValueError(f"smoe placement: {name} (shape {tuple(tensor.shape)}) has an extent of {E}, the "
                             f"expert count, in an MoE layer, and smoe does not know how to put it in the "
                             f"placement's order; serving it unchanged could change the routing. Serve this "
                             f"model without a placement (mode record), or report the tensor name")
        yield name, tensor


def check_covered(plan: LoadPlan, covered: np.ndarray) -> None:
    """After the whole checkpoint streamed through :func:`permute_weights`: every MoE layer had its
    router weight and its experts put in placement order. A checkpoint naming them otherwise would
    be served half placed (routing silently changed, recorded ids mislabelled): refused, by layer."""
    missing = [(plan.moe_layers[i], what) for i in range(covered.shape[0])
               for what, seen in (("router weight", covered[i, 0]), ("experts", covered[i, 1])) if not seen]
    if missing:
        layer, what = missing[0]
        raise ValueError(f"smoe placement: no {what} of decoder layer {layer} (an MoE layer) was found in the "
                         f"checkpoint under a name smoe reorders (...layers.<i>.<mlp|block_sparse_moe|feed_forward>."
                         f"<gate|router>.weight, experts.<e>.*, stacked experts); {len(missing)} such gaps in all. "
                         f"Serve this model without a placement (mode record), or report its tensor names")


def _expert_dim(name: str, tensor: torch.Tensor, num_experts: int) -> int:
    """The dimension of a router or stacked expert tensor that runs over experts: the first of
    extent E (router weights [E, hidden], score biases [E] or ERNIE's [1, E], stacked experts [E, ...])."""
    for dim, n in enumerate(tensor.shape):
        if n == num_experts:
            return dim
    raise ValueError(f"smoe placement: {name} (shape {tuple(tensor.shape)}) has no extent of {num_experts}, "
                     f"the expert count: not a router or stacked expert tensor smoe can order")


class SmoeModelLoader(DefaultModelLoader):
    """DefaultModelLoader + the placement's slot permutation."""

    def __init__(self, load_config):
        inner = copy.copy(load_config)
        inner.load_format = "auto"  # the file discovery of the default loader
        super().__init__(inner)
        self.plan: LoadPlan | None = None
        # vLLM's CPU build packs router GEMM weights and drops the loaded ones: a live swap
        # rebuilds them from these checkpoint-order rows (E x hidden per MoE layer)
        from vllm.platforms import current_platform

        self.gate_rows: dict | None = {} if current_platform.is_cpu() else None

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        if is_draft(vllm_config, model_config):  # vLLM loads it through our format: its own load, nothing of smoe's
            return log_draft(super().load_model(vllm_config, model_config, prefix), vllm_config, model_config)
        cfg = SmoeConfig.from_additional_config(vllm_config.additional_config)
        served = placement_for(cfg, vllm_config)  # the one parse of this process (the exchange's too)
        if served is not None:
            self.plan = served.plan
        if self.plan is not None and self.plan.num_redundant:
            with _redundant_slots(vllm_config.parallel_config, self.plan.num_redundant):
                model = super().load_model(vllm_config, model_config, prefix)
            install_routes(model, self.plan, self._ep_rank())
        else:
            model = super().load_model(vllm_config, model_config, prefix)
        if cfg is None:
            return model
        if cfg.mode == "speculate":  # load_weights sized the MoE buffers to a rank's chunk
            from ..speculate.moe_buffers import built_before_cap

            early = built_before_cap(model)
            if early:
                logger.warning("smoe mode speculate: vLLM built the MoE kernels of %s (and %d more) before smoe sized "
                               "their buffers to a rank's chunk: they hold the whole step", early[0], len(early) - 1)
        worker = WorkerState(model, vllm_config, cfg, served, self.gate_rows)  # what POST /smoe/placement swaps
        if served is not None:  # the placement's maps on the device, the routers' routes among them
            from ..location import location_for

            worker.location = location_for(model, vllm_config, cfg, served,
                                           self._ep_rank() if served.plan.num_redundant else 0)
        if cfg.mode == "speculate":
            from ..speculate.install import install_token_order

            worker.order = install_token_order(model, vllm_config, cfg, served, worker.location)
        if cfg.record is not None:  # after the token order: its rows are split
            from ..record.recorder import install_recorder

            worker.recorder = install_recorder(model, vllm_config, cfg, worker.location, worker.order)
        start_worker(worker)
        return model

    def load_weights(self, model, model_config) -> None:
        # after vLLM built the model, before process_weights_after_loading builds its MoE kernels
        # from each layer's max_num_tokens; a draft's too (its MoE runs sequence parallel as well)
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        cfg = SmoeConfig.from_additional_config(vllm_config.additional_config)
        if cfg is not None and cfg.mode == "speculate":
            from ..speculate.moe_buffers import cap_max_num_tokens

            cap_max_num_tokens(model, vllm_config.scheduler_config.max_num_batched_tokens)
        super().load_weights(model, model_config)

    def _init_ep_weight_filter(self, model_config) -> None:
        super()._init_ep_weight_filter(model_config)
        if self.plan is not None:
            # vLLM's set is its linear split of checkpoint ids, one for every layer; a placement
            # puts other experts (and copies) on this rank in each layer (a draft has no plan here)
            from vllm.config import get_current_vllm_config

            pc = get_current_vllm_config().parallel_config
            ep = pc.enable_expert_parallel
            self.local_expert_ids = placed_experts(self.plan, self._ep_rank(), pc) if ep else None
            # read by vLLM's iterators by this name, which no signature check covers: get_all_weights
            # checks afterwards that every slot of this rank got its expert's tensors

    def get_all_weights(self, model_config, model):
        weights = super().get_all_weights(model_config, model)
        if self.plan is None:
            yield from weights
            return
        counts: dict = {}
        slots = self.plan.local_slots(self._ep_rank()) if self.plan.num_redundant else None
        covered = np.zeros((len(self.plan.moe_layers), 2), dtype=bool)
        tally = ReadTally(self.plan, _FUSED)
        yield from permute_weights(tally.count(weights), self.plan, slots, counts, self.gate_rows, covered)
        check_covered(self.plan, covered)  # a draft never gets here: it loads as vLLM loads it
        from vllm.config import get_current_vllm_config

        pc = get_current_vllm_config().parallel_config
        rank = self._ep_rank() if pc.enable_expert_parallel else 0
        # every (MoE layer, slot) of this rank got its expert's tensors, whichever filter ran
        tally.check_slots(needed_slots(self.plan, rank, pc), rank)
        if pc.enable_expert_parallel:
            logger.info("%s", tally.line(rank, self.local_expert_ids))
        L, P = self.plan.physical2expert.shape
        start = initial_physical_names(self.plan.slot2expert.shape[1], P)
        moved = int(np.count_nonzero(self.plan.physical2expert != start))
        logger.info("smoe: placement applied: %d expert tensors renamed, %d router/fused tensors reordered, "
                    "%d of %d expert slots changed", counts.get("renamed", 0), counts.get("reordered", 0), moved,
                    L * P)


    @staticmethod
    def _ep_rank() -> int:
        from vllm.distributed import get_ep_group

        return get_ep_group().rank_in_group


@contextlib.contextmanager
def _redundant_slots(parallel_config, num_redundant: int):
    """While the model is built: vLLM's models and FusedMoE allocate ``num_redundant`` extra
    expert slots only for EPLB, so ask as EPLB would. Restored afterwards: the model runner
    then starts no EPLB (no rearrangement, no load recording)."""
    eplb = parallel_config.eplb_config
    was = parallel_config.enable_eplb, eplb.num_redundant_experts
    parallel_config.enable_eplb = True
    eplb.num_redundant_experts = num_redundant
    try:
        yield
    finally:
        eplb.num_redundant_experts = was[1]
        parallel_config.enable_eplb = was[0]


def set_route(router, route: np.ndarray, num_physical: int, device) -> None:
    """Give a router's EPLB layer state a static logical -> physical map: route [E] int, the
    physical slot of each router output (one replica each), load recording off."""
    state = getattr(router, "eplb_state", None)
    if state is None or not callable(getattr(router, "_apply_eplb_mapping", None)):
        raise ValueError(f"smoe replicas: {type(router).__name__} has no EPLB layer state (the model does not take "
                         f"vLLM's redundant experts); build the placement without --replicas")
    state.logical_to_physical_map = torch.as_tensor(route, dtype=torch.long, device=device)[:, None]
    state.logical_replica_count = torch.ones(route.shape[0], dtype=torch.long, device=device)
    state.expert_load_view = torch.zeros(num_physical, dtype=torch.int32, device=device)
    state.should_record_tensor = torch.zeros((), dtype=torch.bool, device=device)  # never set: EPLB is off
    state.num_unpadded_tokens_tensors = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(2)]


def _check_slots(experts, layer: int, P: int, N: int) -> None:
    """The layout smoe named and routes for is the one vLLM built: P slots, P / N per rank, no
    fused shared experts among them, and each rank routing only its own rows (vLLM's naive
    dispatch gathers every rank's rows first, so a row would meet its copy on two ranks)."""
    routed = getattr(experts, "routed_experts", experts)
    got = (getattr(routed, "global_num_experts", None), getattr(routed, "local_num_experts", None))
    if got != (P, P // N):
        raise ValueError(f"smoe replicas: MoE layer {layer} has {got[0]} expert slots ({got[1]} per rank), not the "
                         f"{P} ({P // N} per rank) of the placement: the model does not take vLLM's redundant "
                         f"experts as EPLB gives them; build the placement without --replicas")
    if getattr(getattr(routed, "expert_map_manager", None), "num_fused_shared_experts", 0):
        raise ValueError(f"smoe replicas: MoE layer {layer} fuses shared experts into its slots; build the placement "
                         f"without --replicas")
    if getattr(experts, "do_naive_dispatch_combine", False):
        raise ValueError(f"smoe replicas: MoE layer {layer} gathers every rank's rows before routing (vLLM's naive "
                         f"dispatch, for this quantization), so a row would be computed on its home and its copy; "
                         f"build the placement without --replicas")


def install_routes(model: torch.nn.Module, plan: LoadPlan, rank: int) -> None:
    """:func:`set_route` on every MoE router with this rank's ``route2physical[l, rank]``."""
    from ..speculate.seams import find_moe_experts

    found = find_moe_experts(model, plan.moe_layers)
    if len(found) != len(plan.moe_layers):
        raise RuntimeError(f"smoe replicas: found {len(found)} MoE routers, expected {len(plan.moe_layers)}")
    L, P = plan.physical2expert.shape
    N = plan.route2physical.shape[1]
    device = next(model.parameters()).device
    for layer, _, experts in found:
        _check_slots(experts, layer, P, N)
        set_route(experts.router, plan.route2physical[layer, rank], P, device)
    logger.info("smoe: replicas: %d physical expert slots per layer (%d redundant), rank %d routes to its own "
                "copies", P, plan.num_redundant, rank)


_registered = False


def register_loader() -> None:
    global _registered
    if not _registered:
        register_model_loader("smoe")(SmoeModelLoader)
        _registered = True
