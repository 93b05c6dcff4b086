"""Layouts ``stack-step`` and ``stack-layer`` (:mod:`.plan`): the DeepSeek family (DeepSeek-V2/V3,
Kimi K2, GLM-4.5, ...), whose decoder layers split the rows themselves: attention skips its
all-reduce, the layer reduce-scatters into contiguous chunks, the MoE block runs
``already_sequence_parallel`` and the residual stays split until the next layer all-gathers. No
per-block order fits there.

``stack-layer`` (the default) orders each MoE layer's rows inside vLLM's own reduce-scatter, by
folding the residual into the attention's partial sums (:class:`StackLayerOrder`);
``stack-step`` (``stack_order: step``) orders the whole step once at the first decoder layer
(:class:`StackStepOrder`). Attentions and the final norm see the step's order in both."""

from __future__ import annotations

import torch

from .comm import chunk_rows
from .token_order import TokenOrder


class StackOrder(TokenOrder):
    """What both stack layouts hook: vLLM's one-row fix, attentions restored and ordered again."""

    def hook(self, model):
        stack = self.plan.stack
        split = [bool(getattr(d, "use_sequence_parallel_moe", False)) for d in stack.layers]
        for i, decoder_layer in enumerate(stack.layers):
            if i > 0 and split[i - 1]:
                decoder_layer.register_forward_pre_hook(self._one_row_layer, with_kwargs=True)
        self.hook_stack(stack, split)

    def hook_stack(self, stack: torch.nn.Module, split: list[bool]) -> None:
        raise NotImplementedError

    @staticmethod
    def _no_residual(args, kwargs) -> None:
        """The first decoder layer's call (positions, hidden_states, residual=None, ...) must carry
        no residual: with one, the stack is not the whole model (pipeline parallel)."""
        if (args[2] if len(args) > 2 else kwargs.get("residual")) is not None:
            raise RuntimeError("smoe speculate: the first decoder layer got a residual (pipeline parallel?)")

    @staticmethod
    def _attn_in(layer: int, ahead: bool = False):
        # ahead: the rows carry input-gate's three columns (fold_residual_ahead), kept for the order
        restore = torch.ops.smoe.restore_tokens_ahead if ahead else torch.ops.smoe.restore_tokens

        def hook(module, args, kwargs):  # attention(positions, hidden_states, ...)
            if len(args) >= 2:
                return (args[0], restore(args[1], layer), *args[2:]), kwargs
            return args, {**kwargs, "hidden_states": restore(kwargs["hidden_states"], layer)}
        return hook

    @staticmethod
    def _attn_out(layer: int):
        def hook(module, args, output):
            return torch.ops.smoe.order_tokens(output, layer, False)
        return hook

    @staticmethod
    def _final(layer: int):
        def hook(module, args):  # norm(hidden_states, residual)
            return tuple(torch.ops.smoe.restore_tokens(a, layer) if isinstance(a, torch.Tensor) else a for a in args)
        return hook

    # vLLM bug (0.32, DeepSeek-family decoder layers and stack): "are my rows split?" is asked as
    # rows != positions.shape[0], which is false for one token (ceil(1 / N) = 1; for N >= 2 only
    # T <= 1), so with a single decode token the split row (on rank 0; zero padding elsewhere) is
    # taken as the whole step: the other ranks attend over padding and the next layers read it.
    # For one token, smoe all-gathers the split rows itself before such a layer and before the
    # final norm. Eager only in effect: compiled with vLLM's (backed, guard-free) dynamic shapes
    # both vLLM's test and this one are fixed at trace time on the general path.
    def _gather_one_row(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = self.tp.all_gather(torch.cat([hidden, residual], dim=-1), 0)[:1]
        return both[:, : hidden.shape[1]].contiguous(), both[:, hidden.shape[1]:].contiguous()

    def _one_row_layer(self, module, args, kwargs):  # layer(positions, hidden_states, residual, ...)
        positions = args[0] if args else kwargs["positions"]
        if positions.shape[0] != 1:
            return None
        if len(args) < 3:  # vLLM's stack passes them positionally; anything else is a new model
            raise RuntimeError(f"smoe speculate: {type(module).__name__} called without positional "
                               f"(positions, hidden_states, residual)")
        rest = args[1:]
        hidden, residual = self._gather_one_row(rest[0], rest[1])
        return (positions, hidden, residual, *rest[2:]), kwargs

    def _one_row_final(self, layer: int):
        final = self._final(layer)

        def hook(module, args):  # after a split last layer: norm(hidden_states, residual)
            if len(args) >= 2 and args[0].shape[0] == 1:
                args = (*self._gather_one_row(args[0], args[1]), *args[2:])
            return final(module, args)
        return hook



class StackStepOrder(StackOrder):
    """Layout ``stack-step``: one order per step, set at the first decoder layer's input and kept
    through the stack; every MoE layer's block reads row 0 of ``perm`` / ``inv``.

    ``stack-step`` (``stack_order: step``): the whole step is ordered once: the first decoder
    layer's input rows are permuted (one prediction from every MoE layer's table), every attention
    sees them in the original order (restore before, order after: row-wise ops commute with a
    permutation), and the final norm gets them back in the original order."""

    rows_ordered = "step"

    def hook_stack(self, stack, split):
        # on the first layer's input, not on embed_tokens: drafters may share the embedding
        stack.layers[0].register_forward_pre_hook(self._first_layer, with_kwargs=True)
        for decoder_layer in stack.layers:
            decoder_layer.self_attn.register_forward_pre_hook(self._attn_in(0), with_kwargs=True)
            decoder_layer.self_attn.register_forward_hook(self._attn_out(0))
        stack.norm.register_forward_pre_hook(self._one_row_final(0) if split[-1] else self._final(0))

    def order_row(self, layer):
        return 0

    def predicts_at(self, layer):
        return True

    def predicted_layers(self, layer):
        return [layer]

    def preferences(self, layers, ids):
        """One order for every layer: (pref [1, T, P], conf [1, T])."""
        return self.predictor.step_preferences(self, ids)

    @staticmethod
    def _first_layer(module, args, kwargs):  # layer(positions, hidden_states, residual=None, ...)
        StackOrder._no_residual(args, kwargs)
        if len(args) > 1:
            return (args[0], torch.ops.smoe.order_tokens(args[1], 0, True), *args[2:]), kwargs
        return args, {**kwargs, "hidden_states": torch.ops.smoe.order_tokens(kwargs["hidden_states"], 0, True)}



class StackLayerOrder(StackOrder):
    """Layout ``stack-layer``: an order per MoE layer, folded into the attention's partial sums. The
    rows stay in the step's order up to the first MoE layer; there each MoE layer's input_layernorm
    hands its residual rows to smoe (``fold_residual``: a zero residual goes on) and its attention's
    output comes out ordered for this layer with them added (``order_folded``), so vLLM's own
    reduce-scatter gives each rank the chunk of this layer's order, residual included (no collective
    or byte more); a later attention (MoE or dense) gets its rows back in the step's order, a dense
    layer's output the order its residual is in, and the final norm the step's order. ``gated``: the
    MoE layers input-gate orders by the gate on their split input."""

    def allocate(self, vllm_config, c, device):
        # kept [c, H] in the served dtype: the layer input's rows this rank adds to its attention
        # partial sums (its chunk of the previous order, or its share of whole rows)
        self.kept = torch.zeros((c, vllm_config.model_config.get_hidden_size()),
                                dtype=vllm_config.model_config.dtype, device=device)

    def hook_stack(self, stack, split):
        moe_layers = self.plan.moe_layers
        stack.layers[0].register_forward_pre_hook(self._first_residual(split[0]), with_kwargs=True)
        cur = -1  # the order the rows entering layer i are in (-1: the step's)
        self.gated = set()
        for i, decoder_layer in enumerate(stack.layers):
            whole = not (i > 0 and split[i - 1])
            gated = split[i] and self.predictor.ahead and not whole
            if cur >= 0:
                decoder_layer.self_attn.register_forward_pre_hook(self._attn_in(cur, ahead=gated), with_kwargs=True)
            if split[i]:
                layer = moe_layers.index(i)
                if gated:
                    self.gated.add(layer)
                decoder_layer.input_layernorm.register_forward_hook(
                    self._fold_in(layer, whole, prev=cur if gated else None))
                decoder_layer.self_attn.register_forward_hook(self._attn_fold(layer, cur, whole, gated))
                cur = layer
            elif cur >= 0:
                decoder_layer.self_attn.register_forward_hook(self._attn_out(cur))
        if cur >= 0:
            stack.norm.register_forward_pre_hook(self._one_row_final(cur) if split[-1] else self._final(cur))

    @staticmethod
    def _first_residual(split: bool):
        def hook(module, args, kwargs):  # layer(positions, hidden_states, residual=None, ...)
            StackOrder._no_residual(args, kwargs)
            if not split:
                return None
            # a first MoE layer: its residual (the embedding) must reach input_layernorm's output,
            # where smoe takes it, not be chunked by vLLM after the reduce-scatter; x + 0 is exact
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            if len(args) > 1:
                return (*args[:2], torch.zeros_like(hidden), *args[3:]), {k: v for k, v in kwargs.items()
                                                                          if k != "residual"}
            return args, {**kwargs, "residual": torch.zeros_like(hidden)}
        return hook

    @staticmethod
    def _fold_in(layer: int, whole: bool, prev: int | None = None):
        def hook(module, args, output):  # input_layernorm(hidden, residual) -> (normed, hidden + residual)
            if not isinstance(output, tuple):
                raise RuntimeError(f"smoe speculate: {type(module).__name__} returned no residual at MoE layer {layer}")
            if prev is not None:  # input-gate: the chunk's ranks for this layer, as columns of the normed rows
                return torch.ops.smoe.fold_residual_ahead(output[0], output[1], layer, prev)
            return torch.ops.smoe.fold_residual(output[0], output[1], layer, whole)
        return hook

    @staticmethod
    def _attn_fold(layer: int, prev: int, whole: bool, gated: bool):
        def hook(module, args, output):
            return torch.ops.smoe.order_folded(output, layer, prev, whole, gated)
        return hook

    def fold_residual(self, normed: torch.Tensor, residual: torch.Tensor, layer: int, whole: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack order per layer, at MoE layer ``layer``'s input_layernorm: residual [R, H] the
        layer's input (the residual stream) as this rank holds it: ``whole`` (every row, R = T, in
        the order the stack's rows are in) or split (this rank's chunk of the previous MoE
        layer's order, R = ceil(T / N)). Keeps the rows this rank adds to its attention partial
        sums (its contiguous share of whole rows, or its chunk) in ``kept``. Returns (a copy of
        normed: the attention depends on it, which orders this op before ``order_folded``; a
        zero residual for vLLM's add after the reduce-scatter, exact: the rows arrive summed)."""
        self._keep(residual, whole)
        return normed.clone(), torch.zeros_like(residual)

    def _keep(self, residual: torch.Tensor, whole: bool) -> None:
        """The rows of residual [R, H] this rank adds (its :func:`chunk_rows` share of whole
        rows, or all of its chunk) into ``kept``, as :meth:`order_folded` reads them back."""
        R = residual.shape[0]
        start, stop = chunk_rows(R, self.rank, self.N) if whole else (0, R)
        self.kept[: stop - start].copy_(residual[start:stop])

    def fold_residual_ahead(self, normed: torch.Tensor, residual: torch.Tensor, layer: int, prev: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`fold_residual` of split rows (this rank's chunk of MoE layer ``prev``'s order),
        and predictor input-gate's ranks of them for ``layer``: [c, H + 3] the normed rows, this
        layer's two preferred ranks (-1 = none) and the confidence (:func:`.gates.gate_ranks` on the
        rows, which are the layer's input) in normed's dtype, for vLLM's all-gather before the
        attention; every rank then reads the same bytes (``restore_ahead``)."""
        self._keep(residual, False)
        # the step's rows: set at its first MoE layer. One row (smoe's one-row fix gathered it,
        # vLLM gathers nothing more): each rank keeps its own columns, and they may differ, but a
        # one-row order is the identity whatever they say (chunk_caps(1, N) = [1, 0, ...])
        c, T = residual.shape[0], self.rows
        q = (torch.arange(c, device=residual.device) + self.rank * c).clamp(max=T - 1)  # padding: dropped later
        ids = self.ids.index_select(0, self.perm[prev].index_select(0, q))
        pref, conf = self.predictor.ranks(self, residual, layer, ids)
        return (torch.cat([normed, pref.to(normed.dtype), conf.to(normed.dtype)[:, None]], dim=1),
                torch.zeros_like(residual))

    def order_folded(self, partial: torch.Tensor, layer: int, prev: int, whole: bool, gated: bool
                     ) -> torch.Tensor:
        """Stack order per layer, at the attention's output of MoE layer ``layer``: partial [T,
        H] this rank's attention partial sums in the step's order (summed over ranks by vLLM's
        reduce-scatter next); prev: the MoE layer whose order ``fold_residual``'s rows are in (-1:
        the step's; then every layer's order is predicted here, once per step); whole: as
        ``fold_residual`` was told (its rows: this rank's share of T, or its chunk); gated: input-gate's
        ranks for this layer rode in with the layer's input (``fold_residual_ahead``). Returns [T, H]
        in this layer's order, plus this rank's kept residual rows at their places, so each row's
        residual is added once over the ranks and each rank's reduced chunk is the rows this
        layer's order gives it, residual included. Static shapes, no host read."""
        T = partial.shape[0]
        dev = partial.device
        c = -(-T // self.N)
        start, stop = chunk_rows(T, self.rank, self.N) if whole else (self.rank * c, self.rank * c + c)
        q = torch.arange(start, stop, device=dev)
        rows = self.kept[: stop - start].to(partial.dtype)
        if not whole:  # the chunk's padding past T adds zero to the last row
            rows = torch.where((q < T)[:, None], rows, 0)
            q = q.clamp(max=T - 1)
        src = q if prev < 0 else self.perm[prev].index_select(0, q)  # the step rows they are
        # this layer's order (made here, or brought by input-gate's columns) plus the rows
        out = self.predictor.fold(self, partial, layer, prev, gated, src, rows)
        self.rows = T
        self._mark_padding(layer, T)
        return out
