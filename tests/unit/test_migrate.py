"""limit_moves: a placement between the served and a fresh one within a budget of moved slots."""

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.placement.migrate import _cycles, rename_ranks, limit_moves


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


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.sampled_from([2, 3, 4]), per=st.integers(1, 4), L=st.integers(1, 3),
       share=st.floats(0, 1), swaps=st.booleans())
def test_within_budget_balanced_and_never_worse(seed, N, per, L, share, swaps):
    rng = np.random.default_rng(seed)
    E = N * per
    cur, fresh = _balanced(rng, L, E, N), _balanced(rng, L, E, N)
    counts = [sp.csr_matrix(rng.poisson(0.5, (30, E)).astype(float)) for _ in range(L)]
    occ = rng.integers(1, 5, 30).astype(float)
    budget = int(share * L * E)
    out, info = limit_moves(cur, fresh, counts, occ, budget, N, swaps=swaps)
    assert out.shape == cur.shape and info["moved"] == int((out != cur).sum()) <= budget
    for layer in range(L):
        assert (np.bincount(out[layer], minlength=N) == per).all()
    target = rename_ranks(cur, fresh, N)
    if not swaps:
        assert (out[out != cur] == target[out != cur]).all()  # only the fresh placement's moves
        assert info["swaps"] == 0
    assert info["score"]["result"] == pytest.approx(_score(counts, occ, out, N))
    assert info["score"]["result"] >= info["score"]["current"] - 1e-9
    assert info["score"]["fresh"] == pytest.approx(_score(counts, occ, target, N))
    if budget >= info["fresh_moves"]:  # everything fits: never worse than the fresh placement
        assert info["score"]["result"] >= info["score"]["fresh"] - 1e-9


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


def test_the_budget_goes_to_the_move_that_pays_most():
    # two ranks, 4 experts; token 0 fires experts 0 and 2, token 1 fires 1 and 3 (counts 5 and 1)
    cur = np.array([[0, 0, 1, 1]])
    fresh = np.array([[0, 1, 0, 1]])  # swaps 1 <-> 2: both tokens' experts on one rank
    C = sp.csr_matrix(np.array([[5.0, 0, 5, 0], [0, 1, 0, 1]]))
    occ = np.array([5.0, 1.0])  # capacity 2.0: each token id may take its best rank
    out, info = limit_moves(cur, fresh, [C], occ, 1, 2, capacity=2.0)  # a cycle has 2 slots: nothing fits
    assert (out == cur).all() and info["moved"] == 0
    out, info = limit_moves(cur, fresh, [C], occ, 2, 2, capacity=2.0)
    assert info["moved"] == 2 and info["score"]["result"] == 12 > info["score"]["current"] == 6
    assert len(set(out[0][[0, 2]])) == 1 and len(set(out[0][[1, 3]])) == 1


def test_refuses_unbalanced_input():
    with pytest.raises(ValueError, match="E / ep_size"):
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
