"""Recording: this data-parallel rank's rows of each MoE layer's router output, in the step's
order, whatever layout vLLM ran the layer in, written into the recorder's step buffer.

The layouts a router's capture can see, and how each is told apart: :func:`locate`.

Speculate's token order has its own chunks (``TokenOrder.gather_rows``). A count that fits no
layout, a micro-batched step (DBO: each micro-batch routes part of the step, at an offset its
forward context does not carry) and more rows than the buffer holds never raise inside the
forward: the rows are not written, the layer's ``written`` count stays 0, and the recorder drops
the step whole and counts it (:meth:`StepRows.complete`). Nothing reads back from the device:
``written`` is set on the device and copied off with the rows after the step (capturable: a
replayed graph writes the counts it was captured with)."""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Sequence

import torch

logger = logging.getLogger("vllm.smoe")


class Layout(NamedTuple):  # a named tuple: the capture may be traced by torch.compile (CPU, one rank)
    name: str  # local, dp-slice, sp-gathered, sp-chunk
    start: int  # this DP rank's first row (of the TP-gathered rows for sp-chunk)
    count: int  # this DP rank's rows: its step, vLLM's DP / graph padding included
    gather: bool  # all-gather the TP group's chunks first


def locate(n: int, across_dp: Sequence[int] | None, local_sizes: Sequence[int] | None, dp_rank: int,
           tp_size: int) -> Layout | None:
    """Where this DP rank's rows are in a router output of ``n`` rows. across_dp: rows of each DP
    rank's step (``dp_metadata.num_tokens_across_dp_cpu``, None without DP metadata);
    local_sizes: the all-gather-v sizes vLLM set for the layer (None outside the MoE runner's
    sequence-parallel context). None: no layout has ``n`` rows. Where two layouts have the same
    count they select the same rows (a DP rank of 0 or 1 rows, or chunks without padding).

    What a router's capture sees depends on where vLLM splits or gathers the rows (vLLM's own
    ``RoutedExpertsCapturer.capture``, ``fused_moe/routed_experts_capturer.py``, tells them apart the
    same way, by the row count against the forward context's DP metadata):

    - ``local``: this rank's step (no DP metadata; or a modular kernel, which gathers inside the
      experts' call, after routing);
    - ``dp-slice``: every DP rank's step, concatenated (naive dispatch, ``MoERunner._maybe_dispatch``
      over the DP group): this rank's span, by the ranks' row counts;
    - ``sp-gathered``: every rank's sequence-parallel chunk, DP-major then TP (naive dispatch under
      sequence parallelism, gathered over the EP group by ``dp_metadata.local_sizes``): this DP
      rank's chunks, which laid end to end are its step plus the chunk padding;
    - ``sp-chunk``: this TP rank's chunk only (a modular kernel under sequence parallelism, vLLM's
      ``sequence_parallel_chunk``): the TP group's chunks all-gathered, padding cut."""
    if across_dp is None:
        return Layout("local", 0, n, False)
    local, total = across_dp[dp_rank], sum(across_dp)
    if n == total:
        return Layout("dp-slice", sum(across_dp[:dp_rank]), local, False)
    if n == local:
        return Layout("local", 0, n, False)
    if local_sizes is not None and n == sum(local_sizes) and len(local_sizes) % len(across_dp) == 0:
        per = len(local_sizes) // len(across_dp)  # chunks per DP rank: its TP ranks'
        mine = local_sizes[dp_rank * per: (dp_rank + 1) * per]
        if sum(mine) >= local:
            return Layout("sp-gathered", sum(local_sizes[: dp_rank * per]), local, False)
    if tp_size > 1 and n == -(-local // tp_size):
        return Layout("sp-chunk", 0, local, True)
    return None


def _micro_batched() -> bool:
    """Is a micro-batch of a step running (vLLM's DBO threads, ``v1/worker/ubatching.py``)?"""
    try:
        from vllm.v1.worker.ubatching import dbo_enabled
    except ImportError:  # a build without micro-batching
        return False
    return dbo_enabled()


class StepRows:
    """The recorder's device buffers: rows [R, L, K] int32 of the step's router outputs and
    written [L] int32, each layer's rows written this step (0 until its capture writes)."""

    def __init__(self, rows: int, layers: int, top_k: int, device, dp_rank: int, tp_size: int,
                 keep: bool = True, all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.buf = torch.zeros((rows, layers, top_k), dtype=torch.int32, device=device)
        self.written = torch.zeros(layers, dtype=torch.int32, device=device)
        self.dp_rank, self.tp_size = dp_rank, tp_size
        self.keep = keep  # False on ranks that never write (TP rank > 0): their captures only join gathers
        self._all_gather = all_gather
        self.missed: dict[str, int] = {}  # reason -> captures not written (host-side; a replayed graph adds none)
        self.layouts: set[str] = set()  # the layouts routed rows came in (logged as each first appears)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if self._all_gather is None:
            from vllm.distributed import get_tp_group

            group = get_tp_group()
            self._all_gather = lambda x: group.all_gather(x, 0)
        return self._all_gather(t.contiguous())

    def begin_step(self) -> None:
        """Before a served step's forward (queued on the device, no wait)."""
        self.written.zero_()

    def _miss(self, reason: str) -> None:
        """Host bookkeeping: called only where the capture runs eagerly (not traced by torch.compile)."""
        if reason not in self.missed:
            logger.warning("smoe record: router rows not recorded: %s; steps with such rows are dropped and "
                           "counted in smoe:record_lost_tokens (warned once)", reason)
        self.missed[reason] = self.missed.get(reason, 0) + 1

    def this_ranks_rows(self, topk_ids: torch.Tensor) -> torch.Tensor | None:
        """[count, K] this DP rank's rows of a router output in the step's order, or None."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        eager = not torch.compiler.is_compiling()  # host bookkeeping (logs, counts) only then
        if eager and _micro_batched():  # DBO runs only where MoE is an opaque op, never traced
            self._miss("a micro-batched step (DBO / ubatching): each micro-batch routes part of the step")
            return None
        dpm = get_forward_context().dp_metadata if is_forward_context_available() else None
        across = None if dpm is None else [int(x) for x in dpm.num_tokens_across_dp_cpu.tolist()]
        sizes = None if dpm is None else getattr(dpm, "local_sizes", None)
        n = topk_ids.shape[0]
        where = locate(n, across, sizes, self.dp_rank, self.tp_size)
        if where is None:
            if eager:
                self._miss(f"{n} rows fit no layout (rows per DP rank {across}, gathered sizes {sizes}, "
                           f"DP rank {self.dp_rank}, TP {self.tp_size})")
            return None
        if eager and where.name not in self.layouts:
            self.layouts.add(where.name)
            logger.info("smoe record: router rows in layout %s (%d rows per DP rank %s, gathered sizes %s)",
                        where.name, n, across, sizes)
        rows = self.all_gather(topk_ids) if where.gather else topk_ids  # every TP rank, in lock step
        return rows[where.start: where.start + where.count]

    def capture(self, layer: int, topk_ids: torch.Tensor, order=None) -> None:
        """A router's output of ``layer``: this rank's rows into the buffer, in place. order:
        speculate's :class:`~.token_order.TokenOrder` (its chunks, not vLLM's)."""
        if order is not None:
            if topk_ids.shape[0] * self.tp_size < order.rows:  # every TP rank sees the same shapes
                if not torch.compiler.is_compiling():
                    self._miss(f"{topk_ids.shape[0]} rows per rank cannot hold speculate's {order.rows}-row step")
                return
            rows = order.gather_rows(layer, topk_ids)
        else:
            rows = self.this_ranks_rows(topk_ids)
        if rows is None or not self.keep:
            return
        # the step's served rows come first and never exceed the buffer (max_num_batched_tokens):
        # rows past it can only be padding
        m = min(rows.shape[0], self.buf.shape[0])
        self.buf[:m, layer].copy_(rows[:m])
        self.written[layer].fill_(m)

    @staticmethod
    def complete(written: torch.Tensor, n: int) -> bool:
        """Did every layer write the step's first ``n`` rows? (host copy of ``written``)"""
        return bool((written >= n).all())
