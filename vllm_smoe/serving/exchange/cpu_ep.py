"""vLLM's own expert parallelism on its CPU build, the communicator smoe puts under it, and
the rotary embedding MLA needs there.

Four gaps in vLLM 0.32's CPU build, all small (docs/patches.md describes them for upstream), each
told in full where it is filled:

1. the CPU experts ignore ``expert_map`` (:func:`~.patches.cpu.fix_cpu_experts`, :func:`local_pairs`);
2. ``CpuCommunicator`` lacks ``all_gatherv`` / ``reduce_scatterv`` (:class:`SmoeCpuCommunicator`);
3. the CPU rope op rotates MLA's 3-D queries and keys wrongly (:func:`~.patches.cpu.fix_cpu_rope`);
4. the logical -> physical expert map is the identity on CPU (:func:`~.patches.cpu.fix_cpu_eplb_map`).

The replacements of vLLM's symbols are in :mod:`.patches.cpu`; this module holds what they
install. With smoe asked for (``additional_config["smoe"]`` present) the CPU platform's
communicator is :class:`SmoeCpuCommunicator` and the worker that asks for it gets the experts fix;
the all2all manager is smoe's sparse one (:mod:`.sparse_a2a`) when the config says so."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator, _CPUSHMDistributed

from .sparse_a2a import p2p_reduce_scatter

logger = logging.getLogger("vllm.smoe")


def local_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs this rank computes, as single-expert rows.

    topk_ids: [M, K] global expert ids; topk_weights: [M, K]; expert_map: [E_global] int,
    local index or -1 = held elsewhere. Returns (rows [P] int64 token index of each pair,
    ids [P, 1] int32 local expert, weights [P, 1]). CPU only (data-dependent P).
    """
    local = expert_map[topk_ids.long()]
    rows, k = torch.nonzero(local >= 0, as_tuple=True)
    return rows, local[rows, k].to(torch.int32).unsqueeze(1), topk_weights[rows, k].unsqueeze(1)


def map_to_physical(topk_ids: torch.Tensor, expert_load_view: torch.Tensor, logical_to_physical_map: torch.Tensor,
                    logical_replica_count: torch.Tensor, record_enabled: torch.Tensor,
                    num_unpadded_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's EPLB map-and-record in torch (its Triton kernel's semantics).

    topk_ids: [T, K] logical ids (outside [0, E) map to -1); logical_to_physical_map: [E, M]
    int, physical slot of each replica, -1 = none; logical_replica_count: [E] int;
    expert_load_view: [P] int, incremented per mapped activation when record_enabled (0-d bool)
    and the row is below num_unpadded_tokens (0-d int, None = every row). Returns [T, K] of
    topk_ids' dtype. No host reads: recording is masked, not branched."""
    if topk_ids.numel() == 0:
        return topk_ids
    E = logical_replica_count.shape[0]
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    safe = torch.where(valid, ids, 0)
    count = logical_replica_count[safe].clamp(min=1)
    token = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    replica = ((token * 2654435769) & 0xFFFFFFFF) % count
    physical = torch.where(valid, logical_to_physical_map[safe, replica].long(), -1)
    keep = valid & record_enabled.to(torch.bool) & (physical >= 0) & (physical < expert_load_view.shape[0])
    if num_unpadded_tokens is not None:
        keep &= token < num_unpadded_tokens
    expert_load_view.index_add_(0, physical.clamp(min=0).flatten(), keep.flatten().to(expert_load_view.dtype))
    return physical.to(topk_ids.dtype)


def smoe_settings():
    """smoe's settings of the vLLM config being built, or None when smoe was not asked for."""
    from vllm import config as vllm_config

    from ..config import SmoeConfig

    current = getattr(vllm_config, "get_current_vllm_config_or_none", None)
    vc = current() if current is not None else vllm_config.get_current_vllm_config()
    return None if vc is None else SmoeConfig.from_additional_config(vc.additional_config)


def _unlink_own_segment(group_name: str, rank: int) -> None:
    """Remove this rank's shared-memory segment of the EP group from /dev/shm once every rank of
    the group has mapped it (``_CPUSHMDistributed`` ends in a barrier after all joined): the
    mappings stay valid until the processes exit, and nothing is left behind, however they
    exit (vLLM never unlinks its groups' segments: each stopped server leaves them)."""
    path = os.path.join("/dev/shm", f"{group_name}_{rank}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("smoe: could not remove the EP group's shared memory %s (%s): it stays after exit", path,
                       e.strerror)


def _counted(kind: str):
    """A communicator method whose calls count per served step (:mod:`.collectives`)."""
    def wrap(fn):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            with self.counted(kind):
                return fn(self, *args, **kwargs)
        return method
    return wrap


class SmoeCpuCommunicator(CpuCommunicator):
    """vLLM's CpuCommunicator plus ``all_gatherv`` / ``reduce_scatterv``, shared memory for
    the EP group, smoe's sparse all2all manager when asked for, and its collectives counted.

    ``CpuCommunicator`` has no ``all_gatherv`` / ``reduce_scatterv``, which the only all2all
    manager it allows (``allgather_reducescatter``) calls whenever tokens are sequence parallel or
    data parallel. This class adds both, and runs the expert-parallel group on
    vLLM's shared-memory transport (vLLM enables it only for groups named tp/pp)."""

    counts = None  # CollectiveCounts of this process (set once the group is up)
    group = ""  # vLLM's group name without its suffix: tp, ep, dp, ...
    all_reduce = _counted("all_reduce")(CpuCommunicator.all_reduce)
    gather = _counted("gather")(CpuCommunicator.gather)
    broadcast = _counted("broadcast")(CpuCommunicator.broadcast)
    send = _counted("send")(CpuCommunicator.send)
    recv = _counted("recv")(CpuCommunicator.recv)

    def __init__(self, cpu_group, device=None, device_group=None, unique_name: str = "",
                 use_all2all: bool = False):
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        if (unique_name.startswith("ep") and self.world_size > 1 and hasattr(torch.ops._C, "init_shm_manager")
                and not isinstance(self.dist_module, _CPUSHMDistributed)
                and self._all_group_ranks_share_shm_group_name()):
            self.dist_module = _CPUSHMDistributed(self)
            _unlink_own_segment(self.dist_module.group_name, self.rank)
        cfg = smoe_settings()
        if cfg is not None:
            from .collectives import counts, group_of

            self.group = group_of(unique_name)
            self.counts = counts(torch.distributed.get_rank(), cfg)
        if self.use_all2all and cfg is not None and cfg.all2all in (None, "sparse"):
            from .sparse_a2a import make_manager

            self.all2all_manager = make_manager(self.cpu_group, self)
            logger.info("smoe: sparse de-duplicated all2all manager on group %s (communicator: %s)", unique_name,
                        "shared memory, static-size gather" if isinstance(self.dist_module, _CPUSHMDistributed)
                        else "gloo, point to point")

    def counted(self, kind: str):
        """Around one collective on this group (also smoe's exchange's all-to-alls)."""
        return contextlib.nullcontext() if self.counts is None else self.counts.call(self.group, kind)

    @_counted("all_gather")
    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        # vLLM's shared-memory all-gather copies floating-point tensors only: carry 4- and 8-byte
        # integers bit for bit as float32 words
        if (isinstance(self.dist_module, _CPUSHMDistributed) and not input_.is_floating_point()
                and input_.element_size() in (4, 8) and input_.dim() > 0):
            words = input_.contiguous().view(torch.float32)
            return super().all_gather(words, dim).view(input_.dtype)
        return super().all_gather(input_, dim)

    @_counted("all_gatherv")
    def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
        assert dim == 0, "smoe's all_gatherv gathers along dim 0"
        tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
        n = tensors[0].shape[0]
        assert sizes is None or sizes[self.rank_in_group] == n
        m = n if sizes is None else max(sizes)
        row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]
        if any(b % 4 for b in row_bytes):
            gathered = [self._all_gatherv(t, sizes) for t in tensors]
            return gathered[0] if isinstance(input_, torch.Tensor) else gathered
        # one collective for all tensors: their rows as 4-byte words side by side
        words = [t.contiguous().view(torch.uint8).view(n, b).view(torch.float32) for t, b in zip(tensors, row_bytes)]
        packed = torch.cat(words, dim=1) if len(words) > 1 else words[0]
        if m != n:
            packed = torch.cat([packed, packed.new_zeros((m - n, packed.shape[1]))])
        g = self.all_gather(packed, 0)
        if sizes is not None and m * self.world_size != sum(sizes):
            g = torch.cat([g[r * m: r * m + s] for r, s in enumerate(sizes)])
        out, col = [], 0
        for t, w in zip(tensors, words):
            part = g[:, col: col + w.shape[1]].contiguous().view(torch.uint8).view(t.dtype)
            out.append(part.reshape((g.shape[0],) + tuple(t.shape[1:])))
            col += w.shape[1]
        return out[0] if isinstance(input_, torch.Tensor) else out

    def _all_gatherv(self, x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        if sizes is None or len(set(sizes)) == 1:
            return self.all_gather(x.contiguous(), 0)
        m = max(sizes)
        padded = x.new_zeros((m,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        g = self.all_gather(padded, 0)
        return torch.cat([g[r * m: r * m + s] for r, s in enumerate(sizes)])

    @_counted("reduce_scatter")
    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Equal chunks along ``dim``, summed over the group. vLLM's base runs gloo's
        ``reduce_scatter_tensor``, which moves an all-reduce's bytes and, within a node, never
        uses the shared memory: here shared memory all-reduces once and keeps this rank's chunk
        (no reduce-scatter of its own), and gloo sends each peer only its chunk
        (``all_to_all_single``, (N - 1) / N of the tensor out and in) and adds what comes back."""
        N = self.world_size
        if N == 1:
            return input_
        dim = dim % input_.dim()
        x = input_.movedim(dim, 0)
        assert x.shape[0] % N == 0, f"reduce_scatter of {x.shape[0]} rows over {N} ranks"
        c = x.shape[0] // N
        if isinstance(self.dist_module, _CPUSHMDistributed):
            x = x.clone(memory_format=torch.contiguous_format)  # the all-reduce is in place
            self.all_reduce(x)
            out = x[self.rank_in_group * c: (self.rank_in_group + 1) * c]
        else:
            out = p2p_reduce_scatter(x, N, self.device_group)
        return out.movedim(0, dim).contiguous()

    @_counted("reduce_scatterv")
    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
                        ) -> torch.Tensor:
        dim = dim % input_.dim()
        assert dim == 0, "smoe's reduce_scatterv scatters along dim 0"
        if sizes is None:
            assert input_.shape[0] % self.world_size == 0
            sizes = [input_.shape[0] // self.world_size] * self.world_size
        if len(set(sizes)) == 1 and not isinstance(self.dist_module, _CPUSHMDistributed):
            return self.reduce_scatter(input_, 0)  # gloo has reduce_scatter_tensor: less traffic than all-reduce
        summed = input_.clone(memory_format=torch.contiguous_format)  # shared memory has no reduce-scatter
        self.all_reduce(summed)
        start = sum(sizes[: self.rank_in_group])
        return summed[start: start + sizes[self.rank_in_group]]
