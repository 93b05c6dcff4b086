"""Live re-placement: serve a new placement YAML without a restart.

``POST /smoe/placement`` (:mod:`.endpoints`) reaches every worker through vLLM's
``collective_rpc``, which the engine core runs between two steps, in two calls: *prepare*
(every worker parses and checks the bytes the API server read; any refusal on any worker stops
the swap on every worker, so all ranks move or none does) and *apply* (expert weights moved to
the new slots in place, routers and the tables vLLM derived from them reordered, the worker's
device location updated): :class:`SmoeWorkerExtension`.

Row i of a router then scores expert slot2expert[i] of the new placement, and physical slot p
holds expert physical2expert[p]: the served model is the same function before and after, so
greedy tokens do not change. A step never sees half a swap: the worker runs the call between
two of its steps, and every tensor a step reads keeps its address (captured graphs stay valid)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from .derived import Derived, derived_tensors
from .load_plan import ROUTER_PARAM
from ..served import ServedPlacement, WorkerState, worker

logger = logging.getLogger("vllm.smoe")


def router_rows(model: torch.nn.Module, moe_layers: tuple[int, ...], num_experts: int
                ) -> list[tuple[list[torch.nn.Parameter], torch.nn.Module | None]]:
    """Per MoE layer: the parameters the loader put in router order that still hold their E rows
    (the gate's weight, a per-expert score bias), and the gate module when vLLM dropped its loaded
    weight (its CPU build packs router GEMMs: ``weight`` is left empty), else None."""
    out: list[tuple[list[torch.nn.Parameter], torch.nn.Module | None]] = [([], None) for _ in moe_layers]
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        m = ROUTER_PARAM.match(name)
        if m is None or int(m["layer"]) not in moe_layers:
            continue
        layer = moe_layers.index(int(m["layer"]))
        if p.dim() and p.shape[0] == num_experts:
            out[layer][0].append(p)
        elif name.endswith(".weight") and p.numel() == 0:
            out[layer] = (out[layer][0], modules[name[: -len(".weight")]])
        else:
            raise ValueError(f"smoe live placement: {name} has shape {tuple(p.shape)}, not {num_experts} router rows")
    return out


def _ep_split(vllm_config) -> bool:
    pc = vllm_config.parallel_config
    return bool(pc.enable_expert_parallel) and pc.tensor_parallel_size * pc.data_parallel_size > 1


@dataclass
class Swap:
    """Everything a swap needs, checked and allocated before anything changes."""

    served: ServedPlacement  # the new placement, parsed once, with its load plan
    weights: list  # [L] lists of this rank's per-expert tensors
    transfer: tuple | None  # (buffers, communicator, process group) for moves over the EP group


def check_swap(state: WorkerState, snapshot) -> Swap:
    """The placement in ``snapshot`` (:class:`~vllm_smoe.formats.placement_file.Snapshot`), parsed once,
    if it can replace the served one live; ValueError otherwise."""
    from .check import check_served_placement
    from ..location import device_tables
    from ..speculate.seams import find_moe_experts

    path = snapshot.path
    fresh = check_served_placement(path, state.cfg, state.vllm_config, snapshot)
    plan = fresh.plan
    old = state.placement.plan
    P, N = plan.physical2expert.shape[1], plan.route2physical.shape[1]
    if _ep_split(state.vllm_config) and P % N:
        raise ValueError(f"{path}: {P} experts over ep_size {N} (vLLM's uneven split): a live swap moves experts "
                         f"with vLLM's EPLB transfer, which needs ep_size to divide the expert slots; restart "
                         f"with the new placement")
    if plan.physical2expert.shape != old.physical2expert.shape:
        raise ValueError(f"{path}: field 'layers[].replicas': needs {plan.physical2expert.shape[1]} physical expert "
                         f"slots per layer, but the server allocated {old.physical2expert.shape[1]} at load; a "
                         f"placement with another number of copies per rank needs a restart")
    rows = router_rows(state.model, old.moe_layers, old.slot2expert.shape[1])
    packed = {layer: gate for layer, (_, gate) in enumerate(rows) if gate is not None}
    dropped = list(packed)
    if dropped and not (state.gate_rows is not None and all(layer in state.gate_rows for layer in dropped)):
        raise ValueError(f"smoe live placement: the routers of MoE layers {dropped} were packed at load and their "
                         f"rows were not kept; restart with the new placement")
    cc = state.vllm_config.compilation_config
    compiled = getattr(cc, "mode", None)
    if dropped and compiled is not None and int(compiled) != 0:
        opaque = [layer for layer, gate in packed.items() if packed_tensor(gate) is None]
        if opaque:
            raise ValueError(f"smoe live placement: vLLM's CPU build packed the routers of MoE layers {opaque} into "
                             f"handles a compiled model keeps and smoe cannot refill in place; serve with "
                             f"--enforce-eager to swap placements live, or restart with the new placement")
    if compiled is not None and int(compiled) != 0 and (cc.inductor_compile_config or {}).get("freezing"):
        raise ValueError("smoe live placement: inductor freezing bakes the weights into the compiled model, so moved "
                         "experts would not be seen; restart with the new placement")
    location = state.location
    if location is not None and location.tables is not None:
        if fresh.tables is None:
            raise ValueError(f"{path}: field 'predictor' is empty; the served token order predicts with tables")
        new = device_tables(fresh.tables, "cpu", location.learned)  # the tensors update() would copy in
        graphs = cc.cudagraph_mode is not None and cc.cudagraph_mode.name != "NONE"  # piecewise ones capture them too
        served = location.tables
        differ = sorted(k for k in set(new) | set(served)
                        if k not in new or k not in served or tuple(new[k].shape) != tuple(served[k].shape))
        if differ and graphs and next(state.model.parameters()).is_cuda:
            raise ValueError(f"{path}: field 'predictor': tables {differ} differ in shape from the served ones, which "
                             f"captured CUDA graphs read; build with the same options or restart")
    found = find_moe_experts(state.model, old.moe_layers)
    if len(found) != len(old.moe_layers):
        raise ValueError(f"smoe live placement: found {len(found)} MoE layers, expected {len(old.moe_layers)} (pipeline "
                         f"parallel?)")
    derived_rows(state, rows)  # refuses a tensor beside a router that a swap would leave stale
    weights = [list(experts.get_expert_weights()) for _, _, experts in found]
    transfer = None
    if _ep_split(state.vllm_config) and (old.physical2expert != plan.physical2expert).any():
        from vllm.distributed import get_ep_group
        from vllm.distributed.eplb.eplb_communicator import create_eplb_communicator

        group = get_ep_group()
        device = weights[0][0].device
        # CPU tensors: plain P2P on the group's gloo side ("torch_nccl" takes the CPU group for
        # them; vLLM's "torch_gloo" stages through an accelerator stream a CPU build lacks)
        backend = "torch_nccl" if device.type == "cpu" else (
            state.vllm_config.parallel_config.eplb_config.communicator or "torch_nccl")
        buffers = [torch.empty_like(w) for w in weights[0]]  # one layer's worth, allocated before anything moves
        transfer = (buffers, create_eplb_communicator(group, backend, weights, buffers),
                    group.cpu_group if device.type == "cpu" else group.device_group)
    return Swap(fresh, weights, transfer)


def moved_bytes(old, swap: Swap) -> int:
    """Bytes of this rank's expert weights in the physical slots whose expert changes."""
    changed = old.physical2expert != swap.served.plan.physical2expert  # [L, P] over every rank's slots
    total = 0
    for layer, ws in enumerate(swap.weights):
        local = ws[0].shape[0]  # this rank's slots of the layer
        per_slot = sum(w[0].numel() * w.element_size() for w in ws)
        total += per_slot * min(local, int(changed[layer].sum()))
    return total


def _move_experts(state: WorkerState, swap: Swap) -> int:
    """Expert weights to the new physical slots, in place; returns the slots whose expert changed."""
    old, new = state.placement.plan, swap.served.plan
    moved = int(np.count_nonzero(old.physical2expert != new.physical2expert))
    if not moved:
        return 0
    if swap.transfer is not None:
        from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

        buffers, comm, group = swap.transfer
        rearrange_expert_weights_inplace(torch.as_tensor(old.physical2expert), torch.as_tensor(new.physical2expert),
                                         swap.weights, buffers, group, comm)
    else:  # every rank holds every expert (no copies possible): a permutation of the slots
        for layer, ws in enumerate(swap.weights):
            src = np.argsort(old.physical2expert[layer], kind="stable")[new.physical2expert[layer]]
            idx = torch.as_tensor(src, device=ws[0].device)
            for w in ws:
                w.copy_(w.index_select(0, idx))
    return moved


def derived_rows(state: WorkerState, rows) -> list[list[Derived]]:
    """Per MoE layer: the tensors vLLM derived from its router's rows (:mod:`.derived`'s rule),
    found while ``rows`` (:func:`router_rows`) are still in the served order; ValueError naming a
    tensor with an expert-count extent that is not one."""
    from ..speculate.seams import find_moe_experts

    old = state.placement.plan
    E, P = old.slot2expert.shape[1], old.physical2expert.shape[1]
    names = {id(m): n for n, m in state.model.named_modules()}
    found = {layer: (block, experts) for layer, block, experts in find_moe_experts(state.model, old.moe_layers)}
    out = []
    for layer, (params, packed) in enumerate(rows):
        block, experts = found.get(layer, (None, None))
        ids = {id(p) for p in params}
        owners = [m for m in (block if block is not None else state.model).modules()
                  if any(id(p) in ids for p in m._parameters.values())]
        holders = [(names.get(id(m), ""), m) for m in (block, experts, packed, *owners) if m is not None]
        if getattr(experts, "router", None) is not None:
            holders.append((f"{names.get(id(experts), '')}.router", experts.router))
        refs = list(params)
        if packed is not None and state.gate_rows is not None and layer in state.gate_rows:
            rows_now = state.gate_rows[layer]  # checkpoint order; served as the old placement orders it
            refs.append(rows_now.index_select(0, torch.as_tensor(old.slot2expert[layer], device=rows_now.device)))
        skip = list(params) + (list(experts.get_expert_weights()) if experts is not None else [])
        out.append(derived_tensors(holders, refs, skip, E, P))
    return out


def _reorder_routers(state: WorkerState, new) -> None:
    old = state.placement.plan
    rows = router_rows(state.model, old.moe_layers, old.slot2expert.shape[1])
    derived = derived_rows(state, rows)  # matched against the rows as served: before any of them moves
    for layer, (params, packed) in enumerate(rows):
        # new row i scores expert new.slot2expert[i], which the old order put at old.expert2slot[.]
        idx = old.expert2slot[layer][new.slot2expert[layer]]
        for p in params:
            p.data.copy_(p.data.index_select(0, torch.as_tensor(idx, device=p.device)))
        for d in derived[layer]:
            d.permute(torch.as_tensor(idx))
        if packed is not None:
            _repack(packed, state.gate_rows[layer], new.slot2expert[layer])


def packed_tensor(gate: torch.nn.Module):
    """What vLLM's CPU build packed a router's weight into, as its ``cpu_linear`` closure holds
    it and a compiled model reads it (by reference): the packed weight tensor (sgl kernels) or
    the oneDNN handler, whose pointer vLLM keeps in a tensor for that reason; None when the
    closure holds neither (nothing smoe can refill in place)."""
    fn = getattr(gate, "cpu_linear", None)
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
    tensors = [c for c in cells if isinstance(c, torch.Tensor)]
    handlers = [c for c in cells if isinstance(getattr(c, "handler_tensor", None), torch.Tensor)]
    if len(tensors) + len(handlers) != 1:
        return None
    return (tensors or handlers)[0]


def _refill(old, fresh) -> bool:
    """Make ``old`` (what the model reads) compute what ``fresh`` computes, in place."""
    if isinstance(old, torch.Tensor) and isinstance(fresh, torch.Tensor):
        if fresh.shape != old.shape or fresh.dtype != old.dtype:
            return False
        old.copy_(fresh)
        return True
    if isinstance(old, torch.Tensor) or isinstance(fresh, torch.Tensor) or (old.k, old.n) != (fresh.k, fresh.n):
        return False
    # swap the two handlers' pointers: the model's handler now points at the new GEMM, and the
    # fresh object, dropped next, releases the old one (each releases what it holds)
    held = old.handler_tensor.clone()
    old.handler_tensor.copy_(fresh.handler_tensor)
    fresh.handler_tensor.copy_(held)
    return True


def _repack(gate: torch.nn.Module, rows: torch.Tensor, slot2expert) -> None:
    """vLLM's own packing of the checkpoint's router rows in the new order. What the old packing
    left for the model to read is refilled in place (:func:`_refill`), so a compiled model,
    which holds it, computes with the new rows; else the layer's packed GEMM is replaced (eager
    models only: :func:`check_swap` refuses the rest)."""
    w = rows.index_select(0, torch.as_tensor(slot2expert, device=rows.device))
    old_fn, old = getattr(gate, "cpu_linear", None), packed_tensor(gate)
    gate.weight = torch.nn.Parameter(w.to(gate.weight.dtype), requires_grad=False)
    gate.quant_method.process_weights_after_loading(gate)  # packs it, removes the weight again
    fresh = packed_tensor(gate)
    if old is not None and fresh is not None and _refill(old, fresh):
        gate.cpu_linear = old_fn  # the closure (and the compiled graph) keeps reading ``old``


def apply_swap(state: WorkerState, swap: Swap) -> dict:
    """Move the weights, reorder the routers, update the device location (slot map, held
    experts, routes, tables); ``state`` then serves the new placement."""
    t0 = time.monotonic()
    path, new = swap.served.path, swap.served.plan
    moved = _move_experts(state, swap)
    _reorder_routers(state, new)
    if state.location is not None:
        state.location.update(new, swap.served.tables if state.location.tables is not None else None)
    if state.order is not None:
        state.order.swap(swap.served.placement)
    if state.recorder is not None:
        state.recorder.swap(path)
    old = state.placement.path
    state.serve(swap.served)
    seconds = time.monotonic() - t0
    logger.info("smoe: live placement: %s -> %s: %d of %d expert slots moved in %.3f s", old, path, moved,
                new.physical2expert.size, seconds)
    return {"placement": path, "previous": old, "moved_slots": moved, "seconds": seconds}


class SmoeWorkerExtension:
    """Mixed into vLLM's worker class (``parallel_config.worker_extension_cls``, set by smoe's
    plugin): the methods ``collective_rpc`` calls by name, in two calls:

    1. ``smoe_prepare_placement(path, yaml, tables, digest)``: the API server read the placement
       and its tables file once (:class:`~vllm_smoe.formats.placement_file.Snapshot`) and sends those bytes;
       each worker parses them (never the path, which may have changed since) and checks them as the
       server checked its first placement at start (:func:`.capability.check_served_placement`), and
       that they fit what was allocated at load (the same physical expert slots; table shapes that
       captured CUDA graphs read). Nothing changes; any refusal on any worker stops the swap here,
       on every worker, so all ranks move or none does.
    2. ``smoe_apply_placement(digest)``: every worker moves its expert weights to the new slots in
       place (vLLM's EPLB transfer, ``rearrange_expert_weights_inplace``, over the expert-parallel
       group; a local permutation where every rank holds every expert), reorders its routers' rows
       the way the loader does, and the copies vLLM made of them after load (:mod:`.derived`; step 1
       refuses a tensor beside a router with an expert-count extent that is no such copy), copies
       and updates the worker's :class:`~..location.DeviceLocation` in place: its slot map, held
       experts, tables and the logical -> physical routes the routers' EPLB state holds, which the
       token order, the routers and the recorder read."""

    def smoe_placement(self) -> str | None:
        w = worker()
        return None if w is None or w.placement is None else w.placement.path

    def smoe_prepare_placement(self, path: str, yaml: bytes, tables: bytes | None, digest: str) -> dict:
        """Check the placement read as these bytes on this worker and allocate what the move
        needs: {"reason": '' = ready, else why (nothing changed), "bytes": expert bytes this rank
        holds in slots that change (the server's deadline for the move)}."""
        from ...formats.placement_file import Snapshot

        w = worker()
        if w is None or w.placement is None:
            return {"reason": "this server loaded no smoe placement (start it with --smoe-placement to swap "
                              "placements live)", "bytes": 0}
        w.pending = {}
        snapshot = Snapshot(path, yaml, tables)
        if snapshot.sha256 != digest:  # what was read is not what arrived: never parse half a file
            return {"reason": f"{path}: the placement arrived altered on this worker; send the request again",
                    "bytes": 0}
        try:
            swap = check_swap(w, snapshot)
        except ValueError as e:
            return {"reason": str(e), "bytes": 0}
        w.pending = {digest: swap}
        return {"reason": "", "bytes": moved_bytes(w.placement.plan, swap)}

    def smoe_cancel_placement(self) -> None:
        w = worker()
        if w is not None:
            w.pending = {}

    def smoe_apply_placement(self, digest: str) -> dict:
        w = worker()
        assert w is not None and digest in w.pending, "apply without a successful prepare"
        return apply_swap(w, w.pending.pop(digest))
