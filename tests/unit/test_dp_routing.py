"""Attention-DP request routing: the shared rule (placement/dp.py), request-level placement,
the front-end router around vLLM's balancer, the /smoe/route endpoint, served-step counters."""

import itertools
import os
import types
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.placement.dp import (_request_scores, assign_requests, balance_mask, pick_rank, place_requests,
                                    request_affinity, request_counts, request_index, request_token_table,
                                    step_imbalance, token_votes)
from tests.support import REPO

DP2 = os.path.join(REPO, "configs", "tiny-4dom-dp2.yaml")


def test_balance_mask_golden():
    # empty window: every rank open
    assert balance_mask(np.zeros(2), 5.0, 1.1).tolist() == [True, True]
    # (5, 0) + 5: total 10, fair 5, cap 5.5 -> rank 0 would hold 10: closed; the least loaded stays open
    assert balance_mask(np.array([5.0, 0.0]), 5.0, 1.1).tolist() == [False, True]
    # (30, 28) + 2 at capacity 1.1: cap 33 -> both open
    assert balance_mask(np.array([30.0, 28.0]), 2.0, 1.1).tolist() == [True, True]
    # (4, 0, 0) + 1 at 1.0: limit max(5/3, 1) -> only the empty ranks
    assert balance_mask(np.array([4.0, 0.0, 0.0]), 1.0, 1.0).tolist() == [False, True, True]
    # one request of slack on request counts: (0, 1) + 1 leaves both open, (0, 2) + 1 does not
    assert balance_mask(np.array([0.0, 1.0]), 1.0, 1.1, slack=1.0).tolist() == [True, True]
    assert balance_mask(np.array([0.0, 2.0]), 1.0, 1.1, slack=1.0).tolist() == [True, False]


def test_pick_rank_golden():
    assert pick_rank(np.array([1.0, 3.0, 2.0]), np.array([True, True, True])) == 1
    assert pick_rank(np.array([1.0, 3.0, 2.0]), np.array([True, False, True])) == 2  # best rank masked
    assert pick_rank(np.array([2.0, 2.0, 1.0]), np.ones(3, bool)) == -1  # a tie: no preference
    assert pick_rank(np.zeros(2), np.ones(2, bool)) == -1  # unseen prompt
    assert pick_rank(np.array([0.0, 5.0]), np.array([True, False])) == 0  # the only open rank
    assert pick_rank(np.array([1.0, 2.0]), np.zeros(2, bool)) == -1


def test_requests_of_one_workload_in_a_row_are_spread_by_the_window():
    # 8 requests in a row that all prefer rank 0, then 8 that prefer rank 1: the sliding window
    # of the last 4 requests keeps each rank within its share (or the least loaded + 1 request)
    scores = np.array([[5.0, 0.0]] * 8 + [[0.0, 5.0]] * 8)
    out = assign_requests(scores, np.full(16, 10), 2, capacity=1.0, window=4)
    assert out[:8].tolist() == [0, 1, 0, 1, 0, 0, 1, 0]
    with pytest.raises(ValueError, match="window must be >= 1"):
        assign_requests(scores, np.full(16, 10), 2, window=0)
    # mixed arrivals: everyone gets its rank
    mixed = np.array([[5.0, 0.0], [0.0, 5.0]] * 8)
    assert assign_requests(mixed, np.full(16, 10), 2, capacity=1.0, window=4).tolist() == [0, 1] * 8


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(2, 5), st.integers(1, 12), st.floats(1.0, 1.5), st.integers(0, 2**16))
def test_assign_requests_respects_the_window_and_is_deterministic(Q, N, window, capacity, seed):
    rng = np.random.default_rng(seed)
    scores = rng.random((Q, N)) * (rng.random((Q, 1)) < 0.8)
    tokens = rng.integers(1, 50, Q)
    out = assign_requests(scores, tokens, N, capacity, window)
    assert np.array_equal(out, assign_requests(scores, tokens, N, capacity, window))
    assert out.min() >= 0 and out.max() < N
    load = np.zeros(N)
    for q in range(Q):  # replay: every request went to a rank the mask left open
        if q > window:
            load[out[q - window - 1]] -= tokens[q - window - 1]
        assert balance_mask(load, float(tokens[q]), capacity)[out[q]] or pick_rank(
            scores[q], balance_mask(load, float(tokens[q]), capacity)) < 0
        load[out[q]] += tokens[q]


def test_request_counts_and_affinity_golden():
    req = np.array([7, 7, 3, 7, 3])  # request 7 first, then 3
    topk = np.array([[[0, 1]], [[1, 2]], [[3, 3]], [[0, -1]], [[2, 3]]])  # [T, L=1, K=2]
    A, tokens = request_counts(req, topk, 4)
    np.testing.assert_array_equal(A[:, 0], [[2, 2, 1, 0], [0, 0, 1, 3]])
    np.testing.assert_array_equal(tokens, [3, 2])
    t2r = np.array([[[0, -1], [1, -1], [-1, -1]]], np.int16)  # token 2 unseen
    conf = np.array([[0.5, 1.0, 0.0]], np.float16)
    reqs, S, tok = request_affinity(t2r, conf, np.array([0, 1, 2, 1, 9]), req, None, 2)  # id 9 outside the table
    np.testing.assert_array_equal(reqs, [7, 3])
    np.testing.assert_allclose(S, [[0.5, 2.0], [0.0, 0.0]])  # 7: tokens 0, 1, 1; 3: unseen and outside


def test_request_token_table_golden():
    tok = np.array([0, 1, 0, 2, 0, 1])
    req = np.array([0, 0, 1, 1, 2, 2])
    t2r, conf = request_token_table(tok, req, np.array([1, 0, 1]), 4, 2)
    # token 0 in requests on ranks 1, 0, 1 -> rank 1 (2 of 3: confidence (2/3 - 1/2) / (1/2)),
    # second rank 0; token 1 only on 1; token 2 only on 0; token 3 unseen
    np.testing.assert_array_equal(t2r, [[1, 0], [1, -1], [0, -1], [-1, -1]])
    np.testing.assert_allclose(conf.astype(float), [1 / 3, 1.0, 1.0, 0.0], atol=1e-3)
    # a request counts once however often the token repeats in it; generated tokens do not count
    tok2 = np.array([0, 0, 0, 0, 1, 0])
    t2r, conf = request_token_table(tok2, np.array([0, 0, 0, 0, 1, 1]), np.array([0, 1]), 4, 2,
                                    is_prefill=np.array([1, 1, 1, 1, 1, 0], bool))
    np.testing.assert_array_equal(t2r[:2], [[0, -1], [1, -1]])
    np.testing.assert_allclose(conf.astype(float)[:2], [1.0, 1.0])


def _brute_force(A, tokens, N, capacity):
    """Best local share over every expert split (E / N per rank per layer) and every request
    assignment within the token cap: the exact optimum of place_requests' objective."""
    Q, L, E = A.shape
    per = E // N
    cap = capacity * tokens.sum() / N
    splits = [np.array(s) for s in itertools.product(range(N), repeat=E) if all(s.count(r) == per for r in range(N))]
    best = 0.0
    for e2r in itertools.product(splits, repeat=L):
        S = _request_scores(A, np.stack(e2r), N)
        for r2r in itertools.product(range(N), repeat=Q):
            r2r = np.array(r2r)
            if np.bincount(r2r, weights=tokens, minlength=N).max() <= cap + 1e-9:
                best = max(best, S[np.arange(Q), r2r].sum())
    return best / A.sum()


@pytest.mark.parametrize("seed", range(4))
def test_place_requests_reaches_the_exact_optimum_on_small_cases(seed):
    rng = np.random.default_rng(seed)
    Q, L, E, N = 6, 1, 4, 2
    A = rng.integers(0, 6, (Q, L, E)).astype(np.float32)
    tokens = rng.integers(2, 6, Q)
    e2r, r2r, share = place_requests(A, tokens, N, capacity=1.2, restarts=8)
    S = _request_scores(A, e2r, N)
    assert share == pytest.approx(S[np.arange(Q), r2r].sum() / A.sum())
    assert (np.bincount(e2r[0], minlength=N) == E // N).all()
    assert np.bincount(r2r, weights=tokens, minlength=N).max() <= 1.2 * tokens.sum() / N + 1e-9
    assert share == pytest.approx(_brute_force(A, tokens, N, 1.2), abs=1e-9)


def test_place_requests_recovers_planted_workloads_and_is_seeded():
    # two workloads, each using its own half of the experts in every layer
    rng = np.random.default_rng(0)
    Q, L, E = 40, 3, 8
    work = np.arange(Q) % 2
    A = rng.random((Q, L, E)).astype(np.float32) * 0.1
    for q in range(Q):
        A[q, :, work[q] * 4:(work[q] + 1) * 4] += 5
    e2r, r2r, share = place_requests(A, np.full(Q, 10), 2, seed=3)
    assert share > 0.95
    assert len(set(zip(work.tolist(), r2r.tolist()))) == 2  # one rank per workload
    again = place_requests(A, np.full(Q, 10), 2, seed=3)
    assert np.array_equal(again[0], e2r) and np.array_equal(again[1], r2r)


def _layer_loads(A, e2r, N):
    """[L, N] activations on each rank's experts per layer."""
    return np.stack([np.bincount(e2r[layer], weights=A[:, layer].sum(axis=0), minlength=N) for layer in range(A.shape[1])])


def test_place_requests_caps_the_expert_load_of_a_hot_workload():
    # workload 0 fires twice as often as workload 1, each on its own half of the experts: the
    # uncapped placement puts each half on one rank (load 1.33 x mean); capped at 1.10 every
    # layer's ranks carry within 1.10 x mean, at the price of some locality
    rng = np.random.default_rng(1)
    Q, L, E, N = 40, 2, 8, 2
    work = np.arange(Q) % 2
    A = rng.random((Q, L, E)).astype(np.float32) * 0.1
    for q in range(Q):
        A[q, :, work[q] * 4:(work[q] + 1) * 4] += 10 if work[q] == 0 else 5
    free = place_requests(A, np.full(Q, 10), N, seed=0)
    capped = place_requests(A, np.full(Q, 10), N, seed=0, max_expert_load=1.10)
    free_load = _layer_loads(A, free[0], N)
    capped_load = _layer_loads(A, capped[0], N)
    assert (free_load.max(axis=1) / free_load.mean(axis=1)).min() > 1.3
    assert (capped_load.max(axis=1) / capped_load.mean(axis=1)).max() <= 1.10 + 1e-9
    assert (np.stack([np.bincount(r, minlength=N) for r in capped[0]]) == E // N).all()
    assert 0.5 < capped[2] < free[2]
    S = _request_scores(A, capped[0], N)
    assert capped[2] == pytest.approx(S[np.arange(Q), capped[1]].sum() / A.sum())


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.floats(1.0, 1.5), st.integers(0, 2**16))
def test_place_requests_capped_layers_are_within_the_cap_or_no_swap_lowers_the_hottest_rank(N, cap, seed):
    rng = np.random.default_rng(seed)
    Q, L, E = 12, 2, 2 * N
    A = (rng.random((Q, L, E)) ** 3 * 10).astype(np.float32)
    e2r, r2r, share = place_requests(A, rng.integers(1, 9, Q), N, seed=seed, restarts=2, iters=10,
                                     max_expert_load=cap)
    _assert_capped_or_stuck(A, e2r, N, cap)


def _assert_capped_or_stuck(A, e2r, N, cap):
    """Every layer holds E / N experts a rank and is within ``cap`` x mean activations, or no swap
    takes load off its hottest rank without making another as hot."""
    L, E = e2r.shape
    for layer in range(L):
        assert (np.bincount(e2r[layer], minlength=N) == E // N).all()
        load = A[:, layer].sum(axis=0).astype(np.float64)
        rl = np.bincount(e2r[layer], weights=load, minlength=N)
        hot = int(np.argmax(rl))
        if rl[hot] <= cap * rl.mean() + 1e-6:
            continue
        for a in np.flatnonzero(e2r[layer] == hot):  # a local optimum: no swap takes load off it
            for b in np.flatnonzero(e2r[layer] != hot):
                moved = load[a] - load[b]
                assert not (moved > 0 and max(rl[hot] - moved, rl[e2r[layer, b]] + moved) < rl[hot] - 1e-6)


def _step_imbalance_by_hand(topk, req, e2r, N, C, steps, seed):
    """step_imbalance's twin, one token and one set at a time."""
    firsts = list(dict.fromkeys(req.tolist()))  # requests in first-appearance order
    tokens = {r: [t for t in range(len(req)) if req[t] == r] for r in firsts}
    order = [firsts[i] for i in np.random.default_rng(seed).permutation(len(firsts))]
    live = [[order[i], 0] for i in range(min(C, len(order)))]
    nxt, busiest, mean = len(live), 0.0, 0.0
    for _ in range(steps):
        rows = [tokens[r][p] for r, p in live]
        for layer in range(topk.shape[1]):
            experts = {int(e) for t in rows for e in topk[t, layer]}
            work = [sum(1 for e in experts if e2r[layer][e] == r) for r in range(N)]
            busiest += max(work)
            mean += sum(work) / N
        for c in live:
            c[1] += 1
            if c[1] == len(tokens[c[0]]):
                c[0], c[1] = order[nxt % len(order)], 0
                nxt += 1
    return busiest / mean


def test_step_imbalance_golden():
    # two one-token-per-step requests; layer 0 fires experts {0, 1} (both on rank 0), then {2, 3}
    topk = np.array([[[0, 1]], [[2, 3]]])
    req = np.array([7, 9])
    assert step_imbalance(topk, req, np.array([[0, 0, 1, 1]]), 2, concurrency=2, steps=3) == pytest.approx(1.0)
    assert step_imbalance(topk, req, np.array([[0, 0, 0, 1]]), 2, concurrency=2, steps=3) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="concurrency"):
        step_imbalance(topk, req, np.array([[0, 0, 1, 1]]), 2, concurrency=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.integers(1, 6), st.integers(1, 9), st.integers(0, 2**16))
def test_step_imbalance_matches_a_token_by_token_count(N, C, steps, seed):
    rng = np.random.default_rng(seed)
    T, L, K, E = 30, 2, 2, 2 * N
    topk = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])
    req = rng.integers(0, 5, T) * 3 + 1  # interleaved requests, ids not dense
    e2r = np.stack([rng.permutation(np.arange(E) % N) for _ in range(L)])
    got = step_imbalance(topk, req, e2r, N, concurrency=C, steps=steps, seed=seed)
    assert got == pytest.approx(_step_imbalance_by_hand(topk, req, e2r, N, C, steps, seed))
    assert 1.0 - 1e-9 <= got <= N + 1e-9


# ---- the front-end router around vLLM's balancer -------------------------------------------------

def _router(num_engines=2, ep_size=2, window=64):
    from vllm_smoe.serving.dp.router import RequestRouter

    t2r = np.full((1, 8, 2), -1, np.int16)
    t2r[0, :4, 0] = np.arange(4) % ep_size  # tokens 0-3 -> rank t % ep_size; 4-7 unseen
    conf = np.zeros((1, 8), np.float16)
    conf[0, :4] = 1.0
    return RequestRouter(t2r, conf, ep_size, num_engines, window=window)


def test_router_folds_tp_ranks_into_engines_and_scores_a_nodes_own_engines():
    from vllm_smoe.serving.dp.router import RequestRouter

    r = _router(num_engines=2, ep_size=4)  # TP=2: engine 0 = EP ranks 0, 1; engine 1 = 2, 3
    np.testing.assert_allclose(r.scores([0, 1, 2, 5]), [2.0, 1.0])
    with pytest.raises(ValueError, match="not a multiple"):
        _router(num_engines=3, ep_size=4)
    # hybrid load balancing: this front end routes to DP ranks 2 and 3 of 4 only
    t2r = np.full((1, 8, 2), -1, np.int16)
    t2r[0, :4, 0] = np.arange(4)
    node = RequestRouter(t2r, np.ones((1, 8), np.float16), 4, 4, engine_ranks=[2, 3])
    np.testing.assert_allclose(node.scores([0, 2, 3, 3]), [1.0, 2.0])
    assert node.choose([3], 10, [0, 0]) == 1
    with pytest.raises(ValueError, match="outside the 4 DP ranks"):
        RequestRouter(t2r, np.ones((1, 8), np.float16), 4, 4, engine_ranks=[4])


def _families(seed, Q=48, L=2, E=16):
    """Four workloads in two families: workload w fires its own quarter of the experts, and a
    third as often its sibling's (w ^ 1) quarter: [Q, L, E] activations, workload of each request."""
    rng = np.random.default_rng(seed)
    work = np.arange(Q) % 4
    A = rng.random((Q, L, E)).astype(np.float32) * 0.1
    for q in range(Q):
        A[q, :, work[q] * 4:(work[q] + 1) * 4] += 6
        A[q, :, (work[q] ^ 1) * 4:((work[q] ^ 1) + 1) * 4] += 2
    return A, work


def _node_share(A, e2r, r2r, per):
    S = _request_scores(A, e2r // per, e2r.max() // per + 1)
    return S[np.arange(len(r2r)), r2r // per].sum() / A.sum()


def test_place_requests_by_node_keeps_families_on_a_node():
    # 4 ranks on 2 nodes: the hierarchical solve puts each family (and its experts) on one node,
    # so only the 0.1-noise leaves its node; every rank still holds E / N experts per layer
    A, work = _families(0)
    Q, L, E = A.shape
    # the flat solve names its ranks without knowing nodes: with this seed it splits both families
    flat = place_requests(A, np.full(Q, 10), 4, seed=2)
    assert _node_share(A, flat[0], flat[1], 2) < 0.8
    e2r, r2r, share = place_requests(A, np.full(Q, 10), 4, nodes=2, seed=2)
    assert all((np.bincount(e2r[layer], minlength=4) == E // 4).all() for layer in range(L))
    assert len({(w // 2, r // 2) for w, r in zip(work.tolist(), r2r.tolist())}) == 2  # a family per node
    assert len(set(zip(work.tolist(), r2r.tolist()))) == 4  # a workload per rank
    assert _node_share(A, e2r, r2r, 2) > 0.95 and share > 0.7
    assert share == pytest.approx(_request_scores(A, e2r, 4)[np.arange(Q), r2r].sum() / A.sum())
    with pytest.raises(ValueError, match="nodes 3 does not divide ep_size 4"):
        place_requests(A, np.full(Q, 10), 4, nodes=3)
    with pytest.raises(ValueError, match="3 routing groups and 2 nodes"):
        place_requests(np.ones((4, 1, 24), np.float32), np.ones(4), 6, nodes=2, groups=3)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(4, 2), (8, 2), (8, 4)]), st.integers(0, 2**16))
def test_place_requests_by_node_refines_the_node_level_solution(shape, seed):
    # nodes first, then ranks inside: the node of every expert and request is the node-level
    # solve's, each node's ranks split its experts evenly, and the share is what it scores
    N, nodes = shape
    rng = np.random.default_rng(seed)
    Q, L, E = 20, 2, 2 * N
    A = (rng.random((Q, L, E)) ** 3 * 10).astype(np.float32)
    tokens = rng.integers(1, 9, Q)
    e2r, r2r, share = place_requests(A, tokens, N, seed=seed, restarts=2, iters=10, nodes=nodes)
    e2n, r2n, _ = place_requests(A, tokens, nodes, seed=seed, restarts=2, iters=10)
    per = N // nodes
    np.testing.assert_array_equal(e2r // per, e2n)
    np.testing.assert_array_equal(r2r // per, r2n)
    assert all((np.bincount(e2r[layer], minlength=N) == E // N).all() for layer in range(L))
    assert share == pytest.approx(_request_scores(A, e2r, N)[np.arange(Q), r2r].sum() / A.sum())
    # capped, the ranks are within the cap (not cap x cap) or at a local optimum of the swaps
    e2r, r2r, share = place_requests(A, tokens, N, seed=seed, restarts=2, iters=10, nodes=nodes, max_expert_load=1.1)
    np.testing.assert_array_equal(r2r // per, place_requests(A, tokens, nodes, seed=seed, restarts=2, iters=10,
                                                             max_expert_load=1.1)[1])
    _assert_capped_or_stuck(A, e2r, N, 1.1)


def test_token_votes_count_for_the_node_too():
    # 4 ranks on 2 nodes (0-1, 2-3); token 0 votes rank 1 (conf 1), token 1 rank 2 (conf 0.5)
    t2r = np.array([[[1, -1], [2, -1], [-1, -1]]], dtype=np.int16)
    conf = np.array([[1.0, 0.5, 0.0]])
    np.testing.assert_allclose(token_votes(t2r, conf, 4), [[0, 1, 0, 0], [0, 0, 0.5, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(token_votes(t2r, conf, 4, nodes=2, node_weight=0.5),
                               [[0.5, 1.5, 0, 0], [0, 0, 0.75, 0.25], [0, 0, 0, 0]])
    np.testing.assert_allclose(token_votes(t2r, conf, 4, engines=2, nodes=2), [[1, 0], [0, 0.5]] + [[0, 0]])
    with pytest.raises(ValueError, match="nodes 3 does not divide"):
        token_votes(t2r, conf, 4, nodes=3)
    # a full engine's request goes to its node's other engine, not to the least loaded one
    from vllm_smoe.serving.dp.router import RequestRouter

    flat = RequestRouter(t2r, conf.astype(np.float16), 4, 4, window=8)
    node = RequestRouter(t2r, conf.astype(np.float16), 4, 4, window=8, nodes=2)
    for r in (flat, node):
        r.routed(1, 10, "placement")  # engine 1 is full for one more (20 > max(1.1 x 5, 0 + 10))
    assert flat.choose([0], 10, [0, 0, 0, 0]) == -1  # no open engine scores: vLLM's least loaded
    assert node.choose([0], 10, [0, 0, 0, 0]) == 0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.integers(0, 2), st.integers(1, 20), st.integers(0, 30)),
                                   min_size=1, max_size=60))
def test_router_window_follows_requests_in_flight(window, calls):
    # the load is always the work of the last max(window, in flight) routed requests, however
    # the in-flight count moves between calls
    r = _router(num_engines=3, ep_size=3, window=window)
    history = []
    for engine, weight, in_flight in calls:
        r.choose([1], 5, [0, 0, 0], in_flight=in_flight)
        span = max(window, in_flight)
        want = np.bincount([e for e, _ in history[-span:]], weights=[w for _, w in history[-span:]], minlength=3)
        np.testing.assert_allclose(r.load, want)
        r.routed(engine, weight, "placement")
        history.append((engine, weight))
        want = np.bincount([e for e, _ in history[-span:]], weights=[w for _, w in history[-span:]], minlength=3)
        np.testing.assert_allclose(r.load, want)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4), st.integers(1, 30)),
                                    min_size=1, max_size=50))
def test_router_with_requests_in_flight_is_the_offline_rule(in_flight, requests):
    # what evaluate --mode dp --in-flight simulates: the server's router with that many in flight
    # (vLLM's balancer, for a request without a preference, stands in as the least loaded engine)
    r = _router(window=8)
    scores = np.array([r.scores(p) for p, _ in requests])
    weights = np.array([w for _, w in requests])
    online = []
    for prompt, w in requests:
        e = r.choose(prompt, float(w), [0, 0], in_flight=in_flight)
        e = int(np.argmin(r.load)) if e < 0 else e
        r.routed(e, float(w), "placement")
        online.append(e)
    assert online == assign_requests(scores, weights, 2, window=max(8, in_flight)).tolist()


def test_router_balances_over_what_is_in_flight():
    # 64 requests in flight, the last 8 of them on engine 1: over a window of 8 engine 1 is full,
    # over the 64 in flight (32 on each engine) it is open and the prompt keeps its engine
    r = _router(window=8)
    for i in range(64):
        r.routed(0 if i < 32 else 1, 10, "placement")
    assert r.choose([1], 10, [0, 0]) == 0
    assert r.choose([1], 10, [0, 0], in_flight=64) == 1
    assert r.choose([1], 10, [0, 0], in_flight=3) == 0  # back under the window: its 8 again


def test_router_waiting_mask_follows_vllms_per_client_count():
    # two front ends: vLLM adds 2 to an engine's waiting count per routed request until the next
    # snapshot; one request of slack is then 2, so a burst is not forced to alternate
    r = _router()
    assert r.choose([1], 10, [0, 2], client_count=2) == 1
    assert r.choose([1], 10, [0, 4], client_count=2) == 0


def test_router_prefers_its_rank_until_the_window_is_full():
    r = _router(window=4)
    assert r.choose([1, 3, 1], 10, [0, 0]) == 1
    assert r.choose([4, 5], 10, [0, 0]) == -1  # unseen prompt: vLLM decides
    assert r.choose([1, 3, 1], 10, [3, 0]) == 1
    assert r.choose([0], 10, [3, 0]) == 1  # engine 0 has queued work above its share: the open one
    assert r.choose([0], 10, [1, 0]) == 0  # one request of slack
    assert r.choose([0], 10, [3, 3]) == 0
    for _ in range(2):
        r.routed(1, 10, "placement")
    assert r.choose([1], 10, [0, 0]) == 0  # engine 1 is full in the window (20 of 30 > 1.1 x 15)
    r.routed(0, 10, "placement")
    assert r.choose([1], 10, [0, 0]) == 0  # 30 of 40 would still pass 1.1 x 20
    r.routed(0, 10, "placement")
    assert r.choose([1], 10, [0, 0]) == 1  # (20, 20): both open, the prompt's engine
    for _ in range(2):  # the window slides: the first two requests leave it
        r.routed(0, 10, "placement")
    np.testing.assert_array_equal(r.load, [40, 0])
    assert r.counts == {"placement": 6, "vllm": 0, "explicit": 0}
    assert r.per_engine.tolist() == [4, 2]


class _Request:
    def __init__(self, rid, ids, rank=None):
        self.request_id, self.prompt_token_ids, self.data_parallel_rank = rid, ids, rank
        self.sampling_params = types.SimpleNamespace(max_tokens=4)
        self.pooling_params = None


def _client(router):
    """The state vLLM's DPLBAsyncMPClient keeps, with smoe's router attached."""
    return types.SimpleNamespace(core_engines=[(0).to_bytes(2, "little"), (1).to_bytes(2, "little")],
                                 lb_engines=[[0, 0, 0.0], [0, 0, 0.0]], reqs_in_flight={}, engine_inflight=Counter(),
                                 client_count=1, eng_start_index=0, _smoe_router=router, vllm_config=None)


def test_wrapped_balancer_routes_by_placement_keeps_explicit_ranks_and_vllms_bookkeeping():
    pytest.importorskip("vllm")
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    from vllm_smoe.serving.dp.router import install

    install()
    route = DPLBAsyncMPClient.get_core_engine_for_request
    router = _router()
    c = _client(router)
    e1 = (1).to_bytes(2, "little")
    req = _Request("a", [1, 3, 1])
    assert route(c, req) == e1  # the placement's engine
    assert req.data_parallel_rank is None  # handed back as it came
    assert c.reqs_in_flight["a"] == e1 and c.engine_inflight[e1] == 1 and c.lb_engines[1][0] == 1
    # an explicit rank is the client's, even against the placement
    assert route(c, _Request("b", [1, 3], rank=0)) == (0).to_bytes(2, "little")
    # an unseen prompt: vLLM's least-loaded choice (engine 0 now carries 1 in flight, engine 1 one
    # in flight and one waiting: engine 0 has the lower score)
    assert route(c, _Request("c", [5, 6])) in c.core_engines
    assert router.counts == {"placement": 1, "vllm": 1, "explicit": 1}
    pooled = _Request("p", [1, 3, 1])
    pooled.pooling_params = types.SimpleNamespace(late_interaction_params=None)  # vLLM balances pooling: its choice
    route(c, pooled)
    assert router.counts == {"placement": 1, "vllm": 2, "explicit": 1}
    # a client whose config does not ask for routing keeps vLLM's behaviour
    plain = _client(None)
    assert route(plain, _Request("d", [1, 3, 1])) == (0).to_bytes(2, "little")


def test_route_endpoint_answers_and_refuses_bad_bodies():
    pytest.importorskip("vllm")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_smoe.serving.dp.router import preferred_rank
    from vllm_smoe.serving.endpoints import SmoeEndpoints

    app = FastAPI()
    SmoeEndpoints().attach_router(app)
    app.state.smoe_route = (DP2, 2, types.SimpleNamespace(encode=lambda s: [ord(ch) for ch in s]))
    c = TestClient(app)
    ids = list(range(100, 140))
    r = c.post("/smoe/route", json={"prompt_token_ids": ids})
    assert r.status_code == 200
    rank, scores = preferred_rank(DP2, ids, 2)
    assert r.json() == {"rank": rank, "scores": scores, "placement": DP2}
    assert c.post("/smoe/route", json={"prompt": "def f(x):"}).json()["scores"] == preferred_rank(
        DP2, [ord(ch) for ch in "def f(x):"], 2)[1]
    for bad in ({"prompt": 3}, {"prompt_token_ids": ["a"]}, [1, 2], {}, {"prompt_token_ids": [2**63]},
                {"prompt_token_ids": [-1]}):
        assert c.post("/smoe/route", json=bad).status_code == 400
    app.state.smoe_route = (DP2, 3, None)  # no tokenizer (--skip-tokenizer-init); 2 ranks over 3 engines
    assert c.post("/smoe/route", json={"prompt": "x"}).status_code == 400
    r = c.post("/smoe/route", json={"prompt_token_ids": ids})
    assert r.status_code == 409 and "not a multiple" in r.json()["detail"]
    app.state.smoe_route = (None, None, None)
    assert c.post("/smoe/route", json={"prompt_token_ids": ids}).status_code == 404


def test_smoe_routes_honour_vllms_api_key_and_size_caps():
    """With --api-key (or VLLM_API_KEY) smoe's routes answer 401 without it, as /v1 does (vLLM's own
    check); bodies over the cap are 413 before they are parsed; prompts over the model's length 400."""
    pytest.importorskip("vllm")
    import argparse

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_smoe.serving import endpoints
    from vllm_smoe.serving.place import swap as endpoints_swap

    app = FastAPI()
    endpoints.SmoeEndpoints().attach_router(app)
    app.state.smoe_route = (DP2, 2, None)
    app.state.smoe_live = endpoints_swap.LiveState(None, None, None, DP2)
    app.state.smoe_auth = endpoints._auth(argparse.Namespace(api_key=["SECRET", "OTHER"]))
    app.state.smoe_max_tokens = 64
    c = TestClient(app)
    ids = list(range(100, 140))
    for method, path, body in (("post", "/smoe/route", {"prompt_token_ids": ids}), ("get", "/smoe/placement", None),
                               ("post", "/smoe/placement", {"placement": DP2})):
        kw = {} if body is None else {"json": body}
        for headers in ({}, {"Authorization": "Bearer WRONG"}, {"Authorization": "Basic SECRET"}):
            r = getattr(c, method)(path, headers=headers, **kw)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, headers)
    ok = {"Authorization": "Bearer OTHER"}
    assert c.post("/smoe/route", json={"prompt_token_ids": ids}, headers=ok).status_code == 200
    assert c.get("/smoe/placement", headers=ok).json()["placement"] == DP2
    r = c.post("/smoe/route", json={"prompt_token_ids": list(range(65))}, headers=ok)
    assert r.status_code == 400 and "more than the model's 64" in r.json()["detail"]
    huge = b'{"prompt_token_ids": [' + b"1, " * 800_000 + b"1]}"
    assert c.post("/smoe/route", content=huge, headers=ok).status_code == 413
    deep = b"[" * 100_000 + b"]" * 100_000
    assert c.post("/smoe/route", content=deep, headers=ok).status_code in (400, 413)


def test_smoe_routes_take_the_key_from_vllm_api_key_too(monkeypatch):
    pytest.importorskip("vllm")
    import argparse

    from starlette.datastructures import Headers

    from vllm_smoe.serving import endpoints

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert endpoints._auth(argparse.Namespace(api_key=None)) is None  # no key: the routes are open, as /v1
    monkeypatch.setenv("VLLM_API_KEY", "ENVKEY")
    auth = endpoints._auth(argparse.Namespace(api_key=None))
    assert auth.verify_token(Headers({"Authorization": "Bearer ENVKEY"}))
    auth = endpoints._auth(argparse.Namespace(api_key=["CLI"]))  # --api-key wins, as in vLLM
    assert auth.verify_token(Headers({"Authorization": "Bearer CLI"}))
    assert not auth.verify_token(Headers({"Authorization": "Bearer ENVKEY"}))


def test_sparse_exchange_counts_served_rows_only():
    import torch

    from vllm_smoe.serving.exchange.sparse_a2a import SparseExchange

    owner = torch.tensor([0, 0, 1, 1])
    N, H = 2, 3
    ex = SparseExchange(0, N, owner, lambda x: torch.cat([x, torch.zeros_like(x)]),
                        lambda x: x.view(N, -1, x.shape[1]).sum(0))
    ids = torch.tensor([[0, 2], [1, 0], [3, 2]])
    x, w = torch.randn(3, H), torch.ones(3, 2)
    ex.dispatch(x, w, ids, served=torch.tensor([True, False, True]))
    ex.combine(torch.zeros(3 + 0, H))
    # rows 0 and 2 count: 2 tokens, 2 remote pairs, local activations 1 of 4
    c = ex.counters()
    assert c == {"tokens": 2, "pairs": 2, "bytes": 2 * (2 * H * 4 + 8 * 2), "local": 1, "activations": 4,
                 "node_bytes": 2 * (2 * H * 4 + 8 * 2)}  # each rank its own node by default
    ex.dispatch(x, w, ids, served=False)  # a dummy step: nothing counted
    ex.combine(torch.zeros(3, H))
    assert ex.counters() == c


def test_sequence_parallel_chunk_padding_is_not_counted():
    """One token at TP = 2: rank 1's chunk is a pad row every decode step (was counted)."""
    import types

    import torch

    from vllm_smoe.serving.exchange.sparse_a2a import served_rows

    def fc(T):
        return types.SimpleNamespace(attn_metadata=object(), is_padding=None,
                                     dp_metadata=types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([T])))

    assert served_rows(fc(1), 1, True, sp_rank=0) is True
    assert served_rows(fc(1), 1, True, sp_rank=1).tolist() == [False]
    assert served_rows(fc(5), 3, True, sp_rank=1).tolist() == [True, True, False]  # rows 3, 4 real, 5 padding
    assert served_rows(fc(6), 3, True, sp_rank=1) is True
    assert served_rows(types.SimpleNamespace(attn_metadata=None), 3, True) is False


def test_config_and_flag_for_dp_routing():
    import argparse

    from vllm_smoe.serving.config import SmoeConfig

    assert SmoeConfig.from_dict({}).dp_routing is True
    assert SmoeConfig.from_dict({"dp_routing": False}).dp_routing is False
    with pytest.raises(ValueError, match="field 'dp_routing' must be true or false, got 'no'"):
        SmoeConfig.from_dict({"dp_routing": "no"})
    from vllm_smoe.serving.plugin import _add_flags, _smoe_from_args

    p = argparse.ArgumentParser()
    _add_flags(p)
    assert _smoe_from_args(p.parse_args(["--plugin", "smoe", "--smoe-dp-routing", "off"])) == {"dp_routing": False}
    with pytest.raises(ValueError, match="--smoe-dp-routing given without --plugin smoe"):
        _smoe_from_args(p.parse_args(["--smoe-dp-routing", "on"]))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(0, 2**16))
def test_swap_for_bytes_with_fixed_requests_never_adds_rows(N, seed):
    import scipy.sparse as sp

    from vllm_smoe.placement.bytes import layer_instances, remote_bytes, swap_for_bytes

    rng = np.random.default_rng(seed)
    E, K, T, Q = 4 * N, 2, 200, 12
    req = rng.integers(0, Q, T)
    topk = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    A, _ = request_counts(req, topk[:, None, :], E)
    _, q = request_index(req)
    r2r = rng.integers(0, N, A.shape[0])
    start = rng.permutation(np.repeat(np.arange(N), E // N))
    inst = layer_instances(q, topk)
    out = swap_for_bytes(sp.csr_matrix(A[:, 0]), inst, r2r, N, start, max_expert_load=10.0, seed=seed)
    assert (np.bincount(out, minlength=N) == E // N).all()
    assert remote_bytes(inst[1], inst[2], inst[0], out.astype(np.int64), r2r) <= \
        remote_bytes(inst[1], inst[2], inst[0], start, r2r)
    again = swap_for_bytes(sp.csr_matrix(A[:, 0]), inst, r2r, N, start, max_expert_load=10.0, seed=seed)
    assert np.array_equal(out, again)


def test_swap_for_bytes_golden():
    """Two requests on ranks 0 and 1; request 0's tokens use experts {0, 2}, request 1's {1, 3}.
    Starting from experts 0, 1 on rank 0 and 2, 3 on rank 1, every token sends one row; swapping
    1 and 2 makes every token local."""
    import scipy.sparse as sp

    from vllm_smoe.placement.bytes import layer_instances, remote_bytes, swap_for_bytes

    req = np.array([0, 0, 1, 1])
    topk = np.array([[0, 2], [2, 0], [1, 3], [3, 1]])
    A, _ = request_counts(req, topk[:, None, :], 4)
    _, q = request_index(req)
    inst = layer_instances(q, topk)
    start = np.array([0, 0, 1, 1])
    r2r = np.array([0, 1])
    assert remote_bytes(inst[1], inst[2], inst[0], start, r2r) == 4
    out = swap_for_bytes(sp.csr_matrix(A[:, 0]), inst, r2r, 2, start, max_expert_load=2.0)
    assert out.tolist() == [0, 1, 0, 1]
    assert remote_bytes(inst[1], inst[2], inst[0], out.astype(np.int64), r2r) == 0


@pytest.mark.parametrize("groups,N,nodes", [(4, 2, 1), (4, 4, 1), (2, 4, 1), (8, 2, 1), (2, 8, 1), (4, 8, 1),
                                           (4, 8, 2), (4, 4, 2), (2, 8, 4), (8, 8, 2), (2, 4, 2)])
def test_place_requests_keeps_routing_groups_whole(groups, N, nodes):
    from vllm_smoe.placement.groups import broken_group, check_groups

    rng = np.random.default_rng(groups * 10 + N)
    Q, L, E = 30, 2, 16
    A = rng.random((Q, L, E)).astype(np.float32) ** 4
    check_groups(E, N, nodes, groups)
    e2r, r2r, share = place_requests(A, rng.integers(1, 9, Q), N, groups=groups, nodes=nodes, max_expert_load=1.1)
    for layer in range(L):
        assert broken_group(e2r[layer], groups) == -1
        assert (np.bincount(e2r[layer], minlength=N) == E // N).all()
    with pytest.raises(ValueError, match="cannot stay whole"):
        place_requests(A, np.ones(Q), 4, groups=3)
