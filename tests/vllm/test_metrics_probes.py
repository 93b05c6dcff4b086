"""Issue 65's metrics probes, served: DP = 2 with `--plugin smoe` alone (no VLLM_PLUGINS), where
vLLM runs two API servers; /metrics carries smoe's families, current once the traffic stopped."""

import glob
import os
import re
import time
import urllib.request

import pytest

from tests.support import REPO


def test_dp2_without_vllm_plugins_serves_smoes_families_current_while_idle(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.testbed import FIXTURE_MODEL
    from vllm_smoe.tools.server_process import VllmServer

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    rec = tmp_path / "rec"
    placement = os.path.join(REPO, "configs", "tiny-4dom-dp2.yaml")
    prompts = [[7 + i, 300 + i, 42, 9 + i, 1000 + 3 * i] for i in range(6)]
    s = VllmServer(FIXTURE_MODEL, "--data-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe",
                   "--smoe-placement", placement, "--smoe-record", str(rec), "--smoe-log-interval", "1",
                   "--no-enable-prefix-caching", log=tmp_path / "s.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        s.wait(timeout=900)  # two engines and two API servers start slowly on a shared CPU
        s.complete(prompts, max_tokens=4)
        time.sleep(4)  # idle: no step after the burst; files closed (2 s), counters read (0.5 s), bridged (0.5 s)
        with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        s.__exit__(None, None, None)
    log = open(tmp_path / "s.log").read()
    assert "through prometheus_client's multiprocess files" in log
    metric = {}
    for line in text.splitlines():
        m = re.match(r'^(smoe:[a-z0-9_]+)(\{[^}]*\})? (\S+)$', line)
        if m:
            metric[(m.group(1), m.group(2) or "")] = float(m.group(3))
    written = sum(v for (n, _), v in metric.items() if n == "smoe:record_tokens_total")
    on_disk = sum(len(open_trace(f)["token_ids"]) for f in glob.glob(str(rec / "trace-*.npz")))
    assert written == on_disk > 0, (written, on_disk)
    served = sum(len(p) + 4 - 1 for p in prompts)
    a2a = sum(v for (n, _), v in metric.items() if n == "smoe:a2a_tokens_total")
    assert a2a > 0 and written == served
