"""Hostile inputs to smoe-place build (issue 65's probe): a vocabulary no model has, another
model's checkpoint, non-finite embeddings, and tables that would not read back."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from vllm_smoe.formats.trace import read_traces, write_trace
from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES
from vllm_smoe.tools.place import main as place


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    meta, arr, _ = read_traces([FIXTURE_TRACES["heldout"]])
    path = str(d / "t.npz")
    write_trace(path, meta, **{k: v[:3000] for k, v in arr.items()})
    return path, meta, {k: v[:3000] for k, v in arr.items()}


def _build(capsys, *args):
    code = place(["build", *args])
    return code, capsys.readouterr().err


def test_a_vocabulary_no_model_has_is_refused_naming_the_field(small_trace, tmp_path, capsys):
    _, meta, arr = small_trace
    huge = str(tmp_path / "huge.npz")
    write_trace(huge, dataclasses.replace(meta, vocab_size=2**40), **arr)
    code, err = _build(capsys, "--trace", huge, "--ep-size", "2", "-o", str(tmp_path / "p.yaml"))
    assert code == 2 and "meta.vocab_size" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "p.yaml")


def test_another_models_checkpoint_is_refused_not_fingerprinted(small_trace, tmp_path, capsys):
    trace, _, _ = small_trace
    other = tmp_path / "other"
    shutil.copytree(FIXTURE_MODEL, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_local_experts"] = cfg["num_local_experts"] * 2
    (other / "config.json").write_text(json.dumps(cfg))
    code, err = _build(capsys, "--trace", trace, "--ep-size", "2", "--model", str(other), "-o", str(tmp_path / "p.yaml"))
    assert code == 2 and "num_experts" in err and "--model must be the recorded model" in err
    assert not os.path.exists(tmp_path / "p.yaml")
    code, err = _build(capsys, "--trace", trace, "--ep-size", "2", "--model", FIXTURE_MODEL, "-o", str(tmp_path / "p.yaml"))
    assert code == 0, err  # the recorded model itself is taken


def test_non_finite_embeddings_are_refused_before_anything_is_built(small_trace, tmp_path, capsys, monkeypatch):
    from vllm_smoe.tools.place import read

    trace, _, _ = small_trace
    real = read.read_embeddings

    def poisoned(model_dir, vocab_size):
        emb = real(model_dir, vocab_size)
        emb[7, 3] = np.nan
        return emb

    monkeypatch.setattr(read, "read_embeddings", poisoned)
    code, err = _build(capsys, "--trace", trace, "--ep-size", "2", "--model", FIXTURE_MODEL, "--learned",
                       "-o", str(tmp_path / "p.yaml"))
    assert code == 2 and "non-finite" in err and "token id 7" in err
    assert not os.path.exists(tmp_path / "p.yaml")


def test_nothing_is_written_that_would_not_read_back(tmp_path):
    from vllm_smoe.formats.placement_file import load_placement, load_tables, write_placement

    e2r = np.array([[0, 0, 1, 1], [1, 1, 0, 0]])
    V = 5
    good = {"token2rank": np.zeros((2, V, 2), np.int8), "token_conf": np.ones((2, V), np.float16),
            "markov2rank": np.zeros((2, 4, 2), np.int8), "markov_conf": np.ones((2, 4), np.float16),
            "prior2rank": np.zeros((2, 2), np.int8), "prior_conf": np.ones((2,), np.float16)}
    kw = dict(expert2rank=e2r, ep_size=2, nodes=1, top_k=2, vocab_size=V, method="test", capacity=1.0)
    path = write_placement(str(tmp_path / "ok.yaml"), tables=good, **kw)
    load_tables(load_placement(path))  # what was written reads
    bad = {**good, "token_conf": np.full((2, V), np.nan, np.float16)}
    with pytest.raises(ValueError, match="not written: .*non-finite"):
        write_placement(str(tmp_path / "bad.yaml"), tables=bad, **kw)
    assert not any(n.startswith("bad") for n in os.listdir(tmp_path))
