"""From a placement YAML and a model config to the slot permutation applied at load.

Two orders of experts. The *router order*: the router's rows are permuted so that its output i
is logical expert slot2expert[l, i], rank 0's home experts first (ascending logical id), then
rank 1's, ... Without replicas this is also the *physical order*, so vLLM's contiguous expert
split (E/N slots per EP rank; where N does not divide E, the first E mod N ranks one more, as
the placement's ranks hold) puts on each rank exactly the experts the YAML gives it.

With replicas (C extra copies per rank, C = the most any rank has in any layer) vLLM allocates
P = E + N*C physical slots, S = E/N + C per rank: rank r's slots [r*S, (r+1)*S) hold its home
experts, then its copies, then fillers (dead copies of its first home expert, never routed to,
where a layer has fewer copies). ``route2physical[l, r]`` sends router output i to the copy on
rank r when r holds one, else to its home slot: applied on the rank that routes the row, a
token uses the copy on its own rank. No torch here.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...formats.model_info import expert_groups, moe_layer_indices, num_experts, top_k
from ...formats.placement_file import Placement, load_placement, model_fingerprint
from ...placement.groups import broken_group
from ...placement.counts import rank_sizes

# a router parameter of MoE layer ``layer`` as checkpoints and vLLM's models name it: the rows the
# loader permutes into router order and a live swap permutes again. ``router``: Llama 4 and
# GPT-OSS (with a bias); ``router.layer``: Granite-MoE; ``router.gate``: AFMoE's checkpoints;
# ``moe_statics``: ERNIE 4.5 keeps the score bias there, [1, E]; a score bias straight under the
# block: EXAONE-MoE, MiniMax-M2 (``e_score_correction_bias``), LFM2-MoE and AFMoE (``expert_bias``)
ROUTER_PARAM = re.compile(r"^.*\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|feed_forward)\."
                          r"(?:(?:gate|router|router\.layer|router\.gate|moe_statics)\."
                          r"(?:weight|bias|e_score_correction_bias)|e_score_correction_bias|expert_bias)$")
# any tensor of a decoder layer's feed-forward block: one with an extent of E that smoe does not
# know is refused at load rather than left in checkpoint order (a silent change of routing); a
# vision tower's layers (Llama 4's ``vision_model.model.layers.<i>.mlp``) are not the decoder's
# one expert's tensor in its own name, ``...layers.{i}.<moe>.experts.{e}.*``: the loader renames it
# to the expert's slot, and a rank reads it only where one of its slots holds expert e
EXPERT_PARAM = re.compile(r"^(?P<pre>.*\.layers\.(?P<layer>\d+)\.(?:[^.]+\.)*?)experts\.(?P<e>\d+)\.(?P<rest>.+)$")
MOE_BLOCK_PARAM = re.compile(r"^(?!.*vis(?:ion|ual))"
                             r".*\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.(?P<rest>.+)$")


def initial_physical_names(num_experts: int, num_physical: int) -> np.ndarray:
    """[P] int64: the checkpoint expert id vLLM's loaders read into each physical slot when
    redundant slots exist (its EPLB start: slot p < E holds expert p, slot p >= E expert
    (p - E) % E). smoe loads slot p by handing it a tensor under this name."""
    p = np.arange(num_physical, dtype=np.int64)
    return np.where(p < num_experts, p, (p - num_experts) % num_experts)


@dataclass(frozen=True)
class LoadPlan:
    """moe_layers: decoder layer index of each MoE layer, [L]; slot2expert: [L, E] int64,
    logical expert of each router output (router order); expert2slot: [L, E] int64, its
    inverse; physical2expert: [L, P] int64, logical expert held by each physical slot (P = E
    without replicas, then equal to slot2expert); route2physical: [L, N, E] int64, physical slot
    that rank r's rows use for router output i (N = the placement's ep_size; the identity
    without replicas)."""

    moe_layers: tuple[int, ...]
    slot2expert: np.ndarray
    expert2slot: np.ndarray
    physical2expert: np.ndarray
    route2physical: np.ndarray

    @property
    def num_redundant(self) -> int:
        """Physical slots beyond the E logical experts (vLLM's num_redundant_experts)."""
        return self.physical2expert.shape[1] - self.slot2expert.shape[1]

    @functools.cached_property
    def slot2rank(self) -> np.ndarray:
        """[P] int64: the rank holding each physical slot (vLLM's linear split: P / N each, or
        the first P mod N ranks one more where N does not divide E, which has no replicas)."""
        N, P = self.route2physical.shape[1], self.physical2expert.shape[1]
        return np.repeat(np.arange(N), rank_sizes(P, N))

    def local_slots(self, rank: int) -> range:
        """Physical slots rank ``rank`` holds (vLLM's linear split)."""
        mine = np.flatnonzero(self.slot2rank == rank)
        return range(int(mine[0]), int(mine[-1]) + 1) if mine.size else range(0)

    def held(self, rank: int) -> np.ndarray:
        """[L, E] bool: rank ``rank`` holds a copy (home or replica) of router output i."""
        return self.slot2rank[self.route2physical[:, rank]] == rank

    def local_experts(self, rank: int) -> list[frozenset[int]]:
        """Per MoE layer, the checkpoint expert ids held by rank ``rank``'s slots, copies included:
        the per-expert tensors it must read (every other one lands in another rank's slot)."""
        slots = self.local_slots(rank)
        return [frozenset(int(e) for e in row[slots.start: slots.stop]) for row in self.physical2expert]

    def layer_of(self, decoder_layer: int) -> int | None:
        """MoE ordinal of a decoder layer index, None for dense layers."""
        try:
            return self.moe_layers.index(decoder_layer)
        except ValueError:
            return None


def _checkpoint_config(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


# where a checkpoint lists experts that vLLM (0.33 on) replaces by constants (MoNE pruning,
# vllm/model_executor/layers/fused_moe/expert_substitution.py): vLLM keys them by logical expert id,
# both on the router's output and in the expert tensors' names, which a placement turns into slots
_SUBSTITUTION_FIELDS = ("approximate_experts", "compression_config.transform_config.expert_substitution")


def _field(config, dotted: str):
    for key in dotted.split("."):
        config = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return config


def substituted_experts_field(*configs) -> str | None:
    """The config field by which any of ``configs`` (transformers configs or dicts) lists experts
    vLLM replaces by constants, or None; an empty list substitutes nothing (as in vLLM)."""
    for config in configs:
        for name in _SUBSTITUTION_FIELDS:
            value = _field(config, name)
            if isinstance(value, Mapping) and name.endswith("expert_substitution"):
                value = value.get("targets")
            if isinstance(value, Mapping):
                value = any(value.values())  # {layer: expert ids} / {module: target}
            if value:
                return name
    return None


def make_load_plan(placement_path: str, hf_config, model_dir: str, ep_ranks: int | None,
                   placement: Placement | None = None, outer_config=None) -> LoadPlan:
    """Validate ``placement_path`` against the served model and build its slot permutation.

    hf_config: the model's transformers config (a vision-language model's text part);
    model_dir: checkpoint directory (for the fingerprint); ep_ranks: ranks the experts are split
    over (None when every rank holds all experts); placement: the file as parsed before (else it
    is read); outer_config: the whole config where hf_config is its text part. Raises ValueError
    naming the file and field on any mismatch, and the checkpoint and its config field when the
    checkpoint substitutes experts.
    """
    field = substituted_experts_field(hf_config, outer_config or {}, _checkpoint_config(model_dir) or {})
    if field is not None:
        raise ValueError(f"{placement_path}: the checkpoint at {model_dir} lists experts vLLM replaces by constants "
                         f"(config field '{field}'); vLLM names them by expert id on the router's output, which a "
                         f"placement renumbers, so other experts would be replaced. Serve it without a placement")
    p: Placement = placement if placement is not None else load_placement(placement_path)
    where = f"{placement_path}"
    layers = moe_layer_indices(hf_config)
    E, K = num_experts(hf_config), top_k(hf_config)
    if p.num_layers != len(layers):
        raise ValueError(f"{where}: field 'model.num_layers' = {p.num_layers} but the model has {len(layers)} "
                         f"MoE layers")
    if p.num_experts != E:
        raise ValueError(f"{where}: field 'model.num_experts' = {p.num_experts} but the model has {E} experts")
    if p.top_k != K:
        raise ValueError(f"{where}: field 'model.top_k' = {p.top_k} but the model routes to {K} experts")
    if p.fingerprint:
        cfg = _checkpoint_config(model_dir)
        if cfg is not None and model_fingerprint(cfg) != p.fingerprint:
            raise ValueError(f"{where}: field 'model.fingerprint' = {p.fingerprint} does not match the model at "
                             f"{model_dir} ({model_fingerprint(cfg)}): built for another checkpoint")
    if ep_ranks is not None and ep_ranks > 1 and p.ep_size != ep_ranks:
        raise ValueError(f"{where}: field 'ep_size' = {p.ep_size} but experts are split over {ep_ranks} ranks")
    has_replicas = bool((p.replicas[..., 0] >= 0).any())
    if has_replicas and (ep_ranks is None or ep_ranks < 2):
        raise ValueError(f"{where}: field 'layers[].replicas': copies need experts split over ranks "
                         f"(--enable-expert-parallel); build the placement without --replicas")
    slot2expert = np.argsort(p.expert2rank, axis=1, kind="stable").astype(np.int64)
    expert2slot = np.argsort(slot2expert, axis=1, kind="stable").astype(np.int64)
    physical2expert, route2physical = _physical_layout(p.expert2rank, p.replicas, p.ep_size, expert2slot)
    groups = expert_groups(hf_config)
    if groups > 1:
        for layer in range(p.num_layers):
            e = broken_group(p.expert2rank[layer], groups)
            if e >= 0:
                raise ValueError(f"{where}: field 'layers[{layer}].expert_to_rank' splits expert {e}'s routing "
                                 f"group ({groups} groups of {E // groups}: a rank must hold whole groups, or a "
                                 f"block of ranks one group); grouped top-k routing would change. Build the "
                                 f"placement with --model {model_dir} (reads n_group) or --groups {groups}")
    return LoadPlan(tuple(layers), slot2expert, expert2slot, physical2expert, route2physical)


def _physical_layout(expert2rank: np.ndarray, replicas: np.ndarray, ep_size: int, expert2slot: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(physical2expert [L, P] int64, route2physical [L, N, E] int64) of the module docstring.
    expert2rank: [L, E] home ranks, vLLM's split (validated: E/N per rank with replicas, which an
    uneven split cannot have); replicas: [L, R, 2] (expert,
    rank), -1 = none; expert2slot: [L, E] router output of each expert."""
    L, E = expert2rank.shape
    N = ep_size
    copies = [[sorted(int(e) for e, r in replicas[layer] if e >= 0 and r == rank) for rank in range(N)]
              for layer in range(L)]
    C = max((len(c) for per_rank in copies for c in per_rank), default=0)
    if C == 0:  # the router order is the physical order (any split, even or not)
        return (np.argsort(expert2slot, axis=1, kind="stable").astype(np.int64),
                np.broadcast_to(np.arange(E, dtype=np.int64), (L, N, E)).copy())
    S = E // N + C
    physical2expert = np.empty((L, N * S), dtype=np.int64)
    route2physical = np.empty((L, N, E), dtype=np.int64)
    for layer in range(L):
        home = np.arange(E) // (E // N) * S + np.arange(E) % (E // N)  # router output -> home slot
        for rank in range(N):
            mine = np.flatnonzero(expert2rank[layer] == rank)  # ascending: the router order's
            held = list(mine) + copies[layer][rank]
            held += [mine[0]] * (S - len(held))  # fillers
            physical2expert[layer, rank * S: (rank + 1) * S] = held
            route = home.copy()
            for j, e in enumerate(copies[layer][rank]):
                route[expert2slot[layer, e]] = rank * S + E // N + j
            route2physical[layer, rank] = route
    return physical2expert, route2physical


def plan_for(placement_path: str, vllm_config, placement: Placement | None = None) -> LoadPlan:
    """:func:`make_load_plan` for a vLLM config: experts are split over TP x DP ranks only when
    vLLM's expert parallelism is on."""
    pc = vllm_config.parallel_config
    ep = pc.tensor_parallel_size * pc.data_parallel_size if pc.enable_expert_parallel else None
    mc = vllm_config.model_config
    return make_load_plan(placement_path, mc.hf_text_config, mc.model, ep, placement, outer_config=mc.hf_config)
