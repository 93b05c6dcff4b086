"""Each rank reads only the expert tensors its placement gives it, and says how much it read.

vLLM's expert-parallel weight filter (``--enable-ep-weight-filter``) skips a per-expert tensor
before reading it when its checkpoint expert id is not in the loader's ``local_expert_ids``: one
set for every layer, vLLM's linear split (``model_loader/default_loader.py:
DefaultModelLoader._init_ep_weight_filter``, ``ep_weight_filter.py: should_skip_weight``). A
placement gives a rank other experts in each layer, and copies, so smoe hands the filter a
:class:`PlacedExperts` instead: per MoE layer, the ids its slots hold. vLLM's ``should_skip_weight``
gets the id alone, not the layer; smoe's replacement of it (``patches/model_loader.py``) asks the
set with the whole name. Where that replacement is not in force, vLLM tests the id against the
set itself, the union over layers: the rank reads more, never less. No torch, no vLLM here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from .load_plan import EXPERT_PARAM, LoadPlan


class PlacedExperts(frozenset):
    """A rank's expert ids per MoE layer (``per_layer[i]`` for decoder layer ``moe_layers[i]``);
    as a set, their union."""

    per_layer: tuple[frozenset[int], ...]
    moe_layers: tuple[int, ...]

    def __new__(cls, per_layer: Iterable[frozenset[int]], moe_layers: Iterable[int]):
        per_layer = tuple(per_layer)
        self = super().__new__(cls, frozenset().union(*per_layer))
        self.per_layer, self.moe_layers = per_layer, tuple(moe_layers)
        assert len(self.per_layer) == len(self.moe_layers)
        return self

    def skips(self, name: str, heavy: bool) -> bool:
        """Whether ``name`` need not be read: a tensor vLLM's filter may skip (``heavy``: its own
        rule, a per-expert ``.weight`` / ``.weight_packed``, never a scale) of an expert no slot of
        this rank holds in that layer. A name smoe does not place (no layer index, a layer that is
        not one of the placement's: a draft's or an MTP layer's) is read."""
        m = EXPERT_PARAM.match(name) if heavy else None
        if m is None or int(m["layer"]) not in self.moe_layers:
            return False
        return int(m["e"]) not in self.per_layer[self.moe_layers.index(int(m["layer"]))]


def should_skip(name: str, ids, vllms: Callable[[str, object], bool]) -> bool:
    """vLLM's ``should_skip_weight(name, ids)`` (``vllms``), a :class:`PlacedExperts` asked per layer."""
    if isinstance(ids, PlacedExperts):
        return ids.skips(name, heavy=vllms(name, frozenset()))  # an empty set: skipped iff filterable
    return vllms(name, ids)


def placed_experts(plan: LoadPlan, rank: int, parallel_config) -> PlacedExperts | None:
    """The filter's set for EP rank ``rank``, or None (read every expert) where vLLM's own filter
    would not run: expert parallelism off, or ``--enable-ep-weight-filter`` not given (vLLM made it
    opt-in, PR #37351; smoe keeps the user's choice). Puts smoe's per-layer test in force."""
    if not (parallel_config.enable_expert_parallel and getattr(parallel_config, "enable_ep_weight_filter", False)):
        return None
    from .patches.model_loader import install

    install(should_skip)
    return PlacedExperts(plan.local_experts(rank), plan.moe_layers)


class ReadTally:
    """Bytes of the expert tensors a rank took from the checkpoint, and which experts they were.
    ``stacked``: names of tensors holding every expert of a layer (read whole when read)."""

    def __init__(self, plan: LoadPlan, stacked: re.Pattern | None = None):
        self.moe_layers, self.num_experts = plan.moe_layers, plan.slot2expert.shape[1]
        self.stacked = stacked
        self.bytes = self.total = 0  # expert tensors', every tensor's
        self.experts: set[tuple[int, int]] = set()

    def count(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """``weights`` unchanged, tallied as they pass (before any renaming: a tensor once)."""
        for name, tensor in weights:
            size = tensor.numel() * tensor.element_size()
            self.total += size
            m = EXPERT_PARAM.match(name) or (self.stacked.match(name) if self.stacked is not None else None)
            if m is not None and int(m["layer"]) in self.moe_layers:
                layer = int(m["layer"])
                self.bytes += size
                ids = [int(m["e"])] if "e" in m.groupdict() else range(self.num_experts)
                self.experts.update((layer, e) for e in ids)
            yield name, tensor

    def line(self, rank: int, filtered: bool) -> str:
        how = ("vLLM's EP weight filter skipped the others, fed this rank's placed slots" if filtered else
               "no filter: pass --enable-ep-weight-filter to read only this rank's")
        return (f"smoe: rank {rank} read {self.bytes / 1e6:.2f} MB of expert weights ({len(self.experts)} of "
                f"{len(self.moe_layers) * self.num_experts} experts over {len(self.moe_layers)} MoE layers), "
                f"{self.total / 1e6:.2f} MB in all; {how}")
