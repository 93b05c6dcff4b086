"""Streamed routing counts: exact against in-memory counting, bounded memory, and the same
placement whatever the chunking, storage threshold or number of workers."""

import os

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_smoe.tools.parallel import fork_map
from vllm_smoe.tools.place import main
from vllm_smoe.placement.counts import count_matrix, layer_counts
from vllm_smoe.placement.layout import place_model
from vllm_smoe.placement.predict import build_predictor
from vllm_smoe.placement.metrics import holds_from_expert2rank
from vllm_smoe.placement.routing_counts import RoutingCounts
from vllm_smoe.testbed.synthetic import MoEShape, generate
from vllm_smoe.testbed import FIXTURE_TRACES
from vllm_smoe.formats.trace import read_traces
from tests.support import CONFIGS


def _random_trace(seed, T, L, E, K, V):
    rng = np.random.default_rng(seed)
    tok = (rng.zipf(1.3, T) % V).astype(np.int32)
    topk = np.argsort(rng.random((T, L, E)), axis=2)[:, :, :K].astype(np.int16)
    return tok, topk


def test_golden_counts():
    # token 5 twice routes to (0, 1) then (2, 0); token 2 once to (1, 2); layer 1 follows layer 0
    tok = np.array([5, 2, 5], np.int32)
    topk = np.array([[[0, 1], [2, 0]], [[1, 2], [0, 1]], [[0, 1], [2, 1]]], np.int16)  # [3, 2, 2]
    c = RoutingCounts(2, 3, 2, 8, dense_after=2)  # token 5 becomes dense within the chunk
    c.add(tok, topk)
    ids, occ = c.seen()
    np.testing.assert_array_equal(ids, [2, 5])
    np.testing.assert_array_equal(occ, [1, 2])
    np.testing.assert_array_equal(c.layer_matrix(0).toarray(), [[0, 1, 1], [2, 2, 0]])
    np.testing.assert_array_equal(c.layer_matrix(1).toarray(), [[1, 1, 0], [1, 1, 2]])
    # layer 1 transitions from layer 0's top-1: 0 -> {2, 0}, 1 -> {0, 1}, 0 -> {2, 1}
    np.testing.assert_array_equal(c.markov_matrix(1), [[1, 1, 2], [1, 1, 0], [0, 0, 0]])
    assert not c.markov_matrix(0).any()
    np.testing.assert_array_equal(c.expert_load(), [[2, 3, 1], [2, 2, 2]])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), chunk=st.integers(1, 97), dense_after=st.sampled_from([None, 1, 3, 10**9]),
       E=st.sampled_from([4, 9, 300]), plan=st.sampled_from([None, "exact", "short"]))
def test_streamed_counts_equal_in_memory_counts(seed, chunk, dense_after, E, plan):
    T, L, K, V = 211, 3, 3, 50
    tok, topk = _random_trace(seed, T, L, E, K, V)
    occurrences = None if plan is None else np.bincount(tok[: T if plan == "exact" else T // 3], minlength=V)
    c = RoutingCounts(L, E, K, V, dense_after=dense_after, occurrences=occurrences)
    for s in range(0, T, chunk):
        c.add(tok[s: s + chunk], topk[s: s + chunk])
    ids, occ = c.seen()
    for layer in range(L):
        ref_ids, A, ref_occ = layer_counts(tok, topk[:, layer], E)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(occ, ref_occ)
        got = c.layer_matrix(layer)
        assert got.has_canonical_format
        np.testing.assert_array_equal(got.indptr, A.indptr)
        np.testing.assert_array_equal(got.indices, A.indices)
        np.testing.assert_array_equal(got.data, A.data)
        if layer:
            P = count_matrix(np.repeat(topk[:, layer - 1, 0], K), topk[:, layer].reshape(-1), E, E)
            np.testing.assert_array_equal(c.markov_matrix(layer), P.toarray())
    assert c.num_tokens == T
    np.testing.assert_array_equal(c.expert_load(), [np.bincount(topk[:, x].reshape(-1), minlength=E) for x in range(L)])


def test_memory_is_bounded_by_vocabulary_not_tokens():
    """Counts of a trace that keeps growing stay under a bound set by V, L, E and K alone, and stop
    growing once every id has been seen often enough."""
    shape = MoEShape(num_layers=4, num_experts=16, top_k=2, vocab_size=2000, hidden_size=64)
    c = RoutingCounts(shape.num_layers, shape.num_experts, shape.top_k, shape.vocab_size)
    L, E, K, V = shape.num_layers, shape.num_experts, shape.top_k, shape.vocab_size
    # per id: occ, tier, dense_row; a row in each dense tier (x2: blocks grow by doubling); raw
    # rows until dense
    per_id = 17 + 2 * L * E * (1 + 2 + 4) + (c.dense_after - 1) * (L * K + 4)
    bound = V * per_id + c._markov.nbytes
    sizes = []
    for ch in generate(shape, 400_000, seed=1, chunk_tokens=20_000):
        c.add(ch["token_ids"], ch["topk_ids"])
        sizes.append(c.nbytes)
    assert c.num_tokens == 400_000 and max(sizes) <= bound, (max(sizes), bound)
    assert sizes[-1] < 1.2 * sizes[9], sizes  # twice the tokens of the first ten chunks, about the same bytes


def test_counters_move_up_before_they_could_overflow():
    """An id seen 70,000 times passes through the 8-, 16- and 32-bit tiers; counts stay exact."""
    rng = np.random.default_rng(0)
    T, E, K = 70_500, 4, 2
    tok = np.where(rng.random(T) < 0.995, 7, rng.integers(0, 9, T)).astype(np.int32)
    topk = np.where(rng.random((T, 1, 1)) < 0.9, np.array([[[0, 1]]]), np.array([[[2, 3]]])).astype(np.int16)
    c = RoutingCounts(1, E, K, 9, dense_after=2)
    for s in range(0, T, 7000):  # from 8-bit (< 256 occurrences) straight to 16-bit, then to 32-bit
        c.add(tok[s: s + 7000], topk[s: s + 7000])
    assert c.tier[7] == 2 and c.occ[7] > 65535
    _, A, _ = layer_counts(tok, topk[:, 0], E)
    np.testing.assert_array_equal(c.layer_matrix(0).toarray(), A.toarray())
    c1 = RoutingCounts(1, E, K, 9, dense_after=2)
    for s in range(0, T, 100):  # through every tier one step at a time
        c1.add(tok[s: s + 100], topk[s: s + 100])
    np.testing.assert_array_equal(c1.layer_matrix(0).toarray(), A.toarray())
    np.testing.assert_array_equal(c1.expert_load()[0], A.toarray().sum(axis=0))
    planned = RoutingCounts(1, E, K, 9, dense_after=2, occurrences=np.bincount(tok, minlength=9))
    assert planned.tier[7] == 2  # planned: straight into the 32-bit tier, rows sized exactly
    for s in range(0, T, 7000):
        planned.add(tok[s: s + 7000], topk[s: s + 7000])
    assert [b.shape[1] for b in planned._dense] == [int((planned.tier == t).sum()) for t in range(3)]
    np.testing.assert_array_equal(planned.layer_matrix(0).toarray(), A.toarray())


def test_counts_refuse_bad_chunks():
    c = RoutingCounts(2, 4, 2, 10)
    with pytest.raises(ValueError, match="shape"):
        c.add(np.zeros(3, np.int32), np.zeros((3, 2, 3), np.int16))
    with pytest.raises(ValueError, match="vocab_size"):
        c.add(np.full(3, 10, np.int32), np.zeros((3, 2, 2), np.int16))
    with pytest.raises(ValueError, match="num_experts"):
        c.add(np.zeros(3, np.int32), np.full((3, 2, 2), 4, np.int16))
    with pytest.raises(ValueError, match="top_k"):
        RoutingCounts(2, 4, 5, 10)


def test_build_predictor_streams_like_the_trace():
    meta, arr, _ = read_traces([FIXTURE_TRACES["train"]])
    tok, topk = arr["token_ids"], arr["topk_ids"]
    E, N = meta.num_experts, 4
    c = RoutingCounts(meta.num_layers, E, meta.top_k, meta.vocab_size)
    for s in range(0, tok.size, 5000):
        c.add(tok[s: s + 5000], topk[s: s + 5000])
    e2r, _, tables = place_model("coclust", c, N, vocab_size=meta.vocab_size)
    whole = RoutingCounts.from_arrays(tok, topk, E, meta.vocab_size, dense_after=10**9)  # raw rows only
    np.testing.assert_array_equal(place_model("coclust", whole, N)[0], e2r)
    ref = build_predictor(tok, topk, holds_from_expert2rank(e2r, N), meta.vocab_size)
    for k, v in ref.arrays().items():
        np.testing.assert_array_equal(v, tables.arrays()[k], err_msg=k)


def _parked():
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"smoe-{os.getpid()}-")] if os.path.isdir("/dev/shm") else []


def test_fork_map_keeps_order_and_closures():
    big = np.arange(10)
    assert list(fork_map(lambda i: int(big[i] * 2), range(10), 2)) == [2 * i for i in range(10)]
    assert list(fork_map(lambda i: i, [], 2)) == []
    # large arrays come back through shared-memory files, equal and in order
    out = list(fork_map(lambda i: (i, np.full((300, 1000), i, np.float64)), range(5), 2))
    assert [o[0] for o in out] == list(range(5)) and all((o[1] == i).all() for i, o in enumerate(out))
    assert not _parked()


def test_fork_map_fails_cleanly():
    def boom(i):
        if i == 3:
            raise ValueError("layer 3 is bad")
        return np.zeros((400, 1000))

    with pytest.raises(ValueError, match="layer 3"):
        list(fork_map(boom, range(8), 2))
    g = fork_map(lambda i: np.zeros((400, 1000)), range(8), 2)
    next(g)
    g.close()  # the consumer stops early: results already parked are removed
    assert not _parked()

    def die(i):
        if i == 1:
            os._exit(9)  # as the OOM killer would
        return i

    with pytest.raises(ChildProcessError, match="worker process died"):
        list(fork_map(die, range(4), 2))


def test_jobs_and_rotated_files_give_the_same_placement(tmp_path):
    """One trace file, the same rows split into rotated files, serial or over workers: one placement."""
    tr = FIXTURE_TRACES["train"]
    out = {}
    for name, args in (("serial", ["--trace", tr, "--jobs", "1"]), ("jobs", ["--trace", tr, "--jobs", "2"])):
        p = tmp_path / name / "p.yaml"
        assert main(["build", *args, "--ep-size", "4", "-o", str(p)]) == 0
        doc = yaml.safe_load(open(p))
        out[name] = (doc["layers"], dict(np.load(p.parent / doc["predictor"])))
    assert out["serial"][0] == out["jobs"][0]
    for k, v in out["serial"][1].items():
        np.testing.assert_array_equal(v, out["jobs"][1][k], err_msg=k)


def test_synth_rotated_files_read_as_one_recording(tmp_path):
    from vllm_smoe.testbed.synthetic import write_synthetic

    one = write_synthetic(str(tmp_path / "one.npz"), "mixtral-8x7b", 5000, seed=3)
    many = write_synthetic(str(tmp_path / "many"), "mixtral-8x7b", 5000, seed=3, file_tokens=1300)
    assert sorted(os.listdir(many)) == [f"trace-0000{i}.npz" for i in range(4)]
    _, a, _ = read_traces([one])
    _, b, _ = read_traces([many])
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    pa, pb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert main(["build", "--trace", one, "--ep-size", "4", "--jobs", "1", "-o", str(pa)]) == 0
    assert main(["build", "--trace", many, "--ep-size", "4", "--jobs", "2", "-o", str(pb)]) == 0
    assert yaml.safe_load(open(pa))["layers"] == yaml.safe_load(open(pb))["layers"]
    with pytest.raises(ValueError, match="already holds trace files"):
        write_synthetic(many, "mixtral-8x7b", 100, seed=3, file_tokens=50)


@pytest.mark.parametrize("ep", [2, 8])
def test_rebuild_reproduces_the_committed_placements(tmp_path, ep):
    """configs/tiny-4dom-ep*.yaml were built by the in-memory code before streaming: the streamed,
    parallel build of the same trace, model and defaults gives the same experts and tables (when
    the algorithm changes on purpose, rebuild the configs with it)."""
    from vllm_smoe.testbed import FIXTURE_MODEL

    ref = os.path.join(CONFIGS, f"tiny-4dom-ep{ep}.yaml")
    out = tmp_path / "p.yaml"
    assert main(["build", "--trace", FIXTURE_TRACES["train"], "--ep-size", str(ep), "--model", FIXTURE_MODEL,
                 "--jobs", "2", "-o", str(out)]) == 0
    a, b = yaml.safe_load(open(ref)), yaml.safe_load(open(out))
    assert a["layers"] == b["layers"]
    ta, tb = np.load(os.path.join(os.path.dirname(ref), a["predictor"])), np.load(tmp_path / b["predictor"])
    for k in ta.files:
        np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
