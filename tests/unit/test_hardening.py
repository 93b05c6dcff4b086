"""Bad input, as a careless or unlucky user gives it: every case exits 2 (or is refused) with
the file and the field or flag named, no traceback, and leaves nothing behind."""

import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
import yaml

from vllm_smoe.serving.config import SmoeConfig
from vllm_smoe.testbed import FIXTURE_TRACES
from vllm_smoe.formats.trace import TraceMeta, open_trace, write_trace
from tests.support import REPO

TRAIN, HELDOUT = FIXTURE_TRACES["train"], FIXTURE_TRACES["heldout"]
EP2 = os.path.join(REPO, "configs", "tiny-4dom-ep2.yaml")


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True)


def _expect(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert str(w) in r.stderr, (w, r.stderr[-2000:])


def _small_trace(path, T=64, dup=False):
    rng = np.random.default_rng(0)
    topk = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in range(T)]) if T \
        else np.zeros((0, 3, 2), np.int16)
    if dup:
        topk[5, 1] = [3, 3]
    meta = TraceMeta(num_experts=8, top_k=2, num_layers=3, vocab_size=100)
    return write_trace(path, meta, token_ids=rng.integers(0, 100, T).astype(np.int32),
                       request_ids=np.zeros(T, np.int32), positions=np.arange(T, dtype=np.int32),
                       topk_ids=topk.astype(np.int16))


def _damage_member_data(path):
    """Flip bytes in the middle of the compressed data: the zip directory stays intact."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("topk_ids.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    data = bytearray(open(path, "rb").read())
    for i in range(start + 20, start + min(info.compress_size, 200)):
        data[i] ^= 0x5A
    open(path, "wb").write(bytes(data))


# 1. readers: tracebacks become errors naming the file
def test_unreadable_inputs_name_their_file(tmp_path):
    bad = _small_trace(tmp_path / "damaged.npz", T=4000)
    _damage_member_data(bad)
    _expect(_run("vllm_smoe.tools.trace_cli", "validate", bad), bad, "damaged data")
    _expect(_run("vllm_smoe.tools.trace_cli", "validate", tmp_path), tmp_path, "is a directory")
    _expect(_run("vllm_smoe.tools.place", "build", "--trace", bad, "--ep-size", "2", "-o", tmp_path / "p.yaml"),
            bad)
    if os.geteuid() != 0:  # root reads anything
        locked = _small_trace(tmp_path / "locked.npz")
        os.chmod(locked, 0)
        _expect(_run("vllm_smoe.tools.trace_cli", "info", locked), locked)


# 2. output paths are checked before any work and leave no debris
@pytest.mark.parametrize("cmd,flag", [
    (["build", "--trace", TRAIN, "--ep-size", "2", "-o"], "-o"),
    (["evaluate", "--trace", HELDOUT, "--placement", EP2, "--json"], "--json"),
    (["report", "--trace", HELDOUT, "--placement", EP2, "-o"], "-o"),
])
@pytest.mark.parametrize("where", ["proc", "a-directory", "under-a-file"])
def test_bad_output_paths_fail_first_and_leave_nothing(tmp_path, cmd, flag, where):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    target = {"proc": "/proc/smoe/out.yaml", "a-directory": tmp_path / "dir", "under-a-file": tmp_path / "file" / "o"}
    out = target[where]
    if cmd[0] == "report" and where == "a-directory":
        out = tmp_path / "file"  # report writes a directory: a file is what it cannot use
    r = _run("vllm_smoe.tools.place", *cmd, out)
    _expect(r, out, flag)
    assert "placing" not in r.stderr  # refused before the solve
    assert sorted(os.listdir(tmp_path)) == ["dir", "file"] and os.listdir(tmp_path / "dir") == []


@pytest.mark.parametrize("cmd", [["vllm_smoe.tools.place", "build", "--trace", TRAIN, "--ep-size", "2", "-o"],
                                 ["vllm_smoe.tools.testbed_cli", "synth", "--tokens", "64", "-o"]])
def test_outputs_never_replace_a_fifo_or_device_node(tmp_path, cmd):
    """Outputs are renamed into place: over a FIFO or device node that would leave a regular
    file where it was (as root, -o /dev/null would break the host). Refused first, exit 2."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _expect(_run(*cmd, fifo), fifo, "a FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]
    r = _run(*cmd, "/dev/null")
    _expect(r, "/dev/null", "a character device")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_writers_refuse_special_files_themselves(tmp_path):
    """The library writers check too (a caller that skipped the CLI's check)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="a FIFO"):
        _small_trace(fifo)
    from vllm_smoe.formats.placement_file import _atomic_write

    with pytest.raises(ValueError, match="a FIFO"):
        _atomic_write(str(fifo), b"x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]


def _alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes whose aliases expand to 9 ** levels values."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text,words", [
    (_alias_bomb(), "its aliases expand to"),
    ("smoe_placement: 1\nmodel: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than 32 levels"),
    ("smoe_placement: [1, 2\n", "malformed YAML at line"),
])
def test_hostile_yaml_is_refused_cheaply_without_echoing_it(tmp_path, text, words):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    r = _run("vllm_smoe.tools.place", "evaluate", "--trace", HELDOUT, "--placement", p)
    _expect(r, p, words)
    assert len(r.stderr) < 400  # one line: nothing of the file is quoted back


def test_alias_bomb_and_non_regular_inputs_are_refused(tmp_path):
    """Nine levels of aliases would expand to gigabytes (counted, never expanded); a FIFO would block; a symlink to
    /dev/zero would read until memory runs out: each refused at once, naming the file."""
    from vllm_smoe.formats.bounded import load_yaml
    from vllm_smoe.formats.placement_file import load_placement

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    with pytest.raises(ValueError, match="its aliases expand to"):
        load_placement(str(bomb))
    plain = tmp_path / "shared.yaml"  # aliases as PyYAML writes shared objects: read as before
    plain.write_text("a: &x [1, 2]\nb: *x\n")
    assert load_yaml(str(plain), "placement file") == {"a": [1, 2], "b": [1, 2]}
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO, not a regular file"):
        load_placement(str(fifo))
    zero = tmp_path / "zero.npz"
    os.symlink("/dev/zero", zero)
    with pytest.raises(ValueError, match="is a character device"):
        open_trace(zero)
    big = tmp_path / "big.yaml"
    big.write_text("x: 1\n")
    with pytest.raises(ValueError, match="over the 3 smoe reads"):
        load_yaml(str(big), "placement file", max_bytes=3)


def test_a_trace_header_claiming_more_than_its_data_is_refused_before_allocating(tmp_path):
    """meta claims a 1 GB string: refused from the zip directory, nothing allocated."""
    import io
    import zipfile

    path = _small_trace(tmp_path / "t.npz")
    forged = tmp_path / "forged.npz"
    head = io.BytesIO()
    np.lib.format.write_array_header_2_0(head, {"descr": "<U250000000", "fortran_order": False, "shape": ()})
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(forged, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, head.getvalue() + b"{}" if info.filename == "meta.npy" else src.read(info))
    with pytest.raises(ValueError, match="field 'meta': its header claims 1000000000 bytes"):
        open_trace(forged)


def test_recovery_takes_only_the_formats_field_names(tmp_path):
    import json

    from vllm_smoe.formats.trace import SPILL_INDEX, TraceWriter, recover_spill

    w = TraceWriter(tmp_path / "t.npz", TraceMeta(num_experts=8, top_k=2, num_layers=3, vocab_size=100))
    w.append(token_ids=np.arange(4, dtype=np.int32), request_ids=np.zeros(4, np.int32),
             positions=np.arange(4, dtype=np.int32), topk_ids=np.zeros((4, 3, 2), np.int16))
    spill = w._dir
    index = json.load(open(os.path.join(spill, SPILL_INDEX)))
    index["fields"]["../../../etc/passwd"] = {"dtype": "|u1", "tail": []}
    json.dump(index, open(os.path.join(spill, SPILL_INDEX), "w"))
    w._lock.close()
    with pytest.raises(ValueError, match="not fields of the trace format"):
        recover_spill(spill, force=True)


# 5. NaN and empty inputs
@pytest.mark.parametrize("args,words", [
    (["build", "--trace", TRAIN, "--ep-size", "2", "--capacity", "nan"], "argument --capacity"),
    (["build", "--trace", TRAIN, "--ep-size", "2", "--metrics-tokens", "0"], "argument --metrics-tokens"),
    (["evaluate", "--trace", HELDOUT, "--placement", EP2, "--capacity", "inf"], "argument --capacity"),
])
def test_non_finite_and_zero_options_are_refused(tmp_path, args, words):
    _expect(_run("vllm_smoe.tools.place", *args, *(["-o", tmp_path / "p.yaml"] if args[0] == "build" else [])), words)
    assert not os.listdir(tmp_path)


def test_empty_traces_and_nan_capacity_in_a_yaml_are_refused(tmp_path):
    empty = _small_trace(tmp_path / "empty.npz", T=0)
    _expect(_run("vllm_smoe.tools.place", "build", "--trace", empty, "--ep-size", "2", "-o", tmp_path / "p.yaml"),
            empty, "holds no tokens")
    shutil.copy(EP2, tmp_path / "nan.yaml")
    shutil.copy(os.path.join(REPO, "configs", yaml.safe_load(open(EP2))["predictor"]), tmp_path)
    doc = yaml.safe_load(open(tmp_path / "nan.yaml"))
    doc["capacity"] = float("nan")
    (tmp_path / "nan.yaml").write_text(yaml.safe_dump(doc))
    _expect(_run("vllm_smoe.tools.place", "evaluate", "--trace", HELDOUT, "--placement", tmp_path / "nan.yaml"),
            tmp_path / "nan.yaml", "field 'capacity'")


# 6. the smaller ones
@pytest.mark.parametrize("flag,value", [("--replicas", "-4"), ("--theta", "5"), ("--max-expert-load", "0.5"),
                                        ("--hidden-size", "0"), ("--ep-size", "0"), ("--nodes", "-1")])
def test_out_of_range_options_name_their_flag(tmp_path, flag, value):
    _expect(_run("vllm_smoe.tools.place", "build", "--trace", TRAIN, "--ep-size", "2", flag, value,
                 "-o", tmp_path / "p.yaml"), f"argument {flag}")


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["layers"][0]["expert_to_rank"].__setitem__(0, 1.0), "must hold integer ranks, got 1.0"),
    (lambda d: d["layers"][1].__setitem__("replicas", [[0, 1 - d["layers"][1]["expert_to_rank"][0]]
                                                       for _ in range(2)]), "twice"),  # two lists: no YAML alias
    (lambda d: d["layers"][1].__setitem__("replicas", [[0, d["layers"][1]["expert_to_rank"][0]]]),
     "its own home rank"),
])
def test_placement_yaml_mistakes_name_the_field(tmp_path, edit, words):
    doc = yaml.safe_load(open(EP2))
    doc.pop("predictor"), doc.pop("predictor_sha256")
    edit(doc)
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(doc))
    _expect(_run("vllm_smoe.tools.place", "evaluate", "--trace", HELDOUT, "--placement", p), p, words)


def test_binary_yaml_and_duplicate_top_k_are_refused(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_bytes(bytes(range(256)) * 4)
    _expect(_run("vllm_smoe.tools.place", "evaluate", "--trace", HELDOUT, "--placement", p), p)
    dup = _small_trace(tmp_path / "dup.npz", dup=True)
    _expect(_run("vllm_smoe.tools.trace_cli", "validate", dup), dup, "field 'topk_ids' at token 5", "twice")


def test_the_record_directory_check_creates_nothing(tmp_path):
    cfg = SmoeConfig.from_dict({"record": str(tmp_path / "a" / "b")})
    cfg.check_files()
    assert not (tmp_path / "a").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="field 'record'"):
        SmoeConfig.from_dict({"record": str(tmp_path / "f" / "rec")}).check_files()


def test_debug_flag_shows_the_traceback(tmp_path):
    r = _run("vllm_smoe.tools.trace_cli", "--debug", "validate", tmp_path / "missing.npz")
    assert r.returncode == 2 and "Traceback" in r.stderr and "no such trace file" in r.stderr


def test_open_trace_of_an_empty_trace_still_reads():
    """An empty trace is a valid file (a recording of nothing); only the solvers refuse it."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        assert open_trace(_small_trace(os.path.join(d, "e.npz"), T=0), validate=True).num_tokens == 0


def test_placement_layers_read_expert2rank_or_expert_to_rank(tmp_path):
    """The map's code name (expert2rank) and the spelling files were written with both read,
    to the same placement; one layer giving both is refused, naming the layer."""
    from vllm_smoe.formats.placement_file import load_placement, load_tables

    doc = yaml.safe_load(open(EP2))
    shutil.copy(os.path.join(REPO, "configs", doc["predictor"]), tmp_path)
    for entry in doc["layers"]:
        entry["expert2rank"] = entry.pop("expert_to_rank")
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(doc))
    new, old = load_placement(str(tmp_path / "new.yaml")), load_placement(EP2)
    np.testing.assert_array_equal(new.expert2rank, old.expert2rank)
    load_tables(new)  # the tables still belong to it (same expert2rank)
    doc["layers"][1]["expert_to_rank"] = doc["layers"][1]["expert2rank"]
    (tmp_path / "both.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=r"field 'layers\[1\]' gives both"):
        load_placement(str(tmp_path / "both.yaml"))
    del doc["layers"][1]["expert_to_rank"], doc["layers"][2]["expert2rank"]
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=r"field 'layers\[2\].expert2rank' is missing"):
        load_placement(str(tmp_path / "none.yaml"))
