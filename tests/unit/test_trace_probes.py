"""Hostile input to the trace format and to ``smoe-trace recover`` (issue 65, probe rows 4 and 5
and the negative ids): a spill directory or a trace file is refused with the file and the field
named, exit 2 from the CLI, no traceback, no file read that the user did not name, and memory
bounded by what the input really holds."""

import io
import json
import os
import shutil
import stat
import tracemalloc
import zipfile

import numpy as np
import pytest

from vllm_smoe.formats.trace import SPILL_INDEX, TraceMeta, TraceWriter, open_trace, write_trace
from vllm_smoe.tools.trace_cli import main

META = TraceMeta(num_experts=8, top_k=2, num_layers=3, vocab_size=100)


def _arrays(T=6):
    return dict(token_ids=np.arange(T, dtype=np.int32), request_ids=np.zeros(T, np.int32),
                positions=np.arange(T, dtype=np.int32),
                topk_ids=np.tile(np.array([0, 1], np.int16), (T, 3, 1)))


def _dead_spill(tmp_path, name="rec"):
    """A record directory holding the spill of a writer that died after 6 rows."""
    rec = tmp_path / name
    rec.mkdir()
    w = TraceWriter(rec / "t.npz", META)
    w.append(**_arrays())
    w.release()  # as a killed writer leaves it: data kept, lock dropped
    return rec, rec / os.path.basename(w._dir)


def _refused(rec, capsys, *words):
    assert main(["recover", str(rec)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not any(n.endswith(".npz") for n in os.listdir(rec)), os.listdir(rec)
    return err


# 4a. no file read that the user did not name
def test_recover_refuses_a_symlinked_member_and_keeps_the_spills_mode(tmp_path, capsys):
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:SECRET-HASH:19000:0:99999:7:::\n" * 4)
    secret.chmod(0o600)
    rec, spill = _dead_spill(tmp_path)
    os.remove(spill / "token_ids")
    os.symlink(secret, spill / "token_ids")
    _refused(rec, capsys, "token_ids", "symbolic link")
    assert spill.is_dir()  # left alone for a person to look at
    shutil.rmtree(spill)
    elsewhere, other = _dead_spill(tmp_path, "elsewhere")
    os.symlink(other, rec / ".trace-linked")  # a spill directory that is a link to another one
    _refused(rec, capsys, ".trace-linked", "symbolic link")
    assert os.listdir(elsewhere) == [other.name]  # the linked spill neither read nor removed

    # the members' mode bounds the trace's: a private spill gives a private trace
    rec2, spill2 = _dead_spill(tmp_path, "rec2")
    for n in os.listdir(spill2):
        os.chmod(spill2 / n, 0o600)
    assert main(["recover", str(rec2)]) == 0
    assert stat.S_IMODE(os.stat(rec2 / "t.npz").st_mode) & 0o077 == 0


def test_recover_refuses_members_that_are_not_regular_files_or_not_the_users(tmp_path, capsys):
    rec, spill = _dead_spill(tmp_path)
    os.remove(spill / "positions")
    os.mkfifo(spill / "positions")  # would block the reader forever
    _refused(rec, capsys, "positions", "FIFO")
    if os.geteuid() == 0:  # only root can give a file away
        rec2, spill2 = _dead_spill(tmp_path, "rec2")
        os.chown(spill2 / "topk_ids", 65534, 65534)
        _refused(rec2, capsys, "topk_ids", "owned by uid 65534")


# 4b. memory bounded by what the input really holds
def test_recover_refuses_a_huge_sparse_index_before_reading_it(tmp_path, capsys):
    rec, spill = _dead_spill(tmp_path)
    with open(spill / SPILL_INDEX, "r+b") as f:
        f.truncate(256 << 20)  # sparse: no disk, but a reader that trusts it reads 256 MiB
    tracemalloc.start()
    try:
        _refused(rec, capsys, SPILL_INDEX, "bytes")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


# 4c. a clear ValueError naming the file and the field, exit 2, no traceback
@pytest.mark.parametrize("field, tail, words", [
    ("token_ids", [0], ["token_ids", "tail"]),
    ("topk_ids", [2 ** 40, 2 ** 40], ["topk_ids", "tail"]),
    ("topk_ids", [3, 0], ["topk_ids", "tail"]),
])
def test_recover_names_a_bad_row_shape(tmp_path, capsys, field, tail, words):
    rec, spill = _dead_spill(tmp_path)
    index = json.loads((spill / SPILL_INDEX).read_text())
    index["fields"][field]["tail"] = tail
    (spill / SPILL_INDEX).write_text(json.dumps(index))
    _refused(rec, capsys, SPILL_INDEX, *words)


def test_recover_names_a_deeply_nested_index(tmp_path, capsys):
    rec, spill = _dead_spill(tmp_path)
    (spill / SPILL_INDEX).write_text("[" * 200_000 + "]" * 200_000)
    _refused(rec, capsys, SPILL_INDEX, "nested")


def test_a_deeply_nested_meta_is_named(tmp_path):
    a = _arrays()
    np.savez_compressed(tmp_path / "deep.npz", meta=np.array("[" * 200_000 + "]" * 200_000), **a)
    with pytest.raises(ValueError, match="deep.npz: field 'meta' is nested too deeply"):
        open_trace(tmp_path / "deep.npz")


# 4d. only the format's dtypes are written
@pytest.mark.parametrize("field, descr", [("token_ids", "|O"), ("topk_ids", "<f8"), ("positions", [["a", "<i4"]])])
def test_recover_refuses_a_dtype_the_format_does_not_allow(tmp_path, capsys, field, descr):
    rec, spill = _dead_spill(tmp_path)
    index = json.loads((spill / SPILL_INDEX).read_text())
    index["fields"][field]["dtype"] = descr
    (spill / SPILL_INDEX).write_text(json.dumps(index))
    _refused(rec, capsys, SPILL_INDEX, field, "dtype")


# 5. the meta header's size is bounded before a byte of it is read
def test_a_meta_header_of_a_huge_string_is_refused_before_reading(tmp_path):
    path = write_trace(tmp_path / "t.npz", META, **_arrays())
    forged = tmp_path / "forged.npz"
    chars = 50_000_000  # 200 MB of meta, deflated to ~200 kB
    head = io.BytesIO()
    np.lib.format.write_array_header_2_0(head, {"descr": f"<U{chars}", "fortran_order": False, "shape": ()})
    text = META.to_json().encode("utf-32-le")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(forged, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst:
        for info in src.infolist():
            if info.filename != "meta.npy":
                dst.writestr(info.filename, src.read(info))
        with dst.open("meta.npy", "w", force_zip64=True) as out:
            out.write(head.getvalue() + text)
            zeros, left = bytes(1 << 22), 4 * chars - len(text)
            while left > 0:
                out.write(zeros[:min(left, len(zeros))])
                left -= len(zeros)
    assert os.path.getsize(forged) < 2 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="forged.npz: field 'meta'.*characters"):
            open_trace(forged)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert main(["validate", str(forged)]) == 2


def test_a_writer_refuses_a_meta_no_reader_would_take(tmp_path):
    huge = TraceMeta(num_experts=8, top_k=2, num_layers=3, vocab_size=100, domains=("d" * 1000,) * 2000)
    with pytest.raises(ValueError, match="meta"):
        TraceWriter(tmp_path / "t.npz", huge)
    assert os.listdir(tmp_path) == []


# minor: negative request and step ids (the recorder writes vLLM's step counter and request
# ordinals, both counted up from 0)
@pytest.mark.parametrize("field", ["request_ids", "step_ids"])
def test_negative_request_and_step_ids_are_refused(tmp_path, capsys, field):
    from vllm_smoe.formats.trace import read_traces

    a = dict(_arrays(), step_ids=np.zeros(6, np.int32))
    a[field] = a[field].copy()
    a[field][4] = -3
    path = write_trace(tmp_path / "t.npz", META, **a)
    with pytest.raises(ValueError, match=f"'{field}' at token 4: negative"):
        open_trace(path, validate=True)
    with pytest.raises(ValueError, match=f"'{field}' at token 4: negative"):
        read_traces([str(path)])
    assert main(["validate", str(path)]) == 2
    assert f"'{field}' at token 4" in capsys.readouterr().err
