"""Index kernels for token shuffling: each Triton kernel, its launch wrapper and a pure-torch
``ref_*`` beside it. The ``ref_*`` functions are what runs on CPU; the kernels run on CUDA and,
in tests, under ``TRITON_INTERPRET=1``.

Notation: T tokens, K top-k, N ranks, H hidden size.

- :func:`send_order`: counting sort of tokens by destination rank -> (perm [T] int64, stable;
  send_counts [N] int64). ``x[perm]`` is the all-to-all send buffer.
- :func:`pack_rows`: rows of ``x`` in ``perm`` order.
- :func:`combine_topk`: ``out[t] = sum_k w[t, k] * y[row[t, k]]`` (unpack + top-k weighted sum).
- :func:`remote_ranks`: de-duplicated dispatch: ``need[t, r]`` = rank r holds one of token t's
  experts and is not the token's own rank; a token crosses each link once.
"""

from __future__ import annotations

import os

import torch

try:  # triton is optional: the ref_* path needs only torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # triton reads it at import too


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or _INTERPRET)


# ---------------------------------------------------------------- send order (counting sort)

def ref_send_order(token2rank: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token2rank: [T] int in [0, N). Returns (perm [T] int64, tokens grouped by rank, original
    order kept inside a rank; send_counts [N] int64)."""
    perm = torch.sort(token2rank.long(), stable=True).indices
    return perm, torch.bincount(token2rank.long(), minlength=num_ranks)


if triton is not None:

    @triton.jit
    def _block_counts_kernel(rank_ptr, counts_ptr, T, N: tl.constexpr, BLOCK: tl.constexpr,
                             NP: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        r = tl.load(rank_ptr + offs, mask=offs < T, other=-1)
        ranks = tl.arange(0, NP)
        hit = (r[:, None] == ranks[None, :]).to(tl.int64)
        tl.store(counts_ptr + pid * N + ranks, tl.sum(hit, axis=0), mask=ranks < N)

    @triton.jit
    def _scatter_kernel(rank_ptr, base_ptr, perm_ptr, T, N: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        idx = tl.arange(0, BLOCK)
        offs = pid * BLOCK + idx
        valid = offs < T
        r = tl.load(rank_ptr + offs, mask=valid, other=-1)
        # stable position inside the block: earlier tokens of the same rank
        before = (r[None, :] == r[:, None]) & (idx[None, :] < idx[:, None])
        local = tl.sum(before.to(tl.int64), axis=1)
        base = tl.load(base_ptr + pid * N + r, mask=valid, other=0)
        tl.store(perm_ptr + base + local, offs.to(tl.int64), mask=valid)


def send_order(token2rank: torch.Tensor, num_ranks: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ref_send_order` (stable, so results are exact)."""
    if not _use_triton(token2rank):
        return ref_send_order(token2rank, num_ranks)
    if token2rank.dim() != 1:
        raise ValueError(f"token2rank must be [T], got shape {tuple(token2rank.shape)}")
    T = token2rank.numel()
    r = token2rank.to(torch.int32).contiguous()
    nblocks = max(1, triton.cdiv(T, block))
    counts = torch.zeros((nblocks, num_ranks), dtype=torch.int64, device=r.device)
    _block_counts_kernel[(nblocks,)](r, counts, T, N=num_ranks, BLOCK=block, NP=triton.next_power_of_2(num_ranks))
    send_counts = counts.sum(dim=0)
    rank_start = torch.cumsum(send_counts, 0) - send_counts  # [N]
    block_start = torch.cumsum(counts, 0) - counts  # [B, N] tokens of rank r in earlier blocks
    base = (rank_start[None, :] + block_start).contiguous()
    perm = torch.empty(T, dtype=torch.int64, device=r.device)
    _scatter_kernel[(nblocks,)](r, base, perm, T, N=num_ranks, BLOCK=block)
    return perm, send_counts


# ---------------------------------------------------------------- pack rows

def ref_pack_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; perm: [M] int64 row indices. Returns x[perm]: [M, H]."""
    return x.index_select(0, perm)


if triton is not None:

    @triton.jit
    def _pack_kernel(x_ptr, perm_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
        row = tl.program_id(0)
        src = tl.load(perm_ptr + row)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = cols < H
            v = tl.load(x_ptr + src * H + cols, mask=m)
            tl.store(out_ptr + row * H + cols, v, mask=m)


def pack_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    if not _use_triton(x):
        return ref_pack_rows(x, perm)
    if x.dim() != 2 or perm.dim() != 1:
        raise ValueError(f"pack_rows wants x [T, H] and perm [M], got {tuple(x.shape)} and {tuple(perm.shape)}")
    x = x.contiguous()
    out = torch.empty((perm.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    if perm.numel():
        _pack_kernel[(perm.numel(),)](x, perm.contiguous(), out, x.shape[1],
                                      BLOCK_H=min(1024, triton.next_power_of_2(x.shape[1])))
    return out


# ---------------------------------------------------------------- unpack + weighted combine

def ref_combine_topk(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y: [M, H] expert outputs; rows: [T, K] int64 row of (t, k) in y, -1 = skip;
    weights: [T, K]. Returns out [T, H] = sum_k weights[t, k] * y[rows[t, k]], accumulated in
    fp32 in k order (as the kernel does) and cast to y's dtype."""
    T, K = rows.shape
    out = torch.zeros((T, y.shape[1]), dtype=torch.float32, device=y.device)
    if y.shape[0] == 0:  # nothing to gather: every (t, k) is skipped
        return out.to(y.dtype)
    for k in range(K):  # one [T, H] gather at a time: no [T, K, H] intermediate
        w = torch.where(rows[:, k] >= 0, weights[:, k].float(), torch.zeros((), device=y.device))
        out += w[:, None] * y.index_select(0, rows[:, k].clamp(min=0)).float()
    return out.to(y.dtype)


if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = cols < H
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for k in range(K):
                row = tl.load(rows_ptr + t * K + k)
                w = tl.load(w_ptr + t * K + k).to(tl.float32)
                w = tl.where(row >= 0, w, 0.0)  # row -1: skipped (token, k)
                v = tl.load(y_ptr + tl.maximum(row, 0) * H + cols, mask=m, other=0.0).to(tl.float32)
                acc += w * v
            tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def combine_topk(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if not _use_triton(y):
        return ref_combine_topk(y, rows, weights)
    if rows.shape != weights.shape or rows.dim() != 2:
        raise ValueError(f"rows and weights must both be [T, K], got {tuple(rows.shape)}, {tuple(weights.shape)}")
    T, K = rows.shape
    if y.shape[0] == 0:  # no rows to read (an empty tensor may have no storage to point at)
        return torch.zeros((T, y.shape[1]), dtype=y.dtype, device=y.device)
    out = torch.empty((T, y.shape[1]), dtype=y.dtype, device=y.device)
    if T:
        _combine_kernel[(T,)](y.contiguous(), rows.to(torch.int64).contiguous(), weights.contiguous(), out,
                              y.shape[1], K=K, BLOCK_H=min(1024, triton.next_power_of_2(y.shape[1])))
    return out


# ---------------------------------------------------------------- de-duplicated remote ranks

def ref_remote_ranks(topk_ids: torch.Tensor, expert2rank: torch.Tensor, token2rank: torch.Tensor,
                     num_ranks: int) -> torch.Tensor:
    """topk_ids: [T, K] int; expert2rank: [E] int; token2rank: [T] int. Returns need [T, N]
    bool: rank r holds one of token t's experts and r != token2rank[t]."""
    T = topk_ids.shape[0]
    need = torch.zeros((T, num_ranks), dtype=torch.bool, device=topk_ids.device)
    need.scatter_(1, expert2rank.long()[topk_ids.long()], True)
    need[torch.arange(T, device=topk_ids.device), token2rank.long()] = False
    return need


if triton is not None:

    @triton.jit
    def _remote_kernel(topk_ptr, e2r_ptr, t2r_ptr, need_ptr, T, K: tl.constexpr, N: tl.constexpr,
                       NP: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        valid = offs < T
        ranks = tl.arange(0, NP)
        hit = tl.zeros((BLOCK, NP), dtype=tl.int32)
        for k in range(K):
            e = tl.load(topk_ptr + offs * K + k, mask=valid, other=0)
            r = tl.load(e2r_ptr + e, mask=valid, other=-1)
            hit = hit | (r[:, None] == ranks[None, :]).to(tl.int32)
        own = tl.load(t2r_ptr + offs, mask=valid, other=-1)
        hit = hit & (own[:, None] != ranks[None, :]).to(tl.int32)
        m = valid[:, None] & (ranks[None, :] < N)
        tl.store(need_ptr + offs[:, None] * N + ranks[None, :], hit.to(tl.int8), mask=m)


def remote_ranks(topk_ids: torch.Tensor, expert2rank: torch.Tensor, token2rank: torch.Tensor,
                 num_ranks: int, block: int = 64) -> torch.Tensor:
    if not _use_triton(topk_ids):
        return ref_remote_ranks(topk_ids, expert2rank, token2rank, num_ranks)
    T, K = topk_ids.shape
    need = torch.zeros((T, num_ranks), dtype=torch.int8, device=topk_ids.device)
    if T:
        _remote_kernel[(triton.cdiv(T, block),)](
            topk_ids.to(torch.int32).contiguous(), expert2rank.to(torch.int32).contiguous(),
            token2rank.to(torch.int32).contiguous(), need, T, K=K, N=num_ranks,
            NP=triton.next_power_of_2(num_ranks), BLOCK=block)
    return need.bool()
