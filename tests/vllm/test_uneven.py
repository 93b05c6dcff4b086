"""A model whose expert count the ranks do not divide (15 experts over 2 ranks: vLLM gives rank 0
eight, rank 1 seven), taken the README's way: record, smoe-place build, then served at TP=2 + EP
in mode place and speculate. Greedy tokens equal plain TP=2 (fp32)."""

import re

import numpy as np

from tests.support import heldout_prompts, random_model_placed, vllm_runs


def test_fifteen_experts_on_two_ranks_record_place_serve(tmp_path):
    from vllm_smoe.formats.placement_file import load_placement

    model, placement = random_model_placed(tmp_path, "qwen3_moe", experts=15, top_k=4)
    p = load_placement(placement)
    assert [np.bincount(row, minlength=2).tolist() for row in p.expert2rank] == [[8, 7], [8, 7]]
    prompts = heldout_prompts(6, length=lambda i, r: 5 + 3 * i)
    base = {"model": model, "prompts": prompts, "max_tokens": 12}
    runs = [dict(base, ep=False),
            dict(base, ep=True, extra={"smoe": {"placement": placement}}),
            dict(base, ep=True, extra={"smoe": {"placement": placement, "mode": "speculate"}})]
    (plain, _), (placed, placed_log), (spec, spec_log) = vllm_runs(runs, tmp_path, tp=2)
    assert placed["tokens"] == plain["tokens"]
    assert spec["tokens"] == plain["tokens"]
    moved = [int(m) for m in re.findall(r"placement applied: .*?, (\d+) of 30 expert slots changed", placed_log)]
    assert moved and all(m > 0 for m in moved), placed_log[-2000:]  # the placement did move experts
    assert "Local/global number of experts: 8/15" in placed_log  # vLLM's rank 0 holds the eighth
    assert "mode speculate: token order over 2 ranks" in spec_log  # speculate did run
