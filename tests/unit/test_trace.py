import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smoe.formats.trace import TraceMeta, TraceWriter, open_trace, write_trace
from vllm_smoe.tools.trace_cli import main

META = TraceMeta(num_experts=8, top_k=2, num_layers=3, vocab_size=100, domains=("a", "b"))


def arrays(T=10, seed=0):
    rng = np.random.default_rng(seed)
    topk = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in range(T)])
    return dict(
        token_ids=rng.integers(0, 100, T).astype(np.int32),
        request_ids=np.repeat(np.arange(T // 2 + 1), 2)[:T].astype(np.int32),
        positions=np.tile([0, 1], T // 2 + 1)[:T].astype(np.int32),
        topk_ids=topk.astype(np.int16),
        step_ids=np.zeros(T, np.int32),
        is_prefill=np.ones(T, bool),
        domain=rng.integers(0, 2, T).astype(np.int8),
        topk_weights=np.full((T, 3, 2), 0.5, np.float16),
    )


def test_round_trip_matches_numpy_savez(tmp_path):
    a = arrays(37)
    p = write_trace(tmp_path / "t.npz", META, **a)
    t = open_trace(p, validate=True)
    assert t.num_tokens == 37 and t.meta == META
    # the file is a plain npz: numpy reads it without smoe
    with np.load(p) as z:
        for k, v in a.items():
            np.testing.assert_array_equal(z[k], v)
            assert z[k].dtype == v.dtype
        assert json.loads(str(z["meta"]))["num_experts"] == 8


def test_third_party_savez_compressed_is_accepted(tmp_path):
    a = arrays(12)
    p = tmp_path / "third.npz"
    np.savez_compressed(p, meta=np.array(json.dumps(dict(num_experts=8, top_k=2, num_layers=3, vocab_size=100))),
                        **{k: a[k] for k in ("token_ids", "request_ids", "positions", "topk_ids")})
    t = open_trace(p, validate=True)
    assert t.fields == ("token_ids", "request_ids", "positions", "topk_ids")
    assert main(["validate", str(p)]) == 0


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6), chunk=st.integers(1, 64))
def test_chunked_writer_and_streaming_reader_agree(tmp_path_factory, sizes, chunk):
    d = tmp_path_factory.mktemp("w")
    parts = [arrays(n, seed=i) for i, n in enumerate(sizes)]
    with TraceWriter(d / "t.npz", META) as w:
        for part in parts:
            w.append(**part)
    t = open_trace(d / "t.npz", validate=True, chunk_tokens=chunk)
    for k in parts[0]:
        whole = np.concatenate([p[k] for p in parts])
        np.testing.assert_array_equal(t[k], whole)
        streamed = np.concatenate([c[k] for c in t.iter_chunks([k], chunk_tokens=chunk)])
        np.testing.assert_array_equal(streamed, whole)
    assert not [f for f in os.listdir(d) if f != "t.npz"], "writer left temporary files"


def test_writer_is_atomic_on_error(tmp_path):
    out = tmp_path / "t.npz"
    with pytest.raises(RuntimeError):
        with TraceWriter(out, META) as w:
            w.append(**arrays(4))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def _savez(path, meta=None, drop=(), **override):
    a = arrays(10)
    a.update(override)
    for k in drop:
        a.pop(k)
    m = META.to_json() if meta is None else meta
    np.savez_compressed(path, meta=np.array(m), **a)
    return path


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(drop=("token_ids",)), "token_ids", "missing"),
        (dict(drop=("topk_ids",)), "topk_ids", "missing"),
        (dict(token_ids=np.zeros(10, np.int64)), "token_ids", "dtype"),
        (dict(topk_ids=np.zeros((10, 3, 2), np.float32)), "topk_ids", "dtype"),
        (dict(topk_ids=np.zeros((10, 6), np.int16)), "topk_ids", "rank"),
        (dict(topk_ids=np.zeros((10, 3, 5), np.int16)), "topk_ids", "top_k"),
        (dict(positions=np.zeros(9, np.int32)), "positions", "disagree"),
        (dict(topk_ids=np.full((10, 3, 2), 8, np.int16)), "topk_ids", "num_experts"),
        (dict(topk_ids=np.full((10, 3, 2), -1, np.int16)), "topk_ids", "out of range"),
        (dict(token_ids=np.full(10, 100, np.int32)), "token_ids", "vocab_size"),
        (dict(topk_weights=np.full((10, 3, 2), np.nan, np.float16)), "topk_weights", "NaN"),
        (dict(domain=np.full(10, 2, np.int8)), "domain", "out of range"),
        (dict(positions=np.full(10, -3, np.int32)), "positions", "negative"),
        (dict(is_prefill=np.ones(10, np.int32)), "is_prefill", "dtype"),
        (dict(meta="{not json"), "meta", "JSON"),
        (dict(meta=json.dumps(dict(num_experts=8, top_k=2, num_layers=3))), "meta", "vocab_size"),
        (dict(meta=json.dumps(dict(num_experts=8, top_k=9, num_layers=3, vocab_size=5))), "meta.top_k", "exceeds"),
        (dict(meta=json.dumps(dict(num_experts=0, top_k=2, num_layers=3, vocab_size=5))), "meta.num_experts",
         "positive"),
    ],
)
def test_validator_names_field(tmp_path, kwargs, field, words):
    meta = kwargs.pop("meta", None)
    p = _savez(tmp_path / "bad.npz", meta=meta, **kwargs)
    with pytest.raises(ValueError) as e:
        open_trace(p, validate=True)
    msg = str(e.value)
    assert str(p) in msg and f"'{field}'" in msg and words in msg, msg


def test_validator_reports_first_bad_token(tmp_path):
    topk = np.zeros((10, 3, 2), np.int16)
    topk[:, :, 1] = 1
    topk[7, 2, 1] = 99
    p = _savez(tmp_path / "bad.npz", topk_ids=topk)
    with pytest.raises(ValueError, match="at token 7"):
        open_trace(p, validate=True, chunk_tokens=3)


def test_not_a_zip_and_missing_file(tmp_path):
    p = tmp_path / "x.npz"
    p.write_text("hello")
    with pytest.raises(ValueError, match="not an .npz"):
        open_trace(p)
    with pytest.raises(ValueError, match="no such trace file"):
        open_trace(tmp_path / "nope.npz")


def test_missing_meta(tmp_path):
    p = tmp_path / "m.npz"
    np.savez_compressed(p, **arrays(4))
    with pytest.raises(ValueError, match="'meta'"):
        open_trace(p)


def test_lazy_open_reads_no_rows(tmp_path, monkeypatch):
    """open_trace reads headers only; row data is touched only by load/iter_chunks/validate."""
    from vllm_smoe.formats import trace_reader

    p = write_trace(tmp_path / "t.npz", META, **arrays(2000))

    real_frombuffer = np.frombuffer

    def no_rows(*a, **k):
        raise AssertionError("row data read")

    def frombuffer(buf, dtype, *a, **k):
        if len(buf) > 4096:  # larger than any meta string here: that is row data
            no_rows()
        return real_frombuffer(buf, dtype, *a, **k)

    monkeypatch.setattr(np, "load", no_rows)
    monkeypatch.setattr(trace_reader.np, "frombuffer", frombuffer)
    t = open_trace(p)
    assert t.num_tokens == 2000 and t.meta == META
    with pytest.raises(AssertionError, match="row data read"):
        open_trace(p, validate=True)


def test_cli_exit_codes(tmp_path):
    good = write_trace(tmp_path / "g.npz", META, **arrays(5))
    bad = _savez(tmp_path / "b.npz", token_ids=np.full(10, 1000, np.int32))
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.tools.trace_cli", "validate", str(good)], capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.tools.trace_cli", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "'token_ids'" in r.stderr and "Traceback" not in r.stderr


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_trace import META, arrays
from vllm_smoe.formats.trace import TraceWriter
w = TraceWriter({path!r}, META)
a = arrays(30)
for s in range(0, 30, 10):  # three steps, then a crash before close
    w.append(**{{k: v[s:s + 10] for k, v in a.items()}})
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_writer(tmp_path):
    path = tmp_path / "rec" / "trace-dp0-1-00000.npz"
    path.parent.mkdir()
    code = _KILLED_WRITER.format(tests=os.path.dirname(__file__), path=str(path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    assert not path.exists()
    (spill,) = [d for d in os.listdir(path.parent) if d.startswith(".trace-")]
    return path, path.parent / spill


def test_a_killed_writer_is_recovered_whole(tmp_path, capsys):
    """Every appended step survives SIGKILL (unbuffered spill files); smoe-trace recover turns
    the spill directory into the trace the writer would have closed."""
    path, spill = _killed_writer(tmp_path)
    with pytest.raises(ValueError, match="smoe-trace recover"):  # readers say what to do, no crash
        from vllm_smoe.formats.trace import read_traces

        read_traces([str(path.parent)])
    assert main(["recover", str(path.parent)]) == 0
    assert f"recovered {path}: 30 tokens" in capsys.readouterr().out
    assert not spill.exists()
    assert main(["validate", str(path)]) == 0
    t = open_trace(path)
    for k, v in arrays(30).items():
        np.testing.assert_array_equal(t[k], v)
    assert main(["recover", str(path.parent)]) == 0  # nothing left: says so
    assert "nothing to recover" in capsys.readouterr().out


def test_a_step_cut_in_the_middle_is_dropped_and_the_rest_kept(tmp_path, capsys):
    path, spill = _killed_writer(tmp_path)
    with open(spill / "topk_ids", "r+b") as f:  # the kill came while the third step was written
        f.truncate(os.path.getsize(spill / "topk_ids") - 5)
    assert main(["recover", str(path.parent)]) == 0
    assert "29 tokens" in capsys.readouterr().out
    np.testing.assert_array_equal(open_trace(path, validate=True)["token_ids"], arrays(30)["token_ids"][:29])


def test_recover_leaves_live_writers_and_names_damaged_spills(tmp_path, capsys):
    rec = tmp_path / "rec"
    rec.mkdir()
    w = TraceWriter(rec / "live.npz", META)  # this process: alive
    w.append(**arrays(4))
    assert main(["recover", str(rec)]) == 0
    assert "skipped" in capsys.readouterr().out and not (rec / "live.npz").exists()
    w.close()
    broken = rec / ".trace-broken"
    broken.mkdir()
    (broken / "spill.json").write_text("{not json")
    assert main(["recover", "--force", str(rec)]) == 2
    assert "damaged spill index" in capsys.readouterr().err
    assert main(["recover", str(tmp_path / "nope")]) == 2


def test_a_held_spill_is_never_taken_and_a_closing_writer_is_not_waited_for(tmp_path):
    import threading
    import time

    from vllm_smoe.formats.trace import recover_dead_spills, recover_spill

    rec = tmp_path / "rec"
    rec.mkdir()
    w = TraceWriter(rec / "t.npz", META)
    w.append(**arrays(4))
    (spill,) = [rec / d for d in os.listdir(rec)]
    with pytest.raises(ValueError, match="still held"):  # its writer holds the lock (any process)
        recover_spill(str(spill))
    threading.Timer(0.3, w.close).start()
    t0 = time.monotonic()
    assert recover_dead_spills(str(rec), wait_s=30) == []  # closed meanwhile: nothing to recover
    assert time.monotonic() - t0 < 10 and open_trace(rec / "t.npz").num_tokens == 4


def test_a_failed_close_keeps_the_spill_for_recovery(tmp_path, monkeypatch):
    import vllm_smoe.formats.trace as tr
    import vllm_smoe.formats.trace_writer as writer

    rec = tmp_path / "rec"
    rec.mkdir()
    w = TraceWriter(rec / "t.npz", META)
    w.append(**arrays(6))
    real = writer.assemble

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "assemble", full_disk)
    with pytest.raises(OSError):
        w.close()
    monkeypatch.setattr(writer, "assemble", real)
    assert [n for n in tr.recover_dead_spills(str(rec)) if n[2] == 6]  # the writer is done: lock released
    assert open_trace(rec / "t.npz").num_tokens == 6


def test_read_traces_checks_every_value_field_and_keeps_empty_shapes(tmp_path):
    from vllm_smoe.formats.trace import read_traces

    with pytest.raises(ValueError, match="'domain'.*out of range"):
        read_traces([str(_savez(tmp_path / "d.npz", domain=np.full(10, 2, np.int8)))])
    with pytest.raises(ValueError, match="'topk_weights'.*NaN"):
        read_traces([str(_savez(tmp_path / "w.npz", topk_weights=np.full((10, 3, 2), np.nan, np.float16)))])
    empty = {k: v[:0] for k, v in arrays(10).items()}
    _, arr, _ = read_traces([str(_savez(tmp_path / "e.npz", **empty))])
    assert arr["topk_ids"].shape == (0, 3, 2) and arr["topk_ids"].dtype == np.int16


def _failing_writes(monkeypatch, fail_on: set[int]):
    """trace_writer._write_all that, on the given calls (0-based), writes half the bytes and then
    fails as a full disk does."""
    import errno

    from vllm_smoe.formats import trace_writer

    real, calls = trace_writer._write_all, [0]

    def write_all(f, data):
        k = calls[0]
        calls[0] += 1
        if k in fail_on:
            f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)

    monkeypatch.setattr(trace_writer, "_write_all", write_all)


def test_a_failed_append_is_dropped_whole_and_writing_resumes(tmp_path, monkeypatch):
    """A full disk in the middle of a chunk (one field half written): the chunk is dropped from
    every field, the next chunk lands aligned, and the trace holds exactly the chunks that were
    written, row for row."""
    a, b, c = arrays(10, 1), arrays(6, 2), arrays(8, 3)
    fields = len(a)
    _failing_writes(monkeypatch, {fields + 2})  # the second chunk's third field
    w = TraceWriter(tmp_path / "t.npz", META)
    w.append(**a)
    with pytest.raises(OSError):
        w.append(**b)
    w.append(**c)
    assert w.num_tokens == 18
    t = open_trace(w.close())
    for k in a:
        np.testing.assert_array_equal(t[k], np.concatenate([a[k], c[k]]), err_msg=k)


def test_a_writer_whose_every_append_failed_leaves_no_file(tmp_path, monkeypatch):
    _failing_writes(monkeypatch, {0})
    w = TraceWriter(tmp_path / "t.npz", META)
    with pytest.raises(OSError):
        w.append(**arrays(4))
    with pytest.raises(ValueError, match="no tokens"):
        w.close()
    assert os.listdir(tmp_path) == []  # no 0-row file, no spill


def test_a_short_write_is_finished_or_fails():
    """A raw write that takes part of the bytes is continued; one that takes none fails."""
    from vllm_smoe.formats.trace_writer import _write_all

    class Raw:
        def __init__(self, budget):
            self.out, self.budget = bytearray(), budget

        def write(self, data):
            n = min(len(data), 3, self.budget)
            self.out += data[:n]
            self.budget -= n
            return n

    f = Raw(100)
    _write_all(f, memoryview(b"0123456789"))
    assert f.out == b"0123456789"
    with pytest.raises(OSError, match="short write"):
        _write_all(Raw(4), memoryview(b"0123456789"))


def test_directory_readers_skip_a_bad_file_with_a_warning(tmp_path):
    from vllm_smoe.formats.trace import open_traces

    write_trace(str(tmp_path / "trace-a.npz"), META, **arrays(10))
    (tmp_path / "trace-b.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.warns(UserWarning, match="skipped .*trace-b.npz"):
        _, traces = open_traces([str(tmp_path)])
    assert [os.path.basename(t.path) for t in traces] == ["trace-a.npz"]
    with pytest.raises(ValueError, match="trace-b.npz"):
        open_traces([str(tmp_path / "trace-b.npz")])  # named as such: refused
    os.remove(tmp_path / "trace-a.npz")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no readable trace file"):
        open_traces([str(tmp_path)])
