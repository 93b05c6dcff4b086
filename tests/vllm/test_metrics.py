"""smoe's counters on /metrics: snapshots, the collector, and a served check (speculate, TP=2)."""

import os
import re
import time
import urllib.request

import pytest

from tests.support import CONFIGS


def test_speculate_serves_its_counters_on_metrics(tmp_path):
    """vllm serve at TP=2 + EP, mode speculate: /metrics carries smoe's families, they count
    served tokens only (each distinct prompt's tokens plus its generated ones but the last, per
    MoE layer, summed over ranks; no warm-up or profile rows) and agree with the log line read
    from the same snapshot."""
    pytest.importorskip("vllm")
    from vllm_smoe.tools.server_process import VllmServer
    from vllm_smoe.testbed import FIXTURE_MODEL

    placement = os.path.join(CONFIGS, "tiny-4dom-ep2.yaml")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    prompts = [[7 + i, 300 + i, 42, 9 + i, 1000 + 3 * i] for i in range(6)]  # distinct: no prefix-cache hits
    max_tokens = 4
    shm_before = set(os.listdir("/dev/shm"))
    with VllmServer(FIXTURE_MODEL, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe",
                    "--smoe-mode", "speculate", "--smoe-placement", placement, "--smoe-log-interval", "0.2",
                    "--no-enable-prefix-caching", log=tmp_path / "s.log", env=env) as s:
        # smoe's EP group maps its shared memory and removes the names at once (vLLM's own
        # groups keep theirs in /dev/shm after exit): none is there while it serves, or after
        ep_shm = [n for n in os.listdir("/dev/shm") if "-ep:" in n and n not in shm_before]
        s.complete(prompts, max_tokens=max_tokens)
        time.sleep(0.5)
        s.complete([[5]], max_tokens=1)  # one more step past the interval: every rank publishes after it
        time.sleep(0.3)
        with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=30) as r:
            text = r.read().decode()
    assert ep_shm == [] and not [n for n in os.listdir("/dev/shm") if "-ep:" in n and n not in shm_before]
    assert "could not remove the EP group's shared memory" not in open(tmp_path / "s.log").read()
    metric = {}
    for line in text.splitlines():
        m = re.match(r'^(smoe:[a-z0-9_]+)(\{[^}]*\})? (\S+)$', line)
        if m:
            metric[(m.group(1), m.group(2) or "")] = float(m.group(3))
    # counters are published after a step (outside the forward), so the extra request's one step
    # (one prompt token, no decode) is in them
    served = sum(len(p) + max_tokens - 1 for p in prompts) + 1
    for layer in range(4):
        rows = sum(v for (n, lab), v in metric.items() if n == "smoe:tokens_total" and f'layer="{layer}"' in lab)
        assert rows == served, (layer, rows, served)
    ratio = metric[("smoe:local_activation_ratio", '{layer="all"}')]
    from vllm_smoe.tools.bench.common import SPEC_LINE as _SPEC_LINE, rank_numbers as _rank_numbers

    logged = _rank_numbers(open(tmp_path / "s.log").read().splitlines(), _SPEC_LINE)
    assert ratio == pytest.approx(logged["local_share"], abs=2e-3)
    assert 0 < metric[("smoe:predictor_hit_rate", '{layer="all"}')] <= 1
    assert metric[("smoe:a2a_bytes_per_token", "")] > 0
