"""smoe's counters on /metrics: snapshots, the collector, and a served check (speculate, TP=2)."""

import json
import os

import pytest

from vllm_smoe.serving.observe.metrics import SmoeCollector, families, publish, read_snapshots


def _values(fams):
    """{(name, labels tuple): value} of every sample."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_collector_sums_ranks_golden(tmp_path):
    """Two ranks, two MoE layers: counters per rank and layer, ratios over ranks."""
    publish(str(tmp_path), "order", 0, {"layers": [[6, 8, 2, 2], [2, 8, 2, 1]]})
    publish(str(tmp_path), "order", 1, {"layers": [[2, 8, 2, 1], [0, 8, 2, 0]]})
    publish(str(tmp_path), "a2a", 0, {"tokens": 4, "pairs": 3, "bytes": 300, "local": 8, "activations": 16,
                                      "node_bytes": 200})
    publish(str(tmp_path), "a2a", 1, {"tokens": 4, "pairs": 1, "bytes": 100, "local": 2, "activations": 16,
                                      "node_bytes": 0})
    (tmp_path / "junk.json").write_text("{not json")  # a torn or foreign file is skipped
    (tmp_path / "odd.json").write_text(json.dumps({"source": "order", "rank": 2, "layers": "x"}))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    v = _values(SmoeCollector(str(tmp_path)).collect())
    assert v[("smoe:local_expert_activations_total", (("layer", "0"), ("rank", "0")))] == 6
    assert v[("smoe:tokens_total", (("layer", "1"), ("rank", "1")))] == 2
    assert v[("smoe:local_activation_ratio", (("layer", "0"),))] == pytest.approx(8 / 16)
    assert v[("smoe:local_activation_ratio", (("layer", "1"),))] == pytest.approx(2 / 16)
    assert v[("smoe:local_activation_ratio", (("layer", "all"),))] == pytest.approx(10 / 32)
    assert v[("smoe:predictor_hit_rate", (("layer", "all"),))] == pytest.approx(4 / 8)
    assert v[("smoe:a2a_remote_pairs_total", (("rank", "1"),))] == 1
    assert v[("smoe:a2a_bytes_per_token", ())] == pytest.approx(400 / 8)
    assert v[("smoe:a2a_node_bytes_total", (("rank", "0"),))] == 200
    publish(str(tmp_path), "a2a", 1, {"tokens": 6, "pairs": 1, "bytes": 100, "local": 2, "activations": 16,
                                      "node_bytes": 0})
    assert len(read_snapshots(str(tmp_path))) == 4  # replaced, not added
    assert list(families([])) == [] and read_snapshots(str(tmp_path / "gone")) == []


def test_drift_judges_whole_windows_against_the_placement():
    from vllm_smoe.serving.observe.metrics import Drift

    d = Drift(0.6, 0.8, min_tokens=100)
    assert d.update(50, 80, 20) is None  # too few tokens yet
    w = d.update(300, 400, 100)  # 0.75 >= 0.8 * 0.6
    assert w == {"local": 300, "activations": 400, "tokens": 100, "ratio": 0.75, "drifted": False}
    w = d.update(300 + 120, 400 + 400, 200)  # the next window alone: 0.30 < 0.48
    assert w["ratio"] == pytest.approx(0.3) and w["drifted"] and w["tokens"] == 100
    assert Drift("0.6", 0.8).expected is None and not Drift(None, 0.8).update(1, 2, 10**6)["drifted"]
    snaps = [{"source": "order", "rank": r, "layers": [[1, 2, 1, 1]], "drift": {**d.snapshot()}} for r in (0, 1)]
    v = _values(families(snaps))
    assert v[("smoe:window_local_activation_ratio", ())] == pytest.approx(0.3)
    assert v[("smoe:expected_local_activation_ratio", ())] == 0.6 and v[("smoe:drift", ())] == 1.0


def test_one_observer_reads_judges_and_publishes_for_either_source(tmp_path, caplog):
    """The token order's and the sparse all2all's counters go through one Observer: read on the
    log interval, judged for drift (the warning naming the rank as each source does), published
    with the drift window; a directory gone stops publishing with one warning."""
    import logging

    import torch

    from vllm_smoe.serving.observe.counters import Observer
    from vllm_smoe.serving.observe.metrics import Drift

    o = Observer("order", 1, 0.0, str(tmp_path), Drift(0.6, 0.8, min_tokens=10), who="rank 1",
                 hint=" (smoe-place advise)")
    assert o.due() and o.read(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    with caplog.at_level(logging.WARNING, logger="vllm.smoe"):
        o.judge(10, 100, 20)
    assert ("smoe: drift: rank 1 kept 0.100 of its last 20 tokens' expert activations local, below 0.80 x the "
            "placement's 0.600: the workload may have moved (smoe-place advise)") in caplog.text
    o.publish({"layers": [[1, 2, 1, 1]]})
    (snap,) = read_snapshots(str(tmp_path))
    assert snap["source"] == "order" and snap["rank"] == 1 and snap["drift"]["window"]["drifted"]
    quiet = Observer("a2a", 0, 3600.0, None, Drift(0.6, 0.8, min_tokens=10))
    assert not quiet.due()  # the interval has not passed
    caplog.clear()
    quiet.judge(10, 100, 20)  # who=None: judged, no warning
    assert quiet.drift.window["drifted"] and "drift" not in caplog.text
    o.metrics_dir = str(tmp_path / "gone" / "x")
    with caplog.at_level(logging.WARNING, logger="vllm.smoe"):
        o.publish({})
    assert o.metrics_dir is None and "metrics not published any more" in caplog.text


def test_metric_settings_are_validated(tmp_path):
    from vllm_smoe.serving.config import SmoeConfig

    c = SmoeConfig.from_dict({"metrics_dir": str(tmp_path), "drift_threshold": 0.5})
    assert c.metrics_dir == str(tmp_path) and c.drift_threshold == 0.5
    c.check_files()
    for bad, words in [({"drift_threshold": 0}, "drift_threshold"), ({"drift_threshold": True}, "drift_threshold"),
                       ({"metrics_dir": 3}, "metrics_dir"), ({"metrics": "off"}, "field 'metrics'")]:
        with pytest.raises(ValueError, match=words):
            SmoeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="not a writable directory"):
        SmoeConfig.from_dict({"metrics_dir": str(tmp_path / "missing")}).check_files()


def test_server_makes_and_exports_its_directory_once(tmp_path, monkeypatch):
    from vllm_smoe.serving.config import SmoeConfig
    from vllm_smoe.serving.observe.metrics import ENV, metrics_dir, server_metrics_dir

    monkeypatch.setenv(ENV, "")  # recorded, so the variable server_metrics_dir sets is undone after the test
    monkeypatch.delenv(ENV)
    cfg = SmoeConfig()
    assert metrics_dir(cfg) is None
    made = server_metrics_dir(cfg)
    assert os.path.isdir(made) and os.environ[ENV] == made
    assert server_metrics_dir(cfg) == made == metrics_dir(cfg)  # engines and workers started later see it
    given = SmoeConfig.from_dict({"metrics_dir": str(tmp_path)})
    assert server_metrics_dir(given) == str(tmp_path) == metrics_dir(given)
    off = SmoeConfig.from_dict({"metrics_dir": str(tmp_path), "metrics": False})
    assert server_metrics_dir(off) is None and metrics_dir(off) is None  # nothing published, nothing served


def test_metrics_reach_vllms_multiprocess_registry(tmp_path, monkeypatch):
    """Several API servers: vLLM serves /metrics from a multiprocess registry of its own, where
    the default registry's collector is absent; with smoe's endpoint plugin the route serves
    smoe's families next to vLLM's multiprocess metrics."""
    pytest.importorskip("vllm")

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry, Counter, values
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router
    from vllm.plugins.endpoint_plugins import interface

    from vllm_smoe.serving.endpoints import SmoeEndpoints

    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    # a vLLM-side counter in multiprocess mode (prometheus_client picks its value class at import)
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    Counter("vllm_test_requests", "a vLLM-side counter", registry=CollectorRegistry()).inc(3)
    smoe_dir = tmp_path / "smoe"
    smoe_dir.mkdir()
    publish(str(smoe_dir), "record", 0, {"written": 120, "behind": 0, "failed": 8, "unrecordable": 0})
    served = {}
    for name, plugins in [("vllm", []), ("smoe", [SmoeEndpoints()])]:
        app = FastAPI()
        attach_router(app)
        monkeypatch.setattr("vllm.plugins.load_endpoint_plugins", lambda tasks, p=plugins: p)
        interface.attach_endpoint_plugins(app, ("generate",))
        for plugin in plugins:  # init_state's part that names the directory
            plugin.collector.directory = str(smoe_dir)
        with TestClient(app) as c:
            served[name] = c.get("/metrics").text
    assert "smoe:" not in served["vllm"] and "vllm_test_requests_total 3.0" in served["vllm"]
    assert 'smoe:record_tokens_total{rank="0"} 120.0' in served["smoe"]
    assert 'smoe:record_lost_tokens_total{rank="0",reason="failed"} 8.0' in served["smoe"]
    assert "vllm_test_requests_total 3.0" in served["smoe"]
