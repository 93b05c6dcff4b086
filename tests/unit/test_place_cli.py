import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from vllm_smoe.tools.place import main
from vllm_smoe.formats.placement_file import load_placement, load_tables, write_placement
from vllm_smoe.testbed.synthetic import write_synthetic
from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES

TRAIN, HELDOUT = FIXTURE_TRACES["train"], FIXTURE_TRACES["heldout"]
KEYS = ("lar", "token_load", "expert_load", "remote_pairs_per_token", "remote_unique_per_token",
        "a2a_bytes_per_token", "hit_rate", "solve_seconds")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("place")
    out = d / "p4.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "--model", FIXTURE_MODEL, "-o", str(out)]) == 0
    return out


def test_build_writes_schema_and_tables(built):
    doc = yaml.safe_load(open(built))
    assert doc["smoe_placement"] == 1 and doc["ep_size"] == 4 and doc["method"] == "coclust"
    assert doc["model"]["num_layers"] == 4 and doc["model"]["num_experts"] == 32 and doc["model"]["fingerprint"]
    assert len(doc["layers"]) == 4 and all(len(x["expert_to_rank"]) == 32 for x in doc["layers"])
    assert os.path.basename(doc["predictor"]) == doc["predictor"]  # relative, beside the YAML
    p = load_placement(str(built))
    assert (np.bincount(p.expert2rank[0], minlength=4) == 8).all()
    t = load_tables(p)
    assert t.token2rank.shape == (4, 4096, 2)
    assert not [f for f in os.listdir(built.parent) if ".tmp" in f]


def test_evaluate_compare_all_beats_plain_ep(built, tmp_path):
    js = tmp_path / "eval.json"
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--compare", "all",
                 "--json", str(js)]) == 0
    res = json.load(open(js))
    for name, m in res.items():
        for k in KEYS:
            assert k in m, (name, k)
    ours = res["placement (coclust)"]
    assert {"linear", "round_robin", "metis+pred", "ceo+pred", "alternating+pred", "coclust+pred"} <= set(res)
    # held-out, trained on the train split: locality must clearly beat every placement-only peer
    for peer in ("linear", "round_robin", "eplb", "metis+pred"):
        if peer in res:
            assert ours["lar"] > res[peer]["lar"] + 0.02, (peer, ours["lar"], res[peer]["lar"])
    assert ours["lar"] > 1.5 * res["linear"]["lar"]
    # every placement in both forms: the predictor alone lifts a plain placement, and the
    # placement adds locality beyond it (same predictor and assignment for both)
    for peer in ("linear", "round_robin", "eplb", "metis", "ceo", "alternating", "coclust", "bytes"):
        if peer in res:
            assert res[peer + "+pred"]["lar"] > res[peer]["lar"] + 0.05, peer
    assert res["coclust+pred"]["lar"] > res["linear+pred"]["lar"] + 0.03
    # the bytes objective sends no more rows than coclust, at the same expert-load cap
    assert res["bytes+pred"]["remote_unique_per_token"] <= res["coclust+pred"]["remote_unique_per_token"]
    assert res["bytes+pred"]["expert_load"] < 1.2
    assert ours["token_load"] <= 1.11  # cap is ceil(512 / 4 * 1.10) = 141 of 128 tokens = 1.1016
    # the printed recommendation is in the JSON too: exactly one served form, with its reason
    chosen = [k for k, m in res.items() if m.get("recommended")]
    assert len(chosen) == 1 and (chosen[0].startswith("placement") or chosen[0].endswith("+pred")), chosen
    assert res[chosen[0]]["recommended_why"] and "recommended" not in res["linear"]


def test_report_draws_pngs_and_html(built, tmp_path):
    out = tmp_path / "rep"
    assert main(["report", "--trace", HELDOUT, "--placement", str(built), "--compare", "linear",
                 "-o", str(out)]) == 0
    for f in ("index.html", "lar_per_layer.png", "rank_loads.png", "coactivation.png", "results.json"):
        assert (out / f).stat().st_size > 0
    assert "lar_per_layer.png" in (out / "index.html").read_text()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "vllm_smoe.tools.place", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args, words", [
    (["build", "--trace", TRAIN, "--ep-size", "33"], "--ep-size 33 must be in 1..32 (the trace's experts)"),
    (["build", "--trace", TRAIN, "--ep-size", "3", "--replicas", "3"], "32 experts (vLLM's uneven split): not "
                                                                        "supported with --replicas 3 yet"),
    (["build", "--trace", TRAIN, "--ep-size", "3", "--mode", "dp"], "not supported with --mode dp yet"),
    (["build", "--trace", TRAIN, "--ep-size", "6", "--method", "eplb"], "not supported with --method eplb yet"),
    (["build", "--trace", TRAIN, "--ep-size", "4", "--method", "magic"], "invalid choice"),
    (["build", "--trace", "/nonexistent/x.npz", "--ep-size", "4"], "no trace files"),
    (["build", "--trace", TRAIN, "--ep-size", "4", "--nodes", "3"], "nodes 3"),
    (["build", "--trace", TRAIN, "--ep-size", "4", "--nodes", "3", "--mode", "dp"], "--nodes 3 does not divide --ep-size 4"),
    (["build", "--trace", TRAIN, "--ep-size", "4", "--method", "linear", "--replicas", "4"], "--replicas"),
    (["build", "--trace", TRAIN, "--ep-size", "2", "--mode", "dp", "--method", "auto"],
     "--mode dp: --method not supported"),
])
def test_build_errors_exit_2_and_write_nothing(tmp_path, args, words):
    out = tmp_path / "x.yaml"
    r = _cli(*args, "-o", str(out))
    assert r.returncode == 2, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_evaluate_rejects_trace_of_another_model(built, tmp_path):
    other = write_synthetic(str(tmp_path / "mix.npz"), "mixtral-8x7b", 100)
    r = _cli("evaluate", "--trace", other, "--placement", str(built))
    assert r.returncode == 2 and "num_layers" in r.stderr and "Traceback" not in r.stderr


def _doc(**over):
    d = {"smoe_placement": 1, "model": {"num_layers": 1, "num_experts": 4, "top_k": 2}, "ep_size": 2,
         "layers": [{"expert_to_rank": [0, 1, 0, 1]}]}
    d.update(over)
    return d


@pytest.mark.parametrize("doc, field", [
    ("{not: [yaml", "malformed YAML"),
    (_doc(smoe_placement=2), "'smoe_placement'"),
    (_doc(model={"num_layers": 1, "num_experts": 4}), "'top_k'"),
    (_doc(layers=[{"expert_to_rank": [0, 1, 0]}]), "layers[0].expert_to_rank"),
    (_doc(layers=[{"expert_to_rank": [0, 1, 0, 2]}]), "outside [0, ep_size=2)"),
    (_doc(layers=[{"expert_to_rank": [0, 0, 0, 1]}]), "rank 0 holds 3 experts"),
    (_doc(layers=[]), "'layers'"),
    (_doc(ep_size=3), "rank 1 holds 2 experts, it must hold 1 (vLLM's split of 4 over 3: 2 on rank 0, 1 on"),
    (_doc(ep_size=5), "'ep_size' = 5 must be in 1..model.num_experts (4)"),
    (_doc(predictor="missing.npz"), "'predictor'"),
    (_doc(layers=[{"expert_to_rank": [0, 1, 0, 1], "replicas": [[9, 0]]}]), "replicas"),
])
def test_placement_file_errors_name_the_field(tmp_path, doc, field):
    p = tmp_path / "bad.yaml"
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    with pytest.raises(ValueError) as e:
        load_placement(str(p))
    assert str(p) in str(e.value) and field in str(e.value), str(e.value)


def test_missing_placement_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_placement(str(tmp_path / "nope.yaml"))


def test_write_then_load_round_trip_with_replicas(tmp_path):
    e2r = np.array([[0, 1, 0, 1], [1, 0, 1, 0]], dtype=np.int32)
    reps = np.array([[[1, 0], [0, 1]], [[-1, -1], [-1, -1]]], dtype=np.int32)
    path = write_placement(str(tmp_path / "sub" / "p.yaml"), expert2rank=e2r, ep_size=2, nodes=1, top_k=2,
                           vocab_size=10, method="coclust", capacity=1.1, tables=None, replicas=reps)
    p = load_placement(path)
    np.testing.assert_array_equal(p.expert2rank, e2r)
    h = p.holds()
    assert h[0, 0, 1] and h[0, 1, 0] and h[0, 0, 0]  # home + replica copies
    assert h.sum() == 8 + 2


def test_evaluate_attention_dp_mode(built, tmp_path):
    js = tmp_path / "dp.json"
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--compare", "linear",
                 "--mode", "dp", "--json", str(js)]) == 0
    res = json.load(open(js))
    ours, lin = res["placement (coclust)"], res["linear"]
    assert ours["lar"] > lin["lar"]  # requests scheduled by affinity beat round robin
    assert ours["token_load"] <= 1.2 and lin["token_load"] == 1.0  # 64-request windows, capacity 1.10
    # the lock-step cost at decode, for each placement (at least 1: the busiest rank over the mean)
    assert ours["step_imbalance"] >= 1.0 and lin["step_imbalance"] >= 1.0
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--compare", "linear",
                 "--mode", "dp", "--decode-concurrency", "1", "--json", str(js)]) == 0
    one = json.load(open(js))["linear"]["step_imbalance"]
    assert one > lin["step_imbalance"]  # a lone request's experts fall less evenly than eight requests'
    r = _cli("evaluate", "--trace", HELDOUT, "--placement", str(built), "--decode-concurrency", "8")
    assert r.returncode == 2 and "only with --mode dp" in r.stderr
    r = _cli("evaluate", "--trace", HELDOUT, "--placement", str(built), "--in-flight", "256")
    assert r.returncode == 2 and "--in-flight" in r.stderr and "only with --mode dp" in r.stderr
    # more requests in flight: the same balance over more of them leaves more where they belong
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--mode", "dp", "--shuffle-requests", "0",
                 "--in-flight", "256", "--json", str(js)]) == 0
    wide = json.load(open(js))["placement (coclust)"]
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--mode", "dp", "--shuffle-requests", "0",
                 "--json", str(js)]) == 0
    narrow = json.load(open(js))["placement (coclust)"]
    assert wide["lar"] > narrow["lar"] and wide["token_load"] <= 1.10 + 0.02
    # fewer in flight than the router's 64: routed and judged over its 64, as with the default
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--mode", "dp", "--shuffle-requests", "0",
                 "--in-flight", "4", "--json", str(js)]) == 0
    few = json.load(open(js))["placement (coclust)"]
    assert (few["lar"], few["token_load"]) == (narrow["lar"], narrow["token_load"])


def test_dp_placement_over_nodes_and_evaluate_nodes(built, tmp_path, capsys):
    # --mode dp --nodes 2: nodes first; evaluate --nodes splits any placement's bytes by node
    out = tmp_path / "dpn.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "--mode", "dp", "--nodes", "2", "--model",
                 FIXTURE_MODEL, "-o", str(out)]) == 0
    assert "inter-node" in capsys.readouterr().out and load_placement(str(out)).nodes == 2
    res = {}
    for name, path in (("dp", out), ("tp", built)):
        js = tmp_path / f"{name}.json"
        assert main(["evaluate", "--trace", HELDOUT, "--placement", str(path), "--mode", "dp", "--nodes", "2",
                     "--json", str(js)]) == 0
        res[name] = next(iter(json.load(open(js)).values()))
    for m in res.values():  # the flat placement split as if it ran on two nodes too
        assert m["internode_bytes_per_token"] + m["intranode_bytes_per_token"] == pytest.approx(m["a2a_bytes_per_token"])
        R = np.array(m["rank2rank_rows"])  # which DP rank's rows go where
        assert R.shape == (4, 4) and (np.diag(R) == 0).all() and R.sum() == pytest.approx(m["remote_unique_per_token"])
    r = _cli("evaluate", "--trace", HELDOUT, "--placement", str(built), "--nodes", "3")
    assert r.returncode == 2 and "--nodes 3 does not divide the ep_size 4" in r.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_build_reads_embeddings_of_sharded_half_precision_checkpoints(tmp_path, dtype):
    """Real checkpoints ship bf16 and sharded: the embedding is read from the shard the index
    names, rows converted exactly as torch converts them."""
    import json as _json
    import shutil

    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from vllm_smoe.formats.checkpoint import read_embeddings as _embeddings

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(os.path.join(FIXTURE_MODEL, "config.json"), model / "config.json")
    weights = load_file(os.path.join(FIXTURE_MODEL, "model.safetensors"))
    emb_key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    half = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in weights.items()}
    first = {k: v for i, (k, v) in enumerate(sorted(half.items())) if k != emb_key and i % 2 == 0}
    second = {k: v for k, v in half.items() if k not in first}
    save_file(first, str(model / "model-00001-of-00002.safetensors"))
    save_file(second, str(model / "model-00002-of-00002.safetensors"))
    (model / "model.safetensors.index.json").write_text(_json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in first},
        **{k: "model-00002-of-00002.safetensors" for k in second}}}))
    got = _embeddings(str(model), 1000)
    want = half[emb_key][:1000].float().numpy()
    np.testing.assert_array_equal(got, want)
    out = tmp_path / "p.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "--model", str(model), "-o", str(out)]) == 0


def _pair(tmp_path, name, ep):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    assert main(["build", "--trace", TRAIN, "--ep-size", str(ep), "-o", str(out / "p.yaml"),
                 "--metrics-tokens", "4096"]) == 0
    return out / "p.yaml"


def test_an_interrupted_build_leaves_the_old_pair_and_a_mixed_pair_is_refused(tmp_path, monkeypatch):
    import shutil

    import vllm_smoe.formats.placement_file as pf

    p2 = _pair(tmp_path, "a", 2)
    old_tables = load_placement(str(p2)).predictor
    real = pf._atomic_write

    def fail_on_yaml(path, data):  # the build dies between its two writes
        if path.endswith(".yaml"):
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(pf, "_atomic_write", fail_on_yaml)
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "--seed", "3", "-o", str(p2),
                 "--metrics-tokens", "4096"]) == 2
    monkeypatch.setattr(pf, "_atomic_write", real)
    assert sorted(os.listdir(p2.parent)) == sorted([p2.name, os.path.basename(old_tables)])  # no orphan, no tmp
    placement = load_placement(str(p2))
    assert placement.predictor == old_tables
    load_tables(placement)  # the old pair still belongs together
    # tables of another build copied under the name this YAML expects: refused, named
    p4 = _pair(tmp_path, "b", 4)
    shutil.copy(load_placement(str(p4)).predictor, old_tables)
    r = _cli("evaluate", "--trace", HELDOUT, "--placement", str(p2))
    assert r.returncode == 2 and "predictor_sha256" in r.stderr and old_tables in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # a YAML of an older smoe without the hash: the tables' own expert2rank gives the mix away
    doc = yaml.safe_load(open(p2))
    del doc["predictor_sha256"]
    p2.write_text(yaml.safe_dump(doc))
    r = _cli("evaluate", "--trace", HELDOUT, "--placement", str(p2))
    assert r.returncode == 2 and "expert2rank differs" in r.stderr, r.stderr


@pytest.mark.parametrize("damage,words", [
    (lambda b: b[: len(b) // 2], "not a readable tables file"),
    (lambda b: b"", "not a readable tables file"),
    (lambda b: b"token2rank,token_conf\n1,2\n", "not a readable tables file"),
])
def test_damaged_tables_are_refused_with_their_name(tmp_path, damage, words):
    p = _pair(tmp_path, "c", 2)
    doc = yaml.safe_load(open(p))
    del doc["predictor_sha256"]  # reach the reader itself (with the hash, any damage is a mismatch)
    p.write_text(yaml.safe_dump(doc))
    tables = load_placement(str(p)).predictor
    data = open(tables, "rb").read()
    open(tables, "wb").write(damage(data))
    r = _cli("evaluate", "--trace", HELDOUT, "--placement", str(p))
    assert r.returncode == 2 and words in r.stderr and tables in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tables_of_the_wrong_shape_or_ranks_are_refused(tmp_path):
    import io

    p = _pair(tmp_path, "d", 2)
    placement = load_placement(str(p))
    z = dict(np.load(placement.predictor))
    for key, bad, words in [("token2rank", lambda a: np.where(a == 1, 5, a), "ranks outside"),
                            ("markov_conf", lambda a: a[:, :3], "has shape"),
                            ("token_conf", lambda a: np.full_like(a, np.nan), "non-finite"),
                            ("bigram_keys", lambda a: a[::-1].copy(), "'bigram_keys' must be strictly increasing"),
                            ("bigram2rank", lambda a: np.where(a == 1, 7, a), "'bigram2rank' holds ranks outside"),
                            ("bigram_conf", lambda a: a[:, 1:], "'bigram_conf' has shape"),
                            ("bigram_conf", None, r"tables lack \['bigram_conf'\]")]:
        assert key in z  # built with a bigram table
        broken = {**z, key: bad(z[key])} if bad else {k: v for k, v in z.items() if k != key}
        buf = io.BytesIO()
        np.savez_compressed(buf, **broken)
        open(placement.predictor, "wb").write(buf.getvalue())
        doc = yaml.safe_load(open(p))
        doc.pop("predictor_sha256", None)
        p.write_text(yaml.safe_dump(doc))
        with pytest.raises(ValueError, match=words):
            load_tables(load_placement(str(p)))


@pytest.mark.parametrize("fmt,scale", [("float8_e4m3fn", "block"), ("float8_e5m2", "tensor")])
def test_embeddings_of_fp8_checkpoints_are_dequantised(tmp_path, fmt, scale):
    """fp8 embeddings with DeepSeek-style block scales (weight_scale_inv, 128 x 128 blocks) or a
    per-tensor weight_scale, against torch's own fp8 -> float32 conversion."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from vllm_smoe.formats.checkpoint import read_embeddings as _embeddings

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 200, generator=gen) * 3).to(getattr(torch, fmt))
    if scale == "block":
        s = torch.rand(3, 2, generator=gen) + 0.5
        tensors = {"model.embed_tokens.weight": w, "model.embed_tokens.weight_scale_inv": s}
        want = w.float() * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    else:
        s = torch.tensor(0.25)
        tensors = {"model.embed_tokens.weight": w, "model.embed_tokens.weight_scale": s}
        want = w.float() * s
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = _embeddings(str(tmp_path), 250)
    np.testing.assert_array_equal(got, want[:250].numpy())


def test_two_concurrent_builds_of_one_output_leave_a_consistent_pair(tmp_path):
    out = tmp_path / "p.yaml"
    procs = [subprocess.Popen([sys.executable, "-m", "vllm_smoe.tools.place", "build", "--trace", TRAIN, "--ep-size",
                               str(ep), "-o", str(out), "--metrics-tokens", "2048"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for ep in (2, 4)]
    assert [p.wait(300) for p in procs] == [0, 0]
    placement = load_placement(str(out))
    tables = load_tables(placement)  # hash, expert2rank and shapes agree with the YAML that landed last
    assert int(tables.token2rank.max()) < placement.ep_size
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_fp8_embeddings_without_a_scale_are_refused(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(10, 8).to(torch.float8_e4m3fn)},
              str(tmp_path / "model.safetensors"))
    from vllm_smoe.formats.checkpoint import read_embeddings as _embeddings

    with pytest.raises(ValueError, match="without model.embed_tokens.weight_scale_inv"):
        _embeddings(str(tmp_path), 10)


def test_a_rebuild_keeps_tables_other_yamls_name(tmp_path):
    import shutil

    out = tmp_path / "placement.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "-o", str(out), "--metrics-tokens", "2048"]) == 0
    shutil.copy(out, tmp_path / "placement.bak.yaml")  # a backup names the same tables
    v2 = tmp_path / "placement.v2.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "-o", str(v2), "--metrics-tokens", "2048"]) == 0
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "--seed", "1", "-o", str(out),
                 "--metrics-tokens", "2048"]) == 0
    for y in (out, tmp_path / "placement.bak.yaml", v2):  # every YAML still has its own tables
        load_tables(load_placement(str(y)))


def test_evaluate_bounds_its_sample(built, tmp_path, capsys):
    from vllm_smoe.placement.spans import eval_windows as _windows

    assert _windows(100, 0) == [(0, 100)] and _windows(100, 100) == [(0, 100)]
    assert _windows(160, 32) == [(10 * i, 10 * i + 2) for i in range(16)]  # 16 evenly spaced windows
    assert _windows(100, 5) == [(20 * i, 20 * i + 1) for i in range(5)]  # tiny bounds: fewer windows
    js = tmp_path / "e.json"
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--max-tokens", "4096",
                 "--json", str(js)]) == 0
    assert "evaluating 4096 of" in capsys.readouterr().err
    m = json.load(open(js))["placement (coclust)"]
    assert sum(m["rank_tokens"]) == 4096 * 4 and 0 < m["lar"] <= 1  # tokens x layers


def test_evaluate_scores_each_predictor_against_the_capped_oracle(built, tmp_path):
    res = {}
    for pred in ("tables-markov", "tables", "router"):
        js = tmp_path / f"{pred}.json"
        assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--predictor", pred,
                     "--compare", "linear", "--json", str(js)]) == 0
        res[pred] = json.load(open(js))
    oracle = res["router"]["placement (coclust)"]
    # router knows the routing: it is the oracle, and the oracle is the same whichever predictor is scored
    assert oracle["oracle_share"] == 1.0 and oracle["lar"] == oracle["oracle_lar"]
    for pred in ("tables-markov", "tables"):
        m = res[pred]["placement (coclust)"]
        assert m["oracle_lar"] == oracle["oracle_lar"]
        assert 0.5 < m["oracle_share"] < 1.0 and m["lar"] < oracle["lar"]
        assert "oracle_share" not in res[pred]["linear"]  # plain EP: no predictor to score
        assert res[pred]["linear+pred"]["oracle_share"] < 1.0
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(built), "--mode", "dp",
                 "--predictor", "router"]) == 2


def test_simulate_router_golden():
    from vllm_smoe.placement.online import simulate

    # 2 ranks: experts 0, 1 on rank 0, experts 2, 3 on rank 1; cap 1.0 -> 2 tokens per rank
    holds = np.array([[[1, 1, 0, 0], [0, 0, 1, 1]]], dtype=bool)
    topk = np.array([[0, 1], [2, 3], [0, 2], [1, 0]]).reshape(4, 1, 2)
    t2r, src = simulate(None, holds, np.zeros(4, int), topk, np.zeros(4, int), 2, capacity=1.0, predictor="router")
    # the sure tokens claim first (0 and 3 want rank 0, 1 wants rank 1); the split one takes the free slot
    np.testing.assert_array_equal(t2r[:, 0], [0, 1, 1, 0])
    assert (src == 4).all()


def test_bench_predictors_leaves_each_domain_out(tmp_path):
    from vllm_smoe.tools.bench import main as bench_main

    js = tmp_path / "pred.json"
    assert bench_main(["predictors", "--ep-size", "2", "--json", str(js)]) == 0
    rows = json.load(open(js))["rows"]
    assert [r["split"] for r in rows] == ["in-domain", "without python", "without c", "without prose", "without math"]
    held = np.load(HELDOUT)
    assert rows[4]["test_tokens"] == int((held["domain"] == 3).sum())
    for r in rows:
        assert r["router"]["oracle_share"] == 1.0
        assert r["tables"]["lar"] < r["router"]["lar"]
    # a domain the tables never saw is predicted worse than the domains they did
    assert min(r["tables"]["oracle_share"] for r in rows[1:]) < rows[0]["tables"]["oracle_share"]


def test_eplb_peer_with_replicas_keeps_vllms_slots():
    """vLLM's EPLB with copies: every expert somewhere, each rank P / N physical slots, the hottest
    expert copied; converted to home + (expert, rank) copies without repeats."""
    pytest.importorskip("vllm")
    from vllm_smoe.tools.peers import place_eplb

    load = np.ones((2, 8))
    load[:, 3] = 50.0  # one hot expert per layer
    e2r, reps = place_eplb(load, 2, replicas=2)
    assert e2r.shape == (2, 8) and reps.shape == (2, 2, 2)
    for layer in range(2):
        ok = reps[layer, :, 0] >= 0
        pairs = {(int(e), int(r)) for e, r in reps[layer][ok]}
        assert len(pairs) == ok.sum() and all(e2r[layer, e] != r for e, r in pairs)
        slots = np.bincount(e2r[layer], minlength=2) + np.bincount(reps[layer][ok, 1], minlength=2)
        assert slots.sum() <= 10 and (slots <= 5).all()
        assert 3 in reps[layer, :, 0]  # the hot expert got a copy
    e2r0, reps0 = place_eplb(load, 2)
    assert reps0.shape == (2, 0, 2) and (np.bincount(e2r0[0], minlength=2) == 4).all()


def test_evaluate_gives_peers_the_placements_replica_budget(tmp_path):
    out = tmp_path / "r.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "--replicas", "4", "-o", str(out)]) == 0
    js = tmp_path / "e.json"
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(out), "--compare", "eplb,coclust",
                 "--json", str(js)]) == 0
    res = json.load(open(js))
    ours = res["placement (coclust)"]
    # coclust rebuilt with the same 4 copies scores what the placement does; EPLB's copies serve load
    assert abs(res["coclust+pred"]["lar"] - ours["lar"]) < 0.02
    assert ours["lar"] > res["eplb+pred"]["lar"] > res["eplb"]["lar"]


def test_advise_finds_the_gain_of_a_placement_built_from_live_traffic(tmp_path, capsys):
    """Served placement trained on one workload, live traffic from another: the candidate built
    from the recording's first half keeps clearly more activations local on its second half, and
    the written candidate loads; against a recording of its own workload it gains little."""
    from vllm_smoe.formats.trace import read_traces, write_trace

    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([TRAIN], fields)
    _, he, _ = read_traces([HELDOUT], fields)
    for name, arr, d in (("py.npz", tr, 0), ("live.npz", he, 3), ("same.npz", he, 0)):
        keep = arr["domain"] == d
        write_trace(str(tmp_path / name), meta, **{k: v[keep] for k, v in arr.items()})
    served = tmp_path / "served.yaml"
    assert main(["build", "--trace", str(tmp_path / "py.npz"), "--ep-size", "4", "-o", str(served)]) == 0
    js, cand = tmp_path / "a.json", tmp_path / "cand.yaml"
    assert main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(served), "-o", str(cand),
                 "--json", str(js)]) == 0
    res = json.load(open(js))
    cur, new = res["served (coclust)"], res["candidate (coclust)"]
    assert new["lar"] > cur["lar"] + 0.05 and new["remote_unique_per_token"] < cur["remote_unique_per_token"]
    p = load_placement(str(cand))
    assert p.ep_size == 4 and p.predictor is not None and load_tables(p).token2rank.shape == (4, 4096, 2)
    # written under the served ranks' names: a live swap moves exactly the slots advise counts
    served_p = load_placement(str(served))
    assert int((p.expert2rank != served_p.expert2rank).sum()) == new["moved_slots"] > 0
    # one renaming for the whole model (for one order per step) moves at least as many
    assert main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(served), "--rename", "model",
                 "-o", str(tmp_path / "whole.yaml"), "--json", str(js)]) == 0
    whole = load_placement(str(tmp_path / "whole.yaml"))
    assert json.load(open(js))["candidate (coclust)"]["moved_slots"] == int(
        (whole.expert2rank != served_p.expert2rank).sum()) >= new["moved_slots"]
    # a recording that says it was served with one order per step gets that renaming by default
    import dataclasses
    for order in ("step", "sideways"):
        live = {k: v[he["domain"] == 3] for k, v in he.items()}
        write_trace(str(tmp_path / f"{order}.npz"), dataclasses.replace(meta, extra={**meta.extra, "token_order": order}),
                    **live)
    assert main(["advise", "--trace", str(tmp_path / "step.npz"), "--placement", str(served),
                 "-o", str(tmp_path / "stepped.yaml")]) == 0
    np.testing.assert_array_equal(load_placement(str(tmp_path / "stepped.yaml")).expert2rank, whole.expert2rank)
    assert not np.array_equal(p.expert2rank, whole.expert2rank)  # per layer (the default otherwise) differs
    capsys.readouterr()
    assert main(["advise", "--trace", str(tmp_path / "step.npz"), "--placement", str(served), "--rename", "layer",
                 "-o", str(tmp_path / "per-layer.yaml")]) == 0  # obeyed, with a warning
    assert "--rename layer: the recording was served with one token order per step" in capsys.readouterr().err
    assert main(["advise", "--trace", str(tmp_path / "sideways.npz"), "--placement", str(served)]) == 2
    assert main(["advise", "--trace", str(tmp_path / "same.npz"), "--placement", str(served), "--json", str(js)]) == 0
    same = json.load(open(js))
    assert abs(same["candidate (coclust)"]["lar"] - same["served (coclust)"]["lar"]) < new["lar"] - cur["lar"]
    assert main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(tmp_path / "nope.yaml")]) == 2
    # at most a quarter of the slots moved: the written candidate moves no more, stays balanced, and
    # keeps more activations local than the served placement
    lim_yaml = tmp_path / "lim.yaml"
    assert main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(served), "--max-moves", "0.25",
                 "-o", str(lim_yaml), "--json", str(js)]) == 0
    res = json.load(open(js))
    (lim_key,) = [k for k in res if k.startswith("limited")]
    lim, old_p, new_p = res[lim_key], load_placement(str(served)), load_placement(str(lim_yaml))
    moved = int((old_p.expert2rank != new_p.expert2rank).sum())
    assert moved == lim["moved_slots"] <= 0.25 * old_p.expert2rank.size
    assert res["candidate (coclust)"]["moved_slots"] > moved
    assert (np.bincount(new_p.expert2rank.reshape(-1), minlength=4) == new_p.expert2rank.size // 4).all()
    assert lim["lar"] > res["served (coclust)"]["lar"]
    # no layer left busier than the cap (1.10) or than it was served, on the half it was chosen on
    assert lim["train_expert_load"] <= max(1.10, res["served (coclust)"]["train_expert_load"]) + 1e-9
    for flag, bad in (("--max-moves", "1.5"), ("--balance-weight", "-1")):
        with pytest.raises(SystemExit) as e:  # argparse names the flag
            main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(served), "--max-moves", "0.25",
                  flag, bad])
        assert e.value.code == 2
    # a tensor-parallel placement routes no requests
    assert main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(served),
                 "--in-flight", "128"]) == 2


def test_advise_gives_its_candidates_the_served_learned_predictor(tmp_path, capsys):
    """A placement served with its learned predictor: advise trains one of the same width for the
    fresh and the limited candidate (from --model's embeddings), scores with it, and writes it,
    so a server ordering with --smoe-predictor learned can take the candidate."""
    from vllm_smoe.formats.trace import read_traces, write_trace
    from vllm_smoe.testbed import FIXTURES

    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([TRAIN], fields)
    _, he, _ = read_traces([HELDOUT], fields)
    for name, arr, d in (("py.npz", tr, 0), ("live.npz", he, 3)):
        keep = arr["domain"] == d
        write_trace(str(tmp_path / name), meta, **{k: v[keep] for k, v in arr.items()})
    served, plain = tmp_path / "served.yaml", tmp_path / "plain.yaml"
    for out, extra in ((served, ["--learned", "--learned-width", "24"]), (plain, [])):
        assert main(["build", "--trace", str(tmp_path / "py.npz"), "--ep-size", "4", "--model", FIXTURE_MODEL,
                     "-o", str(out), *extra]) == 0
    js, lim = tmp_path / "a.json", tmp_path / "lim.yaml"
    assert main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(served), "--model", FIXTURE_MODEL,
                 "--predictor", "learned", "--max-moves", "0.25", "-o", str(lim), "--json", str(js)]) == 0
    res = json.load(open(js))
    cur, new = res["served (coclust)"], res["candidate (coclust)"]
    assert new["lar"] > cur["lar"] + 0.05
    net = load_tables(load_placement(str(lim))).learned
    assert net is not None and net.token_proj.shape == (4096, 24)
    capsys.readouterr()
    for placement, args, says in ((plain, ["--predictor", "learned"], "holds no learned predictor"),
                                  (served, ["--model", FIXTURES["deepseek_v2"][0]], "fingerprint")):
        assert main(["advise", "--trace", str(tmp_path / "live.npz"), "--placement", str(placement), *args]) == 2
        assert says in capsys.readouterr().err


def test_advise_a_dp_placement_from_every_engines_recording(tmp_path, capsys):
    """A --mode dp placement built on two workloads, a live recording of the other two by two DP
    engines: advise trains a request co-clustering on each engine's first half, judges both with
    the server's request routing on the second halves, and writes a dp-coclust placement."""
    from vllm_smoe.formats.trace import read_traces, write_trace

    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([TRAIN], fields)
    keep = np.isin(tr["domain"], (2, 3))
    write_trace(str(tmp_path / "old.npz"), meta, **{k: v[keep] for k, v in tr.items()})
    served = tmp_path / "served.yaml"
    assert main(["build", "--trace", str(tmp_path / "old.npz"), "--ep-size", "2", "--mode", "dp",
                 "--shuffle-requests", "0", "-o", str(served)]) == 0
    # two engines' recordings of python + c, as the recorder names them: each engine got every
    # other request, so both engines' first halves hold both workloads' early requests
    live = tr["domain"] < 2
    req = np.unique(tr["request_ids"][live], return_inverse=True)[1].ravel()
    for rank in (0, 1):
        mine = live.copy()
        mine[live] = req % 2 == rank
        write_trace(str(tmp_path / f"trace-dp{rank}-20261203T000000-1-00000.npz"), meta,
                    **{k: v[mine] for k, v in tr.items()})
    js, cand = tmp_path / "a.json", tmp_path / "cand.yaml"
    capsys.readouterr()
    assert main(["advise", "--trace", str(tmp_path / "trace-dp*.npz"), "--placement", str(served), "-o", str(cand),
                 "--json", str(js)]) == 0
    out = capsys.readouterr()
    assert "requests routed as the server does at 64 in flight" in out.out
    res = json.load(open(js))
    cur, new = res["served (dp-coclust)"], res["candidate (dp-coclust)"]
    assert new["lar"] > cur["lar"] + 0.01 and new["expert_load"] < cur["expert_load"]
    assert "step_imbalance" in new
    p = load_placement(str(cand))
    assert p.method == "dp-coclust" and p.ep_size == 2 and load_tables(p).token2rank.shape[0] == 4
    doc = yaml.safe_load(open(cand))
    assert doc["built_from"]["mode"] == "dp" and doc["built_from"]["in_flight"] == 64
    # what advise cannot do for it, and what only a DP placement takes, each named
    for args, says in ((["--max-moves", "0.25"], "restart"), (["--group-workloads"], "--group-workloads"),
                       (["--predictor", "tables"], "prompt's votes"), (["--balance-weight", "1"], "--max-moves"),
                       (["--rename", "layer"], "no live swap")):
        assert main(["advise", "--trace", str(tmp_path / "trace-dp0-20261203T000000-1-00000.npz"), "--placement",
                     str(served), *args]) == 2
        assert says in capsys.readouterr().err


def test_advise_splits_each_dp_engine_into_halves():
    from vllm_smoe.placement.spans import late_half as _late_half

    # engine 0 ran steps 0..3, engine 1 steps 4..9 (its recording offset after engine 0's)
    batch = np.array([0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9])
    engine = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    late = _late_half(batch, engine)
    assert late.tolist() == [False, False, False, True, True, True, False, False, False, True, True, True]
    assert _late_half(batch, None).tolist() == (batch >= 5).tolist()  # one engine: its steps in order
    # whole requests: request 7 starts in engine 0's first half and runs on into its second
    req = np.array([7, 1, 7, 7, 2, 7, 3, 3, 4, 4, 5, 6])
    late = _late_half(batch, engine, req)
    assert late.tolist() == [False, False, False, False, True, False, False, False, False, False, True, True]
    assert _late_half(np.array([0, 0]), np.array([0, 0])).tolist() == [False, False]  # one step: nothing to judge


def test_advise_reads_which_engine_recorded_each_row(tmp_path):
    """Two engines' rotated files in any order, and engines of unequal length: every row is
    labelled with its engine, and each engine's own second half is what advise judges."""
    from vllm_smoe.formats.trace import TraceMeta, write_trace
    from vllm_smoe.placement.spans import late_half as _late_half
    from vllm_smoe.placement.stream import by_step as _batched
    from vllm_smoe.tools.place.read import stream as _stream

    meta = TraceMeta(num_experts=4, top_k=2, num_layers=1, vocab_size=8)
    # file -> (rows, first step): a recorder's rotated chunks go on counting its steps and requests
    sizes = {"trace-dp1-a-1-00000.npz": (4, 0), "trace-dp0-a-2-00000.npz": (6, 0), "trace-dp0-a-2-00001.npz": (2, 6)}
    for name, (n, first) in sizes.items():
        rank = int(name[8])
        ids = np.arange(first, first + n, dtype=np.int32)
        write_trace(str(tmp_path / name), TraceMeta(**{**meta.__dict__, "extra": {"recording": f"r{rank}"}}),
                    token_ids=np.full(n, rank, np.int32), request_ids=ids, positions=np.zeros(n, np.int32),
                    topk_ids=np.tile(np.array([[[0, 1]]], np.int16), (n, 1, 1)), step_ids=ids)
    files = [str(tmp_path / f) for f in sizes]
    _, _, arr, _, _ = _stream(files, lambda T: [(0, T)], counts=False, engines=True)
    np.testing.assert_array_equal(arr["engine"], arr["token_ids"])  # each row's engine is the rank it was written by
    arr, batch = _batched(arr, 512)
    late = _late_half(batch, arr.pop("engine"))
    for rank, n in ((0, 8), (1, 4)):  # engine 0: its two files, 8 steps; engine 1: 4 steps
        assert int(late[arr["token_ids"] == rank].sum()) == n // 2


def test_a_trace_names_the_dp_engine_that_recorded_it(tmp_path):
    from vllm_smoe.formats.trace import TraceMeta, open_trace, write_trace
    from vllm_smoe.tools.place.read import engine as _engine

    rows = dict(token_ids=np.zeros(2, np.int32), request_ids=np.zeros(2, np.int32),
                positions=np.arange(2, dtype=np.int32), topk_ids=np.array([[[0, 1]], [[1, 2]]], np.int16))
    meta = TraceMeta(num_experts=4, top_k=2, num_layers=1, vocab_size=8)
    cases = (("trace-dp3-20261203T000000-9-00001.npz", meta, 3), ("mine.npz", meta, 0),
             ("trace-dp3-x.npz", TraceMeta(num_experts=4, top_k=2, num_layers=1, vocab_size=8,
                                           extra={"dp_rank": 1}), 1))
    for name, m, want in cases:
        write_trace(str(tmp_path / name), m, **rows)
        assert _engine(open_trace(str(tmp_path / name))) == want


def test_build_method_auto_keeps_what_the_rule_picks_and_builds_it_as_the_method_itself(tmp_path):
    """--method auto solves coclust and bytes, judges both on rows past the bytes objective's
    instances, and keeps recommend()'s pick: the YAML says which and why, and its experts and
    tables are the ones --method <pick> builds with the same flags."""
    from vllm_smoe.placement.metrics import recommend

    flags = ["--trace", TRAIN, "--ep-size", "4", "--instance-tokens", "65536", "--metrics-tokens", "65536"]
    auto = tmp_path / "auto.yaml"
    assert main(["build", *flags, "--method", "auto", "-o", str(auto)]) == 0
    doc = yaml.safe_load(open(auto))
    rec = doc["built_from"]["auto"]
    assert doc["method"] == rec["chosen"] in ("coclust", "bytes") and rec["held_out"] is True
    assert rec["judged_rows"] == 65536 and set(rec["candidates"]) == {"coclust", "bytes"}
    c = [rec["candidates"][k] for k in ("coclust", "bytes")]
    i, why = recommend([x["lar"] for x in c], [x["remote_unique_per_token"] for x in c],
                       [x["expert_load"] for x in c], 1.10 * 1.05)
    i = i if i >= 0 else int(np.argmin([x["expert_load"] for x in c]))
    assert rec["chosen"] == ("coclust", "bytes")[i] and rec["why"].startswith(why)
    direct = tmp_path / "direct.yaml"
    assert main(["build", *flags, "--method", rec["chosen"], "-o", str(direct)]) == 0
    a, d = load_placement(str(auto)), load_placement(str(direct))
    np.testing.assert_array_equal(a.expert2rank, d.expert2rank)
    ta, td = load_tables(a), load_tables(d)
    for k, v in td.arrays().items():
        np.testing.assert_array_equal(ta.arrays()[k], v, err_msg=k)


def test_auto_judges_in_sample_when_the_trace_is_short(tmp_path, capsys):
    out = tmp_path / "auto.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "--method", "auto", "-o", str(out)]) == 0
    rec = yaml.safe_load(open(out))["built_from"]["auto"]
    assert rec["held_out"] is False and rec["judged_rows"] == 131072  # the fixture's 131072 rows, all instances
    assert "in sample" in capsys.readouterr().err


@pytest.mark.parametrize("total,metrics,instances,want", [
    (131072, 131072, 131072, [(0, 131072)]),  # nothing past the instances: in sample
    (131072, 65536, 65536, [(65536, 131072)]),
    (1 << 20, 1 << 16, 1 << 17, [(131072 + i * 917504 // 16, 131072 + i * 917504 // 16 + 4096) for i in range(16)]),
])
def test_judge_windows_golden(total, metrics, instances, want):
    from vllm_smoe.placement.spans import judge_windows as _judge_windows

    assert _judge_windows(total, metrics, instances) == want


def test_positions_index_the_kept_rows():
    from hypothesis import given, strategies as st
    from vllm_smoe.placement.spans import span_positions as _positions, union_spans as _union

    @given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), min_size=1, max_size=6), st.data())
    def check(spans, data):
        spans = [(lo, lo + n) for lo, n in spans]
        kept = _union(spans)
        assert all(a[1] < b[0] for a, b in zip(kept, kept[1:]))  # sorted, disjoint, not touching
        trace = np.arange(300) * 7  # each row's value names its position
        sample = np.concatenate([trace[lo:hi] for lo, hi in kept])
        rows = np.array(data.draw(st.lists(st.sampled_from([r for lo, hi in spans for r in range(lo, hi)]),
                                           min_size=1, max_size=20)))
        np.testing.assert_array_equal(sample[_positions(kept, rows)], trace[rows])

    check()


def test_auto_keeps_coclust_where_bytes_cannot_place_and_trains_the_chosen_network(tmp_path, capsys):
    out = tmp_path / "auto.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "--nodes", "2", "--method", "auto", "--learned",
                 "-o", str(out)]) == 0
    doc = yaml.safe_load(open(out))
    assert doc["method"] == "coclust" and set(doc["built_from"]["auto"]["candidates"]) == {"coclust"}
    assert "bytes does not support --nodes 2" in capsys.readouterr().err
    assert load_tables(load_placement(str(out))).learned is not None
    # evaluate --compare skips the peer that cannot place over nodes, with its reason, and scores the rest
    js = tmp_path / "e.json"
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(out), "--compare", "bytes,linear",
                 "--json", str(js)]) == 0
    assert "skipping bytes: it does not support placements over nodes" in capsys.readouterr().err
    assert {"linear", "linear+pred"} <= set(json.load(open(js)))


def test_build_evaluate_and_advise_an_uneven_split(tmp_path, capsys):
    """32 experts on 3 ranks: vLLM's 11 + 11 + 10 in every layer, evaluated against every peer
    that can take it (EPLB skipped with its reason), and advise keeps the split."""
    out = tmp_path / "p3.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "3", "--model", FIXTURE_MODEL, "-o", str(out)]) == 0
    doc = yaml.safe_load(open(out))
    assert all(np.bincount(x["expert_to_rank"], minlength=3).tolist() == [11, 11, 10] for x in doc["layers"])
    assert "polish_tokens" not in doc["built_from"]  # the polish leaves an uneven split alone
    capsys.readouterr()
    js = tmp_path / "e.json"
    assert main(["evaluate", "--trace", HELDOUT, "--placement", str(out), "--compare", "all", "--json", str(js)]) == 0
    err = capsys.readouterr().err
    res = json.load(open(js))
    assert "skipping eplb: vLLM's EPLB needs 32 experts + 0 copies to split evenly over ep_size 3" in err
    assert "eplb" not in res and {"linear+pred", "metis+pred", "bytes+pred"} <= set(res)
    assert res["placement (coclust)"]["lar"] > res["linear+pred"]["lar"]
    limited = tmp_path / "lim.yaml"
    assert main(["advise", "--trace", HELDOUT, "--placement", str(out), "--max-moves", "0.25", "-o", str(limited)]) == 0
    doc = yaml.safe_load(open(limited))
    assert all(np.bincount(x["expert_to_rank"], minlength=3).tolist() == [11, 11, 10] for x in doc["layers"])


def test_build_polishes_coclust_on_the_rows_and_says_when_it_cannot(tmp_path, monkeypatch, capsys):
    from vllm_smoe.placement import layout

    out0, out1, out2 = (tmp_path / f"p{i}.yaml" for i in range(3))
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "--polish-tokens", "0", "-o", str(out0)]) == 0
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "-o", str(out1)]) == 0
    d0, d1 = yaml.safe_load(open(out0)), yaml.safe_load(open(out1))
    assert "polish_tokens" not in d0["built_from"] and d1["built_from"]["polish_tokens"] == 131072
    assert d0["layers"] != d1["layers"]
    # the exact routed objective the polish climbs, on its own rows (the whole training trace)
    scores = []
    for out in (out0, out1):
        js = tmp_path / "e.json"
        assert main(["evaluate", "--trace", TRAIN, "--placement", str(out), "--predictor", "router",
                     "--json", str(js)]) == 0
        scores.append(json.load(open(js))["placement (coclust)"]["lar"])
    assert scores[1] > scores[0]
    # a budget too small for a layer's set-up: the solver's placement, and a line saying so
    monkeypatch.setattr(layout, "POLISH_WORK", 1e6)
    capsys.readouterr()
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "-o", str(out2)]) == 0
    d2 = yaml.safe_load(open(out2))
    assert d2["layers"] == d0["layers"] and "polish_tokens" not in d2["built_from"]
    assert "kept unpolished; --polish-tokens 3906 or fewer" in capsys.readouterr().err


def test_build_over_nodes_says_the_kicks_are_not_applied_and_records_no_polish(tmp_path, capsys):
    """The polish (and its kicks) swap experts freely, which a node layout would not survive:
    the build says so, and its built_from claims neither."""
    out0, out1 = tmp_path / "n0.yaml", tmp_path / "n1.yaml"
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "--nodes", "2", "--polish-tokens", "0",
                 "-o", str(out0)]) == 0
    capsys.readouterr()
    assert main(["build", "--trace", TRAIN, "--ep-size", "4", "--nodes", "2", "--polish-kicks", "2",
                 "-o", str(out1)]) == 0
    assert "--polish-kicks 2: not applied: the polish and its kicks swap experts freely, which 2 nodes would" \
        in capsys.readouterr().err
    d0, d1 = yaml.safe_load(open(out0)), yaml.safe_load(open(out1))
    assert d1["layers"] == d0["layers"]
    assert not {"polish_tokens", "polish_kicks"} & set(d1["built_from"])
    # nor are they where the polish itself is off
    assert main(["build", "--trace", TRAIN, "--ep-size", "2", "--polish-tokens", "0", "--polish-kicks", "1",
                 "-o", str(tmp_path / "off.yaml")]) == 0
    assert "--polish-kicks 1: not applied: the kicks follow the polish" in capsys.readouterr().err


def test_keep_heap_sets_glibc_s_top_pad():
    """smoe-place keeps freed heap (the polish's temporaries) instead of faulting it back per score."""
    import platform

    from vllm_smoe.tools.cli_util import keep_heap
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt's M_TOP_PAD is glibc's")
    assert keep_heap() is True


def test_smoe_place_main_keeps_the_heap_first(monkeypatch):
    from vllm_smoe.tools import place

    calls = []
    monkeypatch.setattr(place, "keep_heap", lambda: calls.append(1))
    with pytest.raises(SystemExit):  # argparse refuses a build without --trace, after main's first line
        main(["build"])
    assert calls == [1]
