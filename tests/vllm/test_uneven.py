"""A model whose expert count the ranks do not divide (15 experts over 2 ranks: vLLM gives rank 0
eight, rank 1 seven), taken the README's way: record, smoe-place build, then served at TP=2 + EP
in mode place and speculate. Greedy tokens equal plain TP=2 (fp32)."""

import re
import subprocess
import sys

import numpy as np

from tests.support import heldout_prompts, vllm_runs


def _run(*args):
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_fifteen_experts_on_two_ranks_record_place_serve(tmp_path):
    from vllm_smoe.formats.placement_file import load_placement

    model, trace, placement = tmp_path / "m15", tmp_path / "rec.npz", tmp_path / "p.yaml"
    _run("vllm_smoe.tools.testbed_cli", "build", "--arch", "qwen3_moe", "--experts", "15", "--top-k", "4",
         "--layers", "2", "-o", str(model))
    _run("vllm_smoe.tools.testbed_cli", "record", "--model", str(model), "--requests", "8", "--seq-len", "64",
         "-o", str(trace))
    _run("vllm_smoe.tools.place_cli", "build", "--trace", str(trace), "--ep-size", "2", "--model", str(model),
         "-o", str(placement))
    p = load_placement(str(placement))
    assert [np.bincount(row, minlength=2).tolist() for row in p.expert2rank] == [[8, 7], [8, 7]]
    prompts = heldout_prompts(6, length=lambda i, r: 5 + 3 * i)
    base = {"model": str(model), "prompts": prompts, "max_tokens": 12}
    runs = [dict(base, ep=False),
            dict(base, ep=True, extra={"smoe": {"placement": str(placement)}}),
            dict(base, ep=True, extra={"smoe": {"placement": str(placement), "mode": "speculate"}})]
    (plain, _), (placed, placed_log), (spec, spec_log) = vllm_runs(runs, tmp_path, tp=2)
    assert placed["tokens"] == plain["tokens"]
    assert spec["tokens"] == plain["tokens"]
    moved = [int(m) for m in re.findall(r"placement applied: .*?, (\d+) of 30 expert slots changed", placed_log)]
    assert moved and all(m > 0 for m in moved), placed_log[-2000:]  # the placement did move experts
    assert "Local/global number of experts: 8/15" in placed_log  # vLLM's rank 0 holds the eighth
    assert "mode speculate: token order over 2 ranks" in spec_log  # speculate did run
