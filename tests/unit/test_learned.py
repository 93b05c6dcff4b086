"""The learned predictor (placement/learned.py): what tables cannot learn, its device twin in
the served token order, its place in the tables file, smoe-place build --learned."""

import dataclasses
import os
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.placement import learned as lp
from vllm_smoe.placement.metrics import holds_from_expert2rank
from vllm_smoe.serving.speculate import device_predict

V, L, N, E, K = 12, 2, 2, 4, 2
E2R = np.array([[0, 0, 1, 1]] * L)  # experts 0, 1 on rank 0; 2, 3 on rank 1, both layers


def _context_trace(reps=300):
    """Token 3 follows token 1 with experts {0, 1} and token 2 with experts {2, 3}; tokens 1, 2
    start their sequences with experts on their own side. The token id alone says nothing of 3."""
    tok, prev, topk = [], [], []
    for _ in range(reps):
        for first, experts in ((1, (0, 1)), (2, (2, 3))):
            tok += [first, 3]
            prev += [-1, first]
            topk += [[experts] * L, [experts] * L]
    return np.array(tok), np.array(prev), np.array(topk)


def test_the_previous_token_decides_where_tables_cannot():
    tok, prev, topk = _context_trace()
    holds = holds_from_expert2rank(E2R, N)
    targets = lp.layer_targets(topk, holds)
    assert targets.shape == (tok.size, L, N) and np.allclose(targets.sum(axis=2), 1)
    model = lp.train_predictor(tok, prev, targets, V, width=16, epochs=20, batch=64, lr=1e-2)
    pref, conf = lp.preferences(lp.forward(model, np.array([3, 3, 1, 2]), np.array([1, 2, -1, -1])), N)
    assert pref.shape == (L, 4, 2) and conf.shape == (L, 4)
    np.testing.assert_array_equal(pref[:, :, 0], [[0, 1, 0, 1]] * L)
    assert (conf > 0.9).all()
    # what a token table holds for id 3: half its rows each way, so at best half of them right
    from vllm_smoe.placement.predict import build_predictor

    t = build_predictor(tok, topk, holds, V)
    assert t.token_conf[:, 3].astype(np.float32).max() <= 0.5 + 1e-3
    step, sconf = lp.step_preferences(lp.forward(model, np.array([3, 3]), np.array([1, 2])), N)
    np.testing.assert_array_equal(step[:, 0], [0, 1])
    assert (sconf > 0.9).all()


def test_without_embeddings_unseen_ids_share_one_preference():
    tok, prev, topk = _context_trace(50)
    model = lp.train_predictor(tok, prev, lp.layer_targets(topk, holds_from_expert2rank(E2R, N)), V, width=8,
                               epochs=2, batch=32)
    assert not model.token_proj[[0, 4, 11]].any() and not model.prev_proj[[0, 4, 11]].any()
    z = lp.forward(model, np.array([0, 4, 11]), np.array([-1, -1, -1]))
    assert (z == z[0]).all()


def test_training_is_deterministic_and_seeded():
    tok, prev, topk = _context_trace(40)
    y = lp.layer_targets(topk, holds_from_expert2rank(E2R, N))
    emb = np.random.default_rng(1).normal(size=(V + 3, 5))  # more rows than the vocabulary: the first V used
    a, b = (lp.train_predictor(tok, prev, y, V, emb, width=8, epochs=2, batch=16) for _ in range(2))
    c = lp.train_predictor(tok, prev, y, V, emb, width=8, epochs=2, batch=16, seed=1)
    for k in lp.LEARNED_FIELDS:
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    assert not np.array_equal(a.out_weight, c.out_weight)
    assert a.token_proj.shape == (V, 8) and a.prev_proj.shape == (V + 1, 8) and a.out_weight.shape == (8, L * N)
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        lp.train_predictor(tok, prev, y, V, emb[:5])
    with pytest.raises(ValueError, match="width must be in"):
        lp.train_predictor(tok, prev, y, V, width=lp.MAX_WIDTH + 1)
    with pytest.raises(ValueError, match="no tokens"):
        lp.train_predictor(tok[:0], prev[:0], y[:0], V)


def _random_model(rng, V, D, L, N):
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return lp.LearnedPredictor(f(V, D).astype(np.float16), f(V + 1, D).astype(np.float16), f(D), f(D, L * N),
                               f(L * N))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(1, 9), st.integers(1, 5), st.sampled_from([1, 2, 3, 8]), st.integers(0, 99))
def test_device_twin_gives_the_offline_ranks(T, D, L_, N_, seed):
    """The served ops (device_predict) against the numpy forward: the same ranks wherever two
    ranks' scores are not within float rounding of each other, the same confidences."""
    rng = np.random.default_rng(seed)
    Vr = 30
    m = _random_model(rng, Vr, D, L_, N_)
    ids, prev = rng.integers(0, Vr, T), rng.integers(-1, Vr, T)
    z = lp.forward(m, ids, prev)
    zt = device_predict.learned_logits(*(torch.from_numpy(getattr(m, k)) for k in lp.LEARNED_FIELDS), torch.from_numpy(ids),
                           torch.from_numpy(prev))
    np.testing.assert_allclose(zt.numpy(), z, rtol=1e-5, atol=1e-5)
    pref, conf = lp.preferences(z, N_)
    tp, tc = device_predict.learned_layers(zt, N_)
    zz = z.reshape(T, L_, N_).transpose(1, 0, 2)
    top2 = np.sort(zz, axis=2)[..., ::-1]
    clear = (top2[..., 0] - top2[..., 1] > 1e-4) if N_ > 1 else np.ones((L_, T), bool)
    np.testing.assert_array_equal(tp.numpy()[..., 0][clear], pref[..., 0][clear])
    if N_ > 2:  # the second preference too, where the second and third scores are apart
        clear2 = clear & (top2[..., 1] - top2[..., 2] > 1e-4)
        np.testing.assert_array_equal(tp.numpy()[..., 1][clear2], pref[..., 1][clear2])
    np.testing.assert_allclose(tc.numpy(), conf, rtol=1e-5, atol=1e-6)
    assert pref.shape == (L_, T, min(2, N_)) and ((pref >= 0) & (pref < N_)).all()
    assert ((conf >= 1.0 / N_ - 1e-6) & (conf <= 1.0 + 1e-6)).all()
    if N_ > 1:
        assert (pref[..., 0] != pref[..., 1]).all()
    sp_, sc = lp.step_preferences(z, N_)
    tsp, tsc = device_predict.learned_step(zt, N_)
    p = np.exp(zz - zz.max(axis=2, keepdims=True))
    score = np.sort((p / p.sum(axis=2, keepdims=True)).sum(axis=0), axis=1)[:, ::-1]
    sclear = score[:, 0] - score[:, 1] > 1e-4 if N_ > 1 else np.ones(T, bool)
    np.testing.assert_array_equal(tsp.numpy()[:, 0][sclear], sp_[:, 0][sclear])
    np.testing.assert_allclose(tsc.numpy(), sc, rtol=1e-5, atol=1e-6)
    assert ((sc >= 1.0 / N_ - 1e-6) & (sc <= 1.0 + 1e-6)).all()


def test_served_order_predicts_as_offline_per_layer_and_per_step():
    """TokenOrder's own preference path (the step's ids and previous ids as _step_ids sets them
    from input_ids and positions) against the offline forward on the same rows."""
    from vllm_smoe.placement.predict import previous_ids
    from vllm_smoe.serving.speculate.layout_block import BlockOrder
    from vllm_smoe.serving.speculate.layout_stack import StackStepOrder
    from vllm_smoe.serving.speculate.predictors import Learned

    rng = np.random.default_rng(3)
    m = _random_model(rng, 40, 6, 3, 4)
    T = 50
    ids = rng.integers(0, 40, T)
    positions = np.concatenate([np.arange(20), np.arange(7, 37)])  # two sequences: row 20 starts one
    t2r = rng.integers(-1, 4, (3, 40, 2)).astype(np.int16)  # token tables: -1 = unseen id
    tconf = np.where(t2r[..., 0] >= 0, rng.uniform(0.2, 1.0, (3, 40)), 0).astype(np.float16)
    prior = rng.integers(0, 4, (3, 2)).astype(np.int16)
    from vllm_smoe.placement.predict import empty_tables
    from vllm_smoe.serving.location import device_tables

    t = dataclasses.replace(empty_tables(3, 40, 8), token2rank=t2r, token_conf=tconf, prior2rank=prior,
                            **m.arrays())
    tables = device_tables(t, "cpu", learned=True)  # as the worker holds them
    assert tables["learned_token_proj"].dtype == torch.float16 and tables["learned_out_weight"].dtype == torch.float32
    prev = previous_ids(ids, positions, np.zeros(T, np.int64))
    assert prev[0] == -1 and prev[20] == -1 and prev[21] == ids[20]
    tab_pref = np.where(t2r[:, ids, :1] >= 0, t2r[:, ids], prior[:, None, :])
    tab_conf = tconf[:, ids].astype(np.float32)
    pref, conf = lp.with_tables(tab_pref, tab_conf, *lp.preferences(lp.forward(m, ids, prev), 4))
    assert 0 < (tab_conf > lp.preferences(lp.forward(m, ids, prev), 4)[1]).mean() < 1  # both sources used
    spref, sconf = lp.step_preferences(lp.forward(m, ids, prev), 4)
    for stack in (False, True):  # one order per step (the DeepSeek family's stack_order step) or per layer
        layout = StackStepOrder if stack else BlockOrder
        o = layout.__new__(layout)
        o.__dict__.update(ids=torch.zeros(64, dtype=torch.long), query=torch.zeros(64, dtype=torch.long),
                          prev=torch.zeros(64, dtype=torch.long), bigrams=False, tables=tables,
                          predictor=Learned(), N=4)
        o._step_ids(None, (), {"input_ids": torch.from_numpy(ids), "positions": torch.from_numpy(positions)})
        np.testing.assert_array_equal(o.prev[:T].numpy(), prev)
        got_p, got_c = o.preferences([0, 1, 2], o.ids[:T])
        if stack:
            np.testing.assert_array_equal(got_p[0].numpy(), spref)
            np.testing.assert_allclose(got_c[0].numpy(), sconf, rtol=1e-5)
        else:
            np.testing.assert_array_equal(got_p.numpy(), pref)
            np.testing.assert_allclose(got_c.numpy(), conf, rtol=1e-5)


def _placement_with_learned(directory, model):
    """A placement of the context trace in ``directory``, its tables with ``model`` (or none)."""
    from vllm_smoe.formats.placement_file import write_placement
    from vllm_smoe.placement.predict import build_predictor

    directory.mkdir(parents=True, exist_ok=True)
    tok, prev, topk = _context_trace(20)
    t = build_predictor(tok, topk, holds_from_expert2rank(E2R, N), V)
    arrays = {**t.arrays(), **({} if model is None else model.arrays())}
    path = str(directory / "p.yaml")
    write_placement(path, expert2rank=E2R, ep_size=N, nodes=1, top_k=K, vocab_size=V, method="coclust",
                    capacity=1.1, tables=arrays)
    return path, arrays


def test_tables_file_carries_the_learned_predictor_and_refuses_a_broken_one(tmp_path):
    from vllm_smoe.formats.placement_file import _npz_bytes, load_placement, load_tables

    rng = np.random.default_rng(0)
    m = _random_model(rng, V, 4, L, N)
    path, arrays = _placement_with_learned(tmp_path, m)
    got = load_tables(load_placement(path)).learned
    for k in lp.LEARNED_FIELDS:
        np.testing.assert_array_equal(getattr(got, k), getattr(m, k))
    plain, _ = _placement_with_learned(tmp_path / "plain", None)
    assert load_tables(load_placement(plain)).learned is None
    p = load_placement(path)
    for change, words in [({"learned_out_bias": None}, "lack ['learned_out_bias']"),
                          ({"learned_out_weight": np.zeros((4, 3), np.float32)}, "'learned_out_weight' has shape"),
                          ({"learned_prev_proj": np.full((V + 1, 4), np.nan, np.float16)}, "finite float16"),
                          ({"learned_prev_proj": np.zeros((V, 4), np.float16)}, "expected (13, 4)"),
                          ({"learned_token_proj": np.zeros((V, 4), np.float32)}, "float16 values, got float32"),
                          ({"learned_hidden_bias": np.zeros(4, np.int32)}, "finite float32 values, got int32"),
                          ({k: np.zeros((V + (k == "learned_prev_proj"), lp.MAX_WIDTH + 1), np.float16)
                            for k in ("learned_token_proj", "learned_prev_proj")}, "a width D in 1..256")]:
        bad = {k: v for k, v in {**arrays, **change}.items() if v is not None}
        with pytest.raises(ValueError, match=re.escape(words)):
            load_tables(p.__class__(**{**p.__dict__, "predictor_sha256": None}),
                        _npz_bytes(expert2rank=E2R.astype(np.int32), **bad))


def test_simulate_runs_the_learned_predictor_and_refuses_tables_without_one(tmp_path):
    from vllm_smoe.formats.placement_file import load_placement, load_tables
    from vllm_smoe.placement.online import simulate

    tok, prev, topk = _context_trace(30)
    holds = holds_from_expert2rank(E2R, N)
    m = lp.train_predictor(tok, prev, lp.layer_targets(topk, holds), V, width=16, epochs=20, batch=64, lr=1e-2)
    path, _ = _placement_with_learned(tmp_path, m)
    t = load_tables(load_placement(path))
    positions = np.tile([0, 1], tok.size // 2)
    batch = np.arange(tok.size) // 8
    t2r, src = simulate(t, holds, tok, topk, batch, N, capacity=1.0, predictor="learned", positions=positions)
    home = E2R[0][topk[:, 0, 0]]
    assert (t2r[:, 0] == home).mean() > 0.95
    assert (src[tok == 3] == 5).all()  # SOURCES.index("learned"): the tables are unsure of token 3 only
    tab, _ = simulate(t, holds, tok, topk, batch, N, capacity=1.0, predictor="tables", positions=positions)
    assert (tab[:, 0] == home).mean() < 0.8
    plain, _ = _placement_with_learned(tmp_path / "plain", None)
    with pytest.raises(ValueError, match="no learned predictor"):
        simulate(load_tables(load_placement(plain)), holds, tok, topk, batch, N, predictor="learned")


def test_place_build_learned_and_its_refusals(tmp_path, capsys):
    from vllm_smoe.formats.placement_file import load_placement, load_tables
    from vllm_smoe.tools.place import main as place
    from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES

    out = str(tmp_path / "p.yaml")
    base = ["build", "--trace", FIXTURE_TRACES["heldout"], "--ep-size", "2", "--metrics-tokens", "4096",
            "--jobs", "1", "-o", out]
    assert place(base + ["--predictor", "learned"]) == 2
    assert "only --learned trains" in capsys.readouterr().err
    assert place(base + ["--method", "linear", "--learned"]) == 2
    assert "--learned: trained for the token order of a locality placement" in capsys.readouterr().err
    assert place(base) == 0
    assert place(["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", out, "--predictor", "learned",
                  "--max-tokens", "4096"]) == 2
    assert "holds no learned predictor" in capsys.readouterr().err
    assert place(base + ["--learned", "--learned-width", "8", "--model", FIXTURE_MODEL]) == 0
    m = load_tables(load_placement(out)).learned
    assert m is not None and m.width == 8 and m.out_weight.shape == (8, 4 * 2) and m.token_proj.dtype == np.float16
    js = str(tmp_path / "e.json")
    assert place(["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", out, "--predictor", "learned",
                  "--max-tokens", "4096", "--json", js]) == 0
    import json

    lar = next(iter(json.load(open(js)).values()))["lar"]
    assert 0.5 < lar <= 1.0  # two ranks: better than the 0.5 a random order keeps
    capsys.readouterr()
    assert place(["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", out, "--predictor", "learned",
                  "--compare", "linear"]) == 2
    assert "--predictor learned with --compare" in capsys.readouterr().err
    assert os.path.exists(out)


def test_a_step_without_rows_predicts_nothing():
    rng = np.random.default_rng(0)
    m = _random_model(rng, 10, 4, 3, 2)
    z = lp.forward(m, np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert z.shape == (0, 6)
    assert lp.preferences(z, 2)[0].shape == (3, 0, 2) and lp.step_preferences(z, 2)[0].shape == (0, 2)
    zt = torch.from_numpy(z)
    assert device_predict.learned_layers(zt, 2)[0].shape == (3, 0, 2) and device_predict.learned_step(zt, 2)[0].shape == (0, 2)
