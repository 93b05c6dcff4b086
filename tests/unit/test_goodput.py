"""The goodput mode of ``smoe-bench cluster`` without root: length distributions, attainment,
targets, the rate search, the per-batch link (goldens), the plan and the report."""

import math
import types

import numpy as np
import pytest

from vllm_smoe.tools.bench.cluster.goodput import (attainment, request_latencies, search_rate, spread,
                                                    unloaded_targets)
from vllm_smoe.tools.bench.cluster.link import (GEMM_SHAPE, TARGETS, link_for_rows, link_settings,
                                                 roofline_step_s)
from vllm_smoe.tools.bench.cluster.mixes import MIXES, draw_lengths, workload_prompts


def test_lengths_are_seeded_clipped_and_keep_each_mixs_proportion():
    for mix, m in MIXES.items():
        p, o = draw_lengths(mix, 4000, seed=3)
        p2, o2 = draw_lengths(mix, 4000, seed=3)
        assert (p == p2).all() and (o == o2).all() and p.dtype == np.int64
        assert p.min() >= m["prompt"][2] and p.max() <= m["prompt"][3]
        assert o.min() >= m["output"][2] and o.max() <= m["output"][3]
        assert abs(np.median(p) - m["prompt"][0]) <= 0.05 * m["prompt"][0] + 1
        assert (p + o).max() <= 512  # the testbed's --max-model-len
        assert m["rates"][0] < m["rates"][1]
    pre, dec = draw_lengths("prefill-heavy", 1000, 0), draw_lengths("decode-heavy", 1000, 0)
    assert np.median(pre[0] / pre[1]) > 10 and np.median(dec[1] / dec[0]) >= 2
    with pytest.raises(ValueError, match="mix 'bulk'"):
        draw_lengths("bulk", 3, 0)


def test_prompts_are_windows_of_one_workload_each_and_rarely_share_a_prefix():
    tok = np.arange(10_000, dtype=np.int32)
    dom = np.repeat(np.arange(4, dtype=np.int8), 2500)
    lens = np.array([300, 17, 480, 64] * 50)
    ps = workload_prompts(tok, dom, lens, seed=1)
    assert [len(p) for p in ps] == lens.tolist()
    for i, p in enumerate(ps):
        assert np.all(np.diff(p) == 1) and dom[p[0]] == dom[p[-1]] == i % 4  # contiguous, one workload
    assert len({tuple(p[:16]) for p in ps}) == len(ps)
    assert ps == workload_prompts(tok, dom, lens, seed=1)
    with pytest.raises(ValueError, match="3000 tokens"):
        workload_prompts(tok, dom, np.array([3000]), seed=0)


def test_attainment_counts_each_target_both_and_failures_as_misses():
    outs = [(0.0, [0.1, 0.2, 0.3], 3, None),      # ttft 0.1, tpot 0.1
            (0.0, [0.5, 0.55, 0.6], 3, None),     # ttft 0.5, tpot 0.05
            (0.0, [0.05, 0.45], 2, None),         # ttft 0.05, tpot 0.4
            (0.0, [0.05], 1, None),               # one token: no TPOT, meets any
            (0.0, [], 0, "ConnectionError()")]    # failed
    lat = request_latencies(outs)
    att = attainment(lat, {"ttft_s": 0.2, "tpot_s": 0.2})
    assert att == {"ttft": 3 / 5, "tpot": 3 / 5, "both": 2 / 5}
    t = unloaded_targets(lat, [3, 3, 2, 1, 0], 3.0)
    assert math.isclose(t["ttft_s"], 3 * 0.075) and math.isclose(t["tpot_s"], 3 * 0.075)
    # one request's time: 0.1 + 2 x 0.1, 0.5 + 2 x 0.05, 0.05 + 0.4, 0.05 -> median 0.375
    assert math.isclose(t["unloaded_request_s"], 0.375)
    with pytest.raises(RuntimeError, match="every unloaded request failed"):
        unloaded_targets(request_latencies(outs[-1:]), [0], 3.0)


@pytest.mark.parametrize("capacity", [0.2, 0.9, 1.7, 3.3, 7.9])
def test_search_finds_the_knee_of_a_falling_attainment_within_its_resolution(capacity):
    seen = []

    def measure(rate):
        seen.append(rate)
        return 1.0 if rate <= capacity else 0.5

    lo, hi, steps = 0.125, 16.0, 5
    r = search_rate(measure, lo, hi, steps)
    res = (hi / lo) ** (1 / 2 ** steps)
    assert r["goodput"] <= capacity < r["goodput"] * res * 1.0001
    assert len(seen) == steps and r["tried"][0][0] == pytest.approx(math.sqrt(lo * hi))
    assert r["bracket"][0] == r["goodput"] and (r["bracket"][1] is None or r["bracket"][1] > capacity)


def test_search_measures_the_lowest_rate_before_saying_zero():
    r = search_rate(lambda rate: 0.0, 0.5, 8.0, 3)
    assert r["goodput"] == 0.0 and r["tried"][-1] == [0.5, 0.0] and len(r["tried"]) == 4
    r = search_rate(lambda rate: 1.0 if rate <= 0.5 else 0.0, 0.5, 8.0, 3)
    assert r["goodput"] == 0.5
    with pytest.raises(ValueError, match="rate range"):
        search_rate(lambda rate: 1.0, 2.0, 1.0, 3)


def test_spread_is_range_over_median():
    assert spread([1.0, 1.1, 0.9]) == pytest.approx(0.2)
    assert spread([1.0]) is None and spread([None, 2.0]) is None


def test_roofline_golden():
    h, n = GEMM_SHAPE
    # 8 rows: bound by reading the bf16 weights at 4.8 TB/s
    assert roofline_step_s(8, "ib-ndr") == pytest.approx(2 * (h * n + 8 * (h + n)) / 4.8e12)
    # 512 rows: bound by 989 TFLOP/s
    assert roofline_step_s(512, "ib-ndr") == pytest.approx(2 * 512 * h * n / 989e12)


def test_link_for_rows_golden_and_agrees_with_the_decode_link_at_small_batches():
    h, n = GEMM_SHAPE
    read_bw = 6e9  # a host reading fp32 weights at 6 GB/s; its 256-row GEMM at 95 GFLOP/s
    host_s = {8: 4 * h * n / read_bw, 256: 2 * 256 * h * n / 95e9}
    small = link_for_rows(host_s, "ib-ndr", 8)
    # the host's fp32 step against the target's bf16 one; fp32 on the wire too: x 4/2
    scale = host_s[8] / (2 * (h * n + 8 * (h + n)) / 4.8e12)
    assert small["scale"] == pytest.approx(scale) and small["rate_bytes_s"] == pytest.approx(50e9 * 2 / scale)
    old = link_settings({"gemm_flops": 95e9, "read_bw": read_bw}, "ib-ndr", "decode")
    assert small["rate_bytes_s"] == pytest.approx(old["rate_bytes_s"], rel=0.01)  # the 8-row GEMV's link
    big = link_for_rows(host_s, "ib-ndr", 256)
    assert big["target_step_s"] == pytest.approx(2 * 256 * h * n / 989e12)
    assert big["rate_bytes_s"] == pytest.approx(50e9 * 2 * big["target_step_s"] / host_s[256])
    assert big["delay_s"] == pytest.approx(TARGETS["ib-ndr"]["latency"] * big["scale"])
    with pytest.raises(ValueError, match="rows 64"):
        link_for_rows(host_s, "ib-ndr", 64)


def _args(**kw):
    base = dict(mixes=["prefill-heavy", "decode-heavy"], large_batch=64, unloaded_requests=2, search_steps=2,
                goodput_warmup=1, goodput_requests=3, seed=0, goal=0.9, slo_scale=3.0, max_seqs=64)
    return types.SimpleNamespace(**{**base, **kw})


def test_plan_is_the_same_requests_for_every_start_and_a_link_per_mix():
    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.tools.bench.cluster.goodput_plan import adopt_targets, host_rows, plan_goodput

    a = _args()
    assert host_rows(a) == [32, 128]
    host_s = {32: 0.01, 128: 0.1}
    ph = plan_goodput(a, host_s, "ib-ndr", FIXTURE_TRACES["heldout"])
    assert [p["name"] for p in ph] == ["decode-c64", "goodput-prefill-heavy", "goodput-decode-heavy"]
    assert ph == plan_goodput(a, host_s, "ib-ndr", FIXTURE_TRACES["heldout"])
    g = ph[1]
    assert len(g["prompts"]) == len(g["outputs"]) == 2 + 3 * (1 + 3)
    assert g["link"]["rows"] == 128 and ph[0]["link"]["rows"] == 32 and ph[0]["concurrency"] == 64
    assert all(p["link"] is None for p in plan_goodput(a, host_s, "none", FIXTURE_TRACES["heldout"]))
    adopt_targets(ph, {"phases": [{"kind": "goodput", "name": "goodput-prefill-heavy", "targets": {"ttft_s": 1}}]},
                  "tp#0")
    assert ph[1]["targets"] == {"ttft_s": 1, "set_by": "tp#0"} and ph[2]["targets"] is None
    only = plan_goodput(_args(mixes=[]), host_s, "ib-ndr", FIXTURE_TRACES["heldout"])
    assert [p["name"] for p in only] == ["decode-c64"]


def _start(smoe, goodputs, greedy=(1, 2)):
    phases = []
    for mix, gp in goodputs.items():
        phases.append({"kind": "goodput", "mix": mix, "name": f"goodput-{mix}", "criterion": "ttft", "goal": 0.9,
                       "targets": {"ttft_s": 0.3, "tpot_s": 0.1, "scale": 3.0},
                       "own_unloaded": {"unloaded_ttft_s": 0.1, "unloaded_tpot_s": 0.03},
                       "link": {"rate_bit": 2e6}, "goodput": gp,
                       "runs": [{"rate": gp, "attainment": {"ttft": 0.95}}, {"rate": 2 * gp, "attainment": {"ttft": 0.5}}]})
    return {"smoe": smoe, "greedy": list(greedy), "phases": phases}


def test_summary_takes_each_sides_best_median_and_the_spread(tmp_path):
    from vllm_smoe.tools.bench.cluster.goodput_report import markdown_goodput, plot_goodput, summarise_goodput

    res = {"ib-ndr": {"tp#0": _start(False, {"prefill-heavy": 1.0}), "tp#1": _start(False, {"prefill-heavy": 1.2}),
                      "dp-ep#0": _start(False, {"prefill-heavy": 2.0}), "dp-ep#1": _start(False, {"prefill-heavy": 2.0}),
                      "dp-ep-smoe#0": _start(True, {"prefill-heavy": 3.0}),
                      "dp-ep-smoe#1": _start(True, {"prefill-heavy": 3.3}, greedy=(1, 3)),
                      "dp-ep-smoe#2": {"error": "node 1 exited with 1\n..."}}}
    s = summarise_goodput(res)["ib-ndr"]
    m = s["mixes"]["prefill-heavy"]
    k = 2 ** (0.05 / 0.45)  # each start's crossing: 0.95 at g, 0.5 at 2 g, interpolated in log rate
    assert m["configs"]["tp"]["median"] == pytest.approx(1.1 * k) and m["configs"]["tp"]["spread"] == pytest.approx(0.2 / 1.1)
    assert m["configs"]["tp"]["grid"] == [1.0, 1.2] and m["configs"]["tp"]["open"] == [False, False]
    assert m["best_vllm"] == ("dp-ep", pytest.approx(2.0 * k)) and m["best_smoe"] == ("dp-ep-smoe", pytest.approx(3.15 * k))
    assert m["ratio"] == pytest.approx(3.15 / 2.0)
    assert s["greedy_equal_tp"]["dp-ep-smoe#1"] is False and s["greedy_equal_tp"]["dp-ep#0"] is True
    md = markdown_goodput({"ib-ndr": s})
    assert "(dp-ep): 1.5" in md and "NOT dp-ep-smoe#1" in md and "start dp-ep-smoe#2 failed: node 1 exited with 1" in md
    res["ib-ndr"]["dp-ep-smoe#0"]["phases"][0]["runs"] = [{"rate": 3.0, "attainment": {"ttft": 0.95}}]  # never missed
    s2 = summarise_goodput({"ib-ndr": {k: v for k, v in res["ib-ndr"].items() if not k.startswith("tp")}})["ib-ndr"]
    md2 = markdown_goodput({"ib-ndr": s2})
    m2 = s2["mixes"]["prefill-heavy"]
    assert m2["ratio_bound"] == ">=" and "&ge; 3" in md2 and "at least 1." in md2  # smoe's median over 3.0 and 3.3 k
    for r in res["ib-ndr"].values():
        for p in r.get("phases", []):
            p["runs"] = [{"rate": p["goodput"], "attainment": {"ttft": 0.95}}]  # every search open
    s3 = summarise_goodput({"ib-ndr": {k: v for k, v in res["ib-ndr"].items() if not k.startswith("tp")}})["ib-ndr"]
    assert s3["mixes"]["prefill-heavy"]["ratio"] is None and "lower bounds" in markdown_goodput({"ib-ndr": s3})
    assert "not checked (no plain TP start)" in md2
    plot_goodput(res, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 1000


def test_cli_parses_the_mode_and_refuses_an_unknown_mix(capsys):
    from vllm_smoe.tools.bench import main

    with pytest.raises(SystemExit) as e:
        main(["cluster", "--goodput", "--mixes", "chat,bulk"])
    assert e.value.code == 2 and "unknown: bulk" in capsys.readouterr().err


def test_crossing_interpolates_between_the_bracket_on_a_log_scale():
    from vllm_smoe.tools.bench.cluster.goodput import crossing

    r, open_ = crossing([[1.0, 1.0], [4.0, 0.5], [2.0, 0.95]], 0.9)
    # between 2.0 (0.95) and 4.0 (0.5): a tenth of the way in log rate
    assert not open_ and r == pytest.approx(2.0 * 2 ** (0.05 / 0.45))
    assert crossing([[1.0, 0.95], [2.0, 0.92]], 0.9) == (2.0, True)
    assert crossing([[1.0, 0.5]], 0.9) == (0.0, False)


@pytest.mark.parametrize("mixes", [",", "chat,chat", ""])
def test_cli_refuses_an_empty_or_repeated_mix_list(mixes, capsys):
    from vllm_smoe.tools.bench import main

    with pytest.raises(SystemExit) as e:
        main(["cluster", "--goodput", "--mixes", mixes])
    assert e.value.code == 2 and "choose each once" in capsys.readouterr().err


def test_nothing_to_measure_and_a_fixed_rate_are_refused_before_any_work(tmp_path):
    from vllm_smoe.tools.bench import main

    assert main(["cluster", "--goodput", "--mixes", "none", "--large-batch", "0", "--work", str(tmp_path)]) == 2
    assert main(["cluster", "--goodput", "--rate", "1e8", "--work", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())
