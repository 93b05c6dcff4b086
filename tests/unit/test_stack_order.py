"""The DeepSeek family's token order per MoE layer, on gloo ranks: a stand-in stack that splits
its rows the way vLLM 0.32's DeepSeek-V2 decoder layer and model do (attention partial sums
reduce-scattered into contiguous chunks, the residual split between layers, gathered before a
dense layer and the final norm, a one-token step taken as whole) gives with smoe's hooks what its
math gives on whole rows, and each MoE layer's chunk holds the rows of that layer's order."""

import os
import types

import torch
import torch.distributed as dist

from tests.support import gloo_all_gather, gloo_reduce_scatter

WORLD = 3
H = 12


_all_gather, _reduce_scatter = gloo_all_gather, gloo_reduce_scatter


class _AddNorm(torch.nn.Module):
    """vLLM's RMSNorm: norm(x) -> normed; norm(x, residual) -> (normed(x + residual), x + residual)."""

    def __init__(self, g):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(H, generator=g) + 0.5)

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return y if residual is None else (y, x)


class _Attn(torch.nn.Module):
    """Mixes rows in the step's order (a causal running mean), then a row-parallel projection:
    each rank's partial sum over its share of the input columns, all-reduced unless told not to."""

    def __init__(self, g, rank, reduce):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H, H, generator=g) / H ** 0.5)
        self.rank, self.reduce = rank, reduce

    def forward(self, positions, x):
        mixed = x.cumsum(0) / torch.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None]
        cols = torch.arange(H) % WORLD == self.rank
        out = mixed[:, cols] @ self.w[cols]
        if self.reduce:
            dist.all_reduce(out)
        return out


class _RowWise(torch.nn.Module):
    """The MoE block (or a dense MLP): row by row, so it cares which rows a rank holds, not their
    order; keeps its input for the test."""

    def __init__(self, g):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H, H, generator=g) / H ** 0.5)

    def forward(self, x):
        self.seen = x.detach().clone()
        return torch.tanh(x @ self.w)


class _Layer(torch.nn.Module):
    """vLLM 0.32's DeepseekV2DecoderLayer.forward, its row handling kept as it is."""

    def __init__(self, g, rank, sp):
        super().__init__()
        self.use_sequence_parallel_moe = sp
        self.input_layernorm, self.post_attention_layernorm = _AddNorm(g), _AddNorm(g)
        self.self_attn, self.mlp = _Attn(g, rank, reduce=not sp), _RowWise(g)

    def forward(self, positions, hidden_states, residual):
        T = positions.shape[0]
        split_in = self.use_sequence_parallel_moe and residual is not None and hidden_states.shape[0] != T
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if split_in:
            hidden_states = _all_gather(hidden_states)[:T]
        hidden_states = self.self_attn(positions, hidden_states)
        if self.use_sequence_parallel_moe:
            hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, (-T) % WORLD))
            hidden_states = _reduce_scatter(hidden_states)
            if not split_in:  # vLLM's sequence_parallel_chunk
                c = -(-residual.shape[0] // WORLD)
                residual = torch.nn.functional.pad(residual, (0, 0, 0, c * WORLD - residual.shape[0]))
                residual = residual[dist.get_rank() * c: (dist.get_rank() + 1) * c]
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class _Stack(torch.nn.Module):
    """vLLM 0.32's DeepseekV2Model.forward over given embeddings."""

    def __init__(self, kinds, seed, rank):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # the same weights on every rank
        self.layers = torch.nn.ModuleList([_Layer(g, rank, sp) for sp in kinds])
        self.norm = _AddNorm(g)

    def forward(self, positions, hidden_states):
        T, residual = positions.shape[0], None
        for layer in self.layers:
            if hidden_states.shape[0] != T and not layer.use_sequence_parallel_moe:
                both = _all_gather(torch.cat([hidden_states, residual], dim=-1))[:T]
                hidden_states, residual = both.split([H, H], dim=-1)
            hidden_states, residual = layer(positions, hidden_states, residual)
        if hidden_states.shape[0] != T:
            both = _all_gather(torch.cat([hidden_states, residual], dim=-1))[:T]
            hidden_states, residual = both.split([H, H], dim=-1)
        return self.norm(hidden_states, residual)[0]


def _reference(stack, x):
    """The stack's math on whole rows in one process: no split, no collective. Keeps each
    layer's input (the residual stream before its attention) as ``layer.input``."""
    h, residual = x, None
    for layer in stack.layers:
        if residual is None:
            residual, n = h, layer.input_layernorm(h)
        else:
            n, residual = layer.input_layernorm(h, residual)
        layer.input = residual
        mixed = n.cumsum(0) / torch.arange(1, n.shape[0] + 1, dtype=n.dtype)[:, None]
        n, residual = layer.post_attention_layernorm(mixed @ layer.self_attn.w, residual)
        layer.routed = n  # what the MoE layer's gate sees
        h = layer.mlp(n)
    return stack.norm(h, residual)[0]


E, K = 8, 2


def _order(rank, L, Tmax, gate_in=None, router=False):
    """A TokenOrder with what the stack order per layer reads; its prediction a seeded random
    permutation per layer, alike on every rank, and with ``gate_in`` (the stack's MoE layers'
    post-attention norms) predictor input-gate over seeded random tables' guesses, or with
    ``router`` too predictor router (the gate's logits summed from the folded partial rows)."""
    from tests.unit.test_speculate_layer import _SoftmaxTopK
    from vllm_smoe.serving.speculate.gates import exact_gate_scale
    from vllm_smoe.serving.speculate.layout_stack import StackLayerOrder
    from vllm_smoe.serving.speculate.predictors import InputGate, Predictor, SummedRouter

    o = StackLayerOrder.__new__(StackLayerOrder)
    c = -(-Tmax // WORLD)
    g = torch.Generator().manual_seed(5)
    gate = torch.nn.Linear(H, E, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, H, generator=g))
    o.__dict__.update(N=WORLD, rank=rank, tp=types.SimpleNamespace(all_gather=_all_gather), step_order=False,
                      markov=False, step_pad=None, rows=0, perm=torch.zeros(L, Tmax, dtype=torch.long),
                      inv=torch.zeros(L, Tmax, dtype=torch.long), kept=torch.zeros(c, H),
                      chunk_only=False, per_layer=False, ahead=gate_in is not None, predicted=0,
                      gates=[(gate, _SoftmaxTopK(K))] * L, next_norm=dict(enumerate(gate_in or [])),
                      holds=torch.rand(L, WORLD, E, generator=g) < 0.4, ids=torch.arange(Tmax) * 7,
                      next_pref=torch.full((Tmax, 2), -1), next_conf=torch.zeros(Tmax),
                      table_pref=torch.randint(0, WORLD, (L, Tmax, 2), generator=g),
                      table_conf=torch.rand(L, Tmax, generator=g) * 0.6, stack=True, exact=[])
    o.predictor = InputGate(o.gates, o.next_norm) if gate_in is not None else Predictor()
    if router:
        o.ahead = False
        for norm in gate_in:
            w, why = exact_gate_scale(norm, gate, o.gates[0][1], H, torch.float32, "cpu")
            assert w is not None, why
            o.exact.append((None, w))
        o.predictor = SummedRouter(o.gates, o.exact)

    def predict(self, x, layer):
        T = x.shape[0]
        g = torch.Generator().manual_seed(1000 + T)
        for m in range(L):
            p = torch.randperm(T, generator=g)
            self.perm[m, :T], self.inv[m, :T] = p, torch.argsort(p)
        self.rows, self.predicted = T, self.predicted + 1

    o._predict = types.MethodType(predict, o)
    return o


def _check_gate_in(o, ref, moe_layers, kinds, T, case):
    """input-gate on the stack: the MoE layers whose input is split (after another MoE layer) are
    ordered by the gate's ranks of that input, which rode through the all-gather: the ranks kept
    equal the gate's on the whole input (rows without a near-tie at the k-th expert), and every
    rank built the same order."""
    from vllm_smoe.serving.speculate import device_predict

    failures, last = [], None
    for m, i in enumerate(moe_layers):
        if i > 0 and kinds[i - 1]:
            last = m
            if m not in o.gated:
                failures.append(f"{case}: MoE layer {m} (split input) not ordered by the gate")
        elif m in o.gated:
            failures.append(f"{case}: MoE layer {m} (whole input) ordered by the gate")
    gate, router = o.gates[last]
    n = ref.layers[moe_layers[last]].post_attention_layernorm(ref.layers[moe_layers[last]].input)
    logits = gate(n)
    top = torch.topk(logits, K + 1, dim=1).values
    clear = top[:, K - 1] - top[:, K] > 1e-4
    want = device_predict.prefer_held(router._compute_routing(n, logits, None)[1], o.holds[last])[0]
    same = (o.next_pref[:T] == want).all(dim=1)
    if not bool(same[clear].all()) or int(clear.sum()) < T // 2:
        failures.append(f"{case}: the gate's ranks of MoE layer {last}'s input differ on "
                        f"{int((~same[clear]).sum())} of {int(clear.sum())} clear rows")
    perms = _all_gather(o.perm[last, :T][None])
    if not all(torch.equal(p, perms[0]) for p in perms):
        failures.append(f"{case}: the ranks built different orders for MoE layer {last}")
    pref, conf = device_predict.learned_or_tables(o.table_pref[last: last + 1, :T], o.table_conf[last: last + 1, :T],
                                      o.next_pref[:T][None], o.next_conf[:T][None])
    perm, inv = torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long)
    device_predict.assign_permute(pref, conf, device_predict.chunk_caps(T, WORLD), perm, inv)
    if not torch.equal(perm[0], o.perm[last, :T]):
        failures.append(f"{case}: MoE layer {last}'s order is not the assignment of the gate's and tables' ranks")
    return failures


def _check_router(o, ref, moe_layers, T, case):
    """router on the stack: each MoE layer's order is the assignment of the experts the gate picks
    on the rows the layer's MoE sees (the reference's), where no row has a near-tie at the k-th."""
    from vllm_smoe.serving.speculate import device_predict

    failures, compared = [], 0
    for m, i in enumerate(moe_layers):
        gate, router = o.gates[m]
        n = ref.layers[i].routed
        logits = gate(n)
        top = torch.topk(logits, K + 1, dim=1).values
        if not bool((top[:, K - 1] - top[:, K] > 1e-4).all()):
            continue
        pref, conf = device_predict.prefer_held(router._compute_routing(n, logits, None)[1], o.holds[m])
        perm, inv = torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long)
        device_predict.assign_permute(pref[None], conf[None], device_predict.chunk_caps(T, WORLD), perm, inv)
        compared += 1
        if not torch.equal(perm[0], o.perm[m, :T]):
            failures.append(f"{case}: MoE layer {m}'s order is not the exact one")
    return failures, compared


def _worker(rank, port, results):
    from tests.unit.test_speculate_layer import _NoHostSync
    from vllm_smoe.serving import served

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    failures, exact_cases = [], 0
    # a first MoE layer (no residual yet) and a dense layer between MoE layers; dense first, as
    # vLLM's DeepSeek-V2 fixtures have it
    for kinds, gated in [(k, g) for k in ((True, False, True, True), (False, True, True))
                         for g in ("random", "input-gate", "router")]:
        moe_layers = tuple(i for i, sp in enumerate(kinds) if sp)
        for T in (1, 2, 3, 5, 7, 16):
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
            positions = torch.arange(T)
            ref, plain = _Stack(kinds, 7, rank), _Stack(kinds, 7, rank)
            with torch.no_grad():
                want = _reference(ref, x)
                if T > 1:  # vLLM's own split (one token: vLLM's bug, which smoe's hooks mend)
                    err = float((plain(positions, x) - want).abs().max())
                    if err > 1e-5:
                        failures.append(f"layers {kinds} T={T}: the stand-in's plain split is {err:.2e} off")
            hooked = _Stack(kinds, 7, rank)
            norms = [hooked.layers[i].post_attention_layernorm for i in moe_layers]
            o = _order(rank, len(moe_layers), 16, None if gated == "random" else norms, gated == "router")
            served._WORKER = types.SimpleNamespace(order=o)
            o.plan = types.SimpleNamespace(moe_layers=moe_layers, stack=hooked)
            o.hook(hooked)
            with torch.no_grad(), _NoHostSync():
                got = hooked(positions, x)
            case = f"layers {kinds} {gated} T={T}"
            if gated == "input-gate" and T > 1:
                failures += _check_gate_in(o, ref, moe_layers, kinds, T, case)
            if gated == "router":
                more, compared = _check_router(o, ref, moe_layers, T, case)
                failures, exact_cases = failures + more, exact_cases + compared * (T > 1)
            if gated != "router" and o.predicted != 1:
                failures.append(f"{case}: predicted {o.predicted} times in a step")
            if gated == "router" and o.predicted:
                failures.append(f"{case}: router predicted from the tables")
            if not torch.allclose(got, want, atol=1e-5, rtol=0):
                failures.append(f"{case}: output differs by {float((got - want).abs().max()):.2e}")
            # each MoE layer's chunk: the rows of its own order (this rank's share of it), as
            # the plain stack's MoE saw them at those step rows
            c = -(-T // WORLD)
            for m, i in enumerate(moe_layers):
                rows = o.perm[m, :T][rank * c: (rank + 1) * c]
                seen = hooked.layers[i].mlp.seen[: rows.shape[0]]
                if not torch.allclose(seen, ref.layers[i].mlp.seen.index_select(0, rows), atol=1e-5, rtol=0):
                    failures.append(f"{case}: MoE layer {m}'s chunk is not its order's rows")
    if exact_cases < 12:
        failures.append(f"router's order compared on {exact_cases} layers of steps only")
    results[rank] = failures
    dist.destroy_process_group()


def test_stack_order_per_layer_gives_the_plain_stack_and_each_layer_its_chunk(gloo_spawn):
    """3 ranks, T from 1 to 16 (steps the ranks do not divide, one-token steps): with each MoE
    layer in its own random order the stack's output equals the stack's math on whole rows in one
    process within fp32 rounding (as vLLM's own split does, but for one token), each MoE layer's rank holds the rows its layer's order gives it, and the order is
    predicted once per step, with no host read; with predictor input-gate, a MoE layer after
    another is ordered by the gate's ranks of its split input, brought by the all-gather, alike on
    every rank; with predictor router each layer's order is the exact one (the experts the gate
    picks on the reduced rows). Fails if the residual is dropped, added on more than one rank or at
    the wrong rows, or a layer's rows are restored with another layer's inverse."""
    assert gloo_spawn(_worker, WORLD) == {r: [] for r in range(WORLD)}


def test_stack_order_kind_takes_one_order_per_step_where_per_layer_cannot_follow():
    from vllm_smoe.serving.speculate.seams import stack_order_kind

    stack = types.SimpleNamespace(layers=[types.SimpleNamespace(use_sequence_parallel_moe=sp)
                                          for sp in (False, True, True)])
    assert stack_order_kind(stack, (1, 2), "layer", torch.bfloat16) == (False, "")
    assert stack_order_kind(stack, (1, 2), "step", torch.float32) == (True, "stack_order: step")
    assert stack_order_kind(stack, (1, 2), "layer", torch.float16) == (False, "")  # nothing rescaled
    for d in stack.layers:  # vLLM's DeepseekV2DecoderLayer with a routed scaling factor, MLA attention
        d.routed_scaling_factor, d.self_attn = 2.5, torch.nn.Identity()
    step, why = stack_order_kind(stack, (1, 2), "layer", torch.float16)
    assert step and "float16" in why and "[0, 1, 2]" in why
    assert stack_order_kind(stack, (1, 2), "layer", torch.bfloat16) == (False, "")
    step, why = stack_order_kind(stack, (0, 1, 2), "layer", torch.float32)
    assert step and "[1, 2]" in why and "[0, 1, 2]" in why
