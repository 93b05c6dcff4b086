"""The 64-expert, top-8 Qwen3-MoE fixture: its traces ship (its checkpoint does not)."""

import numpy as np
import pytest

from vllm_smoe.formats.trace import open_trace
from vllm_smoe.placement.stats import expert_usage, token_hotness
from vllm_smoe.testbed import ALL_FIXTURE_TRACES, FIXTURE_TRACES, FIXTURES, TRACE_ONLY_FIXTURES
from vllm_smoe.tools.testbed_cli import build_parser, main

TOKENS = {"train": 131072, "heldout": 65536}


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_e64_traces_load_with_64_experts_top8(split):
    t = open_trace(ALL_FIXTURE_TRACES["qwen3_moe_e64"][split], validate=True)
    m = t.meta
    assert (m.num_layers, m.num_experts, m.top_k, m.vocab_size, m.hidden_size) == (4, 64, 8, 4096, 128)
    assert m.domains == ("python", "c", "prose", "math")
    topk = t["topk_ids"]
    assert topk.shape == (TOKENS[split], 4, 8)
    assert topk.min() >= 0 and topk.max() < 64
    assert (np.diff(np.sort(topk, -1), axis=-1) > 0).all()  # a token's 8 experts are distinct
    # balanced training, a few experts near-dead as in the 32-expert fixture (whose layer 1 uses 26 of 32)
    assert all(len(np.unique(topk[:, layer])) >= 60 for layer in range(4))
    # same tokenizer, corpus and windows as the shipped Qwen3-MoE fixture's trace of that split
    ref = open_trace(FIXTURE_TRACES[split])
    for field in ("token_ids", "request_ids", "positions", "domain"):
        np.testing.assert_array_equal(t[field], ref[field])


def test_e64_is_hot_and_domain_specific():
    """The shipped fixture's checks (test_testbed.py) hold at 64 experts, top-8."""
    t = open_trace(ALL_FIXTURE_TRACES["qwen3_moe_e64"]["heldout"])
    assert token_hotness(t["token_ids"], t["topk_ids"])[0] > 0.7
    u = expert_usage(t["topk_ids"], 64, t["domain"], 4)
    off = (0.5 * np.abs(u[:, None] - u[None, :]).sum(-1))[~np.eye(4, dtype=bool)]
    u0 = expert_usage(t["topk_ids"], 64, np.random.default_rng(0).permutation(t["domain"]), 4)
    noise = (0.5 * np.abs(u0[:, None] - u0[None, :]).sum(-1)).max()
    assert off.min() > 0.15 and off.min() > 5 * noise, (off.min(), noise)


def test_e64_is_registered_without_a_checkpoint(capsys):
    assert "qwen3_moe_e64" not in FIXTURES  # FIXTURES: fixtures whose checkpoint ships
    assert main(["path", "train", "--fixture", "qwen3_moe_e64"]) == 0
    assert capsys.readouterr().out.strip() == TRACE_ONLY_FIXTURES["qwen3_moe_e64"][0]["train"]
    assert main(["path", "model", "--fixture", "qwen3_moe_e64"]) == 2
    err = capsys.readouterr().err
    assert "not shipped" in err and "smoe-testbed train --experts 64 --top-k 8" in err
    assert main(["path", "heldout"]) == 0  # the default fixture is unchanged
    assert capsys.readouterr().out.strip() == FIXTURE_TRACES["heldout"]


def test_train_defaults_reproduce_the_shipped_sizes():
    a = build_parser().parse_args(["train", "-o", "x"])
    assert (a.arch, a.experts, a.top_k, a.steps, a.threads) == ("qwen3_moe", 32, 4, 2400, 2)
