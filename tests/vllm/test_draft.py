"""Speculative decoding under smoe (``--speculative-config``) on vLLM's CPU build: the target is
placed (and recorded), a draft is served as vLLM serves it. Three drafts, each served plain and
under smoe with a placement that moves every expert: ngram (no draft model: the loader sees only
the target), the target as its own draft model (every proposal routed by a second copy of the
same MoE layers) and a random 64-expert draft of the 32-expert target (another expert count;
nearly every proposal rejected)."""

import subprocess
import sys

import numpy as np
import pytest

from vllm_smoe.formats.trace import read_traces
from vllm_smoe.testbed import FIXTURE_MODEL
from tests.support import derangement_yaml, heldout_prompts, vllm_runs

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

K = 2  # num_speculative_tokens
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def draft_runs(tmp_path_factory):
    """{draft: {"plain" | "smoe": (result, log, record directory or None)}}: six engines, in two processes."""
    d = tmp_path_factory.mktemp("draft")
    e64 = str(d / "e64")
    r = subprocess.run([sys.executable, "-m", "vllm_smoe.tools.testbed_cli", "build", "--experts", "64", "-o", e64],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    placement = derangement_yaml(d / "p.yaml", shift=3)
    prompts = heldout_prompts(4, lambda i, r: 6 + 5 * i)
    drafts = {"ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                        "prompt_lookup_min": 1},
              "self": {"method": "draft_model", "model": FIXTURE_MODEL, "num_speculative_tokens": K},
              "e64": {"method": "draft_model", "model": e64, "num_speculative_tokens": K}}
    smoe = {"ngram": {"mode": "place", "placement": placement},  # record mode applies a placement as place does
            "self": {"mode": "record", "placement": placement, "record": str(d / "self")},
            "e64": {"mode": "record", "placement": placement, "record": str(d / "e64-rec")}}
    runs, names = [], []
    for name in ("self", "e64", "ngram"):
        for kind, extra in (("plain", None), ("smoe", {"smoe": smoe[name]})):
            runs.append({"model": FIXTURE_MODEL, "prompts": prompts, "max_tokens": MAX_TOKENS, "extra": extra,
                         "engine": {"speculative_config": drafts[name]}})
            names.append((name, kind, extra))
    # vLLM 0.32's CPU build cannot start an engine in a process where an ngram engine ran (its kernel
    # overrides scan every module and trip over llvmlite's, which ngram's numba imports): the last one alone
    # a hung engine costs 10 minutes of CI, not the default 30
    results = vllm_runs(runs[:-1], d, timeout=600) + vllm_runs(runs[-1:], d, timeout=600)
    out: dict = {}
    for (name, kind, extra), (res, log) in zip(names, results):
        out.setdefault(name, {})[kind] = (res, log, (extra or {}).get("smoe", {}).get("record"))
    return prompts, out


@pytest.mark.parametrize("draft", ["ngram", "self", "e64"])
def test_greedy_tokens_equal_plain_vllm_with_the_same_draft(draft_runs, draft):
    _, out = draft_runs
    plain, _, _ = out[draft]["plain"]
    placed, log, _ = out[draft]["smoe"]
    assert placed["tokens"] == plain["tokens"]
    assert all(len(t) == MAX_TOKENS for t in placed["tokens"])
    np.testing.assert_allclose(np.array(placed["logprobs"]), np.array(plain["logprobs"]), rtol=0, atol=1e-4)
    assert log.count("smoe: placement applied") == 1, log[-3000:]  # the target's, not the draft's
    if draft == "ngram":  # nothing loaded for it
        assert "smoe: speculative draft" not in log
    else:
        experts = 64 if draft == "e64" else 32
        said = [ln for ln in log.splitlines() if "smoe: speculative draft" in ln]
        assert len(said) == 1 and f"4 MoE layers ({experts} experts) are served as vLLM serves them" in said[0], said


@pytest.mark.parametrize("draft", ["self", "e64"])
def test_recorded_rows_equal_transformers_router_row_for_row(draft_runs, draft):
    """Each request's rows: its positions once each, from 0, the tokens vLLM kept (prompt and
    generated, the last one never run), at most K of the end left out (the drafts of its last
    step); every row's top-k that of transformers' router on that sequence. The random draft's
    proposals are nearly all rejected, yet the target ran them: written, they would repeat positions."""
    from transformers import AutoModelForCausalLM

    from vllm_smoe.testbed.record import router_topk

    prompts, out = draft_runs
    res, _, rec = out[draft]["smoe"]
    _, arr, _ = read_traces([rec])
    assert len(np.unique(arr["request_ids"])) == len(prompts)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE_MODEL, dtype=torch.float32).eval()
    checked = mismatched = 0
    for r in np.unique(arr["request_ids"]):
        rows = np.flatnonzero(arr["request_ids"] == r)
        rows = rows[np.argsort(arr["positions"][rows])]
        np.testing.assert_array_equal(arr["positions"][rows], np.arange(rows.size))  # no gaps, no repeats
        seq = arr["token_ids"][rows]
        i = next(k for k, p in enumerate(prompts) if seq[: len(p)].tolist() == p)
        ran = prompts[i] + res["tokens"][i][:-1]
        assert len(ran) - K <= seq.size <= len(ran) and seq.tolist() == ran[: seq.size]
        ids, _ = router_topk(model, torch.from_numpy(seq.astype(np.int64))[None], 4)
        got, want = np.sort(arr["topk_ids"][rows].astype(np.int32), -1), np.sort(ids, -1)
        checked += got.shape[0] * got.shape[1]
        mismatched += int((got != want).any(-1).sum())
    assert checked > 0 and mismatched == 0, f"{mismatched} of {checked} (token, layer) top-k sets differ"
