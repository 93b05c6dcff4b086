"""The automatic re-placement controller (serving/place/auto.py, auto_build.py): settings, its
policy on a clock, the candidate build on a real recording, and its loop against stand-ins of
the drift snapshots, the build and the swap path."""

import asyncio
import json
import os
import shutil
import time

import pytest

from vllm_smoe.serving.place.auto import AutoReplace, AutoSettings, pooled_drift, run
from vllm_smoe.serving.place.auto_build import BuildError, advise_command, build_candidate
from tests.support import CONFIGS


def test_settings_take_true_a_mapping_or_off_and_name_a_bad_field():
    assert AutoSettings.from_value(None, "x") is None and AutoSettings.from_value(False, "x") is None
    assert AutoSettings.from_value(True, "x") == AutoSettings()
    s = AutoSettings.from_value({"hold_s": 0, "cooldown_s": 5, "window_tokens": 4096, "max_moves": 0.5}, "x")
    assert (s.hold_s, s.cooldown_s, s.window_tokens, s.max_moves) == (0.0, 5.0, 4096, 0.5)
    for bad, field in (({"hold_s": -1}, "auto_replace.hold_s"), ({"max_moves": 1.5}, "auto_replace.max_moves"),
                       ({"window_tokens": 1.5}, "auto_replace.window_tokens"), ({"margin": float("nan")}, "margin"),
                       ({"nope": 1}, "unknown field"), ("yes", "field 'auto_replace'")):
        with pytest.raises(ValueError, match=field):
            AutoSettings.from_value(bad, "additional_config['smoe']")


def _snap(local, acts, expected=0.7, threshold=0.8):
    return {"source": "order", "rank": 0, "layers": [[local, acts, acts, 0]], "drift": {"expected": expected, "threshold": threshold,
                                                     "window": {"local": local, "activations": acts, "tokens": acts}}}


def test_pooled_drift_pools_the_ranks_windows_as_the_metric_does():
    assert pooled_drift([]) is None
    v = pooled_drift([_snap(69, 100), _snap(38, 100)])  # ranks 0.69 and 0.38: pooled 0.535 < 0.8 x 0.7
    assert v["ratio"] == pytest.approx(0.535) and v["drifted"] is True
    assert pooled_drift([_snap(60, 100)])["drifted"] is False  # 0.6 >= 0.56
    assert pooled_drift([_snap(10, 100, expected=None)])["drifted"] is None  # nothing to judge against
    # speculate publishes both: the all2all's window (no expected ratio there) never hides the order's
    a2a = {**_snap(60, 100, expected=None), "source": "a2a"}
    assert pooled_drift([a2a, _snap(30, 100)])["drifted"] is True
    assert pooled_drift([a2a])["drifted"] is None


def test_the_policy_waits_for_drift_to_hold_and_for_the_cool_down():
    ctl = AutoReplace(AutoSettings(hold_s=30, cooldown_s=100), now=0.0)
    assert not ctl.observe(True, 0.0) and not ctl.observe(True, 20.0)
    assert not ctl.observe(None, 25.0)  # an unjudged interval breaks the run
    assert not ctl.observe(True, 30.0) and not ctl.observe(True, 50.0) and ctl.observe(True, 60.0)
    ctl.swapped({"moved_slots": 7, "moved_bytes": 1000, "seconds": 0.5, "placement": "b"}, now=60.0)
    assert ctl.counters["swaps"] == 1 and ctl.counters["moved_slots"] == 7 and ctl.last["decision"] == "swapped"
    assert not ctl.observe(True, 100.0) and not ctl.observe(True, 159.0)  # held 59 s, but cooling down
    assert ctl.observe(True, 160.0)
    ctl.rejected("margin", "no better", now=160.0)
    assert ctl.counters["rejected"]["margin"] == 1 and not ctl.observe(True, 259.0) and ctl.observe(True, 290.0)


def test_a_candidate_must_beat_the_served_ratio_by_the_margin():
    ctl = AutoReplace(AutoSettings(margin=0.05), now=0.0)
    assert ctl.judge(0.60, 0.64)[0] is True
    ok, why = ctl.judge(0.60, 0.62)
    assert ok is False and "0.6300" in why


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    from vllm_smoe.testbed import FIXTURE_TRACES

    d = tmp_path_factory.mktemp("rec")
    shutil.copy(FIXTURE_TRACES["heldout"], d / "trace-dp0-1-2-00000.npz")
    return str(d)


def test_the_build_runs_advise_on_the_recording_and_reads_its_held_out_judgement(recording, tmp_path):
    served = os.path.join(CONFIGS, "tiny-4dom-ep2.yaml")
    out = str(tmp_path / "cand.yaml")
    got = build_candidate(served, recording, out, AutoSettings(window_tokens=4096, max_moves=0.25))
    assert os.path.exists(out) and got["placement"] == out
    with open(out + ".json") as f:
        res = json.load(f)
    assert got["served_lar"] == pytest.approx(next(v["lar"] for k, v in res.items() if k.startswith("served")))
    assert 0 < got["candidate_lar"] <= 1 and got["seconds"] > 0
    assert got["files"] == 1 and "--max-moves" in advise_command(served, [recording], out, AutoSettings())


def test_the_build_is_refused_without_a_recording_and_stopped_at_its_limits(recording, tmp_path):
    served = os.path.join(CONFIGS, "tiny-4dom-ep2.yaml")
    with pytest.raises(BuildError) as e:
        build_candidate(served, str(tmp_path), str(tmp_path / "c.yaml"), AutoSettings())
    assert e.value.reason == "no_recording"
    with pytest.raises(BuildError, match="fewer than min_tokens") as e:  # the fixture's file holds 65536
        build_candidate(served, recording, str(tmp_path / "c.yaml"), AutoSettings(min_tokens=1 << 20))
    assert e.value.reason == "no_recording"
    with pytest.raises(BuildError, match="build_timeout_s") as e:
        build_candidate(served, recording, str(tmp_path / "c.yaml"), AutoSettings(build_timeout_s=0.5))
    assert e.value.reason == "build_failed"
    with pytest.raises(BuildError) as e:  # 64 MiB of address space: the child fails (or stalls) and is stopped
        build_candidate(served, recording, str(tmp_path / "c.yaml"), AutoSettings(build_mem_mb=64, build_timeout_s=60))
    assert e.value.reason == "build_failed"


def _loop(tmp_path, builds, swaps, ticks, settings=None):
    """Runs the controller's loop for ``ticks`` intervals against stand-ins: every interval reads
    drifted; builds and swaps answer from the lists (an exception is raised)."""
    from vllm_smoe.serving.observe.metrics import publish

    metrics = tmp_path / "m"
    metrics.mkdir()
    publish(str(metrics), "order", 0, _snap(30, 100))  # drifted: 0.3 < 0.56
    ctl = AutoReplace(settings or AutoSettings(hold_s=0, cooldown_s=0), now=0.0)
    clock = iter(float(i) for i in range(1000))
    published, calls = [], []

    def build(served, record_dir, out, s, since):
        calls.append(("build", served))
        if not builds:
            raise BuildError("no_recording", "the stand-in's list is spent")
        r = builds.pop(0)
        if isinstance(r, Exception):
            raise r
        return {"placement": out, "seconds": 1.0, **r}

    async def swap(path, extra_dirs):
        calls.append(("swap", path, extra_dirs))
        r = swaps.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    async def main():
        task = asyncio.create_task(run(ctl, served_path=lambda: "served.yaml", record_dir="rec", metrics_dir=str(metrics),
                                       interval=0.01, swap=swap, build=build, clock=lambda: next(clock),
                                       publish=lambda c: published.append(json.loads(json.dumps(c))),
                                       workdir=str(tmp_path)))
        await asyncio.sleep(0.01 * ticks + 0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return ctl, calls, published


def test_the_loop_builds_judges_and_swaps_through_the_swap_path(tmp_path):
    class Refused(Exception):
        status, detail = 400, "field 'ep_size' = 4"

    builds = [{"served_lar": 0.5, "candidate_lar": 0.6}, {"served_lar": 0.5, "candidate_lar": 0.5},
              BuildError("build_failed", "advise exited 1"), {"served_lar": 0.5, "candidate_lar": 0.7},
              RuntimeError("a bug"), {"served_lar": 0.5, "candidate_lar": 0.7}]
    swaps = [{"placement": "c1", "moved_slots": 3, "moved_bytes": 10, "seconds": 0.1}, Refused(),
             {"placement": "c6", "moved_slots": 2, "moved_bytes": 5, "seconds": 0.1}]
    ctl, calls, published = _loop(tmp_path, builds, swaps, ticks=12)
    c = ctl.counters
    assert [k[0] for k in calls][:9] == ["build", "swap", "build", "build", "build", "swap", "build", "build", "swap"]
    assert calls[1][2] == (str(tmp_path),)  # the candidates' own directory is allowed for this swap only
    assert c["swaps"] == 2 and c["moved_slots"] == 5 and c["moved_bytes"] == 15 and c["candidates"] == 4
    assert c["rejected"]["margin"] == 1 and c["rejected"]["build_failed"] == 1 and c["rejected"]["invalid"] == 1
    assert c["failures"] == 1  # the loop went on after its own failure
    assert published[-1] == json.loads(json.dumps(c))


def test_nothing_is_built_while_drift_has_not_held(tmp_path):
    ctl, calls, _ = _loop(tmp_path, [], [], ticks=5, settings=AutoSettings(hold_s=1e9, cooldown_s=0))
    assert calls == [] and ctl.counters["drifted_checks"] >= 3 and ctl.counters["candidates"] == 0


def test_the_build_reads_the_newest_files_written_since_drift_began_within_the_window(tmp_path):
    from vllm_smoe.formats.trace import open_trace, read_traces, write_trace
    from vllm_smoe.serving.place.auto_build import recent_files
    from vllm_smoe.testbed import FIXTURE_TRACES

    meta, arr, _ = read_traces([FIXTURE_TRACES["heldout"]])
    n = 1000
    for i in range(4):  # four files of 1000 tokens, written at t = 100, 200, 300, 400
        path = tmp_path / f"trace-dp0-1-2-{i:05d}.npz"
        write_trace(str(path), meta, **{k: v[i * n: (i + 1) * n] for k, v in arr.items()})
        os.utime(path, (100.0 * (i + 1), 100.0 * (i + 1)))
    (tmp_path / "trace-dp0-1-2-00009.npz.spill").mkdir()  # an open spill: never read
    names = lambda fs: [os.path.basename(f)[-9:-4] for f in fs]  # noqa: E731
    assert names(recent_files(str(tmp_path), None, 2500)) == ["00003", "00002"]
    assert names(recent_files(str(tmp_path), 250.0, 10_000)) == ["00003", "00002"]
    assert names(recent_files(str(tmp_path), None, 10)) == ["00003"]  # at least the newest
    assert recent_files(str(tmp_path), 500.0, 10_000) == []
    assert open_trace(recent_files(str(tmp_path), None, 1)[0]).num_tokens == n


def test_the_controllers_counters_are_served_on_metrics_as_published(tmp_path):
    from prometheus_client.core import CollectorRegistry
    from prometheus_client import generate_latest

    from vllm_smoe.serving.observe.metrics import SmoeCollector, publish

    ctl = AutoReplace(AutoSettings(), now=0.0)
    ctl.built(2.5, 2.0)
    ctl.rejected("margin", "no better", now=1.0)
    ctl.swapped({"moved_slots": 7, "moved_bytes": 4096, "seconds": 0.25}, now=2.0)
    publish(str(tmp_path), "auto", 0, ctl.counters)
    reg = CollectorRegistry()
    reg.register(SmoeCollector(str(tmp_path)))
    text = generate_latest(reg).decode()
    for line in ("smoe:auto_candidates_total 1.0", "smoe:auto_swaps_total 1.0", "smoe:auto_moved_slots_total 7.0",
                 "smoe:auto_moved_bytes_total 4096.0", "smoe:auto_build_seconds_total 2.5",
                 "smoe:auto_build_cpu_seconds_total 2.0", 'smoe:auto_rejected_total{reason="margin"} 1.0',
                 'smoe:auto_rejected_total{reason="invalid"} 0.0'):
        assert line in text, line


def test_too_little_recording_waits_one_hold_not_a_cool_down(tmp_path):
    """A build refused for lack of recording (fewer than min_tokens since drift began) is tried
    again one hold later in the same drift run, logged once; a margin rejection cools down."""
    settings = AutoSettings(hold_s=2, cooldown_s=1e6)
    ctl = AutoReplace(settings, now=0.0)
    assert not ctl.observe(True, 0.0) and ctl.observe(True, 2.0)
    ctl.too_early("100 tokens", 2.0)
    assert ctl.drift_since == 0.0 and not ctl.observe(True, 3.0) and ctl.observe(True, 4.0)
    ctl.too_early("200 tokens", 4.0)
    assert ctl.counters["rejected"]["no_recording"] == 2 and ctl.last["decision"] == "waiting"
    assert ctl.observe(True, 6.0)
    ctl.rejected("margin", "no better", 6.0)
    assert not ctl.observe(True, 100.0) and not ctl.waiting  # cooling down; the next run's wait is logged again


def test_the_loop_retries_a_build_refused_for_lack_of_recording(tmp_path):
    builds = [BuildError("no_recording", "100 tokens"), BuildError("no_recording", "900 tokens"),
              {"served_lar": 0.5, "candidate_lar": 0.7}]
    swaps = [{"placement": "c", "moved_slots": 1, "moved_bytes": 1, "seconds": 0.1}]
    ctl, calls, _ = _loop(tmp_path, builds, swaps, ticks=8, settings=AutoSettings(hold_s=0, cooldown_s=1e6))
    assert [k[0] for k in calls][:4] == ["build", "build", "build", "swap"]
    assert ctl.counters["swaps"] == 1 and ctl.counters["rejected"]["no_recording"] == 2


def test_the_build_runs_at_most_its_share_of_a_core_and_is_killed_at_its_time_limit():
    import resource
    import sys

    from vllm_smoe.serving.place.auto_build import run_throttled

    busy = [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
                                  "print('done')"]

    def cpu():
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    c0, t0 = cpu(), time.monotonic()
    rc, text = run_throttled(busy, dict(os.environ), None, 60.0, 0.2)
    wall, used = time.monotonic() - t0, cpu() - c0
    assert rc == 0 and "done" in text and used >= 0.3
    assert wall >= 0.3 / 0.2 * 0.7  # 0.3 s of CPU at a fifth of a core takes about 1.5 s
    for share in (1.0, 0.3):  # killed for time, also while stopped by the throttle
        t0 = time.monotonic()
        rc, _ = run_throttled([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), None, 0.5, share)
        assert rc is None and time.monotonic() - t0 < 10
    rc, text = run_throttled([sys.executable, "-c", "import sys; sys.exit('bad input')"], dict(os.environ), None, 30, 0.5)
    assert rc == 1 and "bad input" in text


def test_a_build_stopped_for_time_leaves_none_of_its_workers_behind(tmp_path):
    """advise forks a pool when given jobs; a kill for time reaches its whole process group (the
    workers of a killed build were found orphaned, asleep, an hour later)."""
    import sys

    from vllm_smoe.serving.place.auto_build import run_throttled

    pid_file = tmp_path / "worker.pid"
    forks = (f"import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"
             f"open({str(pid_file)!r}, 'w').write(str(pid))\ntime.sleep(60)\n")
    rc, _ = run_throttled([sys.executable, "-c", forks], dict(os.environ), None, 5.0, 1.0)
    assert rc is None
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # SIGKILL's teardown waits for a core on a busy host
    while True:  # gone, or a zombie not yet reaped by its new parent
        try:
            with open(f"/proc/{worker}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z" or time.monotonic() > deadline:
            assert state == "Z", state
            break
        time.sleep(0.05)
    assert "--jobs" in advise_command("s.yaml", ["t.npz"], "c.yaml", AutoSettings())
