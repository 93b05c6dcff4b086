"""`smoe-bench cluster`'s parts that need no root: the link derived from the host and a target,
the wire read from (synthetic) veth counters against smoe's counters, SLO throughput."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_smoe.tools.bench.cluster.link import TARGETS, link_settings
from vllm_smoe.tools.bench.cluster.readings import counters_agree, metric_sum, wire_delta
from vllm_smoe.tools.bench.cluster.slo import latency_summary, slo_rate
from vllm_smoe.tools.bench.veth import HEADER_BYTES

HOST = {"gemm_flops": 170e9, "read_bw": 6e9}


def test_link_keeps_the_targets_proportions():
    d = link_settings(HOST, "ib-ndr", "decode")
    # an H200 reads 4.8 TB/s, this host 6 GB/s: 800x slower, so is its link (50 GB/s -> 62.5 MB/s)
    assert d["scale"] == pytest.approx(800) and d["rate_bytes_s"] == pytest.approx(62.5e6)
    assert d["ratio"] == pytest.approx(96) and d["rate_bit"] == 500_000_000
    # the bandwidth-delay product in bytes is the target's
    assert d["rate_bytes_s"] * d["delay_s"] == pytest.approx(TARGETS["ib-ndr"]["link_bw"] * TARGETS["ib-ndr"]["latency"])
    p = link_settings(HOST, "ib-ndr", "prefill")
    assert p["rate_bytes_s"] == pytest.approx(170e9 / (989e12 / 50e9))  # ~8.6 MB/s: ~20,000 FLOP per byte
    assert link_settings(HOST, "nvlink", "decode")["rate_bytes_s"] == pytest.approx(9 * d["rate_bytes_s"])
    with pytest.raises(ValueError, match="--target 'tpu'"):
        link_settings(HOST, "tpu", "decode")
    with pytest.raises(ValueError, match="phase"):
        link_settings(HOST, "ib-ndr", "train")


def test_wire_from_veth_counters_against_smoes():
    before = {"a": {"tx_bytes": 1000, "tx_packets": 10}, "b": {"tx_bytes": 500, "tx_packets": 5}}
    after = {"a": {"tx_bytes": 1000 + 10 * 1514, "tx_packets": 20}, "b": {"tx_bytes": 500 + 2 * 66, "tx_packets": 7}}
    w = wire_delta(before, after)
    assert w == {"bytes": 10 * 1514 + 132, "packets": 12, "payload": 10 * (1514 - HEADER_BYTES)}
    assert counters_agree(w["payload"], 10 * 1448 * 1.03)["within"]
    off = counters_agree(w["payload"], 10 * 1448 * 0.5)
    assert not off["within"] and off["ratio"] == pytest.approx(0.5)
    assert counters_agree(w["payload"], None) is None
    with pytest.raises(ValueError, match="backwards"):
        wire_delta(after, before)
    with pytest.raises(ValueError, match="different devices"):
        wire_delta(before, {"a": after["a"]})


def test_slo_rate_golden():
    ladder = [{"rate": 1.0, "p90_itl_ms": 20.0}, {"rate": 2.0, "p90_itl_ms": 28.0},
              {"rate": 4.0, "p90_itl_ms": 45.0}, {"rate": 8.0, "p90_itl_ms": 29.0}]
    assert slo_rate(ladder, "p90_itl_ms", 30.0) == 2.0  # 8 req/s under the bound again does not count
    assert slo_rate(ladder, "p90_itl_ms", 10.0) == 0.0
    assert slo_rate(ladder, "p90_itl_ms", 50.0) == 8.0
    ladder[0]["failed"] = 1
    assert slo_rate(ladder, "p90_itl_ms", 50.0) == 0.0


@given(st.lists(st.tuples(st.floats(0.1, 50), st.floats(1, 100)), min_size=1, max_size=8), st.floats(1, 100))
def test_slo_rate_every_lower_rate_meets_the_bound(rows, bound):
    ladder = [{"rate": r, "p90_itl_ms": v} for r, v in rows]
    best = slo_rate(ladder, "p90_itl_ms", bound)
    assert best == 0.0 or best in [r["rate"] for r in ladder]
    assert all(r["p90_itl_ms"] <= bound for r in ladder if r["rate"] <= best)


def test_latency_summary_golden():
    outs = [(0.0, [0.5, 0.6, 0.7, 0.9], 4, None), (0.1, [0.3, 0.4], 2, None), (0.2, [], 0, "timeout")]
    s = latency_summary(outs, 2.0)
    assert s["requests"] == 2 and s["failed"] == 1 and s["tokens"] == 6 and s["tok_s"] == 3.0
    assert s["ttft_ms"] == pytest.approx(350.0)
    assert s["tpot_ms"] == pytest.approx(1e3 * np.median([0.4 / 3, 0.1]))
    assert s["p90_itl_ms"] == pytest.approx(1e3 * np.percentile([0.1, 0.1, 0.2, 0.1], 90))


def test_metric_sum_reads_counters_and_labels():
    text = ("# HELP smoe:a2a_bytes bytes\n# TYPE smoe:a2a_bytes counter\n"
            'smoe:a2a_bytes_total{layer="0",rank="0"} 1.5e3\nsmoe:a2a_bytes_total{layer="0",rank="1"} 500\n'
            'smoe:a2a_bytes_per_token{rank="0"} 99\nsmoe:a2a_bytes_created{rank="0"} 1.7e9\n')
    assert metric_sum(text, "smoe:a2a_bytes") == 2000.0
    assert metric_sum(text, "smoe:tokens") is None


def test_cli_refuses_unknown_target_before_any_work(tmp_path):
    from vllm_smoe.testbed import FIXTURE_MODEL

    r = subprocess.run([sys.executable, "-m", "vllm_smoe.tools.bench", "cluster", "--model", FIXTURE_MODEL, "--target",
                        "tpu", "--work", str(tmp_path / "w")], capture_output=True, text=True)
    assert r.returncode == 2 and "--target tpu" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "w").exists()


def test_socket_bytes_by_process():
    from vllm_smoe.tools.bench.cluster.readings import parse_ss, socket_delta

    text = """ESTAB 0      0               10.213.0.1:29708          10.213.0.2:35314 users:(("VLLM::Worker_TP",pid=5563,fd=5))
\t bbr wscale:10,10 rto:208 mss:1448 bytes_sent:567 bytes_acked:567 bytes_received:142 segs_out:5
ESTAB 0      0      [::ffff:10.213.0.1]:37425 [::ffff:10.213.0.2]:55276 users:(("vllm",pid=5563,fd=6))
\t bbr rto:204 bytes_sent:4 bytes_acked:4 bytes_received:42
ESTAB 0      0      [::ffff:10.213.0.1]:37425 [::ffff:10.213.0.1]:48608 users:(("vllm",pid=5563,fd=21))
\t bbr rto:204 bytes_sent:9999 bytes_acked:4
"""
    before = parse_ss(text)
    assert before == {("10.213.0.1:29708", "10.213.0.2:35314"): ("VLLM::Worker_TP", 567),
                      ("10.213.0.1:37425", "10.213.0.2:55276"): ("vllm", 4)}
    after = {**before, ("10.213.0.1:29708", "10.213.0.2:35314"): ("VLLM::Worker_TP", 1567),
             ("10.213.0.1:1", "10.213.0.2:2"): ("vllm", 10)}
    assert socket_delta(before, after) == {"VLLM::Worker_TP": 1000, "vllm": 10}


def _wire_check_over_a_veth(tmp_path, **kw) -> dict:
    """:func:`wire_check` at hidden 256 over two namespaces made for it (skips where they cannot
    be made), the namespaces removed after."""
    from vllm_smoe.tools.bench.cluster.netns import Net
    from vllm_smoe.tools.bench.cluster.wire import wire_check

    net = Net()
    try:
        try:
            net.up()
        except RuntimeError as e:
            pytest.skip(f"cannot make namespaces here: {e}")
        return wire_check(net, 256, str(tmp_path), port=29000 + os.getpid() % 2000, **kw)
    finally:
        net.down()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_point_to_point_exchange_counters_equal_the_veth(tmp_path):
    """The exchange alone across two namespaces: smoe's counters are what the wire carries for
    its point-to-point transport (within 3% at these small rows: gloo frames each message); the all-gather transport carries more than they say."""
    res = _wire_check_over_a_veth(tmp_path, tokens=48, steps=8)
    for name in ("smoe-p2p", "smoe-p2p-slots"):  # sizes first, or riding in padded row slots
        assert abs(res[name]["agreement"]["ratio"] - 1) < 0.03, res[name]
    assert res["smoe-gather"]["wire"]["payload"] > 1.2 * res["smoe-gather"]["counted_bytes"]
    assert res["smoe-p2p"]["wire"]["payload"] < res["vllm"]["wire"]["payload"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_hierarchical_exchange_crosses_nodes_once_per_node(tmp_path):
    """Two namespaces of two gloo ranks each: the hierarchical exchange's node counters are what
    crosses the veth, and fewer bytes cross than with each row sent to each rank."""
    from vllm_smoe.tools.bench.cluster.report import exchange_table

    res = _wire_check_over_a_veth(tmp_path, tokens=96, steps=6, per_node=2)
    for name, tol in (("smoe-p2p", 0.03), ("smoe-p2p-slots", 0.03), ("smoe-hier", 0.05)):
        # the hierarchical exchange makes twice the messages (gloo frames each; rows of 1 KiB here)
        assert abs(res[name]["agreement"]["ratio"] - 1) < tol, (name, res[name])
    assert res["smoe-hier"]["wire"]["payload"] < 0.9 * res["smoe-p2p"]["wire"]["payload"]
    assert res["smoe-p2p"]["wire"]["payload"] < res["vllm"]["wire"]["payload"]
    assert "2 nodes x 2 gloo ranks" in "\n".join(exchange_table(res))


def test_collectives_read_from_metrics_per_served_step():
    from vllm_smoe.tools.bench.cluster.readings import collective_counts, collectives_per_step
    from vllm_smoe.tools.bench.cluster.report import collectives_table

    def text(ar, a2a, steps):
        return "\n".join([
            "# TYPE smoe:collectives_total counter",
            f'smoe:collectives_total{{group="tp",kind="all_reduce",rank="0"}} {ar}',
            f'smoe:collectives_total{{group="tp",kind="all_reduce",rank="1"}} {ar}',
            f'smoe:collectives_total{{group="ep",kind="all_to_all",rank="1"}} {a2a}',
            f'smoe:collective_steps_total{{rank="0"}} {steps}', f'smoe:collective_steps_total{{rank="1"}} {steps}',
            'smoe:collectives_created{group="tp",kind="all_reduce",rank="0"} 1.7e9', ""])
    before, after = collective_counts(text(10, 4, 5)), collective_counts(text(10 + 9 * 3, 4 + 8 * 3, 5 + 3))
    assert before == ({"tp all_reduce": 20.0, "ep all_to_all": 4.0}, 10.0)
    per = collectives_per_step(before, after)  # two ranks, three steps each
    assert per == {"ep all_to_all": 4.0, "tp all_reduce": 9.0}
    assert collectives_per_step(after, after) is None and collective_counts("") == ({}, 0.0)
    lines = collectives_table({"tp": {"collectives_per_step": per}, "x": {"error": "e"}}, 4)
    assert lines[-1] == "| tp | 13.0 | 3.25 | ep all_to_all 4.00, tp all_reduce 9.00 |"


def test_every_configuration_loads_the_plugin_and_only_ep_ones_turn_ep_on():
    from vllm_smoe.tools.bench.cluster.configs import configurations

    for name, c in configurations("tp.yaml", "dp.yaml", "/m").items():
        f = list(c["flags"])
        assert f[f.index("--plugin") + 1] == "smoe" and c["collectives"], name  # the counters need the plugin
        assert ("--enable-expert-parallel" in f) == (name != "tp"), name
        assert all(not x.startswith("--") or x in ("--plugin", "--enable-expert-parallel", "--additional-config")
                   or x.startswith("--smoe-") for x in f), (name, f)


def test_counters_beside_the_veth_are_the_bytes_it_can_carry():
    """Where a node holds two ranks (dptp-*), bytes between them never reach the veth: the
    counters set beside it are the bytes between nodes; elsewhere every rank is its own node."""
    from vllm_smoe.tools.bench.cluster.configs import configurations

    cfgs = configurations("tp.yaml", "dp.yaml", "/m", None, "dptp.yaml")
    for name, c in cfgs.items():
        want = "smoe:a2a_node_bytes" if name.startswith("dptp") else "smoe:a2a_bytes"
        assert c["counter"] == want, name


def test_smoe_log_keeps_each_ranks_last_line():
    from vllm_smoe.tools.bench.cluster.nodes import smoe_log_lines

    def dp(rank, frac):
        return f"(Worker_DP{rank}) INFO [sparse_a2a.py:470] smoe: dp rank {rank} served {frac} of its requests'"

    node0 = [dp(0, 0.5), dp(0, 0.6), "smoe: advice: b", "smoe: advice: a"]
    node1 = [dp(1, 0.4), dp(1, 0.7), dp(1, 0.8), "smoe: advice: a"]
    got = smoe_log_lines("\n".join(node0 + node1))
    assert got == ["dp rank 0 served 0.6 of its requests'", "dp rank 1 served 0.8 of its requests'", "a", "b"]
    spec = "x smoe: speculate (predictor tables): rank {} served 0.{} of its expert activations"
    assert smoe_log_lines("\n".join([spec.format(1, 1), spec.format(0, 2), spec.format(1, 3)])) == [
        "speculate (predictor tables): rank 0 served 0.2 of its expert activations",
        "speculate (predictor tables): rank 1 served 0.3 of its expert activations"]
