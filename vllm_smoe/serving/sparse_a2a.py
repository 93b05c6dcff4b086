"""smoe's sparse, de-duplicated all2all manager for vLLM's expert-parallel MoE.

vLLM's CPU build only has ``allgather_reducescatter``: every rank receives every token of every
other rank and sends back a full-size partial sum, whatever its experts. Here a token crosses to
a remote rank only if one of its top-k experts lives there, once per (token, rank), with its ids
and weights; one weighted partial row comes back. With smoe's token order most tokens already
sit on the rank holding their experts, so most rows never leave.

The manager speaks vLLM's all2all interface (``dispatch`` / ``combine``), so vLLM's
prepare/finalize and fused experts run unchanged: ``dispatch`` returns this rank's own rows
followed by the rows it received, the experts compute whatever of them is local (``expert_map``),
and ``combine`` returns each received row's partial sum to its source and adds it in.

Transport: each rank packs its outgoing rows once (a destination bit mask per row), and the
group's ``all_gather`` carries them (vLLM's shared-memory transport on one CPU node); a receiver
keeps the rows whose mask names it. The byte counters count what a point-to-point transport
carries: one row per (token, remote rank) pair. Sizes are exchanged as a tensor and read on the
host (CPU tensors here); see the README for GPUs.
"""

from __future__ import annotations

import torch

from collections.abc import Callable


def owner_of(num_experts: int, world_size: int) -> torch.Tensor:
    """[E] int64 rank holding each physical expert under vLLM's linear split (E / N per rank)."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {world_size} expert-parallel ranks")
    return torch.arange(num_experts) // (num_experts // world_size)


def destinations(topk_ids: torch.Tensor, owner: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """[t] int64 bit mask of the remote ranks each row must visit (bit r = rank r holds one of
    its experts; this rank's own bit is never set). topk_ids: [t, K] physical expert ids."""
    dest = owner.to(topk_ids.device)[topk_ids.long()]  # [t, K]
    bits = torch.zeros(topk_ids.shape[0], dtype=torch.int64, device=topk_ids.device)
    for r in range(world_size):
        if r != rank:
            bits |= (dest == r).any(dim=1).to(torch.int64) << r
    return bits


class SparseExchange:
    """The sparse dispatch/combine of one expert-parallel group, over any row all-gather.

    rank, world_size: this rank in the group; owner: [E] int64 rank of each physical expert;
    gather: ``x [n, ...] -> [world_size * n, ...]`` (the same n on every rank), the transport.
    ``stats``: cumulative tokens, (token, remote rank) pairs and bytes that a point-to-point
    transport would carry for this rank's tokens (rows out with ids and weights, rows back)."""

    def __init__(self, rank: int, world_size: int, owner: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]):
        self.rank, self.world_size, self.owner, self.gather = rank, world_size, owner, gather
        self.stats = {"tokens": 0, "pairs": 0, "bytes": 0}
        self._plan = None

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Own rows, then the rows other ranks sent here (source rank order, then source row
        order): (hidden [t + r, H], topk_weights [t + r, K], topk_ids [t + r, K])."""
        N, me = self.world_size, self.rank
        t, K = topk_ids.shape
        bits = destinations(topk_ids, self.owner, me, N)
        out_rows = torch.nonzero(bits, as_tuple=True)[0]  # [U] rows leaving this rank, once each
        per_dest = torch.stack([((bits >> r) & 1).sum() for r in range(N)])  # [N]
        counts = self.gather(torch.cat([out_rows.new_tensor([out_rows.numel()]), per_dest]).view(1, -1))
        counts = counts.view(N, N + 1).tolist()  # host sizes: CPU tensors, no device to wait for
        unique = [c[0] for c in counts]
        pair = [c[1:] for c in counts]  # pair[src][dst]: rows src sends to dst
        m = max(unique)
        H = hidden_states.shape[1]
        received_h, received_w, received_i = [], [], []
        if m:
            u = out_rows.numel()
            h = hidden_states.new_zeros((m, H))
            h[:u] = hidden_states.index_select(0, out_rows)
            meta = torch.zeros((m, 2 * K + 1), dtype=torch.int32, device=topk_ids.device)
            meta[:u, :K] = topk_ids.index_select(0, out_rows).to(torch.int32)
            meta[:u, K: 2 * K] = topk_weights.index_select(0, out_rows).float().view(torch.int32)
            meta[:u, 2 * K] = bits.index_select(0, out_rows).to(torch.int32)
            gh, gm = self.gather(h).view(N, m, H), self.gather(meta).view(N, m, 2 * K + 1)
            for src in range(N):
                if src == me or not pair[src][me]:
                    continue
                mine = torch.nonzero((gm[src, : unique[src], 2 * K] >> me) & 1, as_tuple=True)[0]
                received_h.append(gh[src].index_select(0, mine))
                rm = gm[src].index_select(0, mine)
                received_i.append(rm[:, :K].to(topk_ids.dtype))
                received_w.append(rm[:, K: 2 * K].contiguous().view(torch.float32).to(topk_weights.dtype))
        self._plan = (t, bits, out_rows, pair)
        sent = sum(pair[me])
        row = H * hidden_states.element_size()
        self.stats["tokens"] += t
        self.stats["pairs"] += sent
        self.stats["bytes"] += sent * (2 * row + 8 * K)
        return (torch.cat([hidden_states, *received_h]), torch.cat([topk_weights, *received_w]),
                torch.cat([topk_ids, *received_i]))

    def combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [t + r, H] expert outputs of :meth:`dispatch`'s rows (weighted, summed
        over this rank's experts). Returns [t, H]: each own row plus what remote ranks computed."""
        assert self._plan is not None, "combine without dispatch"
        t, bits, out_rows, pair = self._plan
        self._plan = None
        N, me = self.world_size, self.rank
        own = hidden_states[:t].clone()
        m = max(sum(pair[src][dst] for src in range(N) if src != dst) for dst in range(N))
        if not m:
            return own
        back = hidden_states.new_zeros((m, hidden_states.shape[1]))
        back[: hidden_states.shape[0] - t] = hidden_states[t:]
        g = self.gather(back).view(N, m, -1)
        out_bits = bits.index_select(0, out_rows)
        for peer in range(N):
            n = pair[me][peer] if peer != me else 0
            if n:
                offset = sum(pair[src][peer] for src in range(me) if src != peer)
                rows = out_rows[torch.nonzero((out_bits >> peer) & 1, as_tuple=True)[0]]
                own.index_add_(0, rows, g[peer, offset: offset + n])
        return own


def make_manager(cpu_group, comm):
    """vLLM's all2all manager around :class:`SparseExchange`, on the EP communicator ``comm``."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

    from ..model_info import num_experts

    class SparseAll2AllManager(All2AllManagerBase):
        def __init__(self):
            super().__init__(cpu_group)
            hf = get_current_vllm_config().model_config.hf_text_config
            self.exchange = SparseExchange(comm.rank_in_group, comm.world_size,
                                           owner_of(num_experts(hf), comm.world_size),
                                           lambda x: comm.all_gather(x.contiguous(), 0))

        def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False, extra_tensors=None):
            if extra_tensors:
                raise NotImplementedError("smoe's sparse all2all carries no extra tensors (quantization scales, "
                                          "LoRA); set additional_config smoe.all2all to 'vllm'")
            return self.exchange.dispatch(hidden_states, topk_weights, topk_ids)

        def combine(self, hidden_states, is_sequence_parallel=False):
            return self.exchange.combine(hidden_states)

        def dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel=False,
                                   extra_tensors=None):
            raise NotImplementedError("smoe's sparse all2all needs the modular MoE path (top-k ids before "
                                      "dispatch); set additional_config smoe.all2all to 'vllm' for this backend")

        def destroy(self):
            pass

    return SparseAll2AllManager()
