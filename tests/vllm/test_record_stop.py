"""Recording loses nothing when the server stops: Ctrl-C, SIGTERM right after the last answer,
and a killed engine (recovered by the next start on the same directory)."""

import contextlib
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from vllm_smoe.tools.server_process import VllmServer
from vllm_smoe.testbed import FIXTURE_MODEL
from vllm_smoe.tools.trace_cli import main as trace_main
from vllm_smoe.formats.trace import read_traces
from tests.support import heldout_prompts


def _prompts(n=4, skip=0):
    return heldout_prompts(n, lambda i, r: 5 + 3 * i, skip=skip)


def _served_tokens(prompts, out):
    """Tokens the model processed per request: the prompt and every generated token but the last."""
    return sorted(len(p) + len(lp) - 1 for p, (_, lp) in zip(prompts, out))


def _recorded_tokens(rec):
    _, arr, files = read_traces([str(rec)])
    for f in files:
        assert trace_main(["validate", f]) == 0
    return sorted(np.bincount(arr["request_ids"]).tolist())


@contextlib.contextmanager
def _answered(rec, log):
    """A recording server that has answered four requests: (server, prompts, answers)."""
    s = VllmServer(FIXTURE_MODEL, "--plugin", "smoe", "--smoe-record", str(rec), log=log).wait()
    try:
        prompts = _prompts()
        yield s, prompts, s.complete(prompts)
    finally:
        s.stop()


def _descendants(pid):
    import psutil

    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_clean_stop_right_after_the_last_answer_loses_nothing(tmp_path, how):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) and SIGTERM to the
    server process only (as a container runtime sends it), with no idle wait."""
    pytest.importorskip("vllm")
    rec = tmp_path / "rec"
    with _answered(rec, tmp_path / "serve.log") as (s, prompts, out):
        if how == "ctrl-c":
            os.killpg(s.proc.pid, signal.SIGINT)
        else:
            os.kill(s.proc.pid, signal.SIGTERM)
        s.proc.wait(120)
    log = open(tmp_path / "serve.log").read()
    assert _recorded_tokens(rec) == _served_tokens(prompts, out), log[-3000:]
    assert "smoe record: wrote" in log and "tokens" in log


@pytest.mark.parametrize("killed", ["workers", "everything"])
def test_killed_processes_lose_no_finished_step(tmp_path, killed):
    """SIGKILL of the engine and its workers right after the last answer: the server process
    turns their spill data into the trace when it exits. SIGKILL of every process (an OOM kill, a
    lost machine): the next start on the same directory does."""
    pytest.importorskip("vllm")
    rec = tmp_path / "rec"
    with _answered(rec, tmp_path / "first.log") as (s, prompts, out):
        if killed == "everything":
            os.killpg(s.proc.pid, signal.SIGKILL)
        else:
            for p in _descendants(s.proc.pid):
                p.send_signal(signal.SIGKILL)
        try:
            s.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    spills = [d for d in os.listdir(rec) if d.startswith(".trace-")]
    if killed == "workers":
        assert "at shutdown (the worker was stopped before closing it)" in open(tmp_path / "first.log").read()
        assert not spills
    else:
        with VllmServer(FIXTURE_MODEL, "--plugin", "smoe", "--smoe-record", str(rec), log=tmp_path / "second.log"):
            time.sleep(1)
        if spills:  # killed before the recorder's idle close (2 s after the last step)
            assert "from an earlier run" in open(tmp_path / "second.log").read()
    assert not [d for d in os.listdir(rec) if d.startswith(".trace-")]
    assert _recorded_tokens(rec) == _served_tokens(prompts, out)


def _sequences(files):
    """Per recorded request: its token ids in position order."""
    _, arr, _ = read_traces(files)
    out = []
    for r in np.unique(arr["request_ids"]):
        rows = np.flatnonzero(arr["request_ids"] == r)
        out.append(arr["token_ids"][rows[np.argsort(arr["positions"][rows])]].tolist())
    return sorted(out)


def test_recording_survives_a_full_disk_a_removed_directory_and_a_read_only_disk(tmp_path):
    """A served recording on a 512 KiB tmpfs: while the disk is full every step is dropped whole
    (one error line, counted on /metrics), recording resumes when space returns, a removed
    directory is made again, a read-only remount stops recording with one error; serving never
    stops, no traceback, and every recorded request's token ids are exactly what was served."""
    pytest.importorskip("vllm")
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    import errno
    import shutil
    import urllib.request

    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    kept.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], check=True)
    rec, log = disk / "rec", tmp_path / "serve.log"
    try:
        s = VllmServer(FIXTURE_MODEL, "--plugin", "smoe", "--smoe-record", str(rec), "--smoe-log-interval", "0.3",
                       log=log).wait()
        try:
            def serve(skip):
                out = [(p, s.complete([p], max_tokens=6)[0]) for p in _prompts(4, skip)]  # one at a time
                time.sleep(3.5)  # past the recorder's idle close (2 s): the open file is written
                return out

            with open(disk / "filler", "wb", buffering=0) as f:  # the disk full
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 4096)
            full = serve(0)
            os.remove(disk / "filler")
            back = serve(4)
            for f in os.listdir(rec):
                shutil.copy(rec / f, kept)
            shutil.rmtree(rec)
            again = serve(8)
            for f in os.listdir(rec):
                shutil.copy(rec / f, kept / ("again-" + f))
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            ro = serve(12)
            s.complete([_prompts(1, 16)[0]], max_tokens=2)  # a step after the log interval: counters published
            time.sleep(0.5)
            with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=30) as r:
                metrics = r.read().decode()
        finally:
            s.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    text = log.read_text()
    # while serving (vLLM's own shutdown may log an EngineDeadError traceback when it kills the
    # engine at its 0 s shutdown timeout, with or without smoe)
    serving = text.split("[shutdown]", 1)[0]
    assert "Traceback" not in serving, serving[-3000:]
    assert text.count("dropping whole steps until it can") == 1
    assert text.count("smoe record: writing again") == 1
    assert text.count("smoe record: stopped: cannot write") == 1 and os.strerror(errno.EROFS) in text
    assert "was removed; made it again" in text
    files = sorted(str(kept / f) for f in os.listdir(kept) if f.endswith(".npz"))
    assert len(files) >= 2, os.listdir(kept)  # one per phase at least (an idle close may split a phase)
    for f in files:
        assert trace_main(["validate", f]) == 0
    # ids as served: the prompt and every generated token but the last (the generated ones are
    # read back from the recording itself, so the prompt prefix and the lengths are what is checked)
    want = [(p, len(lp) - 1) for p, (_, lp) in back + again]
    got = _sequences(files)
    assert len(got) == len(want)
    for seq in got:
        assert any(seq[: len(p)] == p and len(seq) == len(p) + g for p, g in want), seq
    lost = int(float(re.search(r'smoe:record_lost_tokens_total\{rank="0",reason="failed"\} (\S+)', metrics)[1]))
    written = int(float(re.search(r'smoe:record_tokens_total\{rank="0"\} (\S+)', metrics)[1]))
    tokens = {k: sum(len(p) + len(lp) - 1 for p, (_, lp) in v) for k, v in
              (("full", full), ("back", back), ("again", again), ("read-only", ro))}
    assert written == tokens["back"] + tokens["again"]
    assert lost >= tokens["full"] + tokens["read-only"]
