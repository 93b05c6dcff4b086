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

Transports and what the byte counters count: :class:`SparseExchange`."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("vllm.smoe")


def served_rows(forward_context, t: int, is_sequence_parallel: bool, sp_rank: int = 0,
                dp_rank: int = 0) -> torch.Tensor | bool:
    """Which of a step's ``t`` MoE rows are served tokens, the only ones the exchange sends and
    counts: False in vLLM's profile and dummy runs (no attention metadata: the idle DP rank's
    lock-step batches, warm-up), else ``~is_padding`` (vLLM's mask of pad rows) when it covers
    exactly these rows. Under sequence parallelism the rows are chunk ``sp_rank`` of the step's T rows padded to a
    multiple of the ranks: rows past T are padding (one token at TP = 2 puts a pad row on rank 1
    every decode step). Else True (every row). On the CPU path only (T is read on the host)."""
    if forward_context.attn_metadata is None:
        return False
    pad = forward_context.is_padding
    if pad is not None and not is_sequence_parallel and pad.shape[0] == t:
        return ~pad
    dpm = forward_context.dp_metadata
    if is_sequence_parallel and dpm is not None:
        T = int(dpm.num_tokens_across_dp_cpu[dp_rank])
        if (sp_rank + 1) * t > T:  # this chunk holds padding
            return torch.arange(t) + sp_rank * t < T
    return True


def p2p_reduce_scatter(x: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """x: [N * c, ...] this rank's addend, chunk j for rank j. Returns [c, ...]: this rank's
    chunk summed over the group (in rank order), each chunk sent only to its rank
    (``all_to_all_single``): (N - 1) / N of x out and in, what a reduce-scatter must move."""
    x = x.contiguous()
    parts = torch.empty_like(x)
    torch.distributed.all_to_all_single(parts, x, group=group)
    return parts.view(world_size, x.shape[0] // world_size, *x.shape[1:]).sum(dim=0)


# the most bytes one peer's row slots may take for a step's sizes to travel with its rows (no
# round trip for them): a decode-sized step, where the round trip costs more than the slots'
# padding on any link from the emulated ones (~130 Mbit/s at a few ms a collective) to
# NVLink/IB (µs latencies, where this much takes a few µs)
PAD_BYTES = 64 << 10

# SparseExchange.stats, in order
COUNTERS = ("tokens", "pairs", "bytes", "local", "activations", "node_bytes")


def owner_of(num_experts: int, world_size: int) -> torch.Tensor:
    """[E] int64 rank holding each physical expert under vLLM's linear split (E / N per rank, or
    the first E mod N ranks one more: :func:`vllm_smoe.placement.counts.rank_sizes`)."""
    from ...placement.counts import rank_sizes

    return torch.repeat_interleave(torch.arange(world_size), torch.from_numpy(rank_sizes(num_experts, world_size)))


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

    Transport: each rank packs its outgoing rows once (a destination bit mask per row), and the
    group's ``all_gather`` carries them (vLLM's shared-memory transport on one CPU node); a receiver
    keeps the rows whose mask names it. The byte counters count what a point-to-point transport
    carries: one row per (token, remote rank) pair. Both gathers have static sizes; the receiving
    side selects its rows with ``nonzero`` (CPU tensors here); docs/cuda.md for GPUs. Across nodes
    (gloo) rows go point to point (``all_to_all_single``), each pair once to its rank; a small step's
    rows travel in fixed slots per peer with their sizes in the same message (two all-to-alls a
    layer), a large one's after a round trip for the sizes (three), and the counters then count
    what that transport carries, its slots' padding included.

    rank, world_size: this rank in the group; owner: [E] int64 rank of each physical expert;
    gather: ``x [n, ...] -> [world_size * n, ...]`` (the same n on every rank) and reduce_scatter:
    ``x [world_size * n, ...] -> [n, ...]`` summed over ranks, the transport. Two collectives per
    layer, both of static size (``m`` rows per rank): a gather of the outgoing rows, packed once
    each with ids, weights and a destination bit mask; and a reduce-scatter of the partial
    results, laid out by source rank and row so that a source adds them without knowing any sizes. ``stats``: [6]
    int64 on the device, over this rank's served rows (see :meth:`dispatch`), named by
    :data:`COUNTERS`: tokens, (token, remote rank) pairs, bytes a point-to-point transport carries
    for them (rows out with ids and weights, rows back), expert activations of a local expert,
    expert activations, and the bytes of those that cross between nodes. exact: first
    gather the number of outgoing rows and size both collectives by the largest (one more tiny
    collective and a host read; worth it where bytes cost time, e.g. over a network).
    all_to_all: ``(out, inp, out_splits, in_splits) -> None`` as ``all_to_all_single`` (splits
    lists of rows per rank, or None for equal splits): when given, the point-to-point transport
    replaces the gather and reduce-scatter (see Transport above). Its rows' sizes travel
    without a round trip of their own where a step is small: when ``m`` rows per peer take at
    most ``pad_bytes``, each peer gets exactly ``m`` row slots with a flag word marking the rows
    that are real (two all-to-alls per layer, the padding counted in ``stats``); larger steps
    first exchange their counts (three, nothing padded).

    node_of: [N] int64, the node of each rank (default: every rank its own node). It splits
    ``stats[5]``, the bytes that cross between nodes, from the rest. hierarchical (with
    ``all_to_all``, where a node holds more than one rank): a row crosses to another node once per
    destination node, to one gateway rank there that holds one of its experts (the one with this
    rank's local index if it does, else the lowest), which forwards it inside its node and sums
    what comes back before one partial row crosses back (DeepEP's and GRACE-MoE's internode
    scheme). Ranks of this rank's own node get their rows directly. It costs two more
    all-to-alls a layer (the forward's counts and rows, :meth:`_dispatch_hier`), so it serves
    only steps too large for row slots (prefill-sized, where bytes set the time); smaller steps go
    flat. Partial sums then add in another order than the flat transport's (gateway first)."""

    def __init__(self, rank: int, world_size: int, owner: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor],
                 reduce_scatter: Callable[[torch.Tensor], torch.Tensor], exact: bool = False,
                 all_to_all: Callable | None = None, pad_bytes: int = PAD_BYTES,
                 node_of: torch.Tensor | None = None, hierarchical: bool = False):
        assert world_size <= 30, "destination masks are int32 bit sets (bit 30: the row is served)"
        self.node_of = torch.arange(world_size) if node_of is None else node_of.long()
        assert self.node_of.shape == (world_size,)
        # forwarding inside a node only pays where there are nodes and one holds more than one rank
        per_node = torch.bincount(self.node_of)
        self.hierarchical = (hierarchical and all_to_all is not None
                             and bool((per_node > 0).sum() > 1 and (per_node > 1).any()))
        self.pad_bytes = pad_bytes
        self.exact = exact
        self.all_to_all = all_to_all
        self.rank, self.world_size, self.owner = rank, world_size, owner
        self.gather, self.reduce_scatter = gather, reduce_scatter
        self.stats = torch.zeros(6, dtype=torch.long)
        self._plan = None
        self._gw = None  # _dispatch_hier's static tables, on the rows' device
        self.hier_steps = 0  # layer steps that went hierarchical (a host count: no device read)

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 rows_per_rank: int | None = None, served: torch.Tensor | bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Own rows, then the rows other ranks sent here (source rank order, then source row
        order): (hidden [t + r, H], topk_weights [t + r, K], topk_ids [t + r, K]).
        rows_per_rank: the largest t of any rank (default: this rank's t, as under sequence
        parallelism where every rank holds one equal chunk). served: which rows are tokens whose
        output is used, sent and counted in ``stats``: True = all, False = none (a warm-up or
        dummy step), or [t] bool; the others get only this rank's experts (their output is
        discarded by the caller, so their bytes would buy nothing)."""
        N, me = self.world_size, self.rank
        (t, K), H = topk_ids.shape, hidden_states.shape[1]
        m = t if rows_per_rank is None else rows_per_rank
        dev = hidden_states.device
        if self.owner.device != dev:
            self.owner, self.node_of = self.owner.to(dev), self.node_of.to(dev)
            self.stats = self.stats.to(dev)
        bits = destinations(topk_ids, self.owner, me, N)
        # rows that are no served token (a sequence-parallel chunk's pad rows, an idle DP rank's
        # dummy batch) are dropped after the layer: they stay here and cost the wire nothing
        if served is False:
            bits = torch.zeros_like(bits)
        elif isinstance(served, torch.Tensor):
            bits = bits * served.to(device=dev, dtype=bits.dtype)
        # hierarchical for steps whose rows are too large for slots (prefill-sized: bytes bound);
        # a small step's latency is set by its collectives, and forwarding adds two (the same
        # split as DeepEP's normal and low-latency kernels). m is the same on every rank.
        if self.hierarchical and m * (H * hidden_states.element_size() + 8 * K + 8) > self.pad_bytes:
            return self._dispatch_hier(hidden_states, topk_weights, topk_ids, bits, m, served)
        pairs = None
        if served is not False:
            pairs = self._count(bits, topk_ids, served, H * hidden_states.element_size())
        if self.all_to_all is not None:
            return self._dispatch_p2p(hidden_states, topk_weights, topk_ids, bits, m, pairs)
        out_rows = torch.nonzero(bits, as_tuple=True)[0]  # rows leaving this rank, once each
        if self.exact:  # size both collectives by the most rows any rank sends, not by the chunk
            m = max(1, int(self.gather(out_rows.new_tensor([[out_rows.shape[0]]])).max()))
        row = H * hidden_states.element_size()
        words = hidden_states.contiguous().view(torch.uint8).view(t, row).view(torch.float32)  # row as 4-byte words
        Hw = words.shape[1]
        packed = torch.cat([words, topk_ids.to(torch.int32).view(torch.float32), topk_weights.float(),
                            bits.to(torch.int32).view(torch.float32)[:, None]], dim=1)
        buf = packed.new_zeros((m, packed.shape[1]))
        buf[: out_rows.shape[0]] = packed.index_select(0, out_rows)
        g = self.gather(buf).view(N, m, packed.shape[1])
        mine = (g[:, :, -1].contiguous().view(torch.int32) >> me) & 1  # own bit never set
        src, pos = torch.nonzero(mine, as_tuple=True)  # source rank, then its packed row
        rows = g[src, pos]
        r = rows.shape[0]
        recv_h = rows[:, :Hw].contiguous().view(torch.uint8).view(r, row).view(hidden_states.dtype).view(r, H)
        recv_i = rows[:, Hw: Hw + K].contiguous().view(torch.int32).to(topk_ids.dtype)
        recv_w = rows[:, Hw + K: Hw + 2 * K].to(topk_weights.dtype)
        self._plan = (t, m, out_rows, src, pos)
        return (torch.cat([hidden_states, recv_h]), torch.cat([topk_weights, recv_w]),
                torch.cat([topk_ids, recv_i]))

    def _count(self, bits: torch.Tensor, topk_ids: torch.Tensor, served, row: int, wire: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add a step's served rows to ``stats`` (on the device; ``row``: bytes of one hidden row).
        Returns the step's served (token, remote rank) pairs and those of them whose rank is on
        another node (device scalars). wire: also count their bytes as each pair's row out and
        back (the flat transport; the hierarchical one counts its own)."""
        N, K, t = self.world_size, topk_ids.shape[1], topk_ids.shape[0]
        per_row = sum((bits >> q) & 1 for q in range(N))  # [t] remote ranks each row visits
        far = self.node_of != self.node_of[self.rank]  # [N] ranks on other nodes
        per_row_far = sum(((bits >> q) & 1) * far[q] for q in range(N))
        local = (self.owner[topk_ids.long()] == self.rank).sum(dim=1)  # [t] activations served here
        w = per_row.new_ones(t) if served is True else served.to(per_row.dtype)
        pairs, far_pairs = (per_row * w).sum(), (per_row_far * w).sum()
        pair_bytes = 2 * row + 8 * K if wire else 0
        self.stats += torch.stack([w.sum(), pairs, pairs * pair_bytes, (local * w).sum(), w.sum() * K,
                                   far_pairs * pair_bytes])
        return pairs, far_pairs

    def _send_rows(self, payload: torch.Tensor, to_rank: torch.Tensor, slots: int | None):
        """One all-to-all of rows: payload [n, W] float32 words, to_rank [n] int64 ascending (the
        rank each row goes to). slots: rows per peer, with a flag word each, so that the sizes
        ride along (one all-to-all), or None: the counts first (two, exact sizes). Returns the
        rows received ([r, W], by source rank, then its order), and the send and receive
        splits (lists, read on the host: the CPU network path only)."""
        N, W = self.world_size, payload.shape[1]
        send_counts = torch.bincount(to_rank, minlength=N)
        sc = send_counts.tolist()
        if slots is not None:
            slot = torch.arange(to_rank.shape[0], device=to_rank.device) - (torch.cumsum(send_counts, 0) - send_counts)[to_rank]
            send = payload.new_zeros((N, slots, W + 1))
            send[to_rank, slot, :W] = payload
            send[to_rank, slot, W] = 1.0
            got = torch.empty_like(send)
            self.all_to_all(got.view(N * slots, W + 1), send.view(N * slots, W + 1), None, None)
            valid = got[:, :, W] != 0  # [N, slots]: source rank, slot
            return got[valid][:, :W], sc, valid.sum(dim=1).tolist()  # sizes from this rank's own rows
        recv_counts = torch.empty_like(send_counts)
        self.all_to_all(recv_counts, send_counts, None, None)
        rc = recv_counts.tolist()
        recv = payload.new_empty((sum(rc), W))
        self.all_to_all(recv, payload, rc, sc)
        return recv, sc, rc

    @staticmethod
    def _pack(hidden_states, topk_weights, topk_ids, *extra) -> torch.Tensor:
        """[t, W] float32 words: the hidden row's bytes, the ids, the weights, then ``extra``
        ([t] int32 words each)."""
        t, row = hidden_states.shape[0], hidden_states.shape[1] * hidden_states.element_size()
        words = hidden_states.contiguous().view(torch.uint8).view(t, row).view(torch.float32)
        return torch.cat([words, topk_ids.to(torch.int32).view(torch.float32), topk_weights.float(),
                          *(e.to(torch.int32).view(torch.float32)[:, None] for e in extra)], dim=1)

    @staticmethod
    def _unpack(recv: torch.Tensor, like_h, like_w, like_i):
        """:meth:`_pack`'s rows back to (hidden [r, H], weights [r, K], ids [r, K]) as the ``like``
        tensors' dtypes; extra words are ignored."""
        r, (H, K) = recv.shape[0], (like_h.shape[1], like_i.shape[1])
        Hw = H * like_h.element_size() // 4
        h = recv[:, :Hw].contiguous().view(torch.uint8).view(r, H * like_h.element_size()).view(like_h.dtype).view(r, H)
        ids = recv[:, Hw: Hw + K].contiguous().view(torch.int32).to(like_i.dtype)
        return h, recv[:, Hw + K: Hw + 2 * K].to(like_w.dtype), ids

    def _dispatch_p2p(self, hidden_states, topk_weights, topk_ids, bits, m: int, pairs):
        """:meth:`dispatch` over ``all_to_all``: each (token, remote rank) pair once, to that rank.
        m: the most rows any rank holds (row slots per peer when padded); pairs: the served pairs
        and those to other nodes :meth:`_count` counted (None: nothing counted), to which
        padding's bytes are added."""
        N, (t, K), H = self.world_size, topk_ids.shape, hidden_states.shape[1]
        peers = torch.arange(N, device=bits.device)
        to_rank, rows = torch.nonzero(((bits[None, :] >> peers[:, None]) & 1).bool(), as_tuple=True)  # rank, row
        row = H * hidden_states.element_size()
        packed = self._pack(hidden_states, topk_weights, topk_ids)
        W = packed.shape[1]
        slots = m if m * (W + 1) * 4 <= self.pad_bytes else None  # sizes ride along: m slots per peer
        recv, sc, rc = self._send_rows(packed.index_select(0, rows), to_rank, slots)
        if slots is not None and pairs is not None:  # what the wire carries beyond the served rows:
            # slots, flags, and the partial rows that come back for pad rows' pairs
            far = self.node_of != self.node_of[self.rank]
            for i, (n_peers, n_rows, served_pairs) in enumerate(
                    ((N - 1, rows.shape[0], pairs[0]), (far.sum(), far[to_rank].sum(), pairs[1]))):
                self.stats[2 + 3 * i] += n_peers * m * (W + 1) * 4 - served_pairs * (row + 8 * K) + (n_rows - served_pairs) * row
        self._plan = ("p2p", t, rows, sc, rc)
        return self._with_received(hidden_states, topk_weights, topk_ids, recv)

    def _with_received(self, hidden_states, topk_weights, topk_ids, recv):
        h, w, i = self._unpack(recv, hidden_states, topk_weights, topk_ids)
        return torch.cat([hidden_states, h]), torch.cat([topk_weights, w]), torch.cat([topk_ids, i])

    def _dispatch_hier(self, hidden_states, topk_weights, topk_ids, bits, m: int, served):
        """:meth:`dispatch` over nodes (``hierarchical``): rows to this node's ranks directly,
        to another node once, to its gateway; the gateways then forward inside their nodes.
        Counts in ``stats`` what each hop carries (rows with ids, weights and a mask word out,
        partial rows back), for the rows of served steps."""
        N, me, (t, K), H = self.world_size, self.rank, topk_ids.shape, hidden_states.shape[1]
        dev, node = bits.device, self.node_of
        self.hier_steps += 1
        row = H * hidden_states.element_size()
        peers = torch.arange(N, device=dev)
        member = ((bits[None, :] >> peers[:, None]) & 1).bool()  # [N, t]: rank q holds one of row's experts
        same = node == node[me]
        if self._gw is None or self._gw[0].device != dev:
            # gateway priority of each rank (0 = the one with this rank's local index in its node,
            # then by local index) and the bit set of each node's ranks
            local_idx = torch.stack([(node[:q] == node[q]).sum() for q in range(N)])
            nodebits = torch.zeros(int(node.max()) + 1, dtype=torch.int64, device=dev).index_add_(
                0, node, torch.ones(N, dtype=torch.int64, device=dev) << peers)
            self._gw = (torch.where(local_idx == local_idx[me], 0, local_idx + 1), nodebits)
        prio, nodebits = self._gw
        score = torch.where(member & ~same[:, None], prio[:, None], N + 1)  # [N, t]
        best = torch.full((nodebits.shape[0], t), N + 1, dtype=torch.long, device=dev)
        best.scatter_reduce_(0, node[:, None].expand(N, t), score, "amin")  # [nodes, t]: each node's gateway
        gateway = member & ~same[:, None] & (score == best[node])
        to_rank, rows = torch.nonzero((member & same[:, None]) | gateway, as_tuple=True)
        # what each pair's receiver computes: its own bit, and a gateway its node's other holders
        mask = torch.where(same[to_rank], torch.ones_like(to_rank) << to_rank, bits[rows] & nodebits[node[to_rank]])
        flag = served if isinstance(served, torch.Tensor) else torch.full((t,), bool(served), device=dev)
        mask = mask | (flag[rows].to(torch.int64) << 30)  # bit 30: the row is served (counted)
        packed = self._pack(hidden_states, topk_weights, topk_ids)
        W = packed.shape[1] + 1
        recv1, sc1, rc1 = self._send_rows(torch.cat([packed.index_select(0, rows),
                                                     mask.to(torch.int32).view(torch.float32)[:, None]], 1),
                                          to_rank, None)
        got_mask = recv1[:, -1].contiguous().view(torch.int32).to(torch.int64)
        fwd = ((got_mask[None, :] >> peers[:, None]) & 1).bool() & (peers != me)[:, None]  # [N, r1], own node
        to2, rows2 = torch.nonzero(fwd, as_tuple=True)
        recv2, sc2, rc2 = self._send_rows(recv1.index_select(0, rows2), to2, None)
        if served is not False:
            far = node != node[me]
            hop = W * 4 + row  # out with ids, weights and mask; a partial row back
            served1 = (mask >> 30) & 1
            served2 = (got_mask[rows2] >> 30) & 1
            out_bytes = (served1.sum() + served2.sum()) * hop
            far_bytes = (served1 * far[to_rank]).sum() * hop
            self._count(bits, topk_ids, served, row, wire=False)
            self.stats[2] += out_bytes
            self.stats[5] += far_bytes
        self._plan = ("hier", t, rows, sc1, rc1, rows2, sc2, rc2)
        return self._with_received(hidden_states, topk_weights, topk_ids, torch.cat([recv1[:, :-1], recv2[:, :-1]]))

    def counters(self) -> dict[str, int]:
        """``stats`` by name, read back to the host (once per log interval, never per step):
        tokens, pairs (token, remote rank), bytes, local (activations of a local expert),
        activations, node_bytes (those of the bytes that cross between nodes)."""
        return dict(zip(COUNTERS, self.stats.tolist()))

    def combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [t + r, H] expert outputs of :meth:`dispatch`'s rows (weighted, summed
        over this rank's experts). Returns [t, H]: each own row plus what remote ranks computed."""
        assert self._plan is not None, "combine without dispatch"
        if self._plan[0] == "hier":  # forwarded rows' partials to their gateways, summed there, then home
            _, t, rows, sc1, rc1, rows2, sc2, rc2 = self._plan
            self._plan = None
            r1, H = sum(rc1), hidden_states.shape[1]
            own, got1 = hidden_states[:t].clone(), hidden_states[t: t + r1].clone()
            back2 = hidden_states.new_empty((sum(sc2), H))
            self.all_to_all(back2, hidden_states[t + r1:].contiguous(), sc2, rc2)
            got1.index_add_(0, rows2, back2)
            back1 = hidden_states.new_empty((sum(sc1), H))
            self.all_to_all(back1, got1, sc1, rc1)
            own.index_add_(0, rows, back1)
            return own
        if self._plan[0] == "p2p":  # each received row's partial sum straight back to its source
            _, t, rows, sc, rc = self._plan
            self._plan = None
            own = hidden_states[:t].clone()
            back = hidden_states.new_empty((sum(sc), hidden_states.shape[1]))
            self.all_to_all(back, hidden_states[t:].contiguous(), sc, rc)
            own.index_add_(0, rows, back)
            return own
        t, m, out_rows, src, pos = self._plan
        self._plan = None
        N, H = self.world_size, hidden_states.shape[1]
        own = hidden_states[:t].clone()
        back = hidden_states.new_zeros((N, m, H))
        back[src, pos] = hidden_states[t:]
        summed = self.reduce_scatter(back.view(N * m, H))  # [m, H]: this rank's rows, summed over ranks
        own.index_add_(0, out_rows, summed[: out_rows.shape[0]])
        return own


def make_manager(cpu_group, comm):
    """vLLM's all2all manager around :class:`SparseExchange`, on the EP communicator ``comm``."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

    from ..config import SmoeConfig
    from ...formats.model_info import moe_layer_indices, num_experts

    class SparseAll2AllManager(All2AllManagerBase):
        def __init__(self):
            super().__init__(cpu_group)
            hf = get_current_vllm_config().model_config.hf_text_config
            from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

            # over shared memory a copy is cheap and a collective is not: static sizes; over a
            # network (gloo) the bytes cost time: collectives sized by the rows that really leave
            network = not isinstance(comm.dist_module, _CPUSHMDistributed)
            vc = get_current_vllm_config()
            cfg = SmoeConfig.from_additional_config(vc.additional_config)
            slots = num_experts(hf)  # physical expert slots: the placement's replicas add some
            from ..served import placement_for

            served = placement_for(cfg, vc)  # parsed here, before the model; the loader reads the same
            if served is not None:
                slots = served.plan.physical2expert.shape[1]
            # over a network each (token, rank) pair travels to that rank alone (all_to_all_single
            # on the group's gloo); over shared memory the static-size gather costs less
            group = comm.device_group

            def all_to_all(out, inp, out_splits, in_splits):
                with comm.counted("all_to_all"):
                    torch.distributed.all_to_all_single(out, inp, out_splits, in_splits, group=group)
            from .topology import ep_rank2node_of

            node_of = ep_rank2node_of(vc.parallel_config)
            if len(node_of) != comm.world_size:  # a layout this rule does not know (e.g. context parallel)
                node_of = list(range(comm.world_size))
            how = cfg.hierarchical if cfg is not None else "auto"
            hier = network and how == "auto" or how == "on"
            self.exchange = SparseExchange(comm.rank_in_group, comm.world_size, owner_of(slots, comm.world_size),
                                           lambda x: comm.all_gather(x.contiguous(), 0),
                                           lambda x: comm.reduce_scatterv(x, 0), exact=network,
                                           all_to_all=all_to_all if network or hier else None,
                                           node_of=torch.tensor(node_of), hierarchical=hier)
            if comm.rank_in_group == 0:
                logger.info("smoe: sparse all2all over %d ranks on %d node(s) (ranks' nodes %s): %s", comm.world_size,
                            len(set(node_of)), node_of,
                            "hierarchical (a row crosses to another node once, then fans out inside it)"
                            if self.exchange.hierarchical else "each row to each rank holding one of its experts")
            # under attention DP each engine logs its own requests' locality (speculate logs its own)
            self.log_dp = vc.parallel_config.data_parallel_size > 1
            self.dp_rank = vc.parallel_config.data_parallel_rank
            self.num_moe_layers = len(moe_layer_indices(hf))
            from ..observe.counters import Observer
            from ..observe.metrics import Drift, metrics_dir

            # judged only where the placement's own ratio is what serving aims at: a DP placement
            # with smoe's request routing (speculate judges its own order)
            expected = None
            if served is not None and self.log_dp and cfg.dp_routing:
                p = served.placement
                expected = p.metrics.get("lar") if p.method == "dp-coclust" else None
            self.rank = comm.rank_in_group
            self.observer = Observer("a2a", self.rank, cfg.log_interval if cfg is not None else 10.0,
                                     metrics_dir(cfg) if cfg is not None else None,
                                     Drift(expected, cfg.drift_threshold if cfg is not None else 0.8),
                                     who=f"dp rank {self.dp_rank}" if self.log_dp else None)
            if self.log_dp or self.observer.metrics_dir is not None:
                self.observer.watch(lambda: self.exchange.stats, self._report)
            self.sp_rank = None

        def _maybe_log(self):
            self.observer.step()  # once per interval: _report; an idle reader reports after a burst

        def _report(self, stats: list) -> None:
            """stats: the exchange's counters read (COUNTERS; the observer's lock held)."""
            from ..observe.counters import counts_clause

            c = dict(zip(COUNTERS, stats))
            self.observer.judge(c["local"], c["activations"], c["tokens"] // max(1, self.num_moe_layers))
            if c["tokens"]:
                self.observer.publish(c)
            if self.log_dp and c["activations"]:
                logger.info("smoe: dp rank %d served %.3f of its requests' expert activations locally (%d tokens, "
                            "served steps); sparse all2all: %.3f remote (token, rank) pairs and %.0f B per token and "
                            "MoE layer (%.0f B between nodes; %d layer steps hierarchical)%s", self.dp_rank,
                            c["local"] / c["activations"], c["tokens"] // max(1, self.num_moe_layers),
                            c["pairs"] / c["tokens"], c["bytes"] / c["tokens"], c["node_bytes"] / c["tokens"],
                            self.exchange.hier_steps,
                            counts_clause(c["local"], c["activations"], "smoe:a2a_local_expert_activations",
                                          "smoe:a2a_expert_activations", self.rank))

        def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False, extra_tensors=None):
            if extra_tensors:
                raise NotImplementedError("smoe's sparse all2all carries no extra tensors (quantization scales, "
                                          "LoRA); set additional_config smoe.all2all to 'vllm'")
            from vllm.forward_context import get_forward_context

            fc = get_forward_context()
            dpm = fc.dp_metadata  # set with DP or sequence parallelism: ranks' row counts
            rows = max(dpm.get_chunk_sizes_across_dp_rank()) if dpm is not None else None
            out = self.exchange.dispatch(hidden_states, topk_weights, topk_ids, rows,
                                         served_rows(fc, hidden_states.shape[0], is_sequence_parallel,
                                                     self._sp_rank(), max(0, self.dp_rank or 0)))
            if self.log_dp or self.observer.metrics_dir is not None:
                self._maybe_log()
            return out

        def _sp_rank(self) -> int:
            """This rank's chunk under sequence parallelism: its tensor-parallel rank (the TP group
            is built before the EP group, but read at the first step, once)."""
            if self.sp_rank is None:
                from vllm.distributed import get_tensor_model_parallel_rank

                self.sp_rank = get_tensor_model_parallel_rank()
            return self.sp_rank

        def combine(self, hidden_states, is_sequence_parallel=False):
            return self.exchange.combine(hidden_states)

        def dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel=False,
                                   extra_tensors=None):
            raise NotImplementedError("smoe's sparse all2all needs the modular MoE path (top-k ids before "
                                      "dispatch); set additional_config smoe.all2all to 'vllm' for this backend")

        def destroy(self):
            pass

    return SparseAll2AllManager()
