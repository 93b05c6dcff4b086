"""The token order's predictors: one class per way of guessing each token's rank, behind one
interface, composed once into the order (:func:`make_predictor`).

Every method takes the order ``o`` (:class:`~.token_order.TokenOrder`: the step's ids, the
permutations it writes, the device location's tables and held experts, the TP group) and runs on
the device with static shapes. What a predictor decides (the interface): :class:`Predictor`."""

from __future__ import annotations

import torch

from ...placement.learned import LEARNED_FIELDS
from . import device_predict
from .comm import agree, chunk_rows
from .gates import gate_logits, gate_ranks, route_ahead, sum_gathered, unit_rows


def _bigram(o, T: int, layer: int | None = None) -> tuple | None:
    """:func:`device_predict.bigram_override`'s argument for the step's T rows (every layer, or one)."""
    if not o.bigrams:
        return None
    t = o.tables
    sl = slice(None) if layer is None else slice(layer, layer + 1)
    return t["bigram_keys"], t["bigram2rank"][sl], t["bigram_conf"][sl], o.query[:T]


def _token_tables(o, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = o.tables
    return device_predict.predict_token_tables(t["token2rank"], t["token_conf"], t["prior2rank"], ids,
                                               _bigram(o, ids.shape[0]))


def ordered_plus(o, partial: torch.Tensor, layer: int, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """partial [T, H] in ``layer``'s order, plus ``rows`` [n, H] at the places of step rows
    ``src`` [n] (the stack's kept residual rows, added once over the ranks)."""
    T = partial.shape[0]
    out = partial.index_select(0, o.perm[layer, :T])
    out.index_add_(0, o.inv[layer].index_select(0, src), rows)
    return out


class Predictor:
    """The tables-free base: the order of ``layers`` from :meth:`preferences`, each rank's own.
    What every predictor decides:

    - :meth:`Predictor.preferences` / :meth:`Predictor.step_preferences`: (pref [layers, T, P] int64
      ranks, -1 = none; conf [layers, T] float32) for the step's ids, per MoE layer or one order for
      the whole step (the stack's ``stack_order: step``);
    - :meth:`Predictor.predict`: the order of some layers from those, written into ``o.perm`` /
      ``o.inv``;
    - where the order is made when the attention's partial sums are reduced in the token order
      (:meth:`Predictor.before_reduce`, the shuffled reduce-scatter) or folded into it
      (:meth:`Predictor.fold`, the stack per layer);
    - ``per_layer``: each MoE layer predicted at its own block (else every layer at the first);
      ``judged``: drift is judged against the placement's ratio; ``ahead``: the next layer's ranks
      ride as three more columns in a block's all-gather (predictor input-gate); ``reads_previous``:
      each row's previous id in its sequence is kept (``o.prev``, predictor learned)."""

    per_layer = False
    judged = True
    ahead = False
    reads_previous = False  # the step's previous ids (``o.prev``), set from the positions

    def allocate(self, o, T: int, L: int, device) -> None:
        """Buffers of this predictor on the order (none here)."""

    def preferences(self, o, layers: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def step_preferences(self, o, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def predict(self, o, x: torch.Tensor, layer: int, layers: list[int], rows: slice, caps: torch.Tensor) -> None:
        """``o.perm`` / ``o.inv`` of ``layers`` (their ``rows``) for x [T, H] the step's rows."""
        pref, conf = o.preferences(layers, o.ids[: x.shape[0]])
        device_predict.assign_permute(pref, conf, caps, o.perm[rows], o.inv[rows])

    def before_reduce(self, o, partial: torch.Tensor, layer: int) -> None:
        """The shuffled reduce-scatter of ``layer``: predict where the block would have."""
        if self.per_layer or layer == 0:
            o._predict(partial, layer)

    def fold(self, o, partial: torch.Tensor, layer: int, prev: int, gated: bool, src: torch.Tensor,
             rows: torch.Tensor) -> torch.Tensor:
        """The stack per layer at ``layer``'s attention output: predicted there when its rows are
        in the step's order (``prev`` < 0: once per step), then :func:`ordered_plus`."""
        if prev < 0:
            o._predict(partial, layer)
        return ordered_plus(o, partial, layer, src, rows)

    def after_restore(self, o, layer: int, inv: torch.Tensor, T: int) -> None:
        """After ``layer``'s rows are restored (the next layer's prediction may read them)."""


class RandomRanks(Predictor):
    """``random``: a seeded random rank per token and layer (a floor to compare with)."""

    judged = False

    def preferences(self, o, layers, ids):
        both = [device_predict.predict_random(ids, layer, o.N) for layer in layers]
        return torch.stack([p for p, _ in both]), torch.stack([c for _, c in both])

    def step_preferences(self, o, ids):
        pref, conf = device_predict.predict_random(ids, 0, o.N)
        return pref[None], conf[None]


class OneRank(Predictor):
    """``one-rank``: every token to rank 0's chunk first (the capped assignment spreads them)."""

    judged = False

    def preferences(self, o, layers, ids):
        pref, conf = device_predict.predict_one_rank(ids)
        return pref.expand(len(layers), -1, -1), conf.expand(len(layers), -1)

    def step_preferences(self, o, ids):
        pref, conf = device_predict.predict_one_rank(ids)
        return pref[None], conf[None]


class TokenTables(Predictor):
    """``tables``: the placement's token (and bigram) tables, every layer at the first MoE layer."""

    def preferences(self, o, layers, ids):
        return _token_tables(o, ids)  # always every layer: whole tables, no index copies

    def step_preferences(self, o, ids):
        pref, conf = device_predict.vote(*_token_tables(o, ids), o.N)
        return pref[None], conf[None]


class MarkovTables(TokenTables):
    """``tables-markov``: each layer from the previous layer's top-1 expert of every row, which
    waits for that layer (one all-gather of the top-1 per layer, at its restore)."""

    per_layer = True

    def preferences(self, o, layers, ids):
        (layer,) = layers
        t = o.tables
        prev = o.slot2expert[layer - 1][o.prev_top1[: ids.shape[0]]] if layer > 0 else None
        pref, conf = device_predict.predict_tables(*(t[k][layer] for k in ("token2rank", "token_conf", "markov2rank",
                                                                           "markov_conf", "prior2rank")), ids, prev,
                                                   _bigram(o, ids.shape[0], layer))
        return pref[None], conf[None]

    def after_restore(self, o, layer, inv, T):
        if layer + 1 < o.inv.shape[0]:
            c = -(-T // o.N)
            top1 = o.tp.all_gather(o.top1[:c].contiguous(), 0)[:T]  # sorted order -> original
            o.prev_top1[:T].copy_(top1.index_select(0, inv))


class _Agreed(Predictor):
    """Floats each rank computes itself: the gate's rows are equal across ranks only if the
    attention all-reduce is bitwise deterministic (vLLM's FlashInfer one is not), and a network's
    GEMM need not round alike on every rank (thread counts, kernels), so rank 0's assignment is
    the step's (4 bytes a token and layer). A one-row step needs none: the identity."""

    def _preferences_of(self, o, x, layer, layers):
        return o.preferences(layers, o.ids[: x.shape[0]])

    def predict(self, o, x, layer, layers, rows, caps):
        T = x.shape[0]
        if T == 1:  # no gate and no broadcast for it
            o._one_row(rows)
            return
        pref, conf = self._preferences_of(o, x, layer, layers)
        perm, inv = device_predict.permutation(agree(device_predict.assign(pref, conf, caps), o.broadcast))
        o.perm[rows, :T].copy_(perm)
        o.inv[rows, :T].copy_(inv)


class Learned(_Agreed):
    """``learned``: the placement's small network on each token and the one before it, or the
    token tables where they are the more confident."""

    reads_previous = True

    @staticmethod
    def _logits(o, ids):
        t = o.tables
        return device_predict.learned_logits(*(t["learned_" + k] for k in LEARNED_FIELDS), ids,
                                             o.prev[: ids.shape[0]])

    def preferences(self, o, layers, ids):
        return device_predict.learned_or_tables(*_token_tables(o, ids),
                                                *device_predict.learned_layers(self._logits(o, ids), o.N))

    def step_preferences(self, o, ids):  # expected local activations summed over every layer
        pref, conf = device_predict.learned_step(self._logits(o, ids), o.N)
        return pref[None], conf[None]


class Router(_Agreed):
    """``router`` (and ``input-gate`` where the rows are whole before each block): vLLM's own gate
    and routing step on the block's rows, each token's ranks known rather than guessed.
    gates: (gate, router) per MoE layer."""

    per_layer = True

    def __init__(self, gates: list):
        self.gates = gates

    def _preferences_of(self, o, x, layer, layers):
        gate, router = self.gates[layer]
        pref, conf = route_ahead(gate, router, x, o.holds[layer], o.ids[: x.shape[0]])
        return pref[None], conf[None]


class SummedRouter(Router):
    """``router`` before the attention's reduce (the shuffled reduce-scatter, the stack per
    layer): the gate's logits of the reduced rows summed from each rank's partial rows
    (:func:`.gates.exact_gate_scale`). exact: (input_layernorm or None, w [H]) per MoE layer;
    the shuffled layout adds this rank's share of the layer input's logits (``o.base``, written
    at input_layernorm by :meth:`note_input`), the stack's partial rows carry their input."""

    def __init__(self, gates: list, exact: list):
        super().__init__(gates)
        self.exact = exact

    def allocate(self, o, T, L, device):
        if any(norm is not None for norm, _ in self.exact):
            # [T, E] float32: the gate's logits of the layer input's rows this rank adds (its
            # contiguous share of the rows; zero elsewhere), written at input_layernorm
            o.base = torch.zeros((T, o.holds.shape[2]), dtype=torch.float32, device=device)

    def note_input(self, o, x: torch.Tensor, layer: int) -> None:
        """x [T, H] the layer's input (every row whole): the gate's logits of this rank's
        contiguous share of the rows (:func:`.comm.chunk_rows`) into ``o.base``, zero elsewhere,
        so each row's term is added once over the ranks."""
        T = x.shape[0]
        if T == 1:  # before_reduce orders a one-row step without it
            return
        start, stop = chunk_rows(T, o.rank, o.N)
        o.base[:T].zero_()
        if stop > start:
            gate, _ = self.gates[layer]
            o.base[start:stop].copy_(gate_logits(gate, x[start:stop] * self.exact[layer][1]))

    def before_reduce(self, o, partial, layer):
        self.exact_order(o, partial, layer)

    def fold(self, o, partial, layer, prev, gated, src, rows):
        T = partial.shape[0]
        full = partial.index_add(0, src, rows)
        self.exact_order(o, full, layer, with_base=False)  # full carries the layer input's rows
        return full.index_select(0, o.perm[layer, :T])

    def exact_order(self, o, partial: torch.Tensor, layer: int, with_base: bool = True) -> None:
        """The exact order of ``layer`` before its reduce: each rank's gate logits of its partial
        rows (plus, ``with_base``, its share of the input's, ``o.base``), all-gathered and summed
        rank by rank into the gate's logits over the reduced rows up to each row's positive norm
        scale, which the routing step's top-k ignores; its experts' ranks -> ``perm`` / ``inv``.
        Every rank sums the same bytes in the same order: the same assignment, no broadcast. One
        all-gather of [T, E] float32: each term is the gate's output (in its dtype), the sums
        over terms and ranks are float32, where a bf16 gather would round each rank's sum once
        more."""
        T = partial.shape[0]
        o.rows = T
        if T == 1:
            o._one_row(slice(layer, layer + 1))
            return
        gate, router = self.gates[layer]
        mine = gate_logits(gate, partial * self.exact[layer][1]).float()
        if with_base:
            mine += o.base[:T]
        logits = unit_rows(sum_gathered(o.tp.all_gather(mine, 0), o.N))
        # rows for the routing step alike on every rank (its experts decide which rows each rank
        # reduces; the partial rows differ): zeros of their shape, no memory, as in the probe
        rows = partial.new_zeros(()).expand(T, partial.shape[1])
        _, ids = router._compute_routing(rows, logits, None, input_ids=o.ids[:T])
        pref, conf = device_predict.prefer_held(ids, o.holds[layer])
        device_predict.assign_permute(pref[None], conf[None], device_predict.chunk_caps(T, o.N, partial.device),
                                      o.perm[layer: layer + 1], o.inv[layer: layer + 1])


class InputGate(TokenTables):
    """``input-gate`` where a layer's order is needed before its rows are whole (the shuffled
    reduce-scatter, the stack per layer): the layer's gate runs on its input instead (after the
    layer's post-attention norm, ``next_norm``), each rank on its own chunk rows, the ranks and
    confidence riding as three more columns in the all-gather before, so every rank assigns from
    the same bytes (no collective more, none of rank 0's broadcast); the first MoE layer takes the
    tables, the others the tables' guess where it is the more confident (measured:
    BENCHMARKS.md). gates: (gate, router) per MoE layer; next_norm: MoE layer -> its norm."""

    ahead = True

    def __init__(self, gates: list, next_norm: dict):
        self.gates, self.next_norm = gates, next_norm

    def allocate(self, o, T, L, device):
        o.next_pref = torch.full((T, 2), -1, dtype=torch.long, device=device)
        o.next_conf = torch.zeros(T, dtype=torch.float32, device=device)
        o.table_pref = torch.full((L, T, 2), -1, dtype=torch.long, device=device)
        o.table_conf = torch.zeros((L, T), dtype=torch.float32, device=device)

    def predict(self, o, x, layer, layers, rows, caps):
        pref, conf = o.preferences(layers, o.ids[: x.shape[0]])
        T = x.shape[0]
        # the tables' guesses kept for the layers the gate then orders
        o.table_pref[:, :T].copy_(pref)
        o.table_conf[:, :T].copy_(conf)
        first = o.first_guesses  # the layout's: the first layer's order now, or every layer's (some redone)
        if first:
            pref, conf, rows = pref[:first], conf[:first], slice(0, first)
        device_predict.assign_permute(pref, conf, caps, o.perm[rows], o.inv[rows])

    def gated_order(self, o, layer: int, T: int, device) -> None:
        """``layer``'s order from the ranks the previous all-gather brought (equal on every rank),
        or the tables' where they are the more confident."""
        pref, conf = device_predict.learned_or_tables(o.table_pref[layer: layer + 1, :T],
                                                      o.table_conf[layer: layer + 1, :T],
                                                      o.next_pref[:T][None], o.next_conf[:T][None])
        device_predict.assign_permute(pref, conf, device_predict.chunk_caps(T, o.N, device),
                                      o.perm[layer: layer + 1], o.inv[layer: layer + 1])

    def before_reduce(self, o, partial, layer):
        if layer > 0:
            self.gated_order(o, layer, partial.shape[0], partial.device)
        else:
            o._predict(partial, layer)

    def fold(self, o, partial, layer, prev, gated, src, rows):
        if prev < 0:
            o._predict(partial, layer)
        elif gated:
            self.gated_order(o, layer, partial.shape[0], partial.device)
        return ordered_plus(o, partial, layer, src, rows)

    def ranks(self, o, x: torch.Tensor, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pref [n, 2] int64, conf [n] float32) of rows x [n, H] of ``layer``'s input."""
        gate, router = self.gates[layer]
        return gate_ranks(self.next_norm[layer], gate, router, x, o.holds[layer], ids)


def make_predictor(plan) -> Predictor:
    """The predictor :class:`~.plan.OrderPlan` chose (``plan.predicts``)."""
    kind = plan.predicts
    if kind == "router":
        return Router(list(plan.gates))
    if kind == "summed-router":
        return SummedRouter(list(plan.gates), list(plan.exact))
    if kind == "input-gate":
        return InputGate(list(plan.gates), dict(plan.next_norm))
    return {"random": RandomRanks, "one-rank": OneRank, "tables": TokenTables, "tables-markov": MarkovTables,
            "learned": Learned}[kind]()
