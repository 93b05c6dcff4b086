"""Speculate's capped assignment and token permutation in one Triton kernel, a pure-torch
``ref_*`` twin beside it.

The torch version (:func:`vllm_smoe.serving.speculate.device_predict.assign` + ``permutation``) is
many small ops per step (sorts, scans, scatters per preference; counted: docs/history.md#kernelsassignpy);
this kernel is one launch with one program per layer that walks the step's tokens in blocks. The
confidence order it consumes is one ``torch.argsort`` over every layer.

Notation: L layers ordered at once, T tokens, P preferences per token, N ranks.

- :func:`assign_permute`: ``pref [L, T, P]`` int (-1 = none), ``order [L, T]`` int64 (tokens by
  falling confidence, stable), ``caps [N]`` int64 (rows each rank takes, sum >= T) ->
  ``(perm [L, T], inv [L, T])`` int64: ``x[perm[l]]`` groups the tokens rank by rank (stable),
  ``y[inv[l]]`` restores the step's order. The greedy: :func:`ref_assign_permute`."""

from __future__ import annotations

import os

import torch

try:  # triton is optional: the ref_* path needs only torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without triton
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # triton reads it at import too


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or _INTERPRET)


def ref_assign_permute(pref: torch.Tensor, order: torch.Tensor, caps: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy spelled out token by token (slow; tests and small T only). Same contract as
    :func:`assign_permute`: in each layer the most confident tokens claim their preferences first
    (preference 0 of every token before preference 1); tokens left over fill the free slots rank
    by rank, in token order."""
    L, T, P = pref.shape
    N = caps.shape[0]
    pref_l, order_l = pref.tolist(), order.tolist()
    perms, invs = [], []
    for layer in range(L):
        remaining = [int(c) for c in caps.tolist()]
        t2r = [-1] * T
        for j in range(P):
            for t in order_l[layer]:
                r = pref_l[layer][t][j]
                if t2r[t] < 0 and 0 <= r < N and remaining[r] > 0:
                    t2r[t] = r
                    remaining[r] -= 1
        r = 0
        for t in range(T):
            if t2r[t] < 0:
                while remaining[r] == 0:
                    r += 1
                t2r[t] = r
                remaining[r] -= 1
        perm = torch.sort(torch.tensor(t2r, dtype=torch.long), stable=True).indices
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(T)
        perms.append(perm)
        invs.append(inv)
    dev = pref.device
    return torch.stack(perms).to(dev), torch.stack(invs).to(dev)


if triton is not None:

    # T and the row stride change every step: one compiled variant for all of them (a variant
    # first met inside a CUDA-graph capture would compile there)
    @triton.jit(do_not_specialize=["T", "out_stride"])
    def _assign_permute_kernel(pref_ptr, order_ptr, caps_ptr, t2r_ptr, perm_ptr, inv_ptr, T, out_stride,
                               P: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
        # counts and one-hot [BLOCK, NP] blocks in int32 (values < T): half the registers of int64;
        # addresses in int64
        layer = tl.program_id(0).to(tl.int64)
        base = layer * T  # into pref (x P), order, t2r
        out = layer * out_stride  # into perm, inv
        ranks = tl.arange(0, NP)
        real_rank = ranks < N
        remaining = tl.load(caps_ptr + ranks, mask=real_rank, other=0).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        for b in range(0, T, BLOCK):
            i = b + lanes
            tl.store(t2r_ptr + base + i, tl.full((BLOCK,), -1, tl.int32), mask=i < T)
        tl.debug_barrier()
        # claims, most confident first: a token takes its j-th preference while that rank has room
        for j in tl.static_range(P):
            wanting = tl.zeros((NP,), dtype=tl.int32)  # tokens before this block that wanted each rank
            for b in range(0, T, BLOCK):
                i = b + lanes
                m = i < T
                t = tl.load(order_ptr + base + i, mask=m, other=0)
                cur = tl.load(t2r_ptr + base + t, mask=m, other=0)
                want = tl.load(pref_ptr + (base + t) * P + j, mask=m, other=-1).to(tl.int32)
                free = m & (cur < 0) & (want >= 0)
                hit = (free[:, None] & (want[:, None] == ranks[None, :])).to(tl.int32)  # [BLOCK, NP]
                ahead = tl.cumsum(hit, axis=0) - hit + wanting[None, :]
                take = hit * (ahead < remaining[None, :]).to(tl.int32)
                got = tl.sum(take, axis=1)
                tl.store(t2r_ptr + base + t, tl.sum(take * ranks[None, :], axis=1), mask=m & (got > 0))
                wanting += tl.sum(hit, axis=0)
            remaining = remaining - tl.minimum(wanting, remaining)
            tl.debug_barrier()
        # leftovers, in token order, into the free slots rank by rank
        bounds = tl.cumsum(remaining, axis=0)  # [NP] inclusive
        seen = tl.zeros((1,), dtype=tl.int32)
        for b in range(0, T, BLOCK):
            i = b + lanes
            m = i < T
            cur = tl.load(t2r_ptr + base + i, mask=m, other=0)
            left = (m & (cur < 0)).to(tl.int32)
            nth = tl.cumsum(left, axis=0) - left + seen
            fill = tl.sum(((bounds[None, :] <= nth[:, None]) & real_rank[None, :]).to(tl.int32), axis=1)
            tl.store(t2r_ptr + base + i, fill, mask=left > 0)
            seen += tl.sum(left, axis=0)
        tl.debug_barrier()
        # stable counting sort by rank: rows of each rank start after the earlier ranks' rows
        count = tl.zeros((NP,), dtype=tl.int32)
        for b in range(0, T, BLOCK):
            i = b + lanes
            m = i < T
            r = tl.load(t2r_ptr + base + i, mask=m, other=-1)
            count += tl.sum((r[:, None] == ranks[None, :]).to(tl.int32), axis=0)
        start = tl.cumsum(count, axis=0) - count
        placed = tl.zeros((NP,), dtype=tl.int32)
        for b in range(0, T, BLOCK):
            i = b + lanes
            m = i < T
            r = tl.load(t2r_ptr + base + i, mask=m, other=-1)
            hit = (r[:, None] == ranks[None, :]).to(tl.int32)
            slot = tl.cumsum(hit, axis=0) - hit + placed[None, :] + start[None, :]
            pos = tl.sum(hit * slot, axis=1)
            tl.store(perm_ptr + out + pos, i.to(tl.int64), mask=m)
            tl.store(inv_ptr + out + i, pos.to(tl.int64), mask=m)
            placed += tl.sum(hit, axis=0)


def assign_permute(pref: torch.Tensor, order: torch.Tensor, caps: torch.Tensor, perm: torch.Tensor | None = None,
                   inv: torch.Tensor | None = None, block: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ref_assign_permute`, in one launch. perm, inv: optional [L, >= T]
    int64 outputs whose rows may be longer than T (the served buffers); their first T columns
    are written and returned. Static shapes, no host reads: capturable in a CUDA graph."""
    if pref.dim() != 3 or order.shape != pref.shape[:2]:
        raise ValueError(f"assign_permute wants pref [L, T, P] and order [L, T], got {tuple(pref.shape)} "
                         f"and {tuple(order.shape)}")
    L, T, P = pref.shape
    N = caps.shape[0]
    if perm is None:
        perm = torch.empty((L, T), dtype=torch.int64, device=pref.device)
        inv = torch.empty((L, T), dtype=torch.int64, device=pref.device)
    if perm.stride(1) != 1 or inv.stride() != perm.stride() or perm.shape[0] != L or perm.shape[1] < T:
        raise ValueError("assign_permute: perm and inv must be [L, >= T] with rows of one stride")
    if not use_triton(pref):
        ref_perm, ref_inv = ref_assign_permute(pref, order, caps)
        perm[:, :T].copy_(ref_perm)
        inv[:, :T].copy_(ref_inv)
        return perm[:, :T], inv[:, :T]
    if T:
        t2r = torch.empty((L, T), dtype=torch.int32, device=pref.device)
        blk = triton.next_power_of_2(block)  # fixed, not from T: one variant serves every step
        _assign_permute_kernel[(L,)](pref.contiguous(), order.contiguous(), caps.to(torch.int64).contiguous(), t2r,
                                     perm, inv, T, perm.stride(0), P=P, N=N, NP=triton.next_power_of_2(N),
                                     BLOCK=blk, num_warps=8)
    return perm[:, :T], inv[:, :T]
