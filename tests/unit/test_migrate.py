"""limit_moves: a placement between the served and a fresh one within a budget of moved slots."""

import itertools

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.placement.counts import rank_sizes
from vllm_smoe.placement.migrate import (_budgeted_assignment, _cycles, _polish_across, busiest_after_swaps, limit_moves,
                                         rank_names, rename_block, rename_ranks)


def _balanced(rng, L, E, N):
    return np.stack([rng.permutation(np.repeat(np.arange(N), E // N)) for _ in range(L)])


def _score(counts, occ, e2r, N, capacity=1.10):
    """The objective from coclust's own pieces: capped token assignment, local activations."""
    from vllm_smoe.placement.counts import assign_token_ids, local_count, rank_scores

    total = 0.0
    for layer, C in enumerate(counts):
        R = rank_scores(sp.csr_matrix(C), e2r[layer], N)
        total += local_count(R, assign_token_ids(R, occ, capacity))
    return total


def _rank_loads(C, e2r_layer, N):
    """[N]: activations of the experts on each rank, summed token by token."""
    dense = np.asarray(sp.csr_matrix(C).todense())
    return np.array([dense[:, e2r_layer == r].sum() for r in range(N)])


def _penalised(counts, occ, e2r, N, max_load, weight):
    """_score less weight x each layer's busiest rank's activations past max_load x the mean."""
    excess = 0.0
    for layer, C in enumerate(counts):
        loads = _rank_loads(C, e2r[layer], N)
        excess += max(0.0, loads.max() - max_load * loads.mean())
    return _score(counts, occ, e2r, N) - weight * excess


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.sampled_from([2, 3, 4]), per=st.integers(1, 4), L=st.integers(1, 3),
       share=st.floats(0, 1), swaps=st.booleans(), weight=st.sampled_from([0.0, 1.0, 4.0]),
       max_load=st.sampled_from([1.0, 1.1, 1.5, 3.0]), resolve=st.booleans())
def test_within_budget_balanced_and_never_worse(seed, N, per, L, share, swaps, weight, max_load, resolve):
    rng = np.random.default_rng(seed)
    E = N * per
    cur, fresh = _balanced(rng, L, E, N), _balanced(rng, L, E, N)
    counts = [sp.csr_matrix(rng.poisson(0.5, (30, E)).astype(float)) for _ in range(L)]
    occ = rng.integers(1, 5, 30).astype(float)
    budget = int(share * L * E)
    out, info = limit_moves(cur, fresh, counts, occ, budget, N, swaps=swaps, max_expert_load=max_load,
                            balance_weight=weight, resolve=resolve)
    assert out.shape == cur.shape and info["moved"] == int((out != cur).sum()) <= budget
    for layer in range(L):
        assert (np.bincount(out[layer], minlength=N) == per).all()
    target = rename_ranks(cur, fresh, N)
    if not swaps and not resolve:
        assert (out[out != cur] == target[out != cur]).all()  # only the fresh placement's moves
        assert info["swaps"] == 0
    assert info["score"]["result"] == pytest.approx(_score(counts, occ, out, N))
    assert info["score"]["fresh"] == pytest.approx(_score(counts, occ, target, N))
    if weight == 0:  # locality alone
        assert info["score"]["result"] >= info["score"]["current"] - 1e-9
    value = {k: _penalised(counts, occ, x, N, max_load, weight) for k, x in (("cur", cur), ("out", out),
                                                                              ("fresh", target))}
    assert value["out"] >= value["cur"] - 1e-6
    guarded = all(_rank_loads(counts[i], target[i], N).max() <= max(max_load * _rank_loads(counts[i], cur[i], N).mean(),
                                                                     _rank_loads(counts[i], cur[i], N).max()) + 1e-9
                  for i in range(L))
    if budget >= info["fresh_moves"] and guarded:  # everything fits: never worse than the fresh placement
        assert value["out"] >= value["fresh"] - 1e-6
    for layer in range(L):  # no layer is left busier than the cap allows, the fresh placement whole included
        loads, was = _rank_loads(counts[layer], out[layer], N), _rank_loads(counts[layer], cur[layer], N)
        assert loads.max() <= max(max_load * loads.mean(), was.max()) + 1e-9
    assert info["expert_load"]["result"] == pytest.approx(max(
        (lambda x: x.max() / x.mean() if x.sum() else 1.0)(_rank_loads(counts[layer], out[layer], N))
        for layer in range(L)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.sampled_from([2, 3, 5]), per=st.integers(1, 5))
def test_cycles_are_exchanges_that_make_the_target(seed, N, per):
    rng = np.random.default_rng(seed)
    cur, target = (_balanced(rng, 1, N * per, N)[0] for _ in range(2))
    cycles = _cycles(cur, target)
    x = cur.copy()
    for cyc in cycles:
        assert len(cyc) >= 2 and len(set(cur[cyc])) == len(cyc)  # each rank once
        for i, e in enumerate(cyc):
            assert target[e] == cur[cyc[(i + 1) % len(cyc)]]
        x[cyc] = target[cyc]
    assert (x == target).all()
    assert sum(map(len, cycles)) == int((cur != target).sum())


def testrename_ranksd_ranks_cost_no_move():
    rng = np.random.default_rng(1)
    cur = _balanced(rng, 3, 12, 4)
    fresh = np.array([2, 0, 3, 1])[cur]  # the same placement under other rank names
    counts = [sp.csr_matrix(rng.poisson(1.0, (20, 12)).astype(float)) for _ in range(3)]
    out, info = limit_moves(cur, fresh, counts, np.ones(20), 36, 4)
    assert info["fresh_moves"] == 0 and (out == cur).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.sampled_from([2, 3, 4]), per=st.integers(1, 4), L=st.integers(1, 4))
def test_renaming_per_layer_moves_no_more_and_only_renames(seed, N, per, L):
    rng = np.random.default_rng(seed)
    cur, fresh = _balanced(rng, L, N * per, N), _balanced(rng, L, N * per, N)
    whole, each = rename_ranks(cur, fresh, N), rename_ranks(cur, fresh, N, per_layer=True)
    assert (whole != cur).sum() >= (each != cur).sum()
    names = rank_names(cur, fresh, N, per_layer=True)
    for layer in range(L):
        assert sorted(names[layer]) == list(range(N))  # a renaming: same experts together
        assert (each[layer] == names[layer][fresh[layer]]).all()
        # the best renaming of that layer alone: no permutation of names keeps more experts home
        best = max(int((np.asarray(p)[fresh[layer]] == cur[layer]).sum()) for p in itertools.permutations(range(N)))
        assert int((each[layer] == cur[layer]).sum()) == best
    assert (rank_names(cur, fresh, N) == rank_names(cur, fresh, N)[0]).all()  # one renaming for all layers
    for block in (b for b in range(1, N + 1) if N % b == 0):  # names stay inside blocks of ranks
        inside = rank_names(cur, fresh, N, per_layer=True, block=block)
        assert (inside // block == np.arange(N) // block).all()
        assert (np.take_along_axis(inside, fresh, axis=1) != cur).sum() >= (each != cur).sum()


def test_rename_block_keeps_nodes_and_group_blocks():
    assert rename_block(8) == 8 and rename_block(8, nodes=2) == 4
    assert rename_block(8, groups=4) == 2 and rename_block(8, groups=16) == 8  # a rank holds whole groups
    assert rename_block(8, nodes=2, groups=2) == 4 and rename_block(8, nodes=4, groups=2) == 2


def test_renamed_tables_predict_the_renamed_ranks():
    """The token, Markov, prior and bigram tables and the learned network of a placement, renamed,
    predict for every token what the originals predict, under the new names."""
    from vllm_smoe.placement.learned import LearnedPredictor, forward, preferences
    from vllm_smoe.placement.predict import PredictorTables, predict_layer, rename_tables

    rng = np.random.default_rng(3)
    L, V, E, N, D, M = 3, 50, 8, 4, 6, 5

    def ranks(*shape):
        r = rng.integers(0, N, (*shape, 2)).astype(np.int16)
        r[rng.random(shape) < 0.2] = -1  # no data
        return r
    t = PredictorTables(token2rank=ranks(L, V), token_conf=rng.random((L, V)).astype(np.float16),
                        markov2rank=ranks(L, E), markov_conf=rng.random((L, E)).astype(np.float16),
                        prior2rank=rng.integers(0, N, (L, 2)).astype(np.int16),
                        prior_conf=rng.random(L).astype(np.float16),
                        bigram_keys=np.sort(rng.choice(V * V, M, replace=False)).astype(np.int64),
                        bigram2rank=ranks(L, M), bigram_conf=rng.random((L, M)).astype(np.float16),
                        learned_token_proj=rng.standard_normal((V, D)).astype(np.float16),
                        learned_prev_proj=rng.standard_normal((V + 1, D)).astype(np.float16),
                        learned_hidden_bias=rng.standard_normal(D).astype(np.float32),
                        learned_out_weight=rng.standard_normal((D, L * N)).astype(np.float32),
                        learned_out_bias=rng.standard_normal(L * N).astype(np.float32))
    names = np.stack([rng.permutation(N) for _ in range(L)])
    r = rename_tables(t, names)
    ids, prev = rng.integers(0, V, 200), rng.integers(-1, V, 200)
    keys = np.where(rng.random(200) < 0.3, t.bigram_keys[rng.integers(0, M, 200)], ids)
    top1 = rng.integers(0, E, 200)
    for layer in range(L):
        p0, c0, s0 = predict_layer(t, layer, ids, prev_top1=top1, keys=keys)
        p1, c1, s1 = predict_layer(r, layer, ids, prev_top1=top1, keys=keys)
        assert (p1 == np.where(p0 >= 0, names[layer][np.maximum(p0, 0)], -1)).all()
        assert (c1 == c0).all() and (s1 == s0).all()
    z0, z1 = (forward(x.learned, ids, prev) for x in (t, r))
    best0, best1 = preferences(z0, N)[0][..., 0], preferences(z1, N)[0][..., 0]  # [L, T]
    assert (best1 == np.take_along_axis(names, best0, axis=1)).all()
    assert np.allclose(np.sort(z0.reshape(-1, L, N), axis=2), np.sort(z1.reshape(-1, L, N), axis=2))
    assert isinstance(r.learned, LearnedPredictor)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.sampled_from([2, 3]), per=st.integers(2, 3), L=st.integers(1, 3),
       budget=st.integers(0, 8), weight=st.sampled_from([0.0, 4.0]), max_load=st.sampled_from([1.0, 1.1, 2.0]))
def test_polish_across_layers_keeps_one_budget_and_never_loses(seed, N, per, L, budget, weight, max_load):
    from vllm_smoe.placement.polish import routed_score

    rng = np.random.default_rng(seed)
    E = N * per
    cur = _balanced(rng, L, E, N)
    start = cur.copy()
    for layer in range(L):  # the start has already spent some moves
        if rng.random() < 0.5:
            a, b = rng.choice(np.flatnonzero(start[layer] == 0)), rng.choice(np.flatnonzero(start[layer] == 1))
            start[layer, [a, b]] = start[layer, [b, a]]
    budget += int((start != cur).sum())
    T = 40
    topk = np.stack([np.argsort(rng.random((T, E)) ** (1 + np.arange(E) % 3), axis=1)[:, :2] for _ in range(L)], 1)
    batch = np.sort(rng.integers(0, 3, T))
    loads = rng.integers(1, 20, (L, E)).astype(float)
    out, _ = _polish_across(start, cur, (topk, batch), loads, budget, N, 1.10, max_load, weight, evals=64, step=8)
    assert int((out != cur).sum()) <= budget
    for layer in range(L):
        assert (np.bincount(out[layer], minlength=N) == per).all()
        def value(e):
            return routed_score(topk[:, layer], batch, e, N, 1.10, loads[layer], max_load, weight)
        assert value(out[layer]) >= value(start[layer]) - 1e-9


def test_the_budget_goes_to_the_move_that_pays_most():
    # two ranks, 4 experts; token 0 fires experts 0 and 2, token 1 fires 1 and 3 (counts 5 and 1)
    cur = np.array([[0, 0, 1, 1]])
    fresh = np.array([[0, 1, 0, 1]])  # swaps 1 <-> 2: both tokens' experts on one rank
    C = sp.csr_matrix(np.array([[5.0, 0, 5, 0], [0, 1, 0, 1]]))
    occ = np.array([5.0, 1.0])  # capacity 2.0: each token id may take its best rank
    # a cycle has 2 slots: nothing fits
    out, info = limit_moves(cur, fresh, [C], occ, 1, 2, capacity=2.0, max_expert_load=2.0)
    assert (out == cur).all() and info["moved"] == 0
    # rank 0 would hold 10 of 12 activations: past the default cap (1.10 x 6), and 6 / 6 now;
    # refused by the guard alone (no balance term), with every move in budget or not
    for budget, layers in ((2, [C]), (2, [C, C])):
        cur2, fresh2 = np.repeat(cur, len(layers), 0), np.concatenate([fresh, cur[:, ::-1]])[:len(layers)]
        out, info = limit_moves(cur2, fresh2, layers, occ, budget, 2, capacity=2.0, balance_weight=0.0)
        assert (out == cur2).all() and info["moved"] == 0, budget
    out, info = limit_moves(cur, fresh, [C], occ, 2, 2, capacity=2.0, max_expert_load=2.0)
    assert info["moved"] == 2 and info["score"]["result"] == 12 > info["score"]["current"] == 6
    assert len(set(out[0][[0, 2]])) == 1 and len(set(out[0][[1, 3]])) == 1


def test_refuses_unbalanced_input():
    with pytest.raises(ValueError, match=r"every rank must hold its \[2, 2\] experts"):
        limit_moves(np.array([[0, 0, 0, 1]]), np.array([[0, 0, 1, 1]]), [np.ones((2, 4))], np.ones(2), 2, 2)


def test_a_swap_the_fresh_placement_does_not_make_is_taken():
    # the fresh placement is the served one: no cycle moves anything, one exchange of two experts
    # puts each token's experts on one rank (as in the golden above)
    cur = np.array([[0, 0, 1, 1]])
    C = sp.csr_matrix(np.array([[5.0, 0, 5, 0], [0, 1, 0, 1]]))
    occ = np.array([5.0, 1.0])
    out, info = limit_moves(cur, cur, [C], occ, 2, 2, capacity=2.0)
    assert (out == cur).all() and info["swaps"] == 0  # swaps off: the fresh placement's moves only
    # it puts 10 of 12 activations on one rank: refused under the expert-load cap, taken above it
    out, info = limit_moves(cur, cur, [C], occ, 2, 2, capacity=2.0, swaps=True)
    assert (out == cur).all()
    out, info = limit_moves(cur, cur, [C], occ, 2, 2, capacity=2.0, swaps=True, max_expert_load=2.0)
    assert info["swaps"] == 1 and info["moved"] == 2 and info["score"]["result"] == 12
    assert len(set(out[0][[0, 2]])) == 1 and len(set(out[0][[1, 3]])) == 1
    out, info = limit_moves(cur, cur, [C], occ, 1, 2, capacity=2.0, swaps=True, max_expert_load=2.0)  # 2 slots
    assert (out == cur).all()


def test_a_layer_past_the_cap_is_balanced_where_the_weight_says_it_pays():
    # token 0 fires experts 0 and 1 (10 times each), token 1 experts 2 and 3 (once each): all local,
    # but rank 0 holds 20 of 22 activations. Swapping 1 <-> 2 balances the ranks (11 / 11) and
    # loses 11 local activations; the excess over the cap (1.10 x 11 = 12.1) was 7.9.
    cur = np.array([[0, 0, 1, 1]])
    C = sp.csr_matrix(np.array([[10.0, 10, 0, 0], [0, 0, 1, 1]]))
    occ = np.array([10.0, 1.0])
    for weight, taken in ((0.0, False), (1.0, False), (4.0, True)):  # -11 + weight x 7.9 local
        out, info = limit_moves(cur, cur, [C], occ, 2, 2, capacity=2.0, swaps=True, balance_weight=weight)
        assert (info["swaps"] == 1) is taken, weight
        assert info["expert_load"]["current"] == pytest.approx(20 / 11)
        if taken:
            assert info["moved"] == 2 and info["expert_load"]["result"] == pytest.approx(1.0)
            assert info["score"]["result"] == 11 < info["score"]["current"] == 22
            assert out[0][0] != out[0][1]
    out, info = limit_moves(cur, cur, [C], occ, 1, 2, capacity=2.0, swaps=True)  # a swap is 2 slots
    assert (out == cur).all()
    with pytest.raises(ValueError, match="balance_weight"):
        limit_moves(cur, cur, [C], occ, 2, 2, balance_weight=-1.0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.integers(1, 6), per=st.integers(1, 4))
def test_busiest_after_swaps_against_each_swap_made(seed, N, per):
    rng = np.random.default_rng(seed)
    e2r = _balanced(rng, 1, N * per, N)[0]
    act = rng.integers(0, 20, N * per).astype(float)
    loads = np.bincount(e2r, weights=act, minlength=N)
    got = busiest_after_swaps(loads, e2r, act)
    for e in range(N * per):
        for f in range(N * per):
            trial = e2r.copy()
            trial[e], trial[f] = e2r[f], e2r[e]
            assert got[e, f] == pytest.approx(np.bincount(trial, weights=act, minlength=N).max())


def test_the_program_reaches_the_best_placement_the_greedy_search_misses():
    # 8 experts on 2 ranks, four token ids (one fires nothing), 4 slots to move, no balance in the
    # way: of every placement within 4 moves (enumerated) the best serves 8 activations locally;
    # the greedy search (one exchange at a time, each paying alone) stops at 7, the program gets 8
    cur = np.array([[0, 0, 0, 0, 1, 1, 1, 1]])
    C = sp.csr_matrix(np.array([[0.0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0],
                                [0, 1, 0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 1, 1, 0, 1]]))
    occ = np.ones(4)
    best = max(_score([C], occ, p[None], 2) for p in _enumerate(8, 2) if (p != cur[0]).sum() <= 4)
    assert best == 8
    out, info = limit_moves(cur, cur, [C], occ, 4, 2, swaps=True, max_expert_load=3.0)
    assert info["score"]["result"] == 7 and not info["resolved"] and info["programs"] == 0
    out, info = limit_moves(cur, cur, [C], occ, 4, 2, swaps=True, max_expert_load=3.0, resolve=True)
    assert info["resolved"] and info["moved"] <= 4 and info["score"]["result"] == 8 == _score([C], occ, out, 2)
    out, info = limit_moves(cur, cur, [C], occ, 0, 2, swaps=True, max_expert_load=3.0, resolve=True)
    assert (out == cur).all() and not info["resolved"]


def _enumerate(E, N):
    """Every expert2rank [E] with vLLM's rank sizes, as an [M, E] array (small E only)."""
    import itertools

    sizes = rank_sizes(E, N)
    return np.array([p for p in itertools.product(range(N), repeat=E)
                     if (np.bincount(p, minlength=N) == sizes).all()])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.sampled_from([2, 3]), E=st.integers(3, 7), L=st.integers(1, 2),
       budget=st.integers(0, 8), weight=st.sampled_from([0.0, 1.0, 4.0]), cap=st.sampled_from([1.0, 1.2]))
def test_budgeted_assignment_against_enumeration(seed, N, E, L, budget, weight, cap):
    # the 0-1 program against every placement of a tiny instance: same optimum, within its budget,
    # its ceilings and vLLM's rank sizes (uneven where N does not divide E)
    rng = np.random.default_rng(seed)
    G = [rng.integers(0, 6, (E, N)).astype(float) for _ in range(L)]
    act = [rng.integers(0, 5, E).astype(float) for _ in range(L)]
    every = _enumerate(E, N)
    cur = np.stack([every[rng.integers(len(every))] for _ in range(L)])
    caps = np.array([cap * a.sum() / N for a in act])
    ceilings = np.array([max(caps[i], np.bincount(cur[i], weights=act[i], minlength=N).max()) + 1e-9 for i in range(L)])

    def value(layer, p):
        loads = np.bincount(p, weights=act[layer], minlength=N)
        if loads.max() > ceilings[layer]:
            return None
        return G[layer][np.arange(E), p].sum() - weight * max(0.0, loads.max() - caps[layer])
    per = [[(value(i, p), int((p != cur[i]).sum())) for p in every] for i in range(L)]
    best = -np.inf  # over pairs of layers' placements within the budget together
    for combo in np.ndindex(*(len(every),) * L):
        vals = [per[i][k] for i, k in enumerate(combo)]
        if all(v is not None for v, _ in vals) and sum(m for _, m in vals) <= budget:
            best = max(best, sum(v for v, _ in vals))
    got = _budgeted_assignment(G, act, caps, ceilings, cur, rank_sizes(E, N), budget, weight)
    assert got is not None and got.shape == (L, E)
    assert int((got != cur).sum()) <= budget
    vals = [value(i, got[i]) for i in range(L)]
    assert all(v is not None for v in vals)
    for i in range(L):
        assert (np.bincount(got[i], minlength=N) == rank_sizes(E, N)).all()
    assert sum(vals) == pytest.approx(best, abs=1e-6)
