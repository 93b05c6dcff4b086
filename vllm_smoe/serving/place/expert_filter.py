"""Each rank reads only the expert tensors its placement gives it, and says how much it read.

vLLM's expert-parallel weight filter (``--enable-ep-weight-filter``) skips a per-expert tensor
before reading it when its checkpoint expert id is not in the loader's ``local_expert_ids``: one set
for every layer, vLLM's linear split (``model_loader/default_loader.py:
DefaultModelLoader._init_ep_weight_filter``, ``ep_weight_filter.py: should_skip_weight``). A
placement gives a rank other experts in each layer, and copies, so smoe hands the filter a
:class:`PlacedExperts` instead: per MoE layer, the ids its slots hold. vLLM's ``should_skip_weight``
gets the id alone; smoe's replacement (``patches/model_loader.py``) asks the set with the whole
name. Per-expert tensors of a layer the placement does not cover (DeepSeek-V3's MTP layer in the
target's checkpoint) are tested against vLLM's own set, so smoe never reads more than vLLM would.

vLLM reads the set by attribute name, which no signature check covers: after the read
:meth:`ReadTally.check_slots` refuses a rank any of whose (MoE layer, slot) pairs lacks its
expert's tensors. No torch here, and vLLM only for its linear split."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from .load_plan import EXPERT_PARAM, LoadPlan, initial_physical_names


class PlacedExperts(frozenset):
    """A rank's expert ids per MoE layer (``per_layer[i]`` for decoder layer ``moe_layers[i]``), and
    ``unplaced``: the ids it reads of a per-expert tensor outside them (vLLM's own set; None: all);
    as a set, their union. ``in_force``: smoe's per-layer test replaced vLLM's (else vLLM tests
    the id against the set itself, the union over layers: the rank reads more, never less, and
    its read line says so)."""

    per_layer: tuple[frozenset[int], ...]
    moe_layers: tuple[int, ...]
    unplaced: frozenset[int] | None
    in_force: bool

    def __new__(cls, per_layer: Iterable[frozenset[int]], moe_layers: Iterable[int],
                unplaced: Iterable[int] | None = None, in_force: bool = True):
        per_layer = tuple(per_layer)
        unplaced = None if unplaced is None else frozenset(unplaced)
        self = super().__new__(cls, frozenset().union(*per_layer, unplaced or ()))
        self.per_layer, self.moe_layers, self.unplaced, self.in_force = per_layer, tuple(moe_layers), unplaced, in_force
        assert len(self.per_layer) == len(self.moe_layers)
        return self

    def ids_for(self, name: str) -> frozenset[int] | None:
        """The set vLLM's filter tests ``name``'s expert id against: the ids this rank's slots hold
        in its layer, for a per-expert tensor of a placed MoE layer; else (a layer the placement
        does not cover: DeepSeek-V3's MTP layer in the target's checkpoint, a name without a layer
        index) ``unplaced``, what vLLM's own filter would keep."""
        m = EXPERT_PARAM.match(name)
        if m is not None and int(m["layer"]) in self.moe_layers:
            return self.per_layer[self.moe_layers.index(int(m["layer"]))]
        return self.unplaced


def should_skip(name: str, ids, vllms: Callable[[str, object], bool]) -> bool:
    """vLLM's ``should_skip_weight(name, ids)`` (``vllms``: its rule of which tensors it may skip
    and how it reads the id), a :class:`PlacedExperts` asked per layer."""
    return vllms(name, ids.ids_for(name) if isinstance(ids, PlacedExperts) else ids)


def ep_size(parallel_config) -> int:
    """Ranks vLLM splits experts over, as its filter computes them (``_init_ep_weight_filter``:
    DP x PCP x TP); 1 where expert parallelism is off."""
    if not parallel_config.enable_expert_parallel:
        return 1
    return (parallel_config.data_parallel_size * getattr(parallel_config, "prefill_context_parallel_size", 1)
            * parallel_config.tensor_parallel_size)


def unplaced_experts(plan: LoadPlan, rank: int, size: int) -> frozenset[int]:
    """The ids rank ``rank`` of ``size`` reads of a per-expert tensor no placed layer holds: vLLM's
    linear split (``ep_weight_filter.compute_local_expert_ids``); with copies, vLLM builds every MoE
    layer with the redundant slots (and turns its filter off, as under EPLB), so the names its
    slots take there (:func:`initial_physical_names`)."""
    E, P = plan.slot2expert.shape[1], plan.physical2expert.shape[1]
    if P == E:
        from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids

        return frozenset(compute_local_expert_ids(E, size, rank))
    names = initial_physical_names(E, P)
    return frozenset(int(names[p]) for p in plan.local_slots(rank))


def placed_experts(plan: LoadPlan, rank: int, parallel_config) -> PlacedExperts | None:
    """The filter's set for EP rank ``rank``, or None (read every expert) where vLLM's own filter
    would not run: expert parallelism off or over one rank, or ``--enable-ep-weight-filter`` not
    given (vLLM made it opt-in, PR #37351; smoe keeps the user's choice). Puts smoe's per-layer test
    in force (``in_force`` says whether it took)."""
    size = ep_size(parallel_config)
    if size <= 1 or not getattr(parallel_config, "enable_ep_weight_filter", False):
        return None
    from ..patches.model_loader import install

    in_force = install(should_skip)
    return PlacedExperts(plan.local_experts(rank), plan.moe_layers, unplaced_experts(plan, rank, size), in_force)


def needed_slots(plan: LoadPlan, rank: int, parallel_config) -> range:
    """Physical slots rank ``rank`` holds: its share of the placement's under expert parallelism
    (over more than one rank), else every slot."""
    return plan.local_slots(rank) if ep_size(parallel_config) > 1 else range(plan.physical2expert.shape[1])


class ReadTally:
    """Bytes of the expert tensors a rank took from the checkpoint, and which experts they were.
    ``stacked``: names of tensors holding every expert of a layer (read whole when read).
    ``parts[(layer, e)]``: the tensors of expert e in decoder layer ``layer`` that were read, by
    name with the expert id left out (a stacked one counts for every expert), for :meth:`check_slots`."""

    def __init__(self, plan: LoadPlan, stacked: re.Pattern | None = None):
        self.moe_layers, self.num_experts = plan.moe_layers, plan.slot2expert.shape[1]
        self.physical2expert = plan.physical2expert
        self.stacked = stacked
        self.bytes = self.total = 0  # expert tensors', every tensor's
        self.experts: set[tuple[int, int]] = set()
        self.parts: dict[tuple[int, int], set[tuple[str, str | None]]] = {}

    def count(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """``weights`` unchanged, tallied as they pass (before any renaming: a tensor once)."""
        for name, tensor in weights:
            size = tensor.numel() * tensor.element_size()
            self.total += size
            m = EXPERT_PARAM.match(name) or (self.stacked.match(name) if self.stacked is not None else None)
            if m is not None and int(m["layer"]) in self.moe_layers:
                layer = int(m["layer"])
                self.bytes += size
                if "e" in m.groupdict():  # (name before the id, after it)
                    ids, part = [int(m["e"])], (name[:m.start("e")], name[m.end("e"):])
                else:
                    ids, part = range(self.num_experts), (name, None)
                for e in ids:
                    self.experts.add((layer, e))
                    self.parts.setdefault((layer, e), set()).add(part)
            yield name, tensor

    def check_slots(self, slots: range, rank: int) -> None:
        """After the checkpoint streamed: every slot of ``slots`` (this rank's) in every MoE layer had
        its expert's tensors read, each one any expert of that layer had read (a filter fed a set
        other than the placement's skips the weights of experts its slots hold and keeps their
        scales). ValueError naming the first (layer, slot, expert) short of one. Host-side, names only."""
        short = []
        for i, layer in enumerate(self.moe_layers):
            every = set().union(*(self.parts.get((layer, e), ()) for e in range(self.num_experts)))
            for p in slots:
                e = int(self.physical2expert[i, p])
                missing = every - self.parts.get((layer, e), set())
                if missing or not every:
                    short.append((layer, p, e, missing))
        if not short:
            return
        layer, p, e, missing = short[0]
        what = ("no tensor of it was read" if (layer, e) not in self.parts else ", ".join(
            sorted(before if after is None else f"{before}{e}{after}" for before, after in missing)) + " were not read")
        raise ValueError(
            f"smoe placement: rank {rank}'s slot {p} of decoder layer {layer} (an MoE layer) holds expert {e}, but "
            f"{what} from the checkpoint; {len(short)} of its {len(slots) * len(self.moe_layers)} (MoE layer, slot) "
            f"pairs are short. The EP weight filter skipped tensors this rank's slots need (vLLM's own split "
            f"of expert ids, not the placement's: does this vLLM still read DefaultModelLoader.local_expert_ids?). "
            f"Serve without --enable-ep-weight-filter, or report this vLLM version")

    def line(self, rank: int, ids) -> str:
        """The read line; ``ids``: the loader's ``local_expert_ids`` (which filter was in force)."""
        if ids is None:
            how = "no filter: pass --enable-ep-weight-filter to read only this rank's"
        elif not isinstance(ids, PlacedExperts):
            how = "vLLM's EP weight filter skipped the others, fed vLLM's own split of expert ids"
        elif ids.in_force:
            how = "vLLM's EP weight filter skipped the others, fed this rank's placed slots"
        else:
            how = ("vLLM's EP weight filter skipped only experts no slot of this rank holds in any layer (the union "
                   "over layers: smoe's per-layer test was refused, vLLM's should_skip_weight is not the one smoe "
                   "was written for)")
        return (f"smoe: rank {rank} read {self.bytes / 1e6:.2f} MB of expert weights ({len(self.experts)} of "
                f"{len(self.moe_layers) * self.num_experts} experts over {len(self.moe_layers)} MoE layers), "
                f"{self.total / 1e6:.2f} MB in all; {how}")
