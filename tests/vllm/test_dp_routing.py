"""Attention-DP request routing: the shared rule (placement/dp.py), request-level placement,
the front-end router around vLLM's balancer, the /smoe/route endpoint, served-step counters."""

import os

import numpy as np
import pytest

from tests.support import REPO
from tests.unit.test_dp_routing import DP2


# ---- vllm serve --data-parallel-size 2: routing changes where requests run, never their tokens ----

def _mixed(n):
    from vllm_smoe.tools.bench.common import mixed_prompts as _mixed_prompts
    from vllm_smoe.testbed import FIXTURE_TRACES

    return [p[: 3 + i % 32] for i, p in enumerate(_mixed_prompts(FIXTURE_TRACES["heldout"], n, 64))]


def _concurrent(server, prompts, clients=8):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(clients) as ex:
        return list(ex.map(lambda p: server.complete([p])[0], prompts))


def test_dp2_serving_with_and_without_smoe_routing_gives_plain_tokens(tmp_path):
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
    prompts = _mixed(32)
    with VllmServer(FIXTURE_MODEL, log=tmp_path / "plain.log") as s:
        plain = s.complete(prompts)
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
    from vllm_smoe.serving.dp_router import preferred_rank

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
    import subprocess
    import sys

    from vllm_smoe.placement.groups import broken_group
    from vllm_smoe.formats.placement_file import load_placement
    from vllm_smoe.tools.server_process import VllmServer
    from vllm_smoe.testbed import FIXTURES

    model, traces = FIXTURES["deepseek_v3"]
    out = tmp_path / "v3-dp2.yaml"
    subprocess.run([sys.executable, "-m", "vllm_smoe.tools.place_cli", "build", "--trace", traces["train"], "--ep-size", "2",
                    "--model", model, "--mode", "dp", "-o", str(out)], check=True, capture_output=True, text=True)
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
