"""Static-shape helpers of the token order's communication: which rows are a rank's chunk, the
shuffled reduce-scatter, the kept residual, rank 0's assignment on every rank. Device ops on
static shapes only: no host read, capturable in a CUDA graph."""

from __future__ import annotations

import torch


def chunk_rows(T: int, rank: int, N: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [start, stop) of T rows split as vLLM's sequence_parallel_chunk does
    (ceil(T / N) each, the last ones short or empty)."""
    c = -(-T // N)
    start = min(rank * c, T)
    return start, min(start + c, T)


def chunk_real(perm: torch.Tensor, T: int, rank: int, n: int, num_real: torch.Tensor) -> torch.Tensor:
    """Which of rank ``rank``'s ``n`` chunk rows of the token order are real tokens: [n] bool.
    perm: [>= T] int64, row i of the order is step row perm[i]; the chunk's rows past T are its
    padding, and step rows at or past ``num_real`` (a 0-d device tensor) are vLLM's pad rows,
    wherever the order put them. Static shapes, no host read."""
    q, src = _chunk_sources(perm, T, rank, n)
    return (q < T) & (src < num_real)


def chunk_padding(perm: torch.Tensor, T: int, rank: int, n: int, step_pad: torch.Tensor) -> torch.Tensor:
    """vLLM's pad-row mask for rank ``rank``'s ``n`` chunk rows of the token order: [n] bool, True
    where the row is the chunk's own padding (past T) or a step row ``step_pad`` (vLLM's [>= T]
    bool mask of the step, in step order) marks. Static shapes, no host read."""
    q, src = _chunk_sources(perm, T, rank, n)
    return (q >= T) | step_pad.index_select(0, src)


def _chunk_sources(perm: torch.Tensor, T: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, src): [n] int64 rank ``rank``'s chunk rows' places in the token order, and the step
    rows they hold (the chunk's padding past T reads the last row)."""
    q = torch.arange(n, device=perm.device) + rank * n
    return q, perm.index_select(0, q.clamp(max=T - 1))


def shuffled_reduce_scatter(partial: torch.Tensor, perm: torch.Tensor, rank: int, N: int, reduce_scatter
                            ) -> torch.Tensor:
    """s-MoE's shuffled reduce-scatter of one tensor-parallel partial sum. partial: [T, H] this
    rank's share (summed over ranks it is the all-reduce's result); perm: [T] int64, row i of the
    token order is step row perm[i]; reduce_scatter: ``[N * c, H] -> [c, H]`` summed over the
    group, c = ceil(T / N). Returns [T, H]: this rank's chunk of the token order, reduced, at the
    step rows it came from (``perm[start:stop]``); every other row zero. Static shapes."""
    T, H = partial.shape
    c = -(-T // N)
    rows = partial.new_zeros((N * c, H))
    torch.index_select(partial, 0, perm, out=rows[:T])
    mine = reduce_scatter(rows)
    start, stop = chunk_rows(T, rank, N)
    out = partial.new_zeros((T, H))
    out.index_copy_(0, perm[start:stop], mine[: stop - start])
    return out


def keep_chunk_residual(x: torch.Tensor, residual: torch.Tensor, perm: torch.Tensor, rank: int, N: int,
                        kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After the add + norm on :func:`shuffled_reduce_scatter`'s output: x, residual [T, H], exact
    on this rank's chunk rows. Writes the chunk's residual rows, in chunk order, to
    ``kept[:ceil(T / N)]`` (zero past them; kept: [>= ceil(T / N), H]) for the experts' output to
    add before the block's all-gather. Returns (x's chunk rows at their step rows, the rest zero;
    a zero residual: the all-gathered rows then carry the whole residual stream)."""
    T = x.shape[0]
    start, stop = chunk_rows(T, rank, N)
    src = perm[start:stop]
    kept[: -(-T // N)].zero_()
    kept[: stop - start].copy_(residual.index_select(0, src))
    out = torch.zeros_like(x)
    out.index_copy_(0, src, x.index_select(0, src))
    return out, torch.zeros_like(residual)


def agree(token2rank: torch.Tensor, broadcast) -> torch.Tensor:
    """Rank 0's assignment on every rank. token2rank: [T] or [L, T] int64; broadcast: the TP
    group's ``broadcast(tensor, src)`` (in place). Returns the same shape, int64."""
    t = token2rank.to(torch.int32).contiguous()
    return broadcast(t, 0).long()
