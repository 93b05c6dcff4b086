"""Record mode: routing captured live in vLLM equals transformers' own router on the same tokens."""

import os

import numpy as np
import pytest

from vllm_smoe.testbed import FIXTURE_MODEL
from vllm_smoe.formats.trace import read_traces
from tests.support import CONFIGS, derangement_yaml, heldout_prompts, vllm_runs

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def _prompts(n=5):
    return heldout_prompts(n, lambda i, r: 6 + 5 * i)


@pytest.fixture(scope="module")
def record_runs(tmp_path_factory):
    """Every engine of this module, in two processes (one per TP size, vLLM imported once in
    each): record mode at one rank (eager, compiled) with every expert moved; at TP=2 + EP,
    recording left on while speculating under vLLM's default compilation (each rank routes its
    chunk of reordered rows; the recorder gathers them back), and plain TP=2 against a placement
    that moves every expert, recorded. {name: (prompts, result, record directory or None)}."""
    d = tmp_path_factory.mktemp("rec")
    placement = derangement_yaml(d / "p.yaml", shift=3)  # every expert moved: recording must still report logical ids
    prompts = _prompts()

    def record(name, **smoe):
        return {"model": FIXTURE_MODEL, "prompts": prompts, "max_tokens": 6, "compiled": name != "eager",
                "extra": {"smoe": {"record": str(d / name), "record_chunk_tokens": 40, **smoe}}}

    one = {"eager": record("eager", mode="record", placement=str(placement)),
           "compiled": record("compiled", mode="record", placement=str(placement))}
    moved = derangement_yaml(d / "p5.yaml", shift=5, step=0)
    tp2 = {"speculate": {**record("speculate", mode="speculate", placement=os.path.join(CONFIGS, "tiny-4dom-ep2.yaml"),
                                  record_max_mb=64), "ep": True},
           "tp2-plain": {"model": FIXTURE_MODEL, "prompts": prompts[:4], "max_tokens": 6, "extra": None},
           "tp2-placed": {"model": FIXTURE_MODEL, "prompts": prompts[:4], "max_tokens": 6,
                          "extra": {"smoe": {"placement": str(moved), "mode": "record", "record": str(d / "tp2")}}}}
    out = {}
    for tp, runs in ((1, one), (2, tp2)):
        for (name, run), (res, _) in zip(runs.items(), vllm_runs(list(runs.values()), d, tp=tp)):
            rec = (run["extra"] or {}).get("smoe", {}).get("record")
            out[name] = (run["prompts"], res, rec)
    return out


@pytest.fixture(scope="module", params=["eager", "compiled", "speculate"])
def recorded(record_runs, request):
    return record_runs[request.param]


def test_record_writes_valid_rotated_chunks(recorded):
    prompts, out, rec_dir = recorded
    files = sorted(os.listdir(rec_dir))
    assert len(files) >= 2 and all(f.startswith("trace-dp0-") and f.endswith(".npz") for f in files)
    meta, arr, _ = read_traces([rec_dir])
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (4, 32, 4)
    assert meta.extra["dp_rank"] == 0  # advise splits each DP engine's recording on its own
    # how speculate ordered the rows (advise's --rename default reads it); absent when not speculating
    assert meta.extra.get("token_order") == ("layer" if rec_dir.endswith("speculate") else None)
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


def test_tensor_parallel_2_placement_is_lossless_and_recorded_once(record_runs):
    """TP=2 on the CPU build: every expert moved gives the plain TP=2 tokens; only TP rank 0 writes."""
    prompts, plain, _ = record_runs["tp2-plain"]
    _, placed, rec = record_runs["tp2-placed"]
    assert placed["tokens"] == plain["tokens"]
    np.testing.assert_allclose(placed["logprobs"], plain["logprobs"], rtol=0, atol=1e-4)
    _, arr, files = read_traces([rec])
    assert all("-dp0-" in f for f in files)
    assert arr["token_ids"].size == sum(len(p) for p in prompts) + sum(len(t) - 1 for t in plain["tokens"])
