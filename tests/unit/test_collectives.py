"""Collectives counted per served step: only inside served steps, once per outermost call, true
on /metrics."""

from vllm_smoe.serving.exchange.collectives import CollectiveCounts, group_of, per_step
from vllm_smoe.serving.observe.metrics import SmoeCollector, read_snapshots


def _values(fams):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_counts_served_steps_only_and_outermost_calls(tmp_path):
    c = CollectiveCounts(rank=3, log_interval=0.0, metrics_dir=str(tmp_path))
    with c.call("tp", "all_reduce"):  # the profile run / warm-up: before any served step
        pass
    step = object()
    for _ in range(2):
        c.before_step(None, None)
        with c.call("tp", "reduce_scatter"):
            with c.call("tp", "all_reduce"):  # what a shared-memory reduce-scatter runs underneath
                pass
        for _ in range(3):
            with c.call("ep", "all_to_all"):
                pass
        c.after_step(None, None, step)
    c.before_step(None, None)  # a step with no forward: neither it nor its calls are a served step's
    c.after_step(None, None, None)
    with c.call("dp", "all_reduce"):  # a DP dummy batch between steps
        pass
    assert c.steps == 2
    assert c.by == {("tp", "reduce_scatter"): 2, ("ep", "all_to_all"): 6}
    assert per_step(c.snapshot()["counts"], c.steps, layers=3) == {"ep all_to_all": 1.0, "tp reduce_scatter": 1 / 3}
    assert per_step([], 0) == {}
    (snap,) = read_snapshots(str(tmp_path))  # published at the step's end (log interval 0)
    assert snap["steps"] == 2
    v = _values(SmoeCollector(str(tmp_path)).collect())
    assert v[("smoe:collectives_total", (("group", "ep"), ("kind", "all_to_all"), ("rank", "3")))] == 6
    assert v[("smoe:collective_steps_total", (("rank", "3"),))] == 2


def test_a_foreign_collectives_file_is_skipped(tmp_path):
    (tmp_path / "collectives-rank0.json").write_text('{"source": "collectives", "rank": 0, "steps": 1, '
                                                     '"counts": [["tp", "all_reduce", "x"]]}')
    assert read_snapshots(str(tmp_path)) == []
    assert group_of("tp:0") == "tp" and group_of("world") == "world"
