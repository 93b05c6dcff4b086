"""The all-to-all cost model (placement/a2a_cost.py): byte rules per backend on hand-made cases,
against a plain per-token reference, and the properties every rule must keep; the calibration
against DeepEP's published rows; cluster specs' errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.placement.a2a_cost import (BACKENDS, IN, NVLINK, OUT, RDMA, LinkModel, backend_rows, fit_link,
                                          oracle_rows, phase_seconds, token_rows)

PER_RANK = ("nccl-a2a", "smoe-p2p", "smoe-hier", "deepep-ht", "deepep-ll")


def ref_token_pairs(dest_row, src, per_node, backend):
    """(sender, receiver) pairs of one token's dispatch, written as each backend's docs say it."""
    ranks = sorted({d for d in dest_row if d >= 0})
    node = lambda r: r // per_node  # noqa: E731
    if backend == "allgather-rs":
        raise AssertionError("not per token")
    if backend == "deepep-ll":
        return [(src, d) for d in dest_row if d >= 0 and d != src]
    if backend in ("nccl-a2a", "smoe-p2p"):
        return [(src, d) for d in ranks if d != src]
    pairs = [(src, d) for d in ranks if node(d) == node(src) and d != src]
    for n in sorted({node(d) for d in ranks} - {node(src)}):
        there = [d for d in ranks if node(d) == n]
        same_index = n * per_node + src % per_node
        gw = same_index if backend == "deepep-ht" or same_index in there else min(there)
        pairs.append((src, gw))
        pairs += [(gw, d) for d in there if d != gw]
    return pairs


def ref_rows(dest, src, ep_size, per_node, backend):
    rows = np.zeros((2, 2, ep_size))
    for t in range(dest.shape[0]):
        if backend == "allgather-rs":
            pairs = [(src[t], d) for d in range(ep_size) if d != src[t]]
        else:
            pairs = ref_token_pairs(list(dest[t]), int(src[t]), per_node, backend)
        for s, d in pairs:
            link = int(s // per_node != d // per_node)
            rows[link, OUT, s] += 1
            rows[link, IN, d] += 1
    return rows


def test_goldens_one_remote_node():
    """A token on rank 0 whose experts sit on ranks 5, 6, 6 of node 1 (2 nodes x 4)."""
    dest, src = np.array([[5, 6, 6, -1]]), np.array([0])
    got = {b: backend_rows(dest, src, 8, 4, b)[:, OUT].sum(axis=1).tolist() for b in BACKENDS}
    assert got["deepep-ht"] == [2, 1]  # once over RDMA to rank 4 (local index 0), which forwards to 5 and 6
    assert got["smoe-hier"] == [1, 1]  # to rank 5 (rank 4 holds none of them), which forwards to 6
    assert got["deepep-ll"] == [0, 3]  # once per expert: 6 twice
    assert got["nccl-a2a"] == got["smoe-p2p"] == [0, 2]
    assert got["allgather-rs"] == [3, 4]  # every other rank
    r = backend_rows(dest, src, 8, 4, "deepep-ht")
    assert r[RDMA, OUT].tolist() == [1, 0, 0, 0, 0, 0, 0, 0] and r[RDMA, IN, 4] == 1
    assert r[NVLINK, OUT, 4] == 2 and r[NVLINK, IN, 5] == r[NVLINK, IN, 6] == 1


def test_goldens_mixed_nodes():
    """Experts on ranks 4, 6 (node 1) and 1, 1 (own node) of a token on rank 0."""
    dest, src = np.array([[4, 6, 1, 1]]), np.array([0])
    got = {b: backend_rows(dest, src, 8, 4, b)[:, OUT].sum(axis=1).tolist() for b in BACKENDS}
    assert got["deepep-ht"] == got["smoe-hier"] == [2, 1]  # 0->1, RDMA 0->4, 4->6
    assert got["deepep-ll"] == [2, 2]
    assert got["nccl-a2a"] == [1, 2]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.integers(0, 2 ** 31 - 1))
def test_rules_match_reference_and_oracle(nodes, per_node, K, seed):
    """Every rule equals the per-token reference, never sends fewer rows than the oracle's rank
    choice for that token, and sends nothing where every activation is on the token's own rank."""
    rng = np.random.default_rng(seed)
    N, T = nodes * per_node, 12
    dest = rng.integers(-1, N, size=(T, K))
    src = rng.integers(0, N, size=T)
    for b in BACKENDS:
        np.testing.assert_array_equal(backend_rows(dest, src, N, per_node, b), ref_rows(dest, src, N, per_node, b))
        if b == "allgather-rs":
            continue
        bound = oracle_rows(dest, N, per_node, b)
        assert (token_rows(dest, src, N, per_node, b) >= bound).all()
        assert (token_rows(dest, src, N, per_node, b, RDMA) >= oracle_rows(dest, N, per_node, b, RDMA)).all()
        # the bound is the least any rank achieves under the per-rank rules (it is not loose)
        best = np.min([token_rows(dest, np.full(T, r), N, per_node, b) for r in range(N)], axis=0)
        if b in ("nccl-a2a", "smoe-p2p", "deepep-ll"):
            np.testing.assert_array_equal(best, bound)
        else:  # over nodes the forwarding can cost more than one row per rank, never less
            assert (best >= bound).all()
        best_rdma = np.min([token_rows(dest, np.full(T, r), N, per_node, b, RDMA) for r in range(N)], axis=0)
        np.testing.assert_array_equal(best_rdma, oracle_rows(dest, N, per_node, b, RDMA))
    local = np.where(dest >= 0, src[:, None], -1)
    for b in PER_RANK:
        assert backend_rows(local, src, N, per_node, b).sum() == 0


def test_phase_seconds_busiest_rank_slower_link():
    rows = np.zeros((2, 2, 4))
    rows[NVLINK, OUT, 1] = 100
    rows[RDMA, IN, 2] = 10
    link = LinkModel(5e-6, 1e9, 1e8)
    assert phase_seconds(rows, 1000.0, link) == pytest.approx(5e-6 + max(100e3 / 1e9, 10e3 / 1e8))


def test_fit_link_recovers_known_constants():
    rng = np.random.default_rng(0)
    truth = LinkModel(20e-6, 150e9, 40e9)
    cases = []
    for _ in range(6):
        rows = rng.integers(1, 1000, size=(2, 2, 8)).astype(float)
        cases.append((rows, 7000.0, phase_seconds(rows, 7000.0, truth)))
    got, err = fit_link(cases, LinkModel(1e-5, 200e9, 50e9))
    assert np.abs(err).max() < 1e-6
    assert got.latency_s == pytest.approx(truth.latency_s, rel=1e-3)
    assert got.rdma_Bps == pytest.approx(truth.rdma_Bps, rel=1e-3)


def test_shipped_fits_are_the_calibration_and_within_20_percent():
    """backends.yaml is what `smoe-place calibrate` derives from the published rows (no hand-tuned
    constant), and every published row is reproduced within 20%."""
    from vllm_smoe.formats.bounded import load_yaml
    from vllm_smoe.formats.cluster_spec import BACKENDS_FILE, CALIBRATION_FILE, load_fits
    from vllm_smoe.tools.cluster_cost import calibrate

    fits, table = calibrate(load_yaml(CALIBRATION_FILE, "calibration rows"))
    assert fits["backends"] == load_fits(BACKENDS_FILE)["backends"]
    assert len(table) == 20 and max(abs(t["error"]) for t in table) <= 0.2


def test_cluster_spec_errors_name_file_and_field(tmp_path):
    from vllm_smoe.formats.cluster_spec import cluster_names, load_cluster

    assert {"h100x8-ndr400", "h200x8-ndr400", "b200x8-ndr400", "gb200-nvl72", "h800x8-cx7"} <= set(cluster_names())
    bad = tmp_path / "c.yaml"
    bad.write_text("gpus_per_node: 8\nnvlink_GBps: 450\nrdma_GBps: -1\ndense_TFLOPs: 1\nhbm_TBps: 1\n")
    with pytest.raises(ValueError, match=r"c\.yaml: field 'rdma_GBps'"):
        load_cluster(str(bad))
    bad.write_text("gpus_per_node: 8.5\n")
    with pytest.raises(ValueError, match="field 'gpus_per_node'"):
        load_cluster(str(bad))
    with pytest.raises(ValueError, match="no such shipped cluster"):
        load_cluster("h100x9")


def test_evaluate_cluster_columns_for_every_method(tmp_path):
    """evaluate --cluster adds each backend's projection to every method, in the JSON and the
    table; the per-backend bytes follow the rules (allgather-rs the same for every placement)."""
    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.tools.place import main

    placement = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-4dom-ep8.yaml")
    out = tmp_path / "e.json"
    assert main(["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", placement, "--compare", "linear",
                 "--max-tokens", "16384", "--cluster", "h100x8-ndr400", "--backend", "deepep-ll,allgather-rs",
                 "--tokens-per-rank", "256", "--cost-shape", "7168:2048", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"placement (coclust)", "linear", "linear+pred"}
    for m in res.values():
        assert m["cost_steps"] == 16384 // (256 * 8)
        assert m["deepep-ll:a2a_us"] > 0 and m["deepep-ll:calibrated"] and not m["allgather-rs:calibrated"]
        assert m["deepep-ll:rdma_bytes_per_token"] == 0  # EP 8 is one node
    ag = {m["allgather-rs:nvlink_bytes_per_token"] for m in res.values()}
    assert len(ag) == 1  # every token to every rank, whatever the placement
    # fewer remote activations, fewer low-latency messages
    assert res["placement (coclust)"]["deepep-ll:nvlink_bytes_per_token"] < res["linear"]["deepep-ll:nvlink_bytes_per_token"]


def test_evaluate_cluster_flags_errors(tmp_path):
    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.tools.place import main

    placement = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-4dom-ep8.yaml")
    base = ["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", placement, "--max-tokens", "4096",
            "--cluster", "h100x8-ndr400"]
    assert main(base) == 2  # no --cost-shape
    assert main(base + ["--cost-shape", "7168:x"]) == 2
    assert main(base + ["--cost-shape", "deepseek-v3", "--backend", "pplx"]) == 2


def test_messages_per_rank():
    from vllm_smoe.placement.a2a_cost import messages

    dest, src = np.array([[5, 6, 6, -1], [5, 5, 1, -1]]), np.array([0, 0])
    # per receiver: rank 0 sends to 5 and 6 (token 0), to 5 and 1 (token 1): 3 receivers
    assert messages(dest, src, 8, 4, "nccl-a2a")[0] == 3
    assert messages(dest, src, 8, 4, "deepep-ll")[0] == 6  # a put per (token, expert) row
    ht = messages(dest, src, 8, 4, "deepep-ht")  # 0 -> 4 over RDMA, 0 -> 1; 4 forwards to 5, 6
    assert ht[0] == 2 and ht[4] == 2


def test_row_bytes_as_the_backends_send_them():
    """DeepEP's message sizes at DeepSeek-V3 (hidden 7168, top-8), from its code."""
    from vllm_smoe.formats.cluster_spec import row_bytes
    from vllm_smoe.tools.cluster_cost import ROW_FORMATS

    got = {(b, p): row_bytes(ROW_FORMATS[b], p, 7168, 8) for b in ("deepep-ht", "deepep-ll")
           for p in ("dispatch", "combine")}
    assert got == {("deepep-ht", "dispatch"): 7472, ("deepep-ht", "combine"): 14384,
                   ("deepep-ll", "dispatch"): 7408, ("deepep-ll", "combine"): 14336}


def test_expert_seconds_roofline_busiest_rank():
    from vllm_smoe.placement.a2a_cost import Roofline, expert_seconds

    dest = np.array([[0, 0], [0, 1], [1, -1]])
    experts = np.array([[0, 1], [0, 2], [2, -1]])
    roof = Roofline(flops=6.0 * 10 * 20 * 100, hbm_Bps=1e30)  # compute bound: 100 rows a second
    t, rows = expert_seconds(dest, experts, 2, 10, 20, roof, 2.0, 2.0)
    assert rows.tolist() == [3, 2] and t == pytest.approx(3 / 100)
    roof = Roofline(flops=1e30, hbm_Bps=3 * 10 * 20 * 2.0)  # weight bound: one expert's weights a second
    t, _ = expert_seconds(dest, experts, 2, 10, 20, roof, 2.0, 0.0)
    assert t == pytest.approx(2.0)  # rank 0 reads experts 0 and 1, rank 1 expert 2 only


def test_trace_cost_means_over_steps_and_layers():
    from vllm_smoe.placement.a2a_cost import Roofline, Wire, trace_cost

    link = LinkModel(1e-6, 1e9, 1e9)
    wire = Wire("nccl-a2a", 2, link, link, 100.0, 200.0)
    topk = np.array([[[0]], [[1]], [[1]], [[1]]])  # 4 tokens, 1 layer, top-1; 2 experts on 2 ranks
    t2r = np.array([[0], [0], [1], [1]])
    steps = np.array([0, 0, 1, 1])
    c = trace_cost(topk, topk, t2r, steps, 2, wire, 4, 4, Roofline(1e30, 1e30))
    # step 0: token 1 goes 0 -> 1 (1 row), step 1: nothing remote
    assert c["dispatch_us"] == pytest.approx(1.0 + 0.5 * 100 / 1e9 * 1e6)
    assert c["combine_us"] == pytest.approx(1.0 + 0.5 * 200 / 1e9 * 1e6)
    assert c["nvlink_bytes_per_token"] == pytest.approx(300 / 4) and c["rdma_bytes_per_token"] == 0


def test_cluster_steps_give_every_rank_its_tokens(tmp_path):
    """Plain EP on the cluster's steps: each rank holds --tokens-per-rank tokens of every step,
    whatever the recorded batches were (allgather-rs then moves the same rows at 32 and 64)."""
    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.tools.place import main

    placement = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-4dom-ep8.yaml")
    times = {}
    for tpr in (32, 64):
        out = tmp_path / f"{tpr}.json"
        assert main(["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", placement, "--max-tokens",
                     "8192", "--compare", "linear", "--cluster", "h100x8-ndr400", "--backend", "allgather-rs", "--tokens-per-rank",
                     str(tpr), "--cost-shape", "7168:2048", "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["placement (coclust)"]["cost_steps"] == 8192 // (tpr * 8)
        assert len(set(res["linear"]["rank_tokens"])) == 1  # plain EP: every rank its equal share of each step
        times[tpr] = res["linear"]["allgather-rs:dispatch_us"]
    assert times[64] > 1.5 * times[32]  # twice the rows per rank, a step's bytes double


def test_cost_errors_exit_2(tmp_path):
    from vllm_smoe.formats.cluster_spec import load_cluster, wire_for
    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.tools.cluster_cost import check_calibration
    from vllm_smoe.tools.place import main

    with pytest.raises(ValueError, match="at most 8 ranks"):
        wire_for(load_cluster("gb200-nvl72"), "deepep-ht", 16, 7168, 8)
    placement = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny-4dom-ep8.yaml")
    base = ["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", placement, "--max-tokens", "4096",
            "--cluster", "h100x8-ndr400", "--cost-shape", "deepseek-v3"]
    assert main(base + ["--backend", ","]) == 2
    assert main(base + ["--tokens-per-rank", "100000"]) == 2  # more than the trace holds
    bad = tmp_path / "cal.yaml"
    bad.write_text("cluster: h800x8-cx7\nhidden: 7168\ntop_k: 8\nrows:\n- {backend: deepep-ht, phase: dispatch, ep: 8}\n")
    assert main(["calibrate", "--published", str(bad)]) == 2
    with pytest.raises(ValueError, match=r"rows\[0\]\.tokens_per_rank"):
        from vllm_smoe.formats.bounded import load_yaml
        check_calibration(load_yaml(str(bad), "x"), str(bad))
