"""``mode: speculate``: s-TS as the token order around vLLM's own sequence-parallel MoE.

vLLM's sequence-parallel MoE blocks (Qwen3-MoE, Qwen3-Next, ...) take the replicated
post-attention rows, keep a contiguous ``ceil(T / N)`` slice per rank
(``sequence_parallel_chunk``), run FusedMoE on it (expert parallel) and all-gather the result.
smoe changes only the order of the rows around that block, with two opaque custom ops put in by
forward hooks (no model code):

    order_tokens:   predict each token's rank -> capped assignment (exactly the chunk sizes)
                    -> x[perm], so the contiguous chunk of rank r holds the tokens predicted for r
    restore_tokens: y[inv] back to the original order (+ this layer's top-1, all-gathered on the
                    TP group, for the next layer's Markov look-up)

Where the decoder layer allows it (:func:`shuffle_seams`; Qwen3-MoE's does) the attention's
all-reduce goes too, as in s-MoE's own step: smoe sets the layer's ``o_proj.reduce_results`` to
False at load (an attribute of vLLM's module, no symbol replaced) and reduce-scatters its
partial sums with the rows already in the token order (``reduce_scatter_tokens``); vLLM's add +
norm then runs exact on this rank's chunk rows, ``split_residual`` keeps the chunk's residual
and passes a zero one on, and ``add_residual`` adds it to the experts' output before the block's
own all-gather, which so carries every row's whole residual stream (the next layer adds zero).
Per MoE layer: a reduce-scatter where vLLM all-reduces, the same number of collectives and half
the attention's bytes. Predictor router orders a layer before its reduce from the gate's logits
of each rank's partial rows, all-gathered and summed (``note_layer_input`` at the layer's
input_layernorm, :func:`exact_router_seams`): one [T, E] all-gather more.

Everything runs on the device from device-resident tables with static shapes: no host
synchronisation, capturable by torch.compile and CUDA graphs. A misprediction only means the
token's experts sit elsewhere; vLLM's all2all (smoe's sparse manager by default on CPU) takes it
there and back. The block computes exactly what it computed before, row by row.

DeepSeek-family decoder layers (DeepSeek-V2/V3, Kimi K2, GLM-4.5, ...) split the rows themselves:
attention skips its all-reduce, the layer reduce-scatters into contiguous chunks, the MoE block
runs ``already_sequence_parallel`` and the residual stays split until the next layer all-gathers.
No per-block order fits there ("stack" order). By default smoe still orders each MoE layer: at
the layer's input_layernorm ``fold_residual`` takes the layer's residual rows as this rank holds
them and passes a zero residual on, and at the attention's output ``order_folded`` adds them to
this rank's partial sums and permutes the rows into this layer's order, so vLLM's own
reduce-scatter hands each rank its chunk of this layer's order, residual included (no
collective or byte more); attentions see their rows restored to the step's order, and the final
norm too. With ``stack_order: step`` the whole step is ordered once instead: the first decoder
layer's input rows are permuted (one prediction from every MoE layer's table), every attention
sees them in the original order (restore before, order after: row-wise ops commute with a
permutation), and the final norm gets them back in the original order.
"""

from __future__ import annotations

import functools
import logging

import torch

from ...placement.learned import LEARNED_FIELDS
from . import device_predict
from . import ops  # noqa: F401  (registers torch.ops.smoe.*, which the hooks call)
from .comm import agree, chunk_padding, chunk_real, chunk_rows, keep_chunk_residual, shuffled_reduce_scatter
from .gates import exact_gate_scale, gate_logits, gate_ranks, route_ahead, sum_gathered, unit_rows
from .seams import (CHUNK_ONLY_BLOCKS, block_supported, exact_router_seams, find_moe_experts, find_stack,
                    gate_ahead, hookable_gate, shuffle_seams, stack_order_kind, tp_spans_nodes)
from ..config import TABLE_PREDICTORS

logger = logging.getLogger("vllm.smoe")


class TokenOrder:
    """Per-worker state: device tables, the step's token ids, per-layer inverse permutations,
    the previous layer's top-1, and device-side counters read only when logging."""

    def __init__(self, model, vllm_config, cfg, plan, location, expected: float | None = None):
        from vllm.distributed import get_tp_group

        self.tp = get_tp_group()
        self.N, self.rank = self.tp.world_size, self.tp.rank_in_group
        self.predictor = cfg.predictor
        device = next(model.parameters()).device
        experts = find_moe_experts(model, plan.moe_layers)
        self.blocks = [(layer, block, e.router) for layer, block, e in experts]
        if len(self.blocks) != len(plan.moe_layers):
            raise RuntimeError(f"smoe speculate: found {len(self.blocks)} MoE blocks, expected {len(plan.moe_layers)}")
        self.experts = [e for _, _, e in experts]  # where the counters' capture is bound
        kinds, checked = set(), {}
        for _, block, _ in self.blocks:  # once per block class: the stack check reads every layer's source
            if type(block) not in checked:
                checked[type(block)] = block_supported(block, model)
            ok, reason, kind = checked[type(block)]
            if not ok:
                raise ValueError(f"smoe mode speculate: {reason}")
            kinds.add(kind)
        if len(kinds) != 1:
            raise ValueError(f"smoe mode speculate: MoE blocks of mixed kinds {sorted(kinds)}")
        self.stack = kinds == {"stack"}
        stack = find_stack(model) if self.stack else None
        # the DeepSeek family: an order per MoE layer (the split residual folded into the
        # attention's partial sums before the layer's own reduce-scatter) where it can follow the
        # stack, else one order for the whole step (:func:`stack_order_kind`)
        self.step_order, self.step_reason = False, ""
        if self.stack:
            self.step_order, self.step_reason = stack_order_kind(
                stack, plan.moe_layers, cfg.stack_order, vllm_config.model_config.dtype)
        if self.stack and getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError(f"smoe mode speculate: speculative decoding with {type(self.blocks[0][1]).__name__}: its "
                             f"drafters read the stack's hidden states (MTP, EAGLE-3), which smoe keeps in its own "
                             f"order between layers")
        if self.stack and getattr(vllm_config, "lora_config", None) is not None:
            raise ValueError(f"smoe mode speculate: LoRA with {type(self.blocks[0][1]).__name__}: vLLM picks each "
                             f"row's adapter by its place in the step, and smoe keeps the rows in its own order "
                             f"between decoder layers, so the dense layers would take other tokens' adapters")
        if self.stack and cfg.predictor == "tables-markov":
            raise ValueError(f"smoe mode speculate: predictor 'tables-markov' orders each layer by the previous "
                             f"layer's top-1 experts of every row, but {type(self.blocks[0][1]).__name__}'s decoder "
                             f"layers keep their rows split between layers, so no rank holds them; use predictor "
                             f"'tables' or 'learned'")
        if self.step_order and cfg.predictor in ("router", "input-gate"):
            raise ValueError(f"smoe mode speculate: predictor {cfg.predictor!r} runs each MoE layer's gate on rows "
                             f"of that layer, but {type(self.blocks[0][1]).__name__}'s decoder layers keep their rows "
                             f"split between layers, with one order for the whole step ({self.step_reason}); use "
                             f"predictor 'tables' or 'learned'")
        # the TP group's broadcast on the device communicator (pynccl on the current stream on
        # CUDA, capturable like vLLM's other collectives; torch.distributed's elsewhere)
        comm = getattr(self.tp, "device_communicator", None)
        self.broadcast = comm.broadcast if comm is not None and hasattr(comm, "broadcast") else self.tp.broadcast
        self.gates = []  # predictors router, input-gate: (gate, router) per MoE layer
        if cfg.predictor in ("router", "input-gate"):
            for _, block, e in experts:
                ok, reason, gate = gate_ahead(block, e)
                if not ok:
                    raise ValueError(f"smoe mode speculate: predictor {cfg.predictor!r}: {reason}")
                self.gates.append((gate, e.router))
        L, E = plan.slot2expert.shape
        self.learned = cfg.predictor == "learned"
        self._read_location(location)
        T = vllm_config.scheduler_config.max_num_batched_tokens
        self.ids = torch.zeros(T, dtype=torch.long, device=device)
        self.query = torch.full((T,), -1, dtype=torch.long, device=device)  # bigram keys of the step's rows
        self.prev = torch.full((T,), -1, dtype=torch.long, device=device)  # learned: previous row's id, -1 = none
        self.perm = torch.zeros((L, T), dtype=torch.long, device=device)
        self.inv = torch.zeros((L, T), dtype=torch.long, device=device)
        c = -(-T // self.N)
        # this rank's chunk, router outputs (before vLLM's logical -> physical map)
        self.top1 = torch.zeros(c, dtype=torch.long, device=device)
        self.prev_top1 = torch.zeros(T, dtype=torch.long, device=device)
        # per MoE layer, served steps only: local activations, activations, tokens, hits (tokens
        # with an expert on their rank; metrics.ORDER_FIELDS), then local activations,
        # activations and tokens of the steps the order can act on (T >= N: what drift judges, as
        # a step with fewer tokens than ranks keeps them all in rank 0's chunk whatever the
        # prediction); read back once per log interval
        self.counts = torch.zeros((L, 7), dtype=torch.long, device=device)
        from ..observe.counters import Observer
        from ..observe.metrics import Drift, metrics_dir

        # the placement's own ratio is what a trained predictor should reach; random and one-rank
        # orders are not judged against it
        self.count = cfg.metrics  # off: no device counters, no log line, no drift
        self.judged = cfg.predictor in TABLE_PREDICTORS + ("router",)
        self.observer = Observer("order", self.rank, cfg.log_interval, metrics_dir(cfg),
                                 Drift(expected if self.judged else None, cfg.drift_threshold),
                                 who=f"rank {self.rank}", hint=" (smoe-place advise)")
        self.steps = self.small_steps = 0  # served steps; those with fewer tokens than ranks
        self.rows = 0  # rows of the current step, pad rows included (host int, from the op's input shape)
        # the step's real tokens (the rest of the rows are vLLM's padding), written before each
        # served step outside the forward (runner_hooks), 0 otherwise: a replayed CUDA graph and
        # a warm-up run count exactly what they should
        self.num_real = torch.zeros((), dtype=torch.long, device=device)
        # vLLM's pad-row mask for the rows of this rank's ordered chunk (_mark_padding), and the
        # runner's step mask it stands in for between an order and its restore
        self.chunk_pad = torch.ones(c, dtype=torch.bool, device=device)
        self.step_pad = None
        # the block reads only its chunk of the ordered rows: blocks whose forward was read to
        # touch nothing else before vLLM's sequence_parallel_chunk (others get every row)
        self.chunk_only = not self.stack and all(type(b).__name__ in CHUNK_ONLY_BLOCKS for _, b, _ in self.blocks)
        # s-MoE's shuffled reduce-scatter (config reduce_scatter): the attention's partial sums
        # reduce-scatter straight into the token order, and the residual added to this rank's
        # chunk travels in the MoE block's own all-gather; predictor router, which needs the
        # reduced rows' gate logits before the reduce, sums them from each rank's partial rows
        # (exact_router_seams) where the norm, gate and routing step allow, else keeps the all-reduce
        self.shuffled, why = [], "reduce_scatter: off"
        self.exact = []
        if cfg.reduce_scatter != "off" and self.N > 1 and not self.stack:
            if getattr(vllm_config, "lora_config", None) is not None:
                # vLLM wraps o_proj for LoRA after the load: the wrapper would skip both the
                # all-reduce (it reads reduce_results) and smoe's hook on the module it wraps
                why = "LoRA wraps the attention's o_proj after the load"
            elif cfg.reduce_scatter == "auto" and not tp_spans_nodes(self.tp):
                why = ("reduce_scatter: auto, and the tensor-parallel group is on one node, where vLLM's all-reduce "
                       "costs no more")
            else:
                self.shuffled, why = shuffle_seams(model, plan.moe_layers, experts, self.N)
            if self.shuffled and cfg.predictor == "router":
                self.exact, why = exact_router_seams(model, plan.moe_layers, self.gates,
                                                     vllm_config.model_config.get_hidden_size(),
                                                     vllm_config.model_config.dtype, device)
                if not self.exact:
                    self.shuffled, why = [], f"predictor 'router': {why}"
        self.shuffle_reason = why if not self.shuffled else ""
        if self.stack and cfg.predictor == "router":
            # the DeepSeek family ordered per layer: each rank's attention partial sums carry its
            # residual rows (order_folded), so the gate's logits of the reduced rows are their sum
            # over the ranks, where the post-attention norm, gate and routing step allow it
            for layer, (gate, router) in enumerate(self.gates):
                decoder = stack.layers[plan.moe_layers[layer]]
                w, why = exact_gate_scale(decoder.post_attention_layernorm, gate, router,
                                          vllm_config.model_config.get_hidden_size(), vllm_config.model_config.dtype,
                                          device)
                if w is None:
                    raise ValueError(f"smoe mode speculate: predictor 'router' on {type(decoder).__name__}, which "
                                     f"keeps its rows split between layers, sums the gate's logits from each rank's "
                                     f"partial rows before the reduce, but {why}; use predictor 'input-gate', "
                                     f"'tables' or 'learned'")
                self.exact.append((None, w))
        # predictor input-gate: with the shuffled reduce-scatter, layer l's order is needed before
        # its attention output is reduced, so its gate runs on the layer's input instead (after the
        # layer's post-attention norm): each rank on its own chunk rows at the end of the previous
        # MoE block (their output plus the kept residual), the ranks and confidence riding as three
        # more columns in that block's all-gather, so every rank assigns from the same bytes (no
        # collective more, none of rank 0's broadcast); the first MoE layer takes the tables, the
        # others the tables' guess where it is the more confident (measured: BENCHMARKS.md). Where
        # the rows are whole before the block (no shuffled reduce-scatter) the gate sees the exact
        # rows: it is predictor router there.
        # The DeepSeek family ordered per layer: each rank runs the gate on its chunk of the
        # layer's input at input_layernorm, the ranks riding as three more columns in the
        # layer's own all-gather before its attention (a MoE layer whose input is whole, after
        # a dense layer or the first, takes the tables).
        self.ahead = cfg.predictor == "input-gate" and (bool(self.shuffled) or self.stack)
        if self.ahead:
            if self.tables is None:
                raise ValueError("smoe mode speculate: predictor 'input-gate' takes the first MoE layer's order from "
                                 "the placement's tables, and it has none")
            self.next_norm = ({layer: norm for layer, _, norm, _ in self.shuffled} if self.shuffled else
                              {layer: stack.layers[i].post_attention_layernorm
                               for layer, i in enumerate(plan.moe_layers)})
            self.next_pref = torch.full((T, 2), -1, dtype=torch.long, device=device)
            self.next_conf = torch.zeros(T, dtype=torch.float32, device=device)
            self.table_pref = torch.full((L, T, 2), -1, dtype=torch.long, device=device)
            self.table_conf = torch.zeros((L, T), dtype=torch.float32, device=device)
        if self.exact:
            # [T, E] float32: the gate's logits of the layer input's rows this rank adds (its
            # contiguous share of the rows; zero elsewhere), written at input_layernorm
            self.base = torch.zeros((T, self.holds.shape[2]), dtype=torch.float32, device=device)
        if self.shuffled or (self.stack and not self.step_order):
            hidden = vllm_config.model_config.get_hidden_size()
            # shuffled: the residual of this rank's chunk rows, between the norm and the experts'
            # output; stack per layer: the layer input's rows this rank adds to its attention
            # partial sums (its chunk of the previous order, or its share of whole rows)
            self.kept = torch.zeros((c, hidden), dtype=vllm_config.model_config.dtype, device=device)
        # tables-markov: each layer waits for the previous one's top-1 (one extra all-gather per
        # layer); the others predict every layer at the first MoE layer of the step
        self.markov = cfg.predictor == "tables-markov"
        self.per_layer = self.markov or cfg.predictor == "router" or (cfg.predictor == "input-gate" and not self.ahead)
        model.register_forward_pre_hook(self._step_ids, with_kwargs=True)
        from .. import runner_hooks

        runner_hooks.attach(before=self._before_step, after=self._after_step)
        from vllm.platforms import current_platform

        runner_hooks.check_attached(vllm_config, current_platform.device_type)  # else counters would read 0
        from ..record.capture import set_capture

        for (layer, block, _), experts in zip(self.blocks, self.experts):
            set_capture(experts, functools.partial(self._capture, layer), "smoe mode speculate",
                        hookable_gate(block, experts, vllm_config))
        last = len(self.blocks) - 1
        for layer, block, router in self.blocks:
            if not self.stack:
                block.register_forward_pre_hook(self._pre(layer, predict=not self.shuffled), with_kwargs=True)
                block.register_forward_hook(self._post(layer, ahead=self.ahead and layer < last))
        for layer, (in_norm, _) in enumerate(self.exact):
            if in_norm is not None:  # the stack folds the layer's input into the partial sums instead
                in_norm.register_forward_hook(self._layer_input(layer), with_kwargs=True)
        for layer, o_proj, norm, fused in self.shuffled:
            o_proj.reduce_results = False  # its partial sums: the reduce-scatter below sums them
            o_proj.register_forward_hook(self._attn_partial(layer))
            norm.register_forward_hook(self._norm_out(layer))
            fused.register_forward_hook(self._experts_out(layer, ahead=self.ahead and layer < last))
        if self.stack:
            self._hook_stack(stack, plan.moe_layers)

    def _hook_stack(self, stack: torch.nn.Module, moe_layers: tuple[int, ...]) -> None:
        """The hooks of the DeepSeek family's order. One order per step: the first decoder
        layer's input permuted, every attention's rows restored before it and ordered after it,
        the final norm's restored. An order per MoE layer: the rows stay in the step's order up
        to the first MoE layer; there each MoE layer's input_layernorm hands its residual rows to
        smoe (``fold_residual``: a zero residual goes on) and its attention's output comes out
        ordered for this layer with them added (``order_folded``), so vLLM's own reduce-scatter
        gives each rank the chunk of this layer's order, residual included; a later attention
        (MoE or dense) gets its rows back in the step's order, a dense layer's output the order
        its residual is in, and the final norm the step's order."""
        split = [bool(getattr(d, "use_sequence_parallel_moe", False)) for d in stack.layers]
        for i, decoder_layer in enumerate(stack.layers):
            if i > 0 and split[i - 1]:
                decoder_layer.register_forward_pre_hook(self._one_row_layer, with_kwargs=True)
        if self.step_order:
            # on the first layer's input, not on embed_tokens: drafters may share the embedding
            stack.layers[0].register_forward_pre_hook(self._first_layer, with_kwargs=True)
            for decoder_layer in stack.layers:
                decoder_layer.self_attn.register_forward_pre_hook(self._attn_in(0), with_kwargs=True)
                decoder_layer.self_attn.register_forward_hook(self._attn_out(0))
            stack.norm.register_forward_pre_hook(self._one_row_final(0) if split[-1] else self._final(0))
            return
        stack.layers[0].register_forward_pre_hook(self._first_residual(split[0]), with_kwargs=True)
        cur = -1  # the order the rows entering layer i are in (-1: the step's)
        self.gated = set()  # input-gate: the MoE layers ordered by the gate on their split input
        for i, decoder_layer in enumerate(stack.layers):
            whole = not (i > 0 and split[i - 1])
            gated = split[i] and self.ahead and not whole
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
        if self.ahead and not self.gated:
            raise ValueError(f"smoe mode speculate: predictor 'input-gate' orders a MoE layer by its gate on its "
                             f"split input, but no MoE layer of {type(stack).__name__} follows another one (each "
                             f"would take the tables); use predictor 'tables'")
        if cur >= 0:
            stack.norm.register_forward_pre_hook(self._one_row_final(cur) if split[-1] else self._final(cur))

    def step_hooks(self) -> tuple:
        """The runner hooks this order attached (:func:`.runner_hooks.attach`)."""
        return self._before_step, self._after_step

    def _before_step(self, runner, scheduler_output) -> None:
        self.before_step(scheduler_output)

    def _after_step(self, runner, scheduler_output, step) -> None:
        self.after_step()

    def _read_location(self, location) -> None:
        """The served placement's device maps and tables (:class:`~..location.DeviceLocation`,
        updated in place by a live swap): read here, owned there."""
        self.location = location
        self.tables = location.tables  # name -> tensor, None without a table predictor
        self.bigrams = self.tables is not None and "bigram_keys" in self.tables
        self.slot2expert = location.slot2expert  # [L, E] int64
        self.holds = location.holds  # [L, N, E] bool: rank r holds a copy (home or replica) of router output e
        self.held = self.holds[:, self.rank]  # [L, E]: this rank's (a view)

    def swap(self, placement) -> None:
        """A live re-placement (:mod:`.live`), between two steps, once the device location holds
        the new placement (its tables, slot map and held experts, changed in place; a table of
        another shape replaced): drift restarts its window against the new placement's own ratio."""
        self._read_location(self.location)
        rows = self.counts.tolist()  # between steps, once per swap: the new window starts here
        local, acts, tokens = (sum(row[i] for row in rows) for i in (4, 5, 6))
        self.observer.restart(placement.metrics.get("lar") if self.judged else None, local, acts, tokens // len(rows))

    def _step_ids(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if positions is not None and positions.dim() == 2:  # M-RoPE: [3, T], text rows alike
            positions = positions[0]
        if ids is None:
            # rows given as embeddings (refused at start for predictors that need ids): predict
            # as token 0, which costs bytes, never correctness
            if positions is not None:
                self.ids[: positions.shape[0]].zero_()
                self.query[: positions.shape[0]].fill_(-1)
                self.prev[: positions.shape[0]].fill_(-1)
            return
        self.ids[: ids.shape[0]].copy_(ids)
        if self.learned:
            self.prev[: ids.shape[0]].copy_(device_predict.previous_ids(ids, positions))
        if self.bigrams:
            self.query[: ids.shape[0]].copy_(device_predict.bigram_query(ids, positions, self.tables["token2rank"].shape[1]))

    def before_step(self, scheduler_output) -> None:
        """Host side, before a served step's forward: its real token count on the device."""
        n = int(scheduler_output.total_num_scheduled_tokens)
        self.num_real.fill_(n)
        self.step_pad = None  # a step that failed between an order and its restore left its mask
        self.steps += 1
        self.small_steps += 0 < n < self.N  # every token sits in rank 0's chunk: the order cannot move it

    def after_step(self) -> None:
        self.num_real.fill_(0)  # anything run outside a served step (warm-up, capture) counts nothing
        self._maybe_log()  # the steps' counters, outside the forward (replayed graphs run no Python)

    @staticmethod
    def _pre(layer: int, predict: bool = True):
        def hook(module, args, kwargs):  # the rows come first, positional or as hidden_states=
            if args:
                return (torch.ops.smoe.order_tokens(args[0], layer, predict), *args[1:]), kwargs
            return args, {**kwargs,
                          "hidden_states": torch.ops.smoe.order_tokens(kwargs["hidden_states"], layer, predict)}
        return hook

    @staticmethod
    def _layer_input(layer: int):
        def hook(module, args, kwargs, output):
            # input_layernorm(hidden) -> normed (the first layer: its input is hidden), or
            # input_layernorm(hidden, residual) -> (normed, hidden + residual)
            if isinstance(output, tuple):
                return (torch.ops.smoe.note_layer_input(output[0], output[1], layer), *output[1:])
            return torch.ops.smoe.note_layer_input(output, args[0] if args else kwargs["x"], layer)
        return hook

    # shuffled reduce-scatter: o_proj's partial sums -> this rank's chunk of reduced rows (placed
    # at their rows, the rest zero) -> vLLM's add + norm (exact on those rows) -> the chunk's
    # residual kept, a zero residual passed on -> the experts' output plus the kept residual ->
    # the block's all-gather: every row's new residual stream, the next layer adds zero to it
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

    @staticmethod
    def _no_residual(args, kwargs) -> None:
        """The first decoder layer's call (positions, hidden_states, residual=None, ...) must carry
        no residual: with one, the stack is not the whole model (pipeline parallel)."""
        if (args[2] if len(args) > 2 else kwargs.get("residual")) is not None:
            raise RuntimeError("smoe speculate: the first decoder layer got a residual (pipeline parallel?)")

    # stack order, one per step: predict at the first layer's input, keep the order through the stack
    @staticmethod
    def _first_layer(module, args, kwargs):  # layer(positions, hidden_states, residual=None, ...)
        TokenOrder._no_residual(args, kwargs)
        if len(args) > 1:
            return (args[0], torch.ops.smoe.order_tokens(args[1], 0, True), *args[2:]), kwargs
        return args, {**kwargs, "hidden_states": torch.ops.smoe.order_tokens(kwargs["hidden_states"], 0, True)}

    @staticmethod
    def _first_residual(split: bool):
        def hook(module, args, kwargs):  # layer(positions, hidden_states, residual=None, ...)
            TokenOrder._no_residual(args, kwargs)
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

    # stack order per MoE layer
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

    @staticmethod
    def _post(layer: int, ahead: bool = False):
        def hook(module, args, output):
            if ahead:  # the columns _experts_out added come off here, kept for the next layer
                return torch.ops.smoe.restore_tokens_ahead(output, layer)
            return torch.ops.smoe.restore_tokens(output, layer)
        return hook

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        n, K = topk_ids.shape
        self.top1[:n].copy_(topk_ids[:, 0])
        if not self.count or self.rows == 0:
            return
        # which rows of the chunk are real tokens: the chunk's own padding (past T) is not, nor
        # are vLLM's pad rows (step rows at or past num_real) wherever the order put them; on the
        # device, from static shapes, so a replayed graph counts the step it replays
        T = self.rows
        real = chunk_real(self.perm[0 if self.step_order else layer], T, self.rank, n, self.num_real)
        local = (self.held[layer][topk_ids.long()] & real[:, None]).sum(dim=1)  # [n]
        tokens = real.sum()
        add = torch.stack([local.sum(), tokens * K, tokens, (local > 0).sum()])
        # whether the order can act is a shape fact (a CUDA graph's T is fixed): decided in Python
        judged = add[:3] if T >= self.N else torch.zeros_like(add[:3])
        self.counts[layer] += torch.cat([add, judged])

    def gather_rows(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Recording: [c, K] router outputs of this rank's chunk -> [T, K] for every row of the
        step, in its original order (one all-gather on the TP group; static shapes)."""
        T = self.rows
        rows = self.tp.all_gather(topk_ids.contiguous(), 0)[:T]
        return rows.index_select(0, self.inv[0 if self.step_order else layer, :T])

    def preferences(self, layers: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pref [len(layers), T, P], conf [len(layers), T]) for the step's token ids."""
        if self.step_order:  # one order for every layer
            if self.predictor == "random":
                pref, conf = device_predict.predict_random(ids, 0, self.N)
            elif self.predictor == "one-rank":
                pref, conf = device_predict.predict_one_rank(ids)
            elif self.learned:  # expected local activations summed over every layer
                pref, conf = device_predict.learned_step(self._learned_logits(ids), self.N)
            else:
                t = self.tables
                pref, conf = device_predict.vote(*device_predict.predict_token_tables(t["token2rank"], t["token_conf"], t["prior2rank"], ids,
                                                              self._bigram(ids.shape[0])), self.N)
            return pref[None], conf[None]
        if self.predictor == "random":
            both = [device_predict.predict_random(ids, layer, self.N) for layer in layers]
            return torch.stack([p for p, _ in both]), torch.stack([c for _, c in both])
        if self.predictor == "one-rank":
            pref, conf = device_predict.predict_one_rank(ids)
            return pref.expand(len(layers), -1, -1), conf.expand(len(layers), -1)
        t = self.tables
        if self.learned:  # the network, or the token tables where they are the more confident
            tables = device_predict.predict_token_tables(t["token2rank"], t["token_conf"], t["prior2rank"], ids,
                                             self._bigram(ids.shape[0]))
            return device_predict.learned_or_tables(*tables, *device_predict.learned_layers(self._learned_logits(ids), self.N))
        if not self.markov:  # always every layer: whole tables, no index copies
            return device_predict.predict_token_tables(t["token2rank"], t["token_conf"], t["prior2rank"], ids,
                                           self._bigram(ids.shape[0]))
        (layer,) = layers
        prev = self.slot2expert[layer - 1][self.prev_top1[: ids.shape[0]]] if layer > 0 else None
        pref, conf = device_predict.predict_tables(*(t[k][layer] for k in ("token2rank", "token_conf", "markov2rank",
                                                               "markov_conf", "prior2rank")), ids, prev,
                                       self._bigram(ids.shape[0], layer))
        return pref[None], conf[None]

    def _learned_logits(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.tables
        return device_predict.learned_logits(*(t["learned_" + k] for k in LEARNED_FIELDS), ids, self.prev[: ids.shape[0]])

    def _bigram(self, T: int, layer: int | None = None) -> tuple | None:
        """:func:`device_predict.bigram_override`'s argument for the step's T rows (every layer, or one)."""
        if not self.bigrams:
            return None
        t = self.tables
        sl = slice(None) if layer is None else slice(layer, layer + 1)
        return t["bigram_keys"], t["bigram2rank"][sl], t["bigram_conf"][sl], self.query[:T]

    def reduce_scatter(self, partial: torch.Tensor, layer: int) -> torch.Tensor:
        """:func:`shuffled_reduce_scatter` on the TP group, predicting the order first where
        the block would have (the first MoE layer, or every layer for a per-layer predictor)."""
        T = partial.shape[0]
        if self.exact:
            self._exact_order(partial, layer)
        elif self.ahead and layer > 0:
            # the ranks the previous block's all-gather brought (equal on every rank), or the
            # tables' where they are the more confident
            pref, conf = device_predict.learned_or_tables(self.table_pref[layer: layer + 1, :T], self.table_conf[layer: layer + 1, :T],
                                              self.next_pref[:T][None], self.next_conf[:T][None])
            device_predict.assign_permute(pref, conf, device_predict.chunk_caps(T, self.N, partial.device), self.perm[layer: layer + 1],
                              self.inv[layer: layer + 1])
        elif self.per_layer or layer == 0:
            self._predict(partial, layer)
        return shuffled_reduce_scatter(partial, self.perm[layer, :T], self.rank, self.N,
                                       lambda x: self.tp.reduce_scatter(x, 0))

    def note_layer_input(self, normed: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Predictor router under the shuffled reduce-scatter, at the layer's input_layernorm: x
        [T, H] the layer's input (every row whole): the gate's logits of this rank's contiguous
        share of the rows (:func:`chunk_rows`) into ``base``, zero elsewhere, so each row's term
        is added once over the ranks. Returns a copy of normed (the op's output carries the order
        of the ops: the reduce-scatter that reads ``base`` depends on it)."""
        T = x.shape[0]
        if T == 1:  # reduce_scatter orders a one-row step without it
            return normed.clone()
        start, stop = chunk_rows(T, self.rank, self.N)
        self.base[:T].zero_()
        if stop > start:
            gate, _ = self.gates[layer]
            self.base[start:stop].copy_(gate_logits(gate, x[start:stop] * self.exact[layer][1]))
        return normed.clone()

    def _exact_order(self, partial: torch.Tensor, layer: int, with_base: bool = True) -> None:
        """The exact order of ``layer`` before its reduce: each rank's gate logits of its partial
        rows (plus, ``with_base``, its share of the input's, ``base``; the stack's partial rows
        carry their share of the input themselves: :meth:`order_folded`), all-gathered and summed rank by rank into
        the gate's logits over the reduced rows up to each row's positive norm scale, which the
        routing step's top-k ignores (:func:`exact_gate_scale`); its experts' ranks ->
        ``perm`` / ``inv``. Every rank sums the same bytes in the same order: the same
        assignment, no broadcast. One all-gather of [T, E] float32: each term is the gate's output
        (in its dtype), the sums over terms and ranks are float32, where a bf16 gather would round
        each rank's sum once more."""
        T = partial.shape[0]
        self.rows = T
        if T == 1:
            self._one_row(slice(layer, layer + 1))
            return
        gate, router = self.gates[layer]
        mine = gate_logits(gate, partial * self.exact[layer][1]).float()
        if with_base:
            mine += self.base[:T]
        logits = unit_rows(sum_gathered(self.tp.all_gather(mine, 0), self.N))
        # rows for the routing step alike on every rank (its experts decide which rows each rank
        # reduces; the partial rows differ): zeros of their shape, no memory, as in the probe
        rows = partial.new_zeros(()).expand(T, partial.shape[1])
        _, ids = router._compute_routing(rows, logits, None, input_ids=self.ids[:T])
        pref, conf = device_predict.prefer_held(ids, self.holds[layer])
        device_predict.assign_permute(pref[None], conf[None], device_predict.chunk_caps(T, self.N, partial.device),
                          self.perm[layer: layer + 1], self.inv[layer: layer + 1])

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
        layer's two preferred ranks (-1 = none) and the confidence (:func:`gate_ranks` on the
        rows, which are the layer's input) in normed's dtype, for vLLM's all-gather before the
        attention; every rank then reads the same bytes (``restore_ahead``)."""
        self._keep(residual, False)
        # the step's rows: set at its first MoE layer. One row (smoe's one-row fix gathered it,
        # vLLM gathers nothing more): each rank keeps its own columns, and they may differ, but a
        # one-row order is the identity whatever they say (chunk_caps(1, N) = [1, 0, ...])
        c, T = residual.shape[0], self.rows
        q = (torch.arange(c, device=residual.device) + self.rank * c).clamp(max=T - 1)  # padding: dropped later
        gate, router = self.gates[layer]
        pref, conf = gate_ranks(self.next_norm[layer], gate, router, residual, self.holds[layer],
                                self.ids.index_select(0, self.perm[prev].index_select(0, q)))
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
        if self.exact:  # router: the order from the gate's logits of the folded rows, summed over ranks
            full = partial.index_add(0, src, rows)
            self._exact_order(full, layer, with_base=False)  # full carries the layer input's rows
            out = full.index_select(0, self.perm[layer, :T])
        else:
            if prev < 0:
                self._predict(partial, layer)
            elif gated:  # input-gate's ranks, or the tables' where they are the more confident
                pref, conf = device_predict.learned_or_tables(self.table_pref[layer: layer + 1, :T],
                                                  self.table_conf[layer: layer + 1, :T],
                                                  self.next_pref[:T][None], self.next_conf[:T][None])
                device_predict.assign_permute(pref, conf, device_predict.chunk_caps(T, self.N, dev), self.perm[layer: layer + 1],
                                  self.inv[layer: layer + 1])
            out = partial.index_select(0, self.perm[layer, :T])
            out.index_add_(0, self.inv[layer].index_select(0, src), rows)
        self.rows = T
        self._mark_padding(layer, T)
        return out

    def split_residual(self, x: torch.Tensor, residual: torch.Tensor, layer: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        return keep_chunk_residual(x, residual, self.perm[layer, :T], self.rank, self.N, self.kept)

    def add_residual(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """y: [c, H] the experts' output of this rank's chunk: plus its kept residual rows."""
        return y + self.kept[: y.shape[0]].to(y.dtype)

    def add_residual_ahead(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """:meth:`add_residual`, then three columns more: [c, H + 3], the next MoE layer's two
        preferred ranks (-1 = none) and confidence for these rows (:func:`gate_ranks` on the
        rows, which are that layer's input), in y's dtype (small integers stay exact; every rank
        reads the same bytes after the all-gather, so the confidence need not be exact)."""
        x = self.add_residual(y, layer)
        c, T = x.shape[0], self.rows
        nxt = layer + 1
        # the step rows of this chunk (the chunk's padding past T reads the last row: dropped later)
        src = self.perm[layer].index_select(0, (torch.arange(c, device=x.device) + self.rank * c).clamp(max=T - 1))
        gate, router = self.gates[nxt]
        pref, conf = gate_ranks(self.next_norm[nxt], gate, router, x, self.holds[nxt], self.ids.index_select(0, src))
        return torch.cat([x, pref.to(x.dtype), conf.to(x.dtype)[:, None]], dim=1)

    def restore_ahead(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """y: [T, H + 3] the all-gathered rows of :meth:`add_residual_ahead`, in the token
        order. Returns [T, H] in the step's order; keeps the columns for the next layer's order."""
        z = self.restore(y, layer)
        T, H = z.shape[0], z.shape[1] - 3
        self.next_pref[:T].copy_(z[:, H: H + 2].round().long())
        self.next_conf[:T].copy_(z[:, H + 2].float())
        return z[:, :H].contiguous()

    def order(self, x: torch.Tensor, layer: int, predict: bool) -> torch.Tensor:
        T = x.shape[0]
        if predict and (self.step_order or self.per_layer or layer == 0):
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

    def _mark_padding(self, layer: int, T: int) -> None:
        """vLLM's routers (with ``VLLM_MOE_SKIP_PADDING``, on by default: the CUDA top-k kernels
        and the grouped top-k) mask the experts of chunk row j when step row j is padding
        (``forward_context.is_padding[:c]``), which holds for vLLM's contiguous chunks, whose pad
        rows come last; in the token order a real token may sit at any chunk row, and masked it
        would lose its experts' output. So the forward context's mask points, until
        :meth:`restore`, at smoe's own buffer holding this rank's ordered chunk rows' pad flags
        (:func:`chunk_padding`); the runner's step mask stays as vLLM wrote it for every other
        reader (smoe's own routing of whole steps, drafters). Device ops on static shapes: a
        captured graph holds the buffer's address and the copy, so a replay (no Python) masks
        the rows it replays."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        fc = get_forward_context() if is_forward_context_available() else None
        pad = None if fc is None else fc.is_padding
        if pad is None and self.step_pad is None:
            return
        if pad is not None and pad.data_ptr() != self.chunk_pad.data_ptr():  # the runner's, not ours
            self.step_pad = pad
        if self.step_pad.shape[0] < T:  # not a mask of this step's rows: route every row (always right)
            fc.is_padding = None
            return
        c = -(-T // self.N)
        mine = self.chunk_pad[:c]  # the block routes its c rows: vLLM reads is_padding[:c]
        # from the runner's own mask (not num_real): vLLM routes every row of its profile run and
        # none of a capture, and a replay reads the mask the runner wrote for the step
        mine.copy_(chunk_padding(self.perm[0 if self.step_order else layer], T, self.rank, c, self.step_pad))
        fc.is_padding = mine

    def _one_row(self, rows: slice) -> None:
        """The order of a one-row step for the layers ``rows``: the identity. The row sits in rank
        0's chunk whatever the order, so the predictors that make a collective for theirs skip it."""
        self.perm[rows, :1].zero_()
        self.inv[rows, :1].zero_()

    def _predict(self, x: torch.Tensor, layer: int) -> None:
        """The step's token order for ``layer`` (every layer at the first, unless per layer):
        ``perm`` / ``inv`` written in place. x: [T, H] the rows (read by predictor router only)."""
        T = x.shape[0]
        self.rows = T
        layers = [layer] if self.per_layer or self.step_order else list(range(self.perm.shape[0]))
        rows = slice(layers[0], layers[-1] + 1)
        caps = device_predict.chunk_caps(T, self.N, x.device)
        agreed = bool(self.gates and not self.ahead) or self.learned  # rank 0's assignment, broadcast
        if agreed and T == 1:  # no gate and no broadcast for it
            self._one_row(rows)
        elif agreed:
            # floats each rank computes itself: the gate's rows are equal across ranks only if
            # the attention all-reduce is bitwise deterministic (vLLM's FlashInfer one is not),
            # and the network's GEMM need not round alike on every rank (thread counts,
            # kernels), so rank 0's assignment is the step's (4 bytes a token and layer)
            if self.gates:
                gate, router = self.gates[layer]
                pref, conf = route_ahead(gate, router, x, self.holds[layer], self.ids[:T])
                pref, conf = pref[None], conf[None]
            else:
                pref, conf = self.preferences(layers, self.ids[:T])
            perm, inv = device_predict.permutation(agree(device_predict.assign(pref, conf, caps), self.broadcast))
            self.perm[rows, :T].copy_(perm)
            self.inv[rows, :T].copy_(inv)
        else:
            pref, conf = self.preferences(layers, self.ids[:T])
            if self.ahead:  # the tables' guesses kept for the layers the gate then orders
                self.table_pref[:, :T].copy_(pref)
                self.table_conf[:, :T].copy_(conf)
                if not self.stack:  # the first layer's order now (the stack: every layer's, some redone)
                    pref, conf, rows = pref[:1], conf[:1], slice(0, 1)
            device_predict.assign_permute(pref, conf, caps, self.perm[rows], self.inv[rows])

    def restore(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        if self.step_pad is not None:  # the runner's step mask back in the forward context
            from vllm.forward_context import get_forward_context, is_forward_context_available

            if is_forward_context_available():
                get_forward_context().is_padding = self.step_pad
            self.step_pad = None
        T = y.shape[0]
        inv = self.inv[layer, :T]
        if self.markov and layer + 1 < self.inv.shape[0]:
            c = -(-T // self.N)
            top1 = self.tp.all_gather(self.top1[:c].contiguous(), 0)[:T]  # sorted order -> original
            self.prev_top1[:T].copy_(top1.index_select(0, inv))
        return y.index_select(0, inv)

    def _maybe_log(self) -> None:
        if not self.count or not self.observer.due():
            return
        rows = self.observer.read(self.counts)
        if rows is None:
            return
        layers = [row[:4] for row in rows]  # what metrics publish: every served token
        local, acts, tokens = (sum(row[i] for row in layers) for i in range(3))
        if not acts:
            return
        self.observer.judge(*(sum(row[i] for row in rows) for i in (4, 5)), sum(row[6] for row in rows) // len(rows))
        self.observer.publish({"layers": layers})
        from vllm.distributed import get_ep_group

        exchange = getattr(getattr(get_ep_group().device_communicator, "all2all_manager", None), "exchange", None)
        wire = ""
        if exchange is not None:
            c = exchange.counters()
            if c["tokens"]:
                wire = (f"; sparse all2all: {c['pairs'] / c['tokens']:.3f} remote (token, rank) pairs and "
                        f"{c['bytes'] / c['tokens']:.0f} B per token and MoE layer")
        if self.small_steps:
            wire += (f"; {self.small_steps / self.steps:.0%} of {self.steps} steps had fewer tokens than ranks (the "
                     f"order cannot move them)")
        logger.info("smoe: speculate (predictor %s): rank %d served %.3f of its expert activations locally "
                    "(%d tokens)%s", self.predictor, self.rank, local / acts, tokens // self.inv.shape[0], wire)


def install_token_order(model, vllm_config, cfg, served, location) -> TokenOrder:
    """Called by smoe's model loader once the weights are in place; ``served``: the process's
    :class:`~.served.ServedPlacement` (its load plan and expected ratio), ``location``: its
    :class:`~..location.DeviceLocation` (the maps and tables on the device)."""
    order = TokenOrder(model, vllm_config, cfg, served.plan, location, expected=served.placement.metrics.get("lar"))
    logger.info("smoe: mode speculate: token order over %d ranks around %d MoE blocks (%s), %s, predictor %s; "
                "attention output: %s", order.N, len(order.blocks), type(order.blocks[0][1]).__name__,
                (f"one order per step ({order.step_reason})" if order.step_order else
                 "one order per layer (the split residual folded into the attention's reduce-scatter)"
                 if order.stack else "one order per layer"),
                cfg.predictor + (" (as router: the rows are whole before each block)"
                                 if cfg.predictor == "input-gate" and not order.ahead else
                                 " (exact before the reduce: the gate's logits of each rank's partial rows "
                                 "all-gathered)" if order.exact else ""),
                f"reduce-scattered in the token order at {len(order.shuffled)} MoE layers" if order.shuffled
                else "reduce-scattered by the decoder layer" if order.stack
                else f"vLLM's all-reduce ({order.shuffle_reason})")
    return order
