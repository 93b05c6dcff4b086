"""The speculate MoE layer across gloo ranks (world 4) against a single-process MoE reference.

One layer as serving runs it (and the shuffled reduce-scatter before it, ``_shuffled_failures``): predicted token order (``device_predict``) -> vLLM's contiguous
sequence-parallel chunk -> router -> expert-parallel MoE (smoe's sparse exchange, or vLLM's
allgather-reducescatter, or its point-to-point transport) -> all-gather -> original order. Whatever the predictor says, every
rank must end with the reference output. A second run patches ``Tensor.item/.tolist/.cpu/
.numpy`` to raise around the token order and the static allgather-reducescatter path: nothing
there may read device values on the host. The reference MoE below is test-only math.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from vllm_smoe.placement.assign import assign_tokens
from vllm_smoe.placement.assign import chunk_caps as np_chunk_caps
from vllm_smoe.serving.speculate import device_predict
from vllm_smoe.serving.exchange.sparse_a2a import SparseExchange, owner_of, p2p_reduce_scatter
from vllm_smoe.serving.speculate.comm import chunk_rows, keep_chunk_residual, shuffled_reduce_scatter
from tests.support import CONFIGS, gloo_all_gather, gloo_reduce_scatter

H, I, E, K, V = 32, 16, 16, 3, 500
WORLD = 4


def _weights():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, H, generator=g), torch.randn(E, 2 * I, H, generator=g) * 0.2,
            torch.randn(E, H, I, generator=g) * 0.2)


def _route(x, router):
    w, ids = torch.softmax(x @ router.T, dim=-1).topk(K, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def _experts(x, w, ids, w13, w2, keep):
    """Weighted sum over the experts ``keep`` [E] bool says this rank holds (reference math,
    dense over experts so that it reads nothing on the host)."""
    out = torch.zeros_like(x)
    for e in range(E):
        coef = ((ids == e) * w).sum(dim=1, keepdim=True) * keep[e]
        gate, up = (x @ w13[e].T).chunk(2, dim=-1)
        out += coef * ((torch.nn.functional.silu(gate) * up) @ w2[e].T)
    return out


_gather, _reduce_scatter = gloo_all_gather, gloo_reduce_scatter


class _NoHostSync:
    names = ("item", "tolist", "cpu", "numpy")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.names}
        for n in self.names:
            setattr(torch.Tensor, n, lambda *a, _n=n, **k: (_ for _ in ()).throw(AssertionError(f"host sync: {_n}")))

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def _a2a(out, inp, out_splits, in_splits):
    dist.all_to_all_single(out, inp, out_splits, in_splits)


def _layer(rank, x, ids, predictor, exchange_kind, router, w13, w2, owner, exact=False, pad_bytes=1 << 30,
           node_of=None, mark_pad=False):
    T = x.shape[0]
    pref, conf = (device_predict.predict_random(ids, 0, WORLD) if predictor == "random" else
                  device_predict.predict_one_rank(ids) if predictor == "one-rank" else
                  (owner[_route(x, router)[1][:, :1]], torch.ones(T)))  # "oracle": the top-1's rank
    perm, inv = device_predict.permutation(device_predict.assign(pref, conf, device_predict.chunk_caps(T, WORLD)))
    xs = x.index_select(0, perm)
    c = -(-T // WORLD)
    chunk = torch.nn.functional.pad(xs, (0, 0, 0, c * WORLD - T))[rank * c:(rank + 1) * c]
    w, top = _route(chunk, router)
    keep = owner == rank
    if exchange_kind in ("sparse", "p2p", "hier"):
        ex = SparseExchange(rank, WORLD, owner, _gather, _reduce_scatter, exact,
                            all_to_all=None if exchange_kind == "sparse" else _a2a, pad_bytes=pad_bytes,
                            node_of=node_of, hierarchical=exchange_kind == "hier")
        # mark_pad: the chunk's pad rows (past T) marked unserved, as vLLM's chunks are served:
        # they must stay here (their output is dropped), and the counters must not see them
        served = torch.arange(c) + rank * c < T if mark_pad else True
        hs, ws, ids_ = ex.dispatch(chunk, w, top, served=served)
        sent = sum(ex._plan[3]) if exchange_kind == "p2p" else None  # rows this rank sent
        out = ex.combine(_experts(hs, ws, ids_, w13, w2, keep))
        if mark_pad and sent is not None and sent != int(ex.stats[1]):
            raise AssertionError(f"p2p sent {sent} rows for {int(ex.stats[1])} served pairs, T={T}")
        if exchange_kind == "hier":
            _check_hier_bytes(rank, ex, top[served] if mark_pad else top, owner, node_of, c, pad_bytes)
        if exchange_kind == "p2p":  # the counters say what crossed: row slots when padded, else the pairs
            pairs = int(ex.stats[1])
            W = H + 2 * K  # 4-byte words of a row with its ids and weights
            padded = (WORLD - 1) * c * (W + 1) * 4 + pairs * H * 4
            if int(ex.stats[2]) != (padded if c * (W + 1) * 4 <= pad_bytes else pairs * (2 * H * 4 + 8 * K)):
                raise AssertionError(f"p2p bytes {int(ex.stats[2])} with {pairs} pairs, c={c}, pad={pad_bytes}")
            if node_of is None and int(ex.stats[5]) != int(ex.stats[2]):  # every rank its own node
                raise AssertionError(f"p2p node bytes {int(ex.stats[5])} != bytes {int(ex.stats[2])}")
    else:  # vLLM's allgather-reducescatter with equal chunks: static shapes end to end
        hs, ws, ids_ = _gather(chunk), _gather(w), _gather(top)
        full = _experts(hs, ws, ids_, w13, w2, keep)
        dist.all_reduce(full)
        out = full[rank * c:(rank + 1) * c]
    return _gather(out)[:T].index_select(0, inv)


def _check_hier_bytes(rank, ex, top, owner, node_of, c, pad_bytes):
    """The hierarchical exchange's node bytes against a count of its own: one row out (with ids,
    weights and the mask word) and one partial row back per (token, other node holding one of its
    experts), or the slots' padding when the sizes ride along."""
    dest = owner[top]  # [c, K] rank of each activation
    far_nodes = sum(len({int(node_of[q]) for q in row.tolist() if node_of[q] != node_of[rank]}) for row in dest)
    W = H + 2 * K + 1
    if c * (W + 1) * 4 <= pad_bytes:  # a small step goes flat, in padded slots
        far_pairs = sum(len({int(q) for q in row.tolist() if node_of[q] != node_of[rank]}) for row in dest)
        want = int((node_of != node_of[rank]).sum()) * c * W * 4 + far_pairs * H * 4
    else:
        want = far_nodes * (W * 4 + H * 4)
    if int(ex.stats[5]) != want:
        raise AssertionError(f"hier node bytes {int(ex.stats[5])}, want {want} ({far_nodes} token-node pairs, c={c})")


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _block(x, w):  # any row-wise function stands in for the MoE block
    return torch.tanh(x @ w)


def _shuffled_failures(rank):
    """s-MoE's shuffled reduce-scatter on one Qwen3-MoE-style decoder step against the path it
    replaces (vLLM: attention partial sums all-reduced, added to the residual, normed, the MoE
    block on every row, its output added to the residual by the next layer). smoe: the partial
    sums reduce-scattered in the token order over :func:`p2p_reduce_scatter`, vLLM's add + norm,
    the chunk's residual kept, the block on the chunk only, the kept residual added before its
    all-gather. Every rank must end with the same residual stream. ``_block`` is any row-wise
    function (test-only math standing in for the MoE block)."""
    failures = []
    w = torch.randn(HS, HS, generator=torch.Generator().manual_seed(0))
    for T in (1, 2, 3, 5, 8, 37):
        c = -(-T // WORLD)
        g = torch.Generator().manual_seed(T)
        partials = torch.randn(WORLD, T, HS, generator=g)  # every rank's addend, known to all
        residual = torch.randn(T, HS, generator=g)
        perm = torch.randperm(T, generator=g)
        inv = torch.argsort(perm)
        # the reduce-scatter alone: each chunk summed in rank order, the input left as it was
        x = torch.randn(WORLD, WORLD * c, HS, generator=g)
        mine = x[rank].clone()
        got = p2p_reduce_scatter(mine, WORLD)
        if not torch.equal(mine, x[rank]) or not torch.allclose(got, x.sum(0)[rank * c:(rank + 1) * c], atol=1e-6):
            failures.append(f"p2p_reduce_scatter T={T}")
        # vLLM: all-reduce, add, norm, block on every row; the next layer adds the block's output
        r1 = partials.sum(0) + residual
        want = _block(_norm(r1), w) + r1
        kept = torch.full((c + 2, HS), float("nan"))  # larger than needed, stale: must not leak
        with _NoHostSync():
            out = shuffled_reduce_scatter(partials[rank], perm, rank, WORLD, lambda t: p2p_reduce_scatter(t, WORLD))
            res1 = out + residual
            x_rows, zero = keep_chunk_residual(_norm(res1), res1, perm, rank, WORLD, kept)
            start, stop = chunk_rows(T, rank, WORLD)
            chunk = torch.zeros(c, HS)
            chunk[: stop - start] = x_rows.index_select(0, perm[start:stop])  # the block's chunk only
            y = _block(chunk, w) + kept[:c]
            stream = _gather(y)[:T].index_select(0, inv) + zero
        if not torch.equal(zero, torch.zeros(T, HS)):
            failures.append(f"T={T}: residual passed on is not zero")
        if not torch.allclose(stream, want, atol=1e-5):
            failures.append(f"T={T}: {(stream - want).abs().max():.2e}")
        rows = perm[start:stop]
        others = torch.ones(T, dtype=torch.bool)
        others[rows] = False
        if not torch.allclose(out[rows], partials.sum(0)[rows], atol=1e-6) or out[others].any():
            failures.append(f"T={T}: reduce-scatter rows")
    return failures


HS = 6  # hidden size of the shuffled reduce-scatter's rows


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    router, w13, w2 = _weights()
    owner = torch.randperm(E, generator=torch.Generator().manual_seed(1)) % WORLD  # any placement
    failures = []
    for T in (1, 3, 8, 1000):
        g = torch.Generator().manual_seed(T)
        x, ids = torch.randn(T, H, generator=g), torch.randint(0, V, (T,), generator=g)
        w, top = _route(x, router)
        want = _experts(x, w, top, w13, w2, torch.ones(E, dtype=torch.bool))
        for predictor in ("random", "one-rank", "oracle"):
            for exact in (False, True):
                got = _layer(rank, x, ids, predictor, "sparse", router, w13, w2, owner, exact)
                if not torch.allclose(got, want, atol=1e-5):
                    failures.append(f"sparse T={T} {predictor} exact={exact}: {(got - want).abs().max():.2e}")
            for pad in (0, 1 << 30):  # sizes first (three all-to-alls), or riding in padded slots (two)
                got = _layer(rank, x, ids, predictor, "p2p", router, w13, w2, owner, pad_bytes=pad)
                if not torch.allclose(got, want, atol=1e-5):
                    failures.append(f"p2p T={T} {predictor} pad={pad}: {(got - want).abs().max():.2e}")
            # over nodes: two of two ranks, and one of one rank with one of three
            for node_of in (torch.tensor([0, 0, 1, 1]), torch.tensor([1, 0, 0, 0]), torch.tensor([0, 1, 0, 1])):
                for pad in (0, 1 << 30):
                    got = _layer(rank, x, ids, predictor, "hier", router, w13, w2, owner, pad_bytes=pad,
                                 node_of=node_of)
                    if not torch.allclose(got, want, atol=1e-5):
                        failures.append(f"hier T={T} {predictor} nodes={node_of.tolist()} pad={pad}: "
                                        f"{(got - want).abs().max():.2e}")
            # pad rows marked (T = 1, 3: whole chunks of padding): sent nowhere, counted nowhere
            if T < 8:
                for kind, pad in (("sparse", 0), ("p2p", 0), ("p2p", 1 << 30), ("hier", 0), ("hier", 1 << 30)):
                    got = _layer(rank, x, ids, predictor, kind, router, w13, w2, owner, pad_bytes=pad,
                                 node_of=torch.tensor([0, 0, 1, 1]), mark_pad=True)
                    if not torch.allclose(got, want, atol=1e-5):
                        failures.append(f"{kind} T={T} {predictor} pad={pad} pad rows marked: "
                                        f"{(got - want).abs().max():.2e}")
            # every expert on rank 0: ranks 1-3 receive nothing, rank 0 sends nothing
            for kind, pad in (("sparse", 0), ("p2p", 0), ("p2p", 1 << 30), ("hier", 0), ("hier", 1 << 30)):
                got = _layer(rank, x, ids, predictor, kind, router, w13, w2, torch.zeros(E, dtype=torch.long),
                             pad_bytes=pad, node_of=torch.tensor([0, 0, 1, 1]))
                if not torch.allclose(got, want, atol=1e-5):
                    failures.append(f"{kind} T={T} {predictor} pad={pad} all-on-0: {(got - want).abs().max():.2e}")
            with _NoHostSync():
                got = _layer(rank, x, ids, predictor, "agrs", router, w13, w2, owner)
            if not torch.allclose(got, want, atol=1e-5):
                failures.append(f"agrs T={T} {predictor}: {(got - want).abs().max():.2e}")
    failures += _shuffled_failures(rank)
    results[rank] = failures
    dist.destroy_process_group()


def test_speculate_layer_world4_equals_the_reference(gloo_spawn):
    assert gloo_spawn(_worker, WORLD) == {r: [] for r in range(WORLD)}


def test_owner_split_and_destinations():
    from vllm_smoe.serving.exchange.sparse_a2a import destinations

    assert owner_of(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert owner_of(10, 4).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]  # vLLM's uneven split
    with pytest.raises(ValueError, match="ep_size 5"):
        owner_of(4, 5)
    ids = torch.tensor([[0, 1], [2, 7], [1, 0]])  # rank 0 holds 0, 1: only token 1 leaves, to ranks 1 and 3
    assert destinations(ids, owner_of(8, 4), 0, 4).tolist() == [0, 0b1010, 0]


@pytest.mark.parametrize("seed", range(30))
def test_device_assignment_and_prediction_equal_numpy(seed):
    rng = np.random.default_rng(seed)
    T, N, P = int(rng.integers(1, 400)), int(rng.choice([2, 3, 4, 8])), int(rng.integers(1, 3))
    pref = rng.integers(-1, N, (T, P))
    conf = rng.choice([0.1, 0.5, 0.9, 0.3, 0.0], T).astype(np.float32)  # ties: stable order matters
    want = assign_tokens(pref, conf, np.zeros(T, np.int64), N, rank_caps=np_chunk_caps(T, N)[None])
    got = device_predict.assign(torch.from_numpy(pref), torch.from_numpy(conf), device_predict.chunk_caps(T, N)).numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.bincount(got, minlength=N), np_chunk_caps(T, N))
    if T % N == 0:  # the uniform chunk is capacity 1.0 of the offline assignment
        np.testing.assert_array_equal(got, assign_tokens(pref, conf, np.zeros(T, np.int64), N, 1.0))
    perm, inv = device_predict.permutation(torch.from_numpy(got))
    assert (torch.from_numpy(got)[perm].diff() >= 0).all() and (perm[inv] == torch.arange(T)).all()


def test_device_tables_prediction_equals_predict_layer():
    from vllm_smoe.placement.predict import predict_layer
    from vllm_smoe.formats.placement_file import load_placement, load_tables

    t = load_tables(load_placement(os.path.join(CONFIGS, "tiny-4dom-ep2.yaml")))
    rng = np.random.default_rng(0)
    ids, prev = rng.integers(0, t.token2rank.shape[1], 700), rng.integers(0, t.markov2rank.shape[1], 700)
    for layer in range(t.token2rank.shape[0]):
        pv = prev if layer else None
        pref, conf, _ = predict_layer(t, layer, ids, pv)
        arrays = [torch.from_numpy(np.ascontiguousarray(getattr(t, k)[layer])) for k in
                  ("token2rank", "token_conf", "markov2rank", "markov_conf", "prior2rank")]
        got = device_predict.predict_tables(*arrays, torch.from_numpy(ids), None if pv is None else torch.from_numpy(pv))
        np.testing.assert_array_equal(got[0].numpy(), pref)
        np.testing.assert_array_equal(got[1].numpy(), conf)
    # every layer at once from the token table: predict_layer without a previous layer
    arrays = [torch.from_numpy(getattr(t, k)) for k in ("token2rank", "token_conf", "prior2rank")]
    pref_all, conf_all = device_predict.predict_token_tables(*arrays, torch.from_numpy(ids))
    for layer in range(t.token2rank.shape[0]):
        pref, conf, _ = predict_layer(t, layer, ids, None)
        np.testing.assert_array_equal(pref_all[layer].numpy(), pref)
        np.testing.assert_array_equal(conf_all[layer].numpy(), conf)


def test_device_bigram_prediction_equals_predict_layer():
    """The fixture's tables hold a bigram table: rows continuing a pair in it take its ranks, on
    the device as in numpy, with the previous id taken from the step's positions alike."""
    from vllm_smoe.placement.predict import bigram_keys, predict_layer, previous_ids
    from vllm_smoe.formats.placement_file import load_placement, load_tables

    t = load_tables(load_placement(os.path.join(CONFIGS, "tiny-4dom-ep4.yaml")))
    assert t.has_bigrams
    V, L = t.token2rank.shape[1], t.token2rank.shape[0]
    rng = np.random.default_rng(1)
    # a prompt chunk made of known pairs, decode rows (position jumps), and random rows
    pairs = t.bigram_keys[rng.integers(0, t.bigram_keys.size, 40)]
    ids = np.concatenate([np.stack([pairs // V, pairs % V], 1).reshape(-1), rng.integers(0, V, 120)])
    pos = np.concatenate([np.arange(80), rng.integers(0, 500, 120)])
    keys = bigram_keys(previous_ids(ids, pos, np.zeros(ids.size, int)), ids, V)
    query = device_predict.bigram_query(torch.from_numpy(ids), torch.from_numpy(pos), V)
    np.testing.assert_array_equal(query.numpy(), keys)
    assert np.isin(keys, t.bigram_keys).sum() >= 40  # the pairs are looked up
    big = (torch.from_numpy(t.bigram_keys), torch.from_numpy(t.bigram2rank), torch.from_numpy(t.bigram_conf), query)
    arrays = [torch.from_numpy(getattr(t, k)) for k in ("token2rank", "token_conf", "prior2rank")]
    pref_all, conf_all = device_predict.predict_token_tables(*arrays, torch.from_numpy(ids), big)
    prev = rng.integers(0, t.markov2rank.shape[1], ids.size)
    changed = 0
    for layer in range(L):
        pref, conf, _ = predict_layer(t, layer, ids, None, keys=keys)
        np.testing.assert_array_equal(pref_all[layer].numpy(), pref)
        np.testing.assert_array_equal(conf_all[layer].numpy(), conf)
        changed += (pref[:, 0] != predict_layer(t, layer, ids, None)[0][:, 0]).sum()
        pv = prev if layer else None
        pref, conf, _ = predict_layer(t, layer, ids, pv, keys=keys)
        one = (big[0], big[1][layer: layer + 1], big[2][layer: layer + 1], query)
        got = device_predict.predict_tables(*[torch.from_numpy(np.ascontiguousarray(getattr(t, k)[layer])) for k in
                                  ("token2rank", "token_conf", "markov2rank", "markov_conf", "prior2rank")],
                                torch.from_numpy(ids), None if pv is None else torch.from_numpy(pv), one)
        np.testing.assert_array_equal(got[0].numpy(), pref)
        np.testing.assert_array_equal(got[1].numpy(), conf)
    assert changed > 0  # the bigram rows really differ from their tokens' rows somewhere


def test_bigram_table_golden():
    from vllm_smoe.placement.predict import bigram_keys, bigram_table, previous_ids

    # V = 4, 2 ranks: expert 0 on rank 0, expert 1 on rank 1, top-1, one layer. Token 3 follows
    # token 1 three times (expert 0) and token 2 twice (expert 1); token 0 after 1 once.
    ids = np.array([1, 3, 1, 3, 1, 3, 2, 3, 2, 3, 1, 0])
    pos = np.tile([0, 1], 6)
    ex = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]).reshape(12, 1, 1)
    holds = np.array([[[True, False], [False, True]]])
    t2r = np.array([[[1, 0], [0, 1], [1, 0], [0, 1]]], dtype=np.int16)  # token 3's own row says rank 0
    keys = bigram_keys(previous_ids(ids, pos, np.zeros(12, int)), ids, 4)
    np.testing.assert_array_equal(keys[:4], [-1, 1 * 4 + 3, -1, 7])
    bk, b2r, bconf = bigram_table(keys, ex, holds, t2r, max_pairs=10)
    # (1, 3) agrees with token 3's row: no gain, dropped; (2, 3) moves it to rank 1; (1, 0) seen once
    np.testing.assert_array_equal(bk, [2 * 4 + 3])
    np.testing.assert_array_equal(b2r[0, :, 0], [1])
    np.testing.assert_allclose(bconf.astype(float), [[1.0]])
    assert bigram_table(keys, ex, holds, t2r, max_pairs=0)[0].size == 0


def test_assignment_of_all_layers_at_once_equals_layer_by_layer():
    rng = np.random.default_rng(7)
    for T, N in [(1, 2), (5, 4), (64, 2), (333, 8)]:
        pref = torch.from_numpy(rng.integers(-1, N, (4, T, 2)))
        conf = torch.from_numpy(rng.choice([0.2, 0.7, 0.0], (4, T)).astype(np.float32))
        caps = device_predict.chunk_caps(T, N)
        both = device_predict.assign(pref, conf, caps)
        for layer in range(4):
            assert torch.equal(both[layer], device_predict.assign(pref[layer], conf[layer], caps))
        perm, inv = device_predict.permutation(both)
        assert torch.equal(perm.gather(1, inv), torch.arange(T).expand(4, T))


def test_vote_of_layers_golden():
    """Three layers, three ranks. Token 0: layers say 2, 2, 1 -> 2 then 1. Token 1: no layer has
    data (-1) -> no preference. Token 2: one confident layer for 0 beats two
    unsure ones for 1 (0.9 > 2 * 0.1). Token 3: a tie between 0 and 1 goes to the lower rank."""
    pref = torch.tensor([[[2, 0], [-1, -1], [0, -1], [0, -1]],
                         [[2, -1], [-1, -1], [1, -1], [1, -1]],
                         [[1, -1], [-1, -1], [1, -1], [2, -1]]])
    conf = torch.tensor([[0.5, 0.0, 0.9, 0.4], [0.5, 0.0, 0.1, 0.4], [0.5, 0.0, 0.1, 0.0]])
    best, c = device_predict.vote(pref, conf, 3)
    assert best[0].tolist() == [2, 1] and best[2].tolist() == [0, 1] and best[3].tolist() == [0, 1]
    assert best[1].tolist() == [-1, -1] and c[1] == 0  # no layer has data: no preference
    assert abs(c[0] - 2004 / 6006) < 1e-6  # rank 2 got 2 * 1002 of at most 3 * 2 * 1001
    assert torch.equal(device_predict.vote(pref, conf, 3)[0], best)  # same input, same order, on every rank
    one = device_predict.vote(torch.tensor([[[2, -1]], [[2, -1]]]), torch.tensor([[0.3], [0.8]]), 3)[0]
    assert one.tolist() == [[2, -1]]  # a rank nobody voted for is no second preference


@pytest.mark.parametrize("seed", [0, 1])
def test_vote_agrees_with_a_plain_count(seed):
    rng = np.random.default_rng(seed)
    L, T, N = 5, 200, 4
    pref = torch.from_numpy(rng.integers(0, N, (L, T, 1)))
    conf = torch.ones(L, T)
    best, _ = device_predict.vote(pref, conf, N)
    counts = np.stack([np.bincount(pref[:, t, 0].numpy(), minlength=N) for t in range(T)])
    np.testing.assert_array_equal(best[:, 0].numpy(), counts.argmax(1))  # argmax: first on ties


def test_prefer_ranks_golden():
    # ranks of each token's 4 experts over 3 ranks
    er = np.array([[2, 2, 0, 1], [1, 0, 0, 1], [2, 2, 2, 2]])
    from vllm_smoe.placement.predict import prefer_ranks

    pref, conf = prefer_ranks(er, 3)
    np.testing.assert_array_equal(pref, [[2, 0], [0, 1], [2, 0]])  # ties: lower rank first
    np.testing.assert_allclose(conf, [0.5, 0.5, 1.0])


@pytest.mark.parametrize("seed", range(10))
def test_device_prefer_ranks_equals_numpy(seed):
    from vllm_smoe.placement.predict import prefer_ranks

    rng = np.random.default_rng(seed)
    N, K, T = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(1, 300))
    er = rng.integers(0, N, size=(T, K))
    pref, conf = prefer_ranks(er, N)
    tp, tc = device_predict.prefer_ranks(torch.as_tensor(er), N)
    np.testing.assert_array_equal(tp.numpy(), pref)
    np.testing.assert_allclose(tc.numpy(), conf)


@pytest.mark.parametrize("seed", range(10))
def test_device_prefer_held_equals_numpy_with_copies(seed):
    """Router preferences counting replicas: device twin of known_preferences; without copies
    the same as prefer_ranks on the home ranks."""
    from vllm_smoe.placement.predict import known_preferences

    rng = np.random.default_rng(seed)
    N, K, T = int(rng.integers(2, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 300))
    E = N * int(rng.integers(K, K + 4))
    home = rng.permutation(np.repeat(np.arange(N), E // N))
    held = np.zeros((N, E), bool)
    held[home, np.arange(E)] = True
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    tp, tc = device_predict.prefer_held(torch.as_tensor(ids), torch.as_tensor(held))
    rp, rc = device_predict.prefer_ranks(torch.as_tensor(home[ids]), N)
    assert torch.equal(tp, rp) and torch.equal(tc, rc)
    held[rng.integers(0, N, E // 2), rng.integers(0, E, E // 2)] = True  # copies
    pref, conf = known_preferences(ids, held)
    tp, tc = device_predict.prefer_held(torch.as_tensor(ids), torch.as_tensor(held))
    np.testing.assert_array_equal(tp.numpy(), pref)
    np.testing.assert_allclose(tc.numpy(), conf)


def test_table_and_router_predictions_make_no_host_sync():
    """The step's prediction as the token order runs it (bigram query and override, token tables,
    Markov arbitration, the router predictor's rank preference, vote, assignment, permutation)
    reads nothing back to the host."""
    rng = np.random.default_rng(3)
    L, V, E, N, T, M = 3, 50, 8, 4, 37, 20
    t2r = torch.from_numpy(rng.integers(-1, N, (L, V, 2)).astype(np.int16))
    tconf = torch.from_numpy(rng.random((L, V)).astype(np.float32))
    prior = torch.from_numpy(rng.integers(0, N, (L, 2)).astype(np.int16))
    keys = torch.from_numpy(np.sort(rng.choice(V * V, M, replace=False)).astype(np.int64))
    b2r = torch.from_numpy(rng.integers(0, N, (L, M, 2)).astype(np.int16))
    bconf = torch.from_numpy(rng.random((L, M)).astype(np.float32))
    m2r = torch.from_numpy(rng.integers(-1, N, (E, 2)).astype(np.int16))
    mconf = torch.from_numpy(rng.random(E).astype(np.float32))
    ids, pos = torch.from_numpy(rng.integers(0, V, T)), torch.arange(T)
    topk, held = torch.from_numpy(rng.integers(0, E, (T, 4))), torch.from_numpy(rng.random((N, E)) < 0.4)
    with _NoHostSync():
        query = device_predict.bigram_query(ids, pos, V)
        pref, conf = device_predict.predict_token_tables(t2r, tconf, prior, ids, (keys, b2r, bconf, query))
        one, c1 = device_predict.predict_tables(t2r[1], tconf[1], m2r, mconf, prior[1], ids, ids % E,
                                    (keys, b2r[1:2], bconf[1:2], query))
        rp, rc = device_predict.prefer_ranks(torch.from_numpy(rng.integers(0, N, (T, 4))), N)
        hp, hc = device_predict.prefer_held(topk, held)
        vp, vc = device_predict.vote(pref, conf, N)
        for p, c in ((pref, conf), (one, c1), (rp, rc), (hp, hc), (vp, vc)):
            device_predict.permutation(device_predict.assign(p, c, device_predict.chunk_caps(T, N)))


def test_ep_rank2node_golden():
    from vllm_smoe.serving.exchange.topology import ep_rank2node

    assert ep_rank2node(1, 2, 1) == [0, 1]  # DP across two nodes, one rank each
    assert ep_rank2node(2, 2, 1) == [0, 0, 1, 1]  # TP inside a node, DP across nodes
    assert ep_rank2node(2, 2, 2) == [0, 0, 0, 0]  # one node
    assert ep_rank2node(4, 1, 1, nnodes_within_dp=2) == [0, 0, 1, 1]  # TP across two nodes
    assert ep_rank2node(2, 4, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ep_rank2node(2, 2, 0) == [0, 0, 0, 0]  # no local engines: no layout to split
    with pytest.raises(ValueError, match="tensor parallel 3 over 2 nodes"):
        ep_rank2node(3, 1, 1, nnodes_within_dp=2)


def test_hierarchical_only_where_nodes_hold_several_ranks():
    def hier(node_of):
        return SparseExchange(0, len(node_of), torch.zeros(8, dtype=torch.long), None, None, all_to_all=_a2a,
                              node_of=torch.tensor(node_of), hierarchical=True).hierarchical

    assert hier([0, 0, 1, 1]) and hier([0, 1, 1])
    assert not hier([0, 1, 2, 3]) and not hier([0, 0, 0, 0])
    assert not SparseExchange(0, 4, torch.zeros(8, dtype=torch.long), None, None,
                              node_of=torch.tensor([0, 0, 1, 1]), hierarchical=True).hierarchical  # no all_to_all


class _TopK:
    """A router's pure routing step: top-k of the logits, the token id's expert (id mod E) first,
    as a hash-routed layer reads the ids."""

    def __init__(self, k):
        self.k = k

    def _compute_routing(self, x, logits, _, input_ids=None):
        E = logits.shape[1]
        return torch.topk(logits.float() + 100.0 * torch.nn.functional.one_hot(input_ids % E, E), self.k, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,T", [(2, 1), (2, 7), (3, 2), (3, 13), (4, 3), (4, 17)])
def test_input_gate_columns_reach_every_rank_alike(dtype, N, T):
    """Predictor input-gate: each rank predicts the next layer's ranks for its own chunk rows and
    appends them as columns; after the block's all-gather (here: the ranks' outputs concatenated)
    and the restore, every rank holds the rows unchanged and the same predictions, equal to the
    gate run on every row, and assigns the same next order; no host read on the way."""
    import types

    from vllm_smoe.serving.speculate.gates import gate_ranks
    from vllm_smoe.serving.speculate.layout_block import ShuffledOrder
    from vllm_smoe.serving.speculate.predictors import InputGate
    from vllm_smoe.serving.speculate.token_order import TokenOrder

    torch.manual_seed(N * 100 + T)
    H, E, K, L, rows_max = 16, 8, 2, 2, 32
    norm, gate = torch.nn.RMSNorm(H, eps=1e-6).to(dtype), torch.nn.Linear(H, E, bias=False).to(dtype)
    holds = torch.rand(L, N, E) < 0.5
    stream = torch.randn(T, H).to(dtype)  # the next layer's input, in step order
    perm0 = torch.randperm(T)
    c = -(-T // N)

    def rank_state(r):
        s = types.SimpleNamespace(
            rows=T, rank=r, N=N, markov=False, gates=[(gate, _TopK(K))] * L, next_norm={1: norm}, holds=holds,
            ids=torch.arange(rows_max), kept=torch.zeros(c, H, dtype=dtype),
            perm=torch.zeros(L, rows_max, dtype=torch.long), inv=torch.zeros(L, rows_max, dtype=torch.long),
            next_pref=torch.full((rows_max, 2), -1), next_conf=torch.zeros(rows_max), step_pad=None)
        s.predictor = InputGate(s.gates, s.next_norm)
        s.perm[0, :T], s.inv[0, :T] = perm0, torch.argsort(perm0)
        for name in ("add_residual", "restore"):
            setattr(s, name, types.MethodType(getattr(ShuffledOrder, name), s))
        return s

    states = [rank_state(r) for r in range(N)]
    outs = []
    with torch.no_grad(), _NoHostSync():
        for r, s in enumerate(states):
            start, stop = chunk_rows(T, r, N)
            y = torch.zeros(c, H, dtype=dtype)  # the experts' output of the chunk; its kept residual is zero here
            y[: stop - start] = stream[perm0[start:stop]]
            outs.append(ShuffledOrder.add_residual_ahead(s, y, 0))
        gathered = torch.cat(outs)[:T]
        back = [TokenOrder.restore_ahead(s, gathered, 0) for s in states]
        orders = [device_predict.permutation(device_predict.assign(s.next_pref[:T][None], s.next_conf[:T][None], device_predict.chunk_caps(T, N)))[0]
                  for s in states]
    want_pref, want_conf = gate_ranks(norm, gate, _TopK(K), stream, holds[1], torch.arange(T))  # ids: the rows
    for s, rows, order in zip(states, back, orders):
        assert torch.equal(rows, stream)
        assert torch.equal(s.next_pref[:T], want_pref)
        torch.testing.assert_close(s.next_conf[:T], want_conf.to(dtype).float(), rtol=0, atol=0)
        assert torch.equal(order, orders[0])


class _SoftmaxTopK:
    """A router's pure routing step as Qwen3-MoE's: top-k of the softmax of the logits."""

    def __init__(self, k):
        self.k = k

    def _compute_routing(self, x, logits, _, input_ids=None):
        return torch.topk(logits.float().softmax(dim=1), self.k, dim=1)


class _BiasedSigmoidTopK(_SoftmaxTopK):
    """DeepSeek-V3's kind: sigmoid scores plus a correction bias, whose top-k depends on the scale."""

    def _compute_routing(self, x, logits, _, input_ids=None):
        bias = torch.linspace(-0.5, 0.5, logits.shape[1])
        return torch.topk(logits.float().sigmoid() + bias, self.k, dim=1)


def _exact_router_worker(rank, port, results):
    """Predictor router under the shuffled reduce-scatter on ``world`` gloo ranks: the gate's
    logits summed from each rank's partial rows and its share of the layer input's, then the
    capped assignment, against vLLM's order over the reduced rows (the gate on their norm)."""
    import types

    from vllm_smoe.serving.speculate.gates import exact_gate_scale
    from vllm_smoe.serving.speculate.layout_block import ShuffledOrder
    from vllm_smoe.serving.speculate.predictors import SummedRouter

    world = 3
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)

    def all_gather(x, dim):
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    class Recorded(_SoftmaxTopK):  # keeps the experts the order was built from
        def _compute_routing(self, x, logits, _, input_ids=None):
            self.last = super()._compute_routing(x, logits, _, input_ids)[1]
            return logits, self.last

    failures, full_orders = [], 0
    for dtype, T, big in [(d, T, 1.0) for d in (torch.float32, torch.bfloat16) for T in (2, 3, 7, 40)] + [
            (torch.float32, 40, 100.0)]:  # a residual stream of RMS ~100: a float32 softmax of the raw sum underflows
        g = torch.Generator().manual_seed(T)  # the same modules and rows on every rank
        H, E, K, L = 24, 10, 3, 2
        norm = torch.nn.RMSNorm(H, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(H, generator=g) * 2 - 0.5)  # signs and sizes of a trained norm
        gate = torch.nn.Linear(H, E, bias=False)
        with torch.no_grad():
            gate.weight.copy_(torch.randn(E, H, generator=g))
        norm, gate, router = norm.to(dtype), gate.to(dtype), Recorded(K)
        holds = torch.rand(L, world, E, generator=g) < 0.4
        x_in = (torch.randn(T, H, generator=g) * big).to(dtype)  # the layer's input, whole on every rank
        partials = (torch.randn(world, T, H, generator=g) * 0.5).to(dtype)  # o_proj's partial sums
        w, why = exact_gate_scale(norm, gate, router, H, dtype, "cpu")
        if w is None:
            failures.append(f"{dtype} refused: {why}")
            continue
        s = types.SimpleNamespace(
            rank=rank, N=world, rows=0, tp=types.SimpleNamespace(all_gather=all_gather),
            gates=[(gate, router)] * L, exact=[(None, w)] * L, holds=holds, ids=torch.arange(64),
            base=torch.randn(64, E), perm=torch.zeros(L, 64, dtype=torch.long),
            inv=torch.zeros(L, 64, dtype=torch.long))
        s.predictor = SummedRouter(s.gates, s.exact)
        normed = torch.randn(T, H).to(dtype)
        with torch.no_grad(), _NoHostSync():
            out = ShuffledOrder.note_layer_input(s, normed, x_in, 1)
            s.predictor.exact_order(s, partials[rank], 1)
        served = router.last.clone()
        if not torch.equal(out, normed) or out.data_ptr() == normed.data_ptr():
            failures.append(f"{dtype} T={T}: note_layer_input does not return a copy of the normed rows")
        perm = s.perm[1, :T].clone()
        every = all_gather(perm[None], 0)
        if not all(torch.equal(p, perm) for p in every):
            failures.append(f"{dtype} T={T}: ranks built different orders")
        if not torch.equal(s.inv[1, :T], torch.argsort(perm)):
            failures.append(f"{dtype} T={T}: inv is not perm's inverse")
        # vLLM's order: the gate on the norm of the reduced rows, in float64
        x = (x_in.double() + partials.double().sum(0))
        ref = torch.nn.functional.linear(norm.double()(x), gate.weight.double())
        top = torch.topk(ref, K + 1, dim=1).values
        clear = top[:, K - 1] - top[:, K] > 1e-3 * top.abs().amax(dim=1)  # no near-tie at the k-th
        want_ids = router._compute_routing(x, ref, None)[1]
        got_ids = torch.topk(torch.nn.functional.linear(x * w.double(), gate.weight.double()), K, dim=1).indices
        if not torch.equal(want_ids.sort(1).values, got_ids.sort(1).values):  # the identity itself
            failures.append(f"{dtype} T={T}: the scaled logits pick other experts")
        # the experts the order was built from, on every row without a near-tie at the k-th
        same = (served.sort(1).values == want_ids.sort(1).values).all(dim=1)
        if not bool(same[clear].all()):
            failures.append(f"{dtype} T={T} x{big}: {int((~same[clear]).sum())} of {int(clear.sum())} rows "
                            f"routed elsewhere")
        if dtype == torch.float32 and bool(clear.all()):
            full_orders += 1
            want = device_predict.permutation(device_predict.assign(*[a[None] for a in device_predict.prefer_held(want_ids, holds[1])],
                                            device_predict.chunk_caps(T, world)))[0][0]
            if not torch.equal(perm, want):
                failures.append(f"{dtype} T={T}: the order is not vLLM's exact one")
    if full_orders < 3:  # T = 2, 3 and 7 have no near-tie at these seeds (one row: test_one_row_steps...)
        failures.append(f"the whole order was compared on {full_orders} cases only")
    results[rank] = failures
    dist.destroy_process_group()


def test_router_logits_summed_before_the_reduce_give_the_exact_order(gloo_spawn):
    """Predictor router under the shuffled reduce-scatter: every rank builds the same order, and
    in fp32 (no near-tie at the k-th expert) the order of the experts vLLM's gate picks on the
    reduced rows; no host read on the way."""
    assert gloo_spawn(_exact_router_worker, 3) == {r: [] for r in range(3)}


def test_exact_gate_scale_refuses_what_a_sum_of_partial_logits_cannot_give():
    from vllm_smoe.serving.speculate.gates import exact_gate_scale

    H, E = 16, 8
    rms, gate = torch.nn.RMSNorm(H), torch.nn.Linear(H, E, bias=False)
    w, why = exact_gate_scale(rms, gate, _SoftmaxTopK(2), H, torch.float32, "cpu")
    assert w is not None and why == ""
    assert bool((w > 0).all()) and float(w.max() - w.min()) < 1e-6  # the norm's weight (ones), up to a factor
    wide = torch.nn.RMSNorm(H)  # widened losslessly: the new channels' weights are zero
    with torch.no_grad():
        wide.weight[H // 4:] = 0
    w, why = exact_gate_scale(wide, gate, _SoftmaxTopK(2), H, torch.float32, "cpu")
    assert why == "" and bool((w[H // 4:] == 0).all()) and bool((w[: H // 4] > 0).all())
    w, why = exact_gate_scale(torch.nn.LayerNorm(H), gate, _SoftmaxTopK(2), H, torch.float32, "cpu")
    assert w is None and "LayerNorm is not a per-row scale" in why
    w, why = exact_gate_scale(rms, torch.nn.Linear(H, E, bias=True), _SoftmaxTopK(2), H, torch.float32, "cpu")
    assert w is None and "Linear is not linear without bias" in why
    w, why = exact_gate_scale(rms, gate, _BiasedSigmoidTopK(2), H, torch.float32, "cpu")
    assert w is None and "_BiasedSigmoidTopK's experts change when the logits are scaled" in why


class _Decoder(torch.nn.Module):
    """A decoder layer shaped as vLLM's Qwen3-MoE one."""

    def __init__(self, H, post):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = torch.nn.RMSNorm(H), post

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return hidden_states, residual


class _OtherDecoder(_Decoder):
    def forward(self, positions, hidden_states, residual):  # the residual taken elsewhere
        return self.input_layernorm(hidden_states + residual), residual


def test_exact_router_seams_take_input_layernorm_or_say_why_not():
    from vllm_smoe.serving.speculate.seams import exact_router_seams

    H, E = 8, 4
    gate = torch.nn.Linear(H, E, bias=False)

    def model(*layers):
        m = torch.nn.Module()
        m.embed_tokens, m.norm, m.layers = torch.nn.Embedding(3, H), torch.nn.RMSNorm(H), torch.nn.ModuleList(layers)
        return m

    m = model(torch.nn.Identity(), _Decoder(H, torch.nn.RMSNorm(H)), _Decoder(H, torch.nn.RMSNorm(H)))
    seams, why = exact_router_seams(m, (1, 2), [(gate, _SoftmaxTopK(2))] * 2, H, torch.float32, "cpu")
    assert why == "" and [n for n, _ in seams] == [m.layers[1].input_layernorm, m.layers[2].input_layernorm]
    m = model(_Decoder(H, torch.nn.RMSNorm(H)), _Decoder(H, torch.nn.LayerNorm(H)))
    assert exact_router_seams(m, (0, 1), [(gate, _SoftmaxTopK(2))] * 2, H, torch.float32, "cpu") == (
        [], "LayerNorm is not a per-row scale times a per-channel weight, so the gate's logits cannot be summed "
            "from partial rows")
    seams, why = exact_router_seams(model(_OtherDecoder(H, torch.nn.RMSNorm(H))), (0,), [(gate, _SoftmaxTopK(2))],
                                    H, torch.float32, "cpu")
    assert seams == [] and "_OtherDecoder.forward does not take its input's residual stream" in why


@pytest.mark.parametrize("N,T,num_real", [(2, 1, 1), (2, 8, 3), (3, 7, 7), (4, 16, 5), (4, 3, 2),
                                         (2, 8, 8), (3, 5, 0)])  # vLLM's profile run: every row real; a capture: none
def test_vllm_pad_mask_follows_the_token_order(monkeypatch, N, T, num_real):
    """vLLM's routers mask chunk row j's experts when forward_context.is_padding[j] is set (the
    step's row j, right for vLLM's contiguous chunks); under the token order the block must see
    which of this rank's ordered chunk rows are pad rows (vLLM's, past num_real, wherever the order
    put them, or the chunk's own past T), else a real token the order put at a later chunk row
    would lose its experts' output. Read from the runner's own mask (vLLM routes every row of its
    profile run, none of a capture), which is left as vLLM wrote it and is back in the forward
    context after the restore."""
    import types

    pytest.importorskip("vllm")
    import vllm.forward_context as fc

    from vllm_smoe.serving.speculate.predictors import TokenTables
    from vllm_smoe.serving.speculate.token_order import TokenOrder

    c = -(-T // N)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(T * 10 + N))
    for rank in range(N):
        step = torch.zeros(T + 3, dtype=torch.bool)  # vLLM's step mask, as the runner wrote it
        step[num_real:] = True
        ctx = types.SimpleNamespace(is_padding=step)
        monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
        monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)
        s = types.SimpleNamespace(N=N, rank=rank, stack=False, step_order=False, markov=False, num_real=torch.tensor(0),
                                  order_row=lambda layer: layer, predictor=TokenTables(),
                                  perm=torch.zeros(2, T + 3, dtype=torch.long),
                                  inv=torch.zeros(2, T + 3, dtype=torch.long),
                                  chunk_pad=torch.zeros(c + 2, dtype=torch.bool), step_pad=None)
        s.perm[1, :T], s.inv[1, :T] = perm, torch.argsort(perm)
        with _NoHostSync():
            TokenOrder._mark_padding(s, 1, T)
        seen = ctx.is_padding[:c]  # what vLLM's router reads for the block's c rows
        for j in range(c):
            i = rank * c + j  # the row's place in the token order
            assert bool(seen[j]) == (i >= T or int(perm[i]) >= num_real), (rank, j)
        assert ctx.is_padding is not step and bool(step.eq(torch.arange(T + 3) >= num_real).all())
        TokenOrder.restore(s, torch.zeros(T, 4), 1)
        assert ctx.is_padding is step and s.step_pad is None


def test_stack_order_takes_only_stacks_that_split_rows_in_their_layers():
    """One order per step holds where the decoder layers split the rows (vLLM's DeepSeek-V2
    layer); a stack that splits the step itself before its layers (vLLM's CUDA DeepSeek-V3.2 /
    GLM-5 model) or a layer that does not reduce-scatter is refused, naming what it does."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2Model

    from vllm_smoe.serving.speculate.seams import stack_supported

    def layer(forward):
        cls = type("Layer", (torch.nn.Module,), {"forward": forward})
        m = cls()
        m.self_attn, m.mlp = torch.nn.Identity(), torch.nn.Identity()
        m.use_sequence_parallel_moe = True
        return m

    def model(stack_forward, layer_forward):
        stack = type("Stack", (torch.nn.Module,), {"forward": stack_forward})()
        stack.embed_tokens, stack.norm = torch.nn.Identity(), torch.nn.Identity()
        stack.layers = torch.nn.ModuleList([layer(layer_forward), layer(layer_forward)])
        outer = torch.nn.Module()
        outer.model = stack
        return outer

    assert stack_supported(model(DeepseekV2Model.forward, DeepseekV2DecoderLayer.forward), "B") == (True, "")

    def sharding(self, input_ids, positions):
        hidden_states = sp_shard(self.embed_tokens(input_ids))  # noqa: F821 (read, never run)
        return hidden_states

    ok, why = stack_supported(model(sharding, DeepseekV2DecoderLayer.forward), "B")
    assert not ok and "Stack.forward splits or norms the step's rows itself (sp_shard)" in why

    def plain(self, positions, hidden_states, residual):
        return self.mlp(self.self_attn(hidden_states)), residual

    ok, why = stack_supported(model(DeepseekV2Model.forward, plain), "B")
    assert not ok and "decoder layer 0 (Layer) does not reduce-scatter its rows" in why


def test_one_row_steps_make_no_collective_for_an_order():
    """A one-token step sits in rank 0's chunk whatever the order (single-stream decode): router
    under the shuffled reduce-scatter all-gathers no logits for it, and its order is the identity."""
    import types

    from vllm_smoe.serving.speculate.layout_block import ShuffledOrder
    from vllm_smoe.serving.speculate.predictors import SummedRouter
    from vllm_smoe.serving.speculate.token_order import TokenOrder

    def no_gather(*a, **k):
        raise AssertionError("all_gather for a one-row step")

    s = types.SimpleNamespace(exact=[(None, torch.ones(4))], ahead=False, per_layer=True, rank=0, N=2, rows=0,
                              perm=torch.full((2, 8), 5), inv=torch.full((2, 8), 5),
                              tp=types.SimpleNamespace(all_gather=no_gather, reduce_scatter=lambda x, d: x[:1]))
    s.predictor = SummedRouter([], s.exact)
    s._one_row = types.MethodType(TokenOrder._one_row, s)
    partial = torch.randn(1, 4)
    with _NoHostSync():
        out = ShuffledOrder.reduce_scatter(s, partial, 1)
    assert s.perm[1, 0] == 0 and s.inv[1, 0] == 0 and s.rows == 1 and torch.equal(out, partial)


def test_one_row_steps_broadcast_no_order_over_the_all_reduce():
    """Over vLLM's all-reduce, router and learned broadcast rank 0's assignment; a one-token step
    needs none: the identity, no gate, no broadcast."""
    import types

    from vllm_smoe.serving.speculate.predictors import Learned, Router
    from vllm_smoe.serving.speculate.token_order import TokenOrder

    def never(*a, **k):
        raise AssertionError("a collective or a gate for a one-row step")

    for predictor in (Router([(never, None)]), Learned()):
        s = types.SimpleNamespace(predictor=predictor, predicted_layers=lambda layer: [layer], N=2,
                                  broadcast=never, preferences=never, perm=torch.full((2, 8), 5),
                                  inv=torch.full((2, 8), 5), rows=0)
        s._one_row = types.MethodType(TokenOrder._one_row, s)
        with _NoHostSync():
            TokenOrder._predict(s, torch.randn(1, 4), 1)
        assert s.perm[1, 0] == 0 and s.inv[1, 0] == 0 and s.rows == 1
