import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.placement.stats import interlayer_precision, token_hotness
from vllm_smoe.testbed.synthetic import SHAPES, MoEShape, _limit_groups, generate, write_synthetic
from vllm_smoe.formats.trace import open_trace


def _collect(shape, n, **kw):
    chunks = list(generate(shape, n, **kw))
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


@pytest.mark.parametrize("name", list(SHAPES))
def test_production_shapes_write_valid_traces(tmp_path, name):
    s = SHAPES[name]
    p = write_synthetic(str(tmp_path / "s.npz"), name, 700, seed=3, chunk_tokens=256)
    t = open_trace(p, validate=True)
    assert t.num_tokens == 700
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k, t.meta.vocab_size) == (
        s.num_layers, s.num_experts, s.top_k, s.vocab_size)
    topk = t["topk_ids"]
    assert topk.shape == (700, s.num_layers, s.top_k) and topk.dtype == np.int16
    srt = np.sort(topk, axis=2)
    assert (srt[:, :, 1:] != srt[:, :, :-1]).all(), "expert ids repeat inside a token's top-k"


def test_production_shape_numbers():
    def lekt(name):
        s = SHAPES[name]
        return s.num_layers, s.num_experts, s.top_k, s.vocab_size

    assert lekt("deepseek-v3") == (58, 256, 8, 129280)
    assert lekt("qwen3-235b-a22b")[:3] == (94, 128, 8)
    assert lekt("deepseek-v2-lite")[:3] == (26, 64, 6)
    assert lekt("mixtral-8x7b")[:3] == (32, 8, 2)


def test_same_seed_same_trace_and_chunking_irrelevant_to_metadata():
    shape = MoEShape(3, 16, 4, 500, 64)
    a = _collect(shape, 1000, seed=7)
    b = _collect(shape, 1000, seed=7)
    c = _collect(shape, 1000, seed=8)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["topk_ids"], c["topk_ids"])
    # requests are contiguous runs with positions counting up from 0
    starts = np.flatnonzero(np.r_[True, np.diff(a["request_ids"]) != 0])
    assert (a["positions"][starts] == 0).all()


def test_hotness_knob_controls_conjugacy():
    shape = MoEShape(2, 64, 4, 2000, 64)
    hot = _collect(shape, 20000, seed=0, hotness=0.95)
    cold = _collect(shape, 20000, seed=0, hotness=0.2)
    h_hot = token_hotness(hot["token_ids"], hot["topk_ids"])
    h_cold = token_hotness(cold["token_ids"], cold["topk_ids"])
    assert h_hot[0] > 0.9 and h_cold[0] < 0.7 and h_hot[0] > h_cold[0] + 0.2


def test_affinity_knob_controls_interlayer_predictability():
    shape = MoEShape(3, 32, 2, 1000, 64)
    chained = _collect(shape, 5000, seed=1, hotness=0.0, affinity=1.0)
    markov, _ = interlayer_precision(chained["topk_ids"], 32)
    assert (markov > 0.95).all()  # only dedup repairs break the successor chain
    free = _collect(shape, 5000, seed=1, hotness=0.0, affinity=0.0)
    assert (interlayer_precision(free["topk_ids"], 32)[0] < 0.6).all()


def test_bad_knobs():
    with pytest.raises(ValueError, match="hotness"):
        next(generate(MoEShape(1, 4, 2, 10, 32), 10, hotness=1.5))
    with pytest.raises(ValueError, match="unknown shape"):
        write_synthetic("/tmp/x.npz", "gpt-9", 10)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), shape=st.sampled_from([(32, 4, 4, 2), (64, 6, 8, 3), (16, 8, 4, 2), (8, 2, 4, 1)]))
def test_group_limited_rows_stay_in_topk_group_groups(seed, shape):
    """Every row distinct, inside at most topk_group groups, and rows already inside their
    groups are left as they were."""
    E, K, G, M = shape
    rng = np.random.default_rng(seed)
    x = np.stack([rng.choice(E, K, replace=False) for _ in range(300)]).astype(np.int64)
    y = _limit_groups(x.copy(), E, G, M)
    assert ((np.diff(np.sort(y, -1), axis=-1)) != 0).all()
    used = [np.unique(row // (E // G)).size for row in y]
    assert max(used) <= M
    inside = np.array([np.unique(row // (E // G)).size <= M for row in x])
    np.testing.assert_array_equal(y[inside], x[inside])


def test_group_limited_generator_golden_errors():
    with pytest.raises(ValueError, match="must hold top_k"):
        next(generate(SHAPES["mixtral-8x7b"], 10, groups=8, topk_group=1))
    with pytest.raises(ValueError, match="go together"):
        next(generate(SHAPES["deepseek-v3"], 10, groups=8))
    # groups of 2: {0}, {5}, {2}, {7} are groups 0, 2, 1, 3, one expert each; the first two
    # columns win, 2 and 7 move into groups 0 and 2 and step along them until distinct
    assert _limit_groups(np.array([[0, 5, 2, 7]]), 8, 4, 2).tolist() == [[0, 5, 1, 4]]


def test_synth_first_layers_only(tmp_path):
    """num_layers keeps a shape's first MoE layers (projections that would not fit at all 58)."""
    import pytest

    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.testbed.synthetic import write_synthetic

    path = str(tmp_path / "t.npz")
    write_synthetic(path, "deepseek-v3", 2048, seed=0, num_layers=2)
    t = open_trace(path)
    assert t.meta.num_layers == 2 and t["topk_ids"].shape == (2048, 2, 8)
    with pytest.raises(ValueError, match="--layers 59"):
        write_synthetic(str(tmp_path / "u.npz"), "deepseek-v3", 64, num_layers=59)
