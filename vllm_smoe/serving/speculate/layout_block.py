"""Layouts ``block`` and ``shuffled`` (:mod:`.plan`): an order per MoE layer around each MoE
block that chunks, computes and all-gathers its own rows (Qwen3-MoE, Qwen3-Next, ...).

``block``: ``order_tokens`` at the block's input (predict each token's rank -> capped
assignment, exactly the chunk sizes -> x[perm], so the contiguous chunk of rank r holds the
tokens predicted for r), ``restore_tokens`` at its output (y[inv] back to the step's order).

``shuffled`` (s-MoE's shuffled reduce-scatter): the attention's o_proj keeps its partial sums
(smoe sets its ``reduce_results`` to False at load, an attribute of vLLM's module, no symbol
replaced) and ``reduce_scatter_tokens`` reduce-scatters them with the rows already in the token
order; vLLM's add + norm then runs exact on this rank's chunk rows, ``split_residual`` keeps the
chunk's residual and passes a zero one on, and ``add_residual`` adds it to the experts' output
before the block's own all-gather, which so carries every row's whole residual stream (the next
layer adds zero). Per MoE layer: a reduce-scatter where vLLM all-reduces, the same number of
collectives and half the attention's bytes.
"""

from __future__ import annotations

import torch

from .comm import chunk_rows, keep_chunk_residual, shuffled_reduce_scatter
from .token_order import TokenOrder


class BlockOrder(TokenOrder):
    """Layout ``block``: the order around each MoE block, the attention's all-reduce as vLLM runs it."""

    def allocate(self, vllm_config, c, device):
        # the block reads only its chunk of the ordered rows (:data:`.seams.CHUNK_ONLY_BLOCKS`)
        self.chunk_only = self.plan.chunk_only

    def hook(self, model):
        for layer, block, _ in self.blocks:
            block.register_forward_pre_hook(self._pre(layer, predict=True), with_kwargs=True)
            block.register_forward_hook(self._post(layer))

    @staticmethod
    def _pre(layer: int, predict: bool = True):
        def hook(module, args, kwargs):  # the rows come first, positional or as hidden_states=
            if args:
                return (torch.ops.smoe.order_tokens(args[0], layer, predict), *args[1:]), kwargs
            return args, {**kwargs,
                          "hidden_states": torch.ops.smoe.order_tokens(kwargs["hidden_states"], layer, predict)}
        return hook

    @staticmethod
    def _post(layer: int, ahead: bool = False):
        def hook(module, args, output):
            if ahead:  # the columns _experts_out added come off here, kept for the next layer
                return torch.ops.smoe.restore_tokens_ahead(output, layer)
            return torch.ops.smoe.restore_tokens(output, layer)
        return hook

    def order(self, x: torch.Tensor, layer: int, predict: bool) -> torch.Tensor:
        T = x.shape[0]
        if predict and self.predicts_at(layer):
            self._predict(x, layer)
        self._mark_padding(layer, T)
        if self.chunk_only:
            # the block keeps only this rank's chunk (vLLM's sequence_parallel_chunk): gather just
            # those rows; the others are never read
            start, stop = chunk_rows(T, self.rank, self.N)
            out = torch.empty_like(x)
            torch.index_select(x, 0, self.perm[layer, start:stop], out=out[start:stop])
            return out
        return x.index_select(0, self.perm[layer, :T])



class ShuffledOrder(BlockOrder):
    """Layout ``shuffled``: the attention's partial sums reduce-scattered into the token order.
    o_proj's partial sums -> this rank's chunk of reduced rows (placed at their rows, the rest
    zero) -> vLLM's add + norm (exact on those rows) -> the chunk's residual kept, a zero
    residual passed on -> the experts' output plus the kept residual -> the block's all-gather:
    every row's new residual stream, the next layer adds zero to it. The order is made before
    the reduce (:meth:`.predictors.Predictor.before_reduce`)."""

    first_guesses = 1  # input-gate: the first layer's order from the tables; the gate orders the others

    def allocate(self, vllm_config, c, device):
        super().allocate(vllm_config, c, device)
        # kept [c, H] in the served dtype: the residual of this rank's chunk rows, between the
        # norm and the experts' output
        self.kept = torch.zeros((c, vllm_config.model_config.get_hidden_size()),
                                dtype=vllm_config.model_config.dtype, device=device)

    def hook(self, model):
        last = len(self.blocks) - 1
        ahead = self.predictor.ahead
        for layer, block, _ in self.blocks:
            block.register_forward_pre_hook(self._pre(layer, predict=False), with_kwargs=True)
            block.register_forward_hook(self._post(layer, ahead=ahead and layer < last))
        for layer, (in_norm, _) in enumerate(self.plan.exact):
            if in_norm is not None:  # predictor router: the layer input's share of the gate's logits
                in_norm.register_forward_hook(self._layer_input(layer), with_kwargs=True)
        for layer, o_proj, norm, fused in self.plan.shuffled:
            o_proj.reduce_results = False  # its partial sums: the reduce-scatter below sums them
            o_proj.register_forward_hook(self._attn_partial(layer))
            norm.register_forward_hook(self._norm_out(layer))
            fused.register_forward_hook(self._experts_out(layer, ahead=ahead and layer < last))

    @staticmethod
    def _layer_input(layer: int):
        def hook(module, args, kwargs, output):
            # input_layernorm(hidden) -> normed (the first layer: its input is hidden), or
            # input_layernorm(hidden, residual) -> (normed, hidden + residual)
            if isinstance(output, tuple):
                return (torch.ops.smoe.note_layer_input(output[0], output[1], layer), *output[1:])
            return torch.ops.smoe.note_layer_input(output, args[0] if args else kwargs["x"], layer)
        return hook

    @staticmethod
    def _attn_partial(layer: int):
        def hook(module, args, output):
            if isinstance(output, tuple):  # (output, bias) of vLLM's linear layers
                return (torch.ops.smoe.reduce_scatter_tokens(output[0], layer), *output[1:])
            return torch.ops.smoe.reduce_scatter_tokens(output, layer)
        return hook

    @staticmethod
    def _norm_out(layer: int):
        def hook(module, args, output):  # post_attention_layernorm(hidden, residual) -> (normed, residual)
            normed, residual = output
            return torch.ops.smoe.split_residual(normed, residual, layer)
        return hook

    @staticmethod
    def _experts_out(layer: int, ahead: bool = False):
        def hook(module, args, output):
            if not isinstance(output, torch.Tensor):
                raise RuntimeError(f"smoe speculate: {type(module).__name__} returned {type(output).__name__}, not "
                                   f"one tensor; set additional_config smoe.reduce_scatter to false")
            if ahead:  # plus the next MoE layer's ranks of these rows, as columns for the all-gather
                return torch.ops.smoe.add_residual_ahead(output, layer)
            return torch.ops.smoe.add_residual(output, layer)
        return hook

    def reduce_scatter(self, partial: torch.Tensor, layer: int) -> torch.Tensor:
        """:func:`.comm.shuffled_reduce_scatter` on the TP group, the order of ``layer`` made
        first where the predictor makes it (:meth:`.predictors.Predictor.before_reduce`)."""
        T = partial.shape[0]
        self.predictor.before_reduce(self, partial, layer)
        return shuffled_reduce_scatter(partial, self.perm[layer, :T], self.rank, self.N,
                                       lambda x: self.tp.reduce_scatter(x, 0))

    def note_layer_input(self, normed: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Predictor router at the layer's input_layernorm: x [T, H] the layer's input (every row
        whole) noted (:meth:`.predictors.SummedRouter.note_input`). Returns a copy of normed (the
        op's output carries the order of the ops: the reduce-scatter that reads it depends on it)."""
        self.predictor.note_input(self, x, layer)
        return normed.clone()

    def split_residual(self, x: torch.Tensor, residual: torch.Tensor, layer: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        return keep_chunk_residual(x, residual, self.perm[layer, :T], self.rank, self.N, self.kept)

    def add_residual(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """y: [c, H] the experts' output of this rank's chunk: plus its kept residual rows."""
        return y + self.kept[: y.shape[0]].to(y.dtype)

    def add_residual_ahead(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """:meth:`add_residual`, then three columns more: [c, H + 3], the next MoE layer's two
        preferred ranks (-1 = none) and confidence for these rows (:func:`.gates.gate_ranks` on the
        rows, which are that layer's input), in y's dtype (small integers stay exact; every rank
        reads the same bytes after the all-gather, so the confidence need not be exact)."""
        x = self.add_residual(y, layer)
        c, T = x.shape[0], self.rows
        nxt = layer + 1
        # the step rows of this chunk (the chunk's padding past T reads the last row: dropped later)
        src = self.perm[layer].index_select(0, (torch.arange(c, device=x.device) + self.rank * c).clamp(max=T - 1))
        pref, conf = self.predictor.ranks(self, x, nxt, self.ids.index_select(0, src))
        return torch.cat([x, pref.to(x.dtype), conf.to(x.dtype)[:, None]], dim=1)
