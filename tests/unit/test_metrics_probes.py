"""Issue 65's metrics and recorder probes: /metrics current while idle, the start line where
/metrics cannot carry smoe's families, one definition of the locality numbers, a live swap that
keeps the open record file, and a removed record directory said as it is."""

import logging
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_smoe.formats.trace import TraceMeta
from vllm_smoe.serving.observe.metrics import families, publish, read_snapshots


def _values(fams):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def _recorder(tmp_path, metrics_dir=None, chunk_tokens=1000, log_interval=10.0):
    """A recorder's files side (no model, no threads): the writer thread's and idle thread's work
    run by hand."""
    from vllm_smoe.serving.record.recorder import Recorder

    rec = Recorder.__new__(Recorder)
    cfg = SimpleNamespace(record=str(tmp_path / "rec"), record_chunk_tokens=chunk_tokens, record_max_mb=None,
                          log_interval=log_interval, record_sample=1.0)
    os.makedirs(cfg.record, exist_ok=True)
    meta = TraceMeta(num_experts=8, top_k=2, num_layers=2, vocab_size=100, model="m",
                     extra={"placement": "a.yaml", "dp_rank": 0})
    rec.E, rec.K, rec.L, rec.layers = 8, 2, 2, [0, 1]
    rec.speculative = False
    rec._host_state(cfg, meta, 0, metrics_dir)
    return rec


def _step(rec, n, step):
    """One served step of ``n`` decode rows of request 0, as the step thread queues it."""
    ids = torch.arange(n, dtype=torch.int32)
    topk = torch.randint(0, 8, (n, 2, 2), dtype=torch.int32)
    written = torch.full((2,), n, dtype=torch.int32)
    counts = np.array([n], dtype=np.int64)
    rec._write(ids, torch.arange(10 + step * n, 10 + step * n + n), topk, written, None, np.array([0], np.int32),
               counts, np.ones(1, dtype=bool), np.zeros(1, np.int64), step, None)


def test_record_metrics_are_current_once_the_steps_stop(tmp_path):
    """Row 1: the last steps of a burst reach /metrics without another step (the idle thread
    publishes what the writer wrote; nothing on the step's path)."""
    m = tmp_path / "metrics"
    m.mkdir()
    rec = _recorder(tmp_path, str(m))
    rec._tick()  # at start: a zero snapshot, so the families are there before the first burst
    assert _values(families(read_snapshots(str(m))))[("smoe:record_tokens_total", (("rank", "0"),))] == 0
    for s in range(3):
        _step(rec, 5, s)
    rec._tick()  # the idle thread's next tick, no step in between
    v = _values(families(read_snapshots(str(m))))
    assert v[("smoe:record_tokens_total", (("rank", "0"),))] == 15 == rec.total
    assert v[("smoe:record_lost_tokens_total", (("rank", "0"), ("reason", "failed")))] == 0


def test_record_log_says_the_published_numbers_once_after_the_last_change(tmp_path, caplog):
    rec = _recorder(tmp_path, log_interval=0.0)
    with caplog.at_level(logging.INFO, logger="vllm.smoe"):
        rec._tick()
        assert "tokens in" not in caplog.text  # nothing written: nothing to say
        _step(rec, 4, 0)
        rec._tick()
        rec._tick()
    assert caplog.text.count("smoe record: 4 tokens in") == 1


def test_a_live_swap_keeps_the_open_file(tmp_path):
    """Row 4: rows are logical experts whatever the placement, so a swap changes nothing in a
    file's rows: the file goes on, its meta lists the swap; files opened later name the new one."""
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.serving.record import recorder as recorder_mod

    rec = _recorder(tmp_path)
    for s in range(2):
        _step(rec, 3, s)
    for i, s in enumerate(range(2, 50)):  # 48 swaps, a step after each
        rec._swapped(f"p{i}.yaml", s)
        _step(rec, 3, s)
    with rec.lock:
        rec._close_writer()
    files = sorted(f for f in os.listdir(rec.cfg.record) if f.endswith(".npz"))
    assert len(files) == 1
    t = open_trace(os.path.join(rec.cfg.record, files[0]))
    assert len(t["token_ids"]) == 150
    assert t.meta.extra["placement"] == "a.yaml"
    assert t.meta.extra["swaps"][0] == [2, "p0.yaml"] and len(t.meta.extra["swaps"]) == 48
    _step(rec, 3, 50)
    assert rec.writer.meta.extra["placement"] == "p47.yaml" and "swaps" not in rec.writer.meta.extra
    for i in range(recorder_mod.MAX_FILE_SWAPS + 1):  # a file's meta stays bounded: then a new file
        rec._swapped(f"q{i}.yaml", 51)
    assert rec.writer is None  # the 65th closed the file
    _step(rec, 3, 51)
    assert rec.writer.meta.extra["placement"] == f"q{recorder_mod.MAX_FILE_SWAPS}.yaml"


def test_a_removed_record_directory_is_said_and_recording_goes_on(tmp_path, caplog):
    """Row 5: the open file's spill went with the directory: said once (no pointer to a spill that
    is gone), counted as lost, and the next step writes a new file in the directory made again."""
    import shutil

    rec = _recorder(tmp_path)
    _step(rec, 4, 0)
    spill = rec.writer.spill_dir
    shutil.rmtree(rec.cfg.record)
    with caplog.at_level(logging.INFO, logger="vllm.smoe"):
        _step(rec, 4, 1)
    assert "was removed" in caplog.text and "smoe-trace recover" not in caplog.text
    assert rec.failed == 4 and rec.total == 8
    assert rec.writer is not None and rec.writer.spill_dir != spill and os.path.isdir(rec.writer.spill_dir)
    shutil.rmtree(rec.cfg.record)  # removed while idle, then closed: lost, not "stays in" a spill
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.smoe"):
        with rec.lock:
            rec._close_writer()
    assert "lost" in caplog.text and "stay" not in caplog.text and rec.failed == 8 and rec.writer is None


def test_device_counters_are_published_after_the_last_step_of_a_burst(tmp_path, monkeypatch):
    """Row 1: the step path reads once per interval (and on CUDA returns the copy started an
    interval earlier), so a burst's last steps used to wait for the next burst. The idle reader
    publishes them once no served step has run for half an interval, and only once per burst."""
    from vllm_smoe.serving import runner_hooks
    from vllm_smoe.serving.observe.counters import Observer
    from vllm_smoe.serving.observe.metrics import Drift

    counts = torch.zeros((2, 7), dtype=torch.long)
    o = Observer("order", 0, 0.2, str(tmp_path), Drift(None, 0.8))
    reports = []

    def report(rows):
        o.publish({"layers": [r[:4] for r in rows]})
        reports.append(rows)  # after the snapshot is on disk: the test reads it once this is seen

    activity = [0, time.monotonic(), False]
    monkeypatch.setattr(runner_hooks, "_ACTIVITY", activity)
    counts[:, :4] = torch.tensor([[3, 8, 4, 2], [5, 8, 4, 3]])  # a burst's steps, the last one ended now
    activity[:2] = [5, time.monotonic()]
    o.watch(lambda: counts, report, idle=True)
    deadline = time.monotonic() + 30
    while not reports and time.monotonic() < deadline:
        time.sleep(0.02)
    (snap,) = read_snapshots(str(tmp_path))
    assert snap["layers"] == [[3, 8, 4, 2], [5, 8, 4, 3]]
    time.sleep(0.4)  # idle on: no step since, no read again
    assert len(reports) == 1
    activity[2] = True  # a step running: never read under it
    activity[0] = 6
    time.sleep(0.4)
    assert len(reports) == 1
    o.unwatch()


def test_the_step_path_never_waits_for_the_idle_reader():
    from vllm_smoe.serving.observe.counters import Observer
    from vllm_smoe.serving.observe.metrics import Drift

    o = Observer("a2a", 0, 0.0, None, Drift(None, 0.8))
    seen = []
    o.watch(lambda: torch.ones(6, dtype=torch.long), seen.append, idle=False)
    with o.lock:  # the idle reader reading
        o.step()
    assert seen == []
    o.step()
    assert seen == [[1] * 6]


def test_log_line_and_metrics_agree(tmp_path):
    """Row 3: each rank's speculate line gives the very counts /metrics serves for it (the same
    read: every served token, all MoE layers), its share is their quotient, and the share over
    all ranks on /metrics is the ranks' counts pooled."""
    import re

    from vllm_smoe.serving.observe.counters import order_line
    from vllm_smoe.tools.bench.common import SPEC_LINE, rank_numbers

    ranks = {0: [[690, 1000, 250, 240], [700, 1000, 250, 245]], 1: [[300, 800, 200, 150], [310, 800, 200, 160]]}
    lines = []
    for rank, layers in ranks.items():
        publish(str(tmp_path), "order", rank, {"layers": layers})
        lines.append(order_line("tables", rank, layers, "; sparse all2all: 0.500 remote (token, rank) pairs and "
                                                        "100 B per token and MoE layer"))
    v = _values(families(read_snapshots(str(tmp_path))))
    local = act = 0
    for rank, line in zip(ranks, lines):
        m = re.search(r"smoe:local_expert_activations (\d+) / smoe:expert_activations (\d+) \(rank (\d+)", line)
        assert int(m.group(3)) == rank
        mine = [sum(v[(n, (("layer", str(layer)), ("rank", str(rank))))] for layer in range(2))
                for n in ("smoe:local_expert_activations_total", "smoe:expert_activations_total")]
        assert [int(m.group(1)), int(m.group(2))] == mine
        share = float(re.search(r"served ([0-9.]+) of", line).group(1))
        assert share == pytest.approx(mine[0] / mine[1], abs=5e-4)
        local, act = local + mine[0], act + mine[1]
    assert v[("smoe:local_activation_ratio", (("layer", "all"),))] == pytest.approx(local / act)
    got = rank_numbers(lines, SPEC_LINE)  # smoe-bench's reading of the same lines still parses them
    assert got["tokens_per_rank"] == {0: 250, 1: 200}
    assert got["local_share"] == pytest.approx(local / act, abs=1e-3)


def test_several_api_servers_without_vllm_plugins_get_a_start_line():
    """Row 2: `vllm serve M --data-parallel-size 2 ... --plugin smoe` runs two API servers, whose
    /metrics only smoe's endpoint plugin reaches; vLLM loads it only when VLLM_PLUGINS names it.
    smoe says so at start, naming what to set, and says nothing where its families will be there."""
    import argparse

    from vllm_smoe.serving import plugin

    line = plugin.metrics_start_line(2, None)
    assert "2 API servers" in line and "VLLM_PLUGINS=smoe" in line and "it is unset" in line
    assert "--api-server-count 1" in line
    assert "'other'" in plugin.metrics_start_line(4, "other")
    for quiet in [(1, None), (None, None), (0, None), (2, "smoe"), (2, "foo, smoe")]:
        assert plugin.metrics_start_line(*quiet) == ""
    # vllm serve's settled count reaches the check: from_cli_args runs after vLLM defaulted it
    p = argparse.ArgumentParser()
    plugin._add_flags(p)
    args = p.parse_args(["--plugin", "smoe"])
    args.api_server_count = 2
    plugin._fold_flags(SimpleNamespace(additional_config={}), args)
    assert plugin._API_SERVERS[0] == 2


def test_several_api_servers_read_smoes_families_from_the_multiprocess_files(tmp_path, monkeypatch):
    """Row 2: what each API server's /metrics registry is under vLLM (a fresh registry with
    prometheus_client's multiprocess collector only) gives smoe's families once the bridge of
    the parent process wrote them: the same values as smoe's collector, counters as counters."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    from vllm_smoe.serving.observe.bridge import MultiprocessBridge
    from vllm_smoe.serving.observe.metrics import SmoeCollector

    prom, snaps = tmp_path / "prom", tmp_path / "snaps"
    prom.mkdir()
    snaps.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    publish(str(snaps), "order", 0, {"layers": [[6, 8, 2, 2], [2, 8, 2, 1]]})
    publish(str(snaps), "record", 0, {"written": 7, "behind": 0, "failed": 1, "unrecordable": 0})
    bridge = MultiprocessBridge(str(snaps))
    assert bridge.once() > 0
    publish(str(snaps), "record", 0, {"written": 9, "behind": 0, "failed": 1, "unrecordable": 0})
    bridge.once()  # refreshed in place, not added to

    def scrape():
        registry = CollectorRegistry()  # vllm.v1.metrics.prometheus.get_prometheus_registry's
        multiprocess.MultiProcessCollector(registry)
        text = generate_latest(registry).decode()
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("smoe:")}, text

    got, text = scrape()
    assert "# TYPE smoe:tokens_total counter" in text and "# TYPE smoe:local_activation_ratio gauge" in text
    single = CollectorRegistry()  # one API server: smoe's collector on vLLM's default registry
    single.register(SmoeCollector(str(snaps)))
    assert "# TYPE smoe:tokens_total counter" in generate_latest(single).decode()  # the same exposition
    want = _values(SmoeCollector(str(snaps)).collect())
    assert got['smoe:record_tokens_total{rank="0"}'] == 9 == want[("smoe:record_tokens_total", (("rank", "0"),))]
    assert got['smoe:local_activation_ratio{layer="all"}'] == pytest.approx(8 / 16)
    assert got['smoe:tokens_total{layer="1",rank="0"}'] == 2
    assert len(got) == len(want)
