"""Expert-parallel MoE layer with speculative token shuffling, on torch.distributed.

Attention runs tensor parallel, so before the MoE each rank holds a *partial sum* of every
token's hidden state. Two pipelines, same result:

- ``baseline`` (DeepSpeed-MoE style EP): all-reduce -> each rank takes a contiguous slice of
  the tokens -> all-to-all dispatch to the ranks holding their experts -> experts -> all-to-all
  combine -> all-gather.
- ``speculate`` (smoe s-TS): a *shuffled reduce-scatter* hands each token, already summed, to
  the rank predicted to hold its experts (``token2rank``) -> only mispredicted work is
  dispatched, once per (token, remote rank) -> experts -> combine -> a *shuffled all-gather*
  restores the replicated token order.

Dispatch is de-duplicated in both: a token crosses to a remote rank once, with the top-k ids
and weights of the experts that rank holds, and one weighted row comes back. Mispredictions
cost bytes, never correctness. Index work goes through :mod:`vllm_smoe.kernels.shuffle`.

Shapes: T tokens, H hidden, E experts (E/N per rank), K top-k, I expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .kernels.shuffle import combine_topk, pack_rows, remote_ranks, send_order


@dataclass
class ExpertShard:
    """This rank's experts. w_gate_up: [E_loc, 2I, H]; w_down: [E_loc, H, I];
    expert2rank: [E] int64 home rank of every expert; local_of: [E] int64 index into this
    shard (-1 = not here)."""

    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    expert2rank: torch.Tensor
    local_of: torch.Tensor


@dataclass
class CommStats:
    """Bytes this rank sent, per collective."""

    bytes: dict = field(default_factory=dict)

    def add(self, what: str, n: int) -> None:
        self.bytes[what] = self.bytes.get(what, 0) + int(n)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, renormalize: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: (topk_ids [T, K] int64, topk_weights [T, K] float32)."""
    probs = torch.softmax(x.float() @ router_w.float().t(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) over the (t, k) whose expert is in
    ``shard``; other entries (and ids = -1) add nothing. x: [T, H]; ids, weights: [T, K].
    Returns float32 [T, H]."""
    local = torch.where(ids < 0, -1, shard.local_of[ids.clamp(min=0)])
    t, k = torch.nonzero(local >= 0, as_tuple=True)
    if t.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    e = local[t, k]
    order = torch.argsort(e, stable=True)  # one pass: each expert's rows become one contiguous block
    t, k, e = t[order], k[order], e[order]
    xs = x[t].float()
    ys = torch.empty_like(xs)
    start = 0
    for j, c in enumerate(torch.bincount(e, minlength=shard.w_gate_up.shape[0]).tolist()):
        if c:
            g, u = F.linear(xs[start:start + c], shard.w_gate_up[j].float()).chunk(2, dim=-1)
            ys[start:start + c] = F.linear(F.silu(g) * u, shard.w_down[j].float())
            start += c
    rows = torch.full(ids.shape, -1, dtype=torch.long, device=x.device)
    rows[t, k] = torch.arange(t.numel(), device=x.device)
    # gather-side weighted sum in k order: deterministic, unlike a scatter-add with atomics
    return combine_topk(ys, rows, weights.float())


def ref_moe(x: torch.Tensor, router_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
            top_k: int) -> torch.Tensor:
    """Single-process reference of the whole layer on the full hidden states x [T, H]."""
    E = router_w.shape[0]
    ids, w = route(x, router_w, top_k)
    everything = ExpertShard(w_gate_up, w_down, torch.zeros(E, dtype=torch.long), torch.arange(E))
    return experts_forward(x, ids, w, everything).to(x.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, c] any dtype -> [n, c * itemsize] uint8, same memory."""
    return t.contiguous().view(torch.uint8)


def _unbytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


def dispatch_combine(x_loc: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, own_rank: int, shard: ExpertShard,
                      group, stats: CommStats) -> torch.Tensor:
    """Local experts plus one all-to-all round trip for the (token, remote rank) pairs."""
    N = dist.get_world_size(group)
    m, K = ids.shape
    out = experts_forward(x_loc, ids, w, shard)
    t2r = torch.full((m,), own_rank, dtype=torch.long, device=x_loc.device)
    need = remote_ranks(ids, shard.expert2rank, t2r, N)  # [m, N] bool, de-duplicated
    tok, dst = torch.nonzero(need, as_tuple=True)
    order = torch.sort(dst, stable=True).indices
    tok, dst = tok[order], dst[order]
    send_counts = torch.bincount(dst, minlength=N)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    # each pair carries the ids/weights of only the experts the destination holds
    on_dst = shard.expert2rank[ids[tok]] == dst[:, None]
    send_ids = torch.where(on_dst, ids[tok], torch.full_like(ids[tok], -1))
    send_w = torch.where(on_dst, w[tok], torch.zeros_like(w[tok]))
    rows = pack_rows(x_loc, tok)
    # one message per pair: the row, then the ids (int32) and weights (fp32) it needs there
    payload = torch.cat([_bytes(rows), _bytes(send_ids.int()), _bytes(send_w.float())], dim=1)
    recv = payload.new_empty((sum(rc), payload.shape[1]))
    dist.all_to_all_single(recv, payload, rc, sc, group=group)
    stats.add("dispatch", rows.numel() * rows.element_size())
    stats.add("dispatch_meta", payload.numel() - rows.numel() * rows.element_size())
    nb = x_loc.shape[1] * x_loc.element_size()
    recv_rows = _unbytes(recv[:, :nb], x_loc.dtype)
    recv_ids = _unbytes(recv[:, nb: nb + 4 * K], torch.int32).long()
    recv_w = _unbytes(recv[:, nb + 4 * K:], torch.float32)
    partial = experts_forward(recv_rows, recv_ids, recv_w, shard).to(x_loc.dtype)
    back = x_loc.new_empty((len(tok), x_loc.shape[1]))
    dist.all_to_all_single(back, partial, sc, rc, group=group)
    stats.add("combine", partial.numel() * partial.element_size())
    # each remote rank returned one weighted row per token it served: add them in rank order
    rows = torch.full((m, N), -1, dtype=torch.long, device=x_loc.device)
    rows[tok, dst] = torch.arange(tok.numel(), device=x_loc.device)
    out += combine_topk(back.float(), rows, torch.ones((m, N), dtype=torch.float32, device=x_loc.device))
    return out.to(x_loc.dtype)


@dataclass(frozen=True)
class Shuffle:
    """Where each token sits between the reduce-scatter and the all-gather.

    perm: [T] int64, tokens sorted by owning rank (stable); counts: [N] int64 tokens per rank;
    local_tokens: [m] int64, this rank's tokens (original indices) in the order of its rows."""

    perm: torch.Tensor
    counts: torch.Tensor
    local_tokens: torch.Tensor


def _shuffle(token2rank: torch.Tensor, rank: int, N: int) -> Shuffle:
    perm, counts = send_order(token2rank.long(), N)
    start = int(counts[:rank].sum())
    return Shuffle(perm, counts, perm[start: start + int(counts[rank])])


def shuffled_reduce_scatter(x_partial: torch.Tensor, token2rank: torch.Tensor, group, stats: CommStats
                            ) -> tuple[torch.Tensor, Shuffle]:
    """Sum the partial hidden states over ranks and leave token t, summed, on rank
    token2rank[t] (identical on every rank). x_partial: [T, H]. Returns (x_loc [m, H], the
    shuffle), x_loc rows in the order of ``shuffle.local_tokens``.

    One all-to-all-v of exact sizes: every rank sends each other rank its partial rows of that
    rank's tokens and sums the N partials it receives in rank order (so the bytes are a ring
    reduce-scatter's with no padding, whatever the imbalance)."""
    N, rank = dist.get_world_size(group), dist.get_rank(group)
    T, H = x_partial.shape
    sh = _shuffle(token2rank, rank, N)
    m = sh.local_tokens.numel()
    recv = x_partial.new_empty((N * m, H))
    counts = sh.counts.tolist()
    dist.all_to_all_single(recv, pack_rows(x_partial, sh.perm), [m] * N, counts, group=group)
    stats.add("reduce_scatter", (T - m) * H * x_partial.element_size())
    return recv.view(N, m, H).sum(dim=0), sh


def allreduce_slice(x_partial: torch.Tensor, group, stats: CommStats) -> tuple[torch.Tensor, torch.Tensor, Shuffle]:
    """Baseline: all-reduce, then each rank takes a contiguous slice of the tokens.
    Returns (x [T, H] summed and replicated, x_loc [m, H], the shuffle)."""
    N, rank = dist.get_world_size(group), dist.get_rank(group)
    T = x_partial.shape[0]
    x = x_partial.clone()
    dist.all_reduce(x, group=group)
    stats.add("all_reduce", 2 * (N - 1) * x.numel() * x.element_size() // N)  # ring all-reduce per rank
    sh = _shuffle((torch.arange(T, device=x.device) * N // max(T, 1)).long(), rank, N)
    return x, x[sh.local_tokens], sh


def shuffled_all_gather(y_loc: torch.Tensor, sh: Shuffle, group, stats: CommStats) -> torch.Tensor:
    """Inverse of the shuffle: rows y_loc [m, W] of this rank's tokens -> [T, W] in the original
    token order, replicated on every rank (an all-to-all-v of exact sizes: no padding)."""
    N = dist.get_world_size(group)
    T, W = sh.perm.numel(), y_loc.shape[1]
    m = y_loc.shape[0]
    gathered = y_loc.new_empty((T, W))
    dist.all_to_all_single(gathered, y_loc.repeat(N, 1), sh.counts.tolist(), [m] * N, group=group)
    stats.add("all_gather", (N - 1) * m * W * y_loc.element_size())
    out = torch.empty_like(gathered)
    out[sh.perm] = gathered
    return out


def moe_layer(x_partial: torch.Tensor, router_w: torch.Tensor, shard: ExpertShard, top_k: int,
              token2rank: torch.Tensor | None, group=None, stats: CommStats | None = None,
              routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The EP MoE layer on every rank of ``group``.

    x_partial: [T, H], this rank's partial sum of the hidden states (they add up over ranks);
    token2rank: [T] int, the predicted rank of each token (identical on every rank), or None
    for the baseline pipeline; routing: optional replayed (topk_ids [T, K], weights [T, K]) used
    instead of the router (benchmarks). Returns the layer output [T, H], replicated on every rank.
    """
    stats = stats if stats is not None else CommStats()
    rank = dist.get_rank(group)
    if token2rank is None:
        _, x_loc, sh = allreduce_slice(x_partial, group, stats)
    else:
        x_loc, sh = shuffled_reduce_scatter(x_partial, token2rank, group, stats)
    if routing is None:
        ids, w = route(x_loc, router_w, top_k)
    else:
        ids, w = routing[0][sh.local_tokens], routing[1][sh.local_tokens]
    y_loc = dispatch_combine(x_loc, ids, w, rank, shard, group, stats)
    return shuffled_all_gather(y_loc, sh, group, stats)
