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

from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase


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


class SparseAll2AllManager(All2AllManagerBase):
    """comm: the expert-parallel group's device communicator (its ``all_gather`` is the transport).
    ``stats``: cumulative (token, remote rank) pairs and bytes a point-to-point transport carries."""

    def __init__(self, cpu_group, comm):
        super().__init__(cpu_group)
        from vllm.config import get_current_vllm_config

        from ..model_info import num_experts

        self.comm = comm
        hf = get_current_vllm_config().model_config.hf_text_config
        self.owner = owner_of(num_experts(hf), comm.world_size)
        self.stats = {"tokens": 0, "pairs": 0, "bytes": 0}
        self._plan = None

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(x.contiguous(), 0)

    def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False, extra_tensors=None):
        if extra_tensors:
            raise NotImplementedError("smoe's sparse all2all carries no extra tensors (quantization scales, LoRA); "
                                      "use additional_config smoe.all2all 'vllm'")
        N, me = self.comm.world_size, self.comm.rank_in_group
        t, K = topk_ids.shape
        bits = destinations(topk_ids, self.owner, me, N)
        out_rows = torch.nonzero(bits, as_tuple=True)[0]  # [U] rows leaving this rank, once each
        per_dest = torch.stack([((bits >> r) & 1).sum() for r in range(N)])  # [N]
        counts = self._gather(torch.cat([out_rows.new_tensor([out_rows.numel()]), per_dest]).view(1, -1))
        counts = counts.view(N, N + 1).tolist()  # host sizes: CPU tensors, no device to wait for
        unique = [c[0] for c in counts]
        pair = [c[1:] for c in counts]  # pair[src][dst] rows src sends to dst
        m = max(unique)
        H = hidden_states.shape[1]
        received_h, received_w, received_i, recv_from = [], [], [], []
        if m:
            h = hidden_states.new_zeros((m, H))
            h[: out_rows.numel()] = hidden_states.index_select(0, out_rows)
            meta = torch.zeros((m, 2 * K + 1), dtype=torch.int32, device=topk_ids.device)
            meta[: out_rows.numel(), :K] = topk_ids.index_select(0, out_rows).to(torch.int32)
            meta[: out_rows.numel(), K: 2 * K] = topk_weights.index_select(0, out_rows).float().view(torch.int32)
            meta[: out_rows.numel(), 2 * K] = bits.index_select(0, out_rows).to(torch.int32)
            gh, gm = self._gather(h).view(N, m, H), self._gather(meta).view(N, m, 2 * K + 1)
            for src in range(N):
                if src == me or not pair[src][me]:
                    continue
                mine = torch.nonzero((gm[src, : unique[src], 2 * K] >> me) & 1, as_tuple=True)[0]
                received_h.append(gh[src].index_select(0, mine))
                rm = gm[src].index_select(0, mine)
                received_i.append(rm[:, :K].to(topk_ids.dtype))
                received_w.append(rm[:, K: 2 * K].view(torch.float32).to(topk_weights.dtype))
                recv_from.append((src, mine.numel()))
        self._plan = (t, bits, out_rows, pair, recv_from)
        sent = sum(pair[me])
        self.stats["tokens"] += t
        self.stats["pairs"] += sent
        self.stats["bytes"] += sent * (H * hidden_states.element_size() + 8 * K) + sent * H * hidden_states.element_size()
        return (torch.cat([hidden_states, *received_h]), torch.cat([topk_weights, *received_w]),
                torch.cat([topk_ids, *received_i]))

    def combine(self, hidden_states, is_sequence_parallel=False):
        assert self._plan is not None, "combine without dispatch"
        t, bits, out_rows, pair, recv_from = self._plan
        self._plan = None
        N, me = self.comm.world_size, self.comm.rank_in_group
        own = hidden_states[:t].clone()
        received = [sum(pair[src][dst] for src in range(N) if src != dst) for dst in range(N)]
        m = max(received)
        if not m:
            return own
        H = hidden_states.shape[1]
        back = hidden_states.new_zeros((m, H))
        back[: hidden_states.shape[0] - t] = hidden_states[t:]
        g = self._gather(back).view(N, m, H)
        for peer in range(N):
            n = pair[me][peer] if peer != me else 0
            if not n:
                continue
            offset = sum(pair[src][peer] for src in range(me) if src != peer)
            rows = out_rows[torch.nonzero((bits.index_select(0, out_rows) >> peer) & 1, as_tuple=True)[0]]
            own.index_add_(0, rows, g[peer, offset: offset + n])
        return own

    def dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel=False, extra_tensors=None):
        raise NotImplementedError("smoe's sparse all2all needs the modular MoE path (top-k ids before dispatch); "
                                  "use additional_config smoe.all2all 'vllm' for this MoE backend")

    def destroy(self):
        pass
