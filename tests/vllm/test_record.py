"""Record mode: routing captured live in vLLM equals transformers' own router on the same tokens."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_smoe.testbed import FIXTURE_MODEL
from vllm_smoe.formats.trace import read_traces
from tests.support import CONFIGS, HELPER, derangement_yaml, heldout_prompts

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def _prompts(n=5):
    return heldout_prompts(n, lambda i, r: 6 + 5 * i)


@pytest.fixture(scope="module", params=["eager", "compiled", "speculate"])
def recorded(tmp_path_factory, request):
    """Record mode at one rank (eager, compiled), and recording left on while speculating at TP=2
    + EP under vLLM's default compilation (each rank routes its chunk of reordered rows; the
    recorder gathers them back)."""
    d = tmp_path_factory.mktemp("rec")
    placement = derangement_yaml(d / "p.yaml", shift=3)  # every expert moved: recording must still report logical ids
    extra = {"smoe": {"mode": "record", "record": str(d / "traces"), "placement": str(placement),
                      "record_chunk_tokens": 40}}
    prompts = _prompts()
    env = {**os.environ, "SMOE_TEST_COMPILED": "0" if request.param == "eager" else "1"}
    if request.param == "speculate":
        extra = {"smoe": {"mode": "speculate", "placement": os.path.join(CONFIGS, "tiny-4dom-ep2.yaml"),
                          "record": str(d / "traces"), "record_chunk_tokens": 40, "record_max_mb": 64}}
        env.update({"SMOE_TEST_TP": "2", "SMOE_TEST_EP": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    r = subprocess.run([sys.executable, HELPER, FIXTURE_MODEL, json.dumps(prompts), "6", json.dumps(extra)],
                       capture_output=True, text=True, timeout=600, env=env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("SMOE_RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-4000:]
    return prompts, json.loads(line[0][len("SMOE_RESULT "):]), str(d / "traces")


def test_record_writes_valid_rotated_chunks(recorded):
    prompts, out, rec_dir = recorded
    files = sorted(os.listdir(rec_dir))
    assert len(files) >= 2 and all(f.startswith("trace-dp0-") and f.endswith(".npz") for f in files)
    meta, arr, _ = read_traces([rec_dir])
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (4, 32, 4)
    assert meta.extra["dp_rank"] == 0  # advise splits each DP engine's recording on its own
    # every processed token once: the prompts plus all generated tokens but the last of each
    assert arr["token_ids"].size == sum(len(p) for p in prompts) + sum(len(t) - 1 for t in out["tokens"])
    assert arr["is_prefill"].sum() == sum(len(p) for p in prompts)
    assert len(np.unique(arr["request_ids"])) == len(prompts)


def test_recorded_routing_equals_transformers_router(recorded):
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.record import router_topk

    prompts, out, rec_dir = recorded
    _, arr, _ = read_traces([rec_dir])
    model = AutoModelForCausalLM.from_pretrained(FIXTURE_MODEL, dtype=torch.float32).eval()
    checked = mismatched = 0
    for r in np.unique(arr["request_ids"]):
        rows = np.flatnonzero(arr["request_ids"] == r)
        rows = rows[np.argsort(arr["positions"][rows])]
        seq = arr["token_ids"][rows]
        np.testing.assert_array_equal(arr["positions"][rows], np.arange(rows.size))  # no gaps, no repeats
        i = next(k for k, p in enumerate(prompts) if seq[: len(p)].tolist() == p)
        np.testing.assert_array_equal(seq, prompts[i] + out["tokens"][i][:-1])  # what vLLM actually ran
        ids, _ = router_topk(model, torch.from_numpy(seq.astype(np.int64))[None], 4)
        got = np.sort(arr["topk_ids"][rows].astype(np.int32), -1)
        want = np.sort(ids, -1)
        checked += got.shape[0] * got.shape[1]
        mismatched += int((got != want).any(-1).sum())
    assert checked > 0 and mismatched == 0, f"{mismatched} of {checked} (token, layer) top-k sets differ"


def test_smoe_place_builds_from_the_record_directory(recorded, tmp_path):
    from vllm_smoe.tools.place_cli import main

    _, _, rec_dir = recorded
    assert main(["build", "--trace", rec_dir, "--ep-size", "4", "-o", str(tmp_path / "p.yaml")]) == 0


def test_tensor_parallel_2_placement_is_lossless_and_recorded_once(tmp_path):
    """TP=2 on the CPU build: every expert moved gives the plain TP=2 tokens; only TP rank 0 writes."""
    prompts = _prompts(4)
    placement = derangement_yaml(tmp_path / "p.yaml", shift=5, step=0)
    env = {**os.environ, "SMOE_TEST_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}

    def run(extra):
        args = [sys.executable, HELPER, FIXTURE_MODEL, json.dumps(prompts), "6"] + ([json.dumps(extra)] if extra else [])
        r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("SMOE_RESULT ")]
        assert r.returncode == 0 and line, r.stderr[-4000:]
        return json.loads(line[0][len("SMOE_RESULT "):])

    plain = run(None)
    rec = tmp_path / "traces"
    placed = run({"smoe": {"placement": str(placement), "mode": "record", "record": str(rec)}})
    assert placed["tokens"] == plain["tokens"]
    np.testing.assert_allclose(placed["logprobs"], plain["logprobs"], rtol=0, atol=1e-4)
    _, arr, files = read_traces([str(rec)])
    assert all("-dp0-" in f for f in files)
    assert arr["token_ids"].size == sum(len(p) for p in prompts) + sum(len(t) - 1 for t in plain["tokens"])
