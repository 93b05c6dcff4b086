"""Expert counts the ranks do not divide (placement/uneven.py): vLLM's split, placements solved
for it, the file, the load plan, advise and the exchange's owners."""

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vllm_smoe.placement.counts import assign_token_ids, expert_gains, local_count, rank_scores, rank_sizes
from vllm_smoe.placement.layout import SOLVERS, place_model
from vllm_smoe.placement.migrate import limit_moves, rename_ranks
from vllm_smoe.placement.peers import place_linear, place_round_robin
from vllm_smoe.placement.routing_counts import RoutingCounts
from vllm_smoe.placement.uneven import fit_rank_sizes, phantoms, with_phantoms


def _trace(E, L=2, K=3, T=400, V=24, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, V, T)
    # each id prefers a few experts, so placements have something to find
    fav = rng.integers(0, E, (V, L, K + 2))
    topk = np.stack([[rng.permutation(fav[t, layer])[:K] for layer in range(L)] for t in tok])
    # distinct experts per row (a token's top-k ids differ)
    for i in range(T):
        for layer in range(L):
            row = list(dict.fromkeys(topk[i, layer].tolist()))
            while len(row) < K:
                row.append(int(rng.integers(0, E)))
                row = list(dict.fromkeys(row))
            topk[i, layer] = row[:K]
    return tok, topk


def test_rank_sizes_are_vllms_split():
    vllm_map = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")
    from vllm_smoe.serving.exchange.sparse_a2a import owner_of

    for E, N in [(60, 8), (15, 2), (32, 3), (64, 8), (7, 7), (10, 4), (128, 6)]:
        got = rank_sizes(E, N)
        owner = owner_of(E, N).numpy()
        for r in range(N):
            local, emap, _ = vllm_map.determine_expert_map(N, r, E)
            assert got[r] == local, (E, N, r)
            assert (np.flatnonzero(emap.numpy() >= 0) == np.flatnonzero(owner == r)).all(), (E, N, r)
            _, rr, _ = vllm_map.determine_expert_map(N, r, E, "round_robin")
            assert (np.flatnonzero(rr.numpy() >= 0) == np.flatnonzero(place_round_robin(E, N) == r)).all()
        assert (owner == place_linear(E, N)).all()
    assert phantoms(60, 8) == 4 and phantoms(64, 8) == 0
    with pytest.raises(ValueError, match="ep_size 9"):
        rank_sizes(8, 9)


def test_fit_rank_sizes_golden():
    # 5 experts on 2 ranks: vLLM gives rank 0 three, rank 1 two, so rank 1 must hold the phantom
    # (expert 5), which the padded solve put on rank 0. One of rank 1's experts comes back in its
    # place: expert 2 (one activation, from id 2) loses less by the move than 3 or 4 (six each).
    A = sp.csr_matrix(np.array([[5, 5, 0, 0, 0],    # id 0: experts 0, 1 (rank 0)
                                [0, 0, 0, 6, 6],    # id 1: experts 3, 4 (rank 1)
                                [0, 0, 1, 0, 0]],   # id 2: expert 2, rarely
                               dtype=float))
    occ = np.array([5.0, 6.0, 1.0])
    padded = np.array([0, 0, 1, 1, 1, 0])  # ranks 0: {0, 1, 5}, 1: {2, 3, 4}
    got = fit_rank_sizes(A, occ, padded, 2, capacity=10.0)
    assert got.tolist() == [0, 0, 0, 1, 1]  # expert 2 came to rank 0, the phantom went to rank 1
    assert (np.bincount(got, minlength=2) == rank_sizes(5, 2)).all()
    with pytest.raises(ValueError, match="experts on each"):
        fit_rank_sizes(A, occ, np.array([0, 0, 0, 0, 1, 1]), 2)


@settings(max_examples=40, deadline=None)
@given(E=st.integers(3, 20), N=st.integers(2, 6), seed=st.integers(0, 10_000))
def test_fit_rank_sizes_property(E, N, seed):
    """vLLM's sizes on every rank, and only as many real experts move as phantoms were misplaced."""
    assume(N <= E)
    rng = np.random.default_rng(seed)
    pad = phantoms(E, N)
    A = sp.csr_matrix(rng.poisson(0.7, (9, E)).astype(float))
    occ = np.asarray(A.sum(axis=1)).ravel() + 1
    padded = rng.permutation(np.repeat(np.arange(N), (E + pad) // N))
    got = fit_rank_sizes(A, occ, padded, N)
    assert (np.bincount(got, minlength=N) == rank_sizes(E, N)).all()
    want = (rank_sizes(E, N) < -(-E // N)).astype(int)
    misplaced = int(np.maximum(np.bincount(padded[E:], minlength=N) - want, 0).sum())
    assert int((got != padded[:E]).sum()) == misplaced
    if pad == 0:
        assert (got == padded).all()
    # the load cap's swaps keep every rank's count and never raise the busiest rank
    capped = fit_rank_sizes(A, occ, padded, N, max_expert_load=1.1)
    assert (np.bincount(capped, minlength=N) == rank_sizes(E, N)).all()
    act = np.asarray(A.sum(axis=0)).ravel()
    assert np.bincount(capped, weights=act, minlength=N).max() <= np.bincount(got, weights=act, minlength=N).max() + 1e-9


def test_place_model_uneven_every_solver_and_the_refusals():
    tok, topk = _trace(15)
    c = RoutingCounts.from_arrays(tok, topk, 15, 24)
    for N in (2, 4, 7):
        for method in SOLVERS:
            e2r, _, tables = place_model(method, c, N, vocab_size=24 if method not in ("linear", "round_robin")
                                         else None)
            for row in e2r:
                assert (np.bincount(row, minlength=N) == rank_sizes(15, N)).all(), (method, N)
            if method == "linear":
                assert (e2r == place_linear(15, N)).all()
            if tables is not None:
                assert tables.token2rank.max() < N
    # the uneven coclust placement keeps more activations local than vLLM's linear split
    e2r, _, _ = place_model("coclust", c, 4)
    lin = place_linear(15, 4)
    for layer in range(2):
        A = c.layer_matrix(layer)
        ours = rank_scores(A, e2r[layer], 4)
        theirs = rank_scores(A, lin, 4)
        _, occ = c.seen()
        assert local_count(ours, assign_token_ids(ours, occ, 1.1)) > local_count(theirs, assign_token_ids(theirs,
                                                                                                        occ, 1.1))
    for kw, words in [({"replicas": 4}, "replicas 4"), ({"nodes": 2}, "nodes 2"), ({"groups": 3}, "3 routing groups")]:
        with pytest.raises(ValueError, match=words):
            place_model("coclust", c, 4, **kw)
    for bad in (16, 0):
        with pytest.raises(ValueError, match="1..num_experts"):
            place_model("coclust", c, bad)


def test_with_phantoms_adds_zero_columns():
    A = sp.csr_matrix(np.arange(6, dtype=float).reshape(2, 3))
    B = with_phantoms(A, 2)
    assert B.shape == (2, 4) and (B.toarray()[:, :3] == A.toarray()).all() and B.toarray()[:, 3].sum() == 0
    assert with_phantoms(A, 3).shape == (2, 3)


def test_the_file_the_load_plan_and_advise_take_vllms_split(tmp_path):
    from types import SimpleNamespace as NS

    from vllm_smoe.formats.placement_file import load_placement, write_placement
    from vllm_smoe.serving.place.load_plan import make_load_plan

    tok, topk = _trace(15, L=2)
    c = RoutingCounts.from_arrays(tok, topk, 15, 24)
    e2r, _, _ = place_model("coclust", c, 4)
    path = write_placement(str(tmp_path / "p.yaml"), expert2rank=e2r, ep_size=4, nodes=1, top_k=3, vocab_size=24,
                           method="coclust", capacity=1.1, tables=None)
    p = load_placement(path)
    assert (p.expert2rank == e2r).all()
    cfg = NS(model_type="qwen3_moe", num_hidden_layers=2, num_experts=15, num_experts_per_tok=3,
             decoder_sparse_step=1, mlp_only_layers=[])
    plan = make_load_plan(path, cfg, str(tmp_path), 4)
    assert plan.num_redundant == 0
    assert [len(plan.local_slots(r)) for r in range(4)] == rank_sizes(15, 4).tolist()
    for r in range(4):
        held = plan.held(r)  # [L, E] over router outputs
        for layer in range(2):
            assert sorted(plan.slot2expert[layer][held[layer]].tolist()) == np.flatnonzero(e2r[layer] == r).tolist()
    # a rank holding the wrong count is refused, naming the split
    bad = e2r.copy()
    bad[0, np.flatnonzero(bad[0] == 3)[0]] = 0  # rank 0 now holds 5
    bad_path = write_placement(str(tmp_path / "bad.yaml"), expert2rank=bad, ep_size=4, nodes=1, top_k=3,
                               vocab_size=24, method="coclust", capacity=1.1, tables=None, read_back=False)
    with pytest.raises(ValueError, match=r"rank 0 holds 5 experts, it must hold 4 .*vLLM's split of 15 over 4"):
        load_placement(bad_path)
    # advise: renaming keeps sizes, and a limited swap keeps every rank's count
    fresh, _, _ = place_model("coclust", c, 4, seed=5)
    renamed = rename_ranks(e2r, fresh, 4)
    for row in renamed:
        assert (np.bincount(row, minlength=4) == rank_sizes(15, 4)).all()
    _, occ = c.seen()
    out, info = limit_moves(e2r, fresh, [c.layer_matrix(layer) for layer in range(2)], occ, 6, 4, swaps=True)
    for row in out:
        assert (np.bincount(row, minlength=4) == rank_sizes(15, 4)).all()
    assert info["moved"] <= 6


def test_expert_gains_unchanged_by_phantoms():
    """A phantom has no activations: the padded solve's gains are the real ones plus zeros."""
    tok, topk = _trace(15, L=1)
    c = RoutingCounts.from_arrays(tok, topk, 15, 24)
    A = c.layer_matrix(0)
    _, occ = c.seen()
    e2r = place_linear(15, 4)
    t2r = assign_token_ids(rank_scores(A, e2r, 4), occ, 1.1)
    G = expert_gains(with_phantoms(A, 4), t2r, 4)
    assert G.shape == (16, 4) and (G[15] == 0).all() and (G[:15] == expert_gains(A, t2r, 4)).all()
