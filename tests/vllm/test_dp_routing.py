"""Attention-DP request routing: the shared rule (placement/dp.py), request-level placement,
the front-end router around vLLM's balancer, the /smoe/route endpoint, served-step counters."""

import os

import numpy as np
import pytest

from tests.support import REPO, built, plain_prompts
from tests.unit.test_dp_routing import DP2


# ---- vllm serve --data-parallel-size 2: routing changes where requests run, never their tokens ----

def _mixed(n):
    from vllm_smoe.tools.bench.common import mixed_prompts as _mixed_prompts
    from vllm_smoe.testbed import FIXTURE_TRACES

    return [p[: 3 + i % 32] for i, p in enumerate(_mixed_prompts(FIXTURE_TRACES["heldout"], n, 64))]


@plain_prompts
def _mixed32():
    """32 held-out prompts of all four workloads, 3..34 tokens."""
    return _mixed(32)


@plain_prompts
def _long8():
    """8 held-out prompts of 150 tokens."""
    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.tools.bench.common import mixed_prompts as _mixed_prompts

    return [p[:150] for p in _mixed_prompts(FIXTURE_TRACES["heldout"], 8, 150)]


def _concurrent(server, prompts, clients=8):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(clients) as ex:
        return list(ex.map(lambda p: server.complete([p])[0], prompts))


def test_dp2_serving_with_and_without_smoe_routing_gives_plain_tokens(tmp_path, plain_served):
    """32 held-out prompts of all four workloads, 8 concurrent clients, DP=2 + EP on vLLM's CPU
    build: smoe's request-level placement with smoe's routing (sparse all2all, the /smoe/route
    endpoint allowlisted), the same placement with routing off on vLLM's own
    allgather-reducescatter, and a placement with expert copies (redundant slots); all against
    plain single-rank vLLM (prompts one at a time)."""
    pytest.importorskip("vllm")
    import json
    import urllib.request

    from vllm_smoe.tools.server_process import VllmServer
    from vllm_smoe.testbed import FIXTURE_MODEL

    ATOL = 1e-4
    prompts = _mixed32()
    plain = plain_served(prompts)
    dp = ("--data-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe", "--smoe-log-interval", "0.2")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_PLUGINS": "smoe"}
    runs = {"vllm": dp + ("--smoe-all2all", "vllm", "--smoe-placement", DP2, "--smoe-dp-routing", "off"),
            "routed": dp + ("--smoe-placement", DP2),
            # a placement with copies: each DP rank routes its own requests' rows to its own copies
            "replicas": dp + ("--smoe-placement", os.path.join(REPO, "configs", "tiny-4dom-ep2-r4.yaml"))}
    for name, flags in runs.items():
        with VllmServer(FIXTURE_MODEL, *flags, log=tmp_path / f"{name}.log", env=env) as s:
            out = _concurrent(s, prompts)
            if name == "routed":
                want = preferred_rank_of(prompts[0])
                req = urllib.request.Request(f"http://127.0.0.1:{s.port}/smoe/route",
                                             data=json.dumps({"prompt_token_ids": prompts[0]}).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as r:
                    assert json.load(r)["rank"] == want
                import time

                time.sleep(0.3)
                s.complete([prompts[1][:1]], max_tokens=1)  # one more step: the counters' lines cover the run
        assert [t for t, _ in out] == [t for t, _ in plain], name
        np.testing.assert_allclose([lp for _, lp in out], [lp for _, lp in plain], rtol=0, atol=ATOL, err_msg=name)
        log = open(tmp_path / f"{name}.log").read()
        assert ("sparse de-duplicated all2all manager on group ep" in log) == (name != "vllm")
        routed = [int(x) for x in _re_all(r"smoe dp routing: \d+ requests: (\d+) by the placement", log)]
        if name == "replicas":
            assert "replicas: 36 physical expert slots per layer (4 redundant), rank 1 routes to its own copies" in log
        if name in ("routed", "replicas"):
            assert sum(routed) > 0, "no request was routed by the placement"
            from vllm_smoe.tools.bench.common import dp_numbers as _dp_numbers

            served = _dp_numbers(str(tmp_path / f"{name}.log"))
            assert set(served["tokens_per_rank"]) == {0, 1} and 0 < served["local_share"] <= 1
        else:
            assert not routed


def preferred_rank_of(ids):
    from vllm_smoe.serving.dp.router import preferred_rank

    return preferred_rank(DP2, ids, 2)[0]


def _re_all(pattern, text):
    import re

    return re.findall(pattern, text)


def test_deepseek_v3_dp2_with_a_grouped_dp_placement_and_routing_gives_plain_tokens(tmp_path):
    """The trained DeepSeek-V3 fixture (MLA, shared expert, sigmoid + bias routing in 4 groups):
    smoe-place build --mode dp reads n_group and keeps the groups whole; served at DP=2 + EP with
    smoe's routing, 16 held-out prompts from 8 clients give single-rank vLLM's greedy tokens (both
    with the CPU fixes, which MLA's rope needs on this build)."""
    pytest.importorskip("vllm")
    from vllm_smoe.placement.groups import broken_group
    from vllm_smoe.formats.placement_file import load_placement
    from vllm_smoe.tools.server_process import VllmServer
    from vllm_smoe.testbed import FIXTURES

    model, traces = FIXTURES["deepseek_v3"]
    out = built("place_cli", "build", "--trace", traces["train"], "--ep-size", 2, "--model", model, "--mode", "dp")
    p = load_placement(str(out))
    assert p.groups == 4 and all(broken_group(e2r, 4) == -1 for e2r in p.expert2rank)
    from vllm_smoe.tools.bench.common import mixed_prompts as _mixed_prompts

    prompts = [q[: 3 + i % 32] for i, q in enumerate(_mixed_prompts(traces["heldout"], 16, 64))]
    with VllmServer(model, "--plugin", "smoe", log=tmp_path / "plain.log") as s:
        plain = s.complete(prompts)
    with VllmServer(model, "--data-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe",
                    "--smoe-placement", str(out), "--smoe-log-interval", "0.2", log=tmp_path / "dp2.log",
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as s:
        dp2 = _concurrent(s, prompts)
    assert [t for t, _ in dp2] == [t for t, _ in plain]
    np.testing.assert_allclose([lp for _, lp in dp2], [lp for _, lp in plain], rtol=0, atol=1e-4)
    assert sum(int(x) for x in _re_all(r"smoe dp routing: \d+ requests: (\d+) by the placement",
                                       open(tmp_path / "dp2.log").read())) > 0


def test_two_nodes_of_dp_tp_ep_hierarchical_exchange_gives_plain_tokens(tmp_path, plain_served):
    """TP inside a node, EP across nodes: two vLLM nodes on this host (DP=2, one engine each,
    node 1 headless) of TP=2, expert parallel over all 4 ranks, smoe's DP placement built over
    nodes (one node per engine) with its request routing, and the sparse exchange hierarchical
    across the nodes (prefill-sized steps; decode steps go flat). 8 held-out prompts of 150
    tokens from 8 clients give single-rank vLLM's greedy tokens. Recorded as it serves: under
    vLLM's sequence-parallel MoE each TP rank routes only its chunk, and each engine's recording
    equals transformers' router row for row (issue 62, item 3)."""
    pytest.importorskip("vllm")
    import signal
    import subprocess

    from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES
    from vllm_smoe.tools.server_process import CPU_ARGS, VllmServer, free_port, vllm_executable

    placement = built("place_cli", "build", "--trace", FIXTURE_TRACES["train"], "--ep-size", 4, "--mode", "dp",
                      "--nodes", 2)
    prompts = _long8()
    plain = plain_served(prompts)
    flags = ("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--tensor-parallel-size", "2",
             "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port()),
             "--enable-expert-parallel", "--plugin", "smoe", "--smoe-placement", str(placement),
             "--smoe-log-interval", "0.2", "--smoe-record", str(tmp_path / "rec"))
    # each node on a core of its own, as the emulated cluster runs them. With both nodes' TP
    # ranks on "0|1" (a rank of each engine on each core) the first step that one engine served
    # while the other ran its dummy batch hung in the exchange's all_to_all, two ranks sharing a
    # core each waiting for the other's rows (9 starts of 9, splits checked equal on both sides;
    # not reproduced by gloo alone); with a core per node it passes (3 starts of 3)
    env = {"VLLM_PLUGINS": "smoe"}
    with open(tmp_path / "node1.log", "w") as log1:
        node1 = subprocess.Popen([vllm_executable(), "serve", FIXTURE_MODEL, *CPU_ARGS, *flags,
                                  "--data-parallel-start-rank", "1", "--headless"], stdout=log1,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **env, "VLLM_CPU_OMP_THREADS_BIND": "1|1"})
    try:
        with VllmServer(FIXTURE_MODEL, *flags, "--api-server-count", "1", log=tmp_path / "node0.log",
                        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0|0"}) as s:
            out = _concurrent(s, prompts)
            import time

            time.sleep(0.5)
            s.complete([prompts[0][:1]], max_tokens=1)  # one more step: the counters' lines cover the run
    finally:
        os.killpg(node1.pid, signal.SIGTERM)
        node1.wait(60)
    assert [t for t, _ in out] == [t for t, _ in plain]
    np.testing.assert_allclose([lp for _, lp in out], [lp for _, lp in plain], rtol=0, atol=1e-4)
    logs = open(tmp_path / "node0.log").read() + open(tmp_path / "node1.log").read()
    assert "sparse all2all over 4 ranks on 2 node(s) (ranks' nodes [0, 0, 1, 1]): hierarchical" in logs
    assert max(int(x) for x in _re_all(r"(\d+) layer steps hierarchical", logs)) > 0
    assert sum(int(x) for x in _re_all(r"smoe dp routing: \d+ requests: (\d+) by the placement", logs)) > 0
    # each TP rank routed its chunk of the step, gathered by the recorder
    assert "smoe record: router rows in layout sp-chunk" in logs and "not recorded" not in logs
    # every request recorded once, by the engine that ran it (the last one: the counters' request)
    _assert_recorded_as_router(tmp_path / "rec", 2, prompts + [prompts[0][:1]],
                               [len(lp) - 1 for _, lp in out] + [0])


def _assert_recorded_as_router(rec_dir, dp_size, prompts, decoded):
    """Each DP engine's recording: every request's rows in position order are one of ``prompts``
    followed by ``decoded[i]`` generated tokens (all but the last), each request is recorded by
    one engine only, and every row's top-k set equals transformers' router on those tokens."""
    import glob

    import torch
    from transformers import AutoModelForCausalLM

    from vllm_smoe.formats.trace import read_traces
    from vllm_smoe.testbed import FIXTURE_MODEL
    from vllm_smoe.testbed.record import router_topk

    model = AutoModelForCausalLM.from_pretrained(FIXTURE_MODEL, dtype=torch.float32).eval()
    seen = []
    for d in range(dp_size):
        files = sorted(glob.glob(os.path.join(rec_dir, f"trace-dp{d}-*.npz")))
        assert files, f"DP rank {d} recorded nothing"
        meta, arr, _ = read_traces(files)
        for r in np.unique(arr["request_ids"]):
            rows = np.flatnonzero(arr["request_ids"] == r)
            rows = rows[np.argsort(arr["positions"][rows])]
            np.testing.assert_array_equal(arr["positions"][rows], np.arange(rows.size))  # no gaps, no repeats
            seq = arr["token_ids"][rows]
            i = max((k for k, p in enumerate(prompts) if seq[: len(p)].tolist() == list(p)),
                    key=lambda k: len(prompts[k]), default=None)
            assert i is not None and meta.extra["dp_rank"] == d, f"DP rank {d}: request {r} ran no prompt sent"
            assert seq.size == len(prompts[i]) + decoded[i], (d, i)
            want, _ = router_topk(model, torch.from_numpy(seq.astype(np.int64))[None], meta.top_k)
            got = arr["topk_ids"][rows].astype(np.int32)
            bad = int((np.sort(got, -1) != np.sort(want, -1)).any(-1).sum())
            assert bad == 0, f"DP rank {d}, prompt {i}: {bad} of {got.size // got.shape[-1]} (token, layer) top-k differ"
            seen.append(i)
    assert sorted(seen) == list(range(len(prompts)))
