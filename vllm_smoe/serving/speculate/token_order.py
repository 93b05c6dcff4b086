"""``mode: speculate``: s-TS as the token order around vLLM's own sequence-parallel MoE.

vLLM's sequence-parallel MoE blocks take the replicated rows, keep a contiguous ``ceil(T / N)``
slice per rank, run FusedMoE on it (expert parallel) and all-gather the result. smoe changes
only the order of the rows around that, with opaque custom ops (:mod:`.ops`) put in by forward
hooks (no model code): the rows a rank's chunk holds are the tokens predicted to have their
experts on that rank. Everything runs on the device from device-resident tables with static
shapes: no host synchronisation, capturable by torch.compile and CUDA graphs. A misprediction
only means the token's experts sit elsewhere; vLLM's all2all (smoe's sparse manager by default
on CPU) takes it there and back. The block computes exactly what it computed before, row by row.

The package's parts: :mod:`vllm_smoe.serving.speculate`; :class:`TokenOrder` here is the device
state every layout shares."""

from __future__ import annotations

import functools
import logging

import torch

from . import device_predict
from . import ops  # noqa: F401  (registers torch.ops.smoe.*, which the hooks call)
from .comm import chunk_padding, chunk_real
from .seams import hookable_gate

logger = logging.getLogger("vllm.smoe")


class TokenOrder:
    """One worker's token order: the device state every layout shares (the step's token ids,
    per-layer permutations and their inverses, the previous layer's top-1, counters read only
    when logging, the device location's maps and tables) and the ops every layout runs (order,
    restore). A layout (:mod:`.layout_block`, :mod:`.layout_stack`) is a subclass that owns its
    hooks and op bodies; the predictor (:mod:`.predictors`) is composed in. Built by
    :func:`.install.install_token_order` from the :class:`~.plan.OrderPlan`.

    Buffers (T = vLLM's max_num_batched_tokens, c = ceil(T / N), L MoE layers; on the device):
    ids [T] int64 the step's token ids; query [T] int64 their bigram keys (-1 = none); prev [T]
    int64 each row's previous id in its sequence (-1 = none); perm, inv [L, T] int64: row i of
    layer l's order is step row perm[l, i], inv its inverse; top1 [c] int64 this rank's chunk's
    top-1 router output; prev_top1 [T] int64 the previous layer's, in step order (tables-markov);
    counts [L, 7] int64 (:meth:`_capture`); num_real [] int64 the step's real tokens;
    chunk_pad [c] bool vLLM's pad mask of this rank's ordered chunk rows."""

    first_guesses = 0  # input-gate: the layers whose order its first prediction writes now (0 = every one)
    rows_ordered = "layer"  # a recording's meta.token_order: one order per MoE layer ("layer") or per step

    def __init__(self, model, vllm_config, cfg, plan, location, predictor, expected: float | None = None):
        from vllm.distributed import get_tp_group

        from ..observe.counters import Observer
        from ..observe.metrics import Drift, metrics_dir

        self.plan, self.predictor = plan, predictor
        self.tp = get_tp_group()
        self.N, self.rank = self.tp.world_size, self.tp.rank_in_group
        self.blocks = list(plan.blocks)
        self.experts = list(plan.experts)  # where the counters' capture is bound
        device = next(model.parameters()).device
        # the TP group's broadcast on the device communicator (pynccl on the current stream on
        # CUDA, capturable like vLLM's other collectives; torch.distributed's elsewhere)
        comm = getattr(self.tp, "device_communicator", None)
        self.broadcast = comm.broadcast if comm is not None and hasattr(comm, "broadcast") else self.tp.broadcast
        self._read_location(location)
        L = len(plan.moe_layers)
        T = vllm_config.scheduler_config.max_num_batched_tokens
        c = -(-T // self.N)
        self.ids = torch.zeros(T, dtype=torch.long, device=device)
        self.query = torch.full((T,), -1, dtype=torch.long, device=device)
        self.prev = torch.full((T,), -1, dtype=torch.long, device=device)
        self.perm = torch.zeros((L, T), dtype=torch.long, device=device)
        self.inv = torch.zeros((L, T), dtype=torch.long, device=device)
        self.top1 = torch.zeros(c, dtype=torch.long, device=device)
        self.prev_top1 = torch.zeros(T, dtype=torch.long, device=device)
        # per MoE layer, served steps only: local activations, activations, tokens, hits (tokens
        # with an expert on their rank; metrics.ORDER_FIELDS), then local activations,
        # activations and tokens of the steps the order can act on (T >= N: what drift judges, as
        # a step with fewer tokens than ranks keeps them all in rank 0's chunk whatever the
        # prediction); read back once per log interval
        self.counts = torch.zeros((L, 7), dtype=torch.long, device=device)
        self.count = cfg.metrics  # off: no device counters, no log line, no drift
        # the placement's own ratio is what a trained predictor should reach; random and one-rank
        # orders are not judged against it
        self.observer = Observer("order", self.rank, cfg.log_interval, metrics_dir(cfg),
                                 Drift(expected if predictor.judged else None, cfg.drift_threshold),
                                 who=f"rank {self.rank}", hint=" (smoe-place advise)")
        if self.count:
            self.observer.watch(lambda: self.counts, self._report)
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
        predictor.allocate(self, T, L, device)
        self.allocate(vllm_config, c, device)
        model.register_forward_pre_hook(self._step_ids, with_kwargs=True)
        from .. import runner_hooks

        runner_hooks.attach(before=self._before_step, after=self._after_step)
        from vllm.platforms import current_platform

        runner_hooks.check_attached(vllm_config, current_platform.device_type)  # else counters would read 0
        from ..record.capture import set_capture

        for (layer, block, _), experts in zip(self.blocks, self.experts):
            set_capture(experts, functools.partial(self._capture, layer), "smoe mode speculate",
                        hookable_gate(block, experts, vllm_config))
        self.hook(model)

    def allocate(self, vllm_config, c: int, device) -> None:
        """The layout's own buffers (none here)."""

    def hook(self, model) -> None:
        """The layout's forward hooks on ``model``."""
        raise NotImplementedError

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
        with self.observer.lock:  # not while the idle reader judges the old window
            rows = self.counts.tolist()  # between steps, once per swap: the new window starts here
            local, acts, tokens = (sum(row[i] for row in rows) for i in (4, 5, 6))
            self.observer.restart(placement.metrics.get("lar") if self.predictor.judged else None, local, acts,
                                  tokens // len(rows))

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
        if self.predictor.reads_previous:
            self.prev[: ids.shape[0]].copy_(device_predict.previous_ids(ids, positions))
        if self.bigrams:
            self.query[: ids.shape[0]].copy_(device_predict.bigram_query(ids, positions,
                                                                         self.tables["token2rank"].shape[1]))

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

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        n, K = topk_ids.shape
        self.top1[:n].copy_(topk_ids[:, 0])
        if not self.count or self.rows == 0:
            return
        # which rows of the chunk are real tokens: the chunk's own padding (past T) is not, nor
        # are vLLM's pad rows (step rows at or past num_real) wherever the order put them; on the
        # device, from static shapes, so a replayed graph counts the step it replays
        T = self.rows
        real = chunk_real(self.perm[self.order_row(layer)], T, self.rank, n, self.num_real)
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
        return rows.index_select(0, self.inv[self.order_row(layer), :T])

    def order_row(self, layer: int) -> int:
        """The row of ``perm`` / ``inv`` that orders MoE layer ``layer``'s block."""
        return layer

    def predicts_at(self, layer: int) -> bool:
        """Does ``order_tokens`` (told to predict) make the step's order at ``layer``?"""
        return self.predictor.per_layer or layer == 0

    def predicted_layers(self, layer: int) -> list[int]:
        """The layers one prediction at ``layer`` orders."""
        return [layer] if self.predictor.per_layer else list(range(self.perm.shape[0]))

    def preferences(self, layers: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pref [len(layers), T, P], conf [len(layers), T]) for the step's token ids."""
        return self.predictor.preferences(self, layers, ids)

    def _predict(self, x: torch.Tensor, layer: int) -> None:
        """The step's token order for ``layer`` (every layer at the first, unless per layer):
        ``perm`` / ``inv`` written in place. x: [T, H] the rows (read by predictor router only)."""
        T = x.shape[0]
        self.rows = T
        layers = self.predicted_layers(layer)
        rows = slice(layers[0], layers[-1] + 1)
        self.predictor.predict(self, x, layer, layers, rows, device_predict.chunk_caps(T, self.N, x.device))

    def order(self, x: torch.Tensor, layer: int, predict: bool) -> torch.Tensor:
        T = x.shape[0]
        if predict and self.predicts_at(layer):
            self._predict(x, layer)
        self._mark_padding(layer, T)
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
        mine.copy_(chunk_padding(self.perm[self.order_row(layer)], T, self.rank, c, self.step_pad))
        fc.is_padding = mine

    def _one_row(self, rows: slice) -> None:
        """The order of a one-row step for the layers ``rows``: the identity. The row sits in rank
        0's chunk whatever the order, so the predictors that make a collective for theirs skip it."""
        self.perm[rows, :1].zero_()
        self.inv[rows, :1].zero_()

    def restore(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        if self.step_pad is not None:  # the runner's step mask back in the forward context
            from vllm.forward_context import get_forward_context, is_forward_context_available

            if is_forward_context_available():
                get_forward_context().is_padding = self.step_pad
            self.step_pad = None
        T = y.shape[0]
        inv = self.inv[layer, :T]
        self.predictor.after_restore(self, layer, inv, T)
        return y.index_select(0, inv)

    def restore_ahead(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """y: [T, H + 3] the all-gathered rows of :meth:`add_residual_ahead`, in the token
        order. Returns [T, H] in the step's order; keeps the columns for the next layer's order."""
        z = self.restore(y, layer)
        T, H = z.shape[0], z.shape[1] - 3
        self.next_pref[:T].copy_(z[:, H: H + 2].round().long())
        self.next_conf[:T].copy_(z[:, H + 2].float())
        return z[:, :H].contiguous()

    def _maybe_log(self) -> None:
        if self.count:
            self.observer.step()  # once per interval: _report; an idle reader reports after a burst

    def _report(self, rows: list) -> None:
        """rows: [L][7] the counters read (the observer's lock held)."""
        layers = [row[:4] for row in rows]  # what metrics publish: every served token
        if not sum(row[1] for row in layers):
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
        from ..observe.counters import order_line

        logger.info("%s", order_line(self.plan.predictor, self.rank, layers, wire))
