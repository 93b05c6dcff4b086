"""`smoe-testbed inflate`: a widened checkpoint computes what its source computes.

Checked against transformers (logits, every MoE layer's top-k, argmax) for every shipped
architecture, and in vLLM (greedy tokens of the source and the widened model, fp32)."""

import json
import os
import subprocess
import sys

import pytest

from vllm_smoe.testbed import FIXTURES
from vllm_smoe.testbed.inflate import inflate_checkpoint
from tests.support import HELPER
from tests.unit.test_inflate import WIDE, _ids


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_widened_model_greedy_tokens_equal_in_vllm(tmp_path, arch):
    hidden, inter, heads, kv = WIDE[arch]
    dst = str(tmp_path / "wide")
    inflate_checkpoint(FIXTURES[arch][0], dst, hidden, inter, heads=heads, kv_heads=kv)
    prompts = [p[: 5 + 3 * i].tolist() for i, p in enumerate(_ids(arch, n=6, length=30))]
    env = {**os.environ, "SMOE_TEST_TP": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    # MLA on vLLM's CPU build needs the plugin's rotary fix (its CPU fixes alone, nothing placed)
    extra = [json.dumps({"smoe": {}})] if arch.startswith("deepseek") else []
    tokens = []
    for model in (FIXTURES[arch][0], dst):
        r = subprocess.run([sys.executable, HELPER, model, json.dumps(prompts), "16", *extra], capture_output=True,
                           text=True, timeout=900, env=env)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("SMOE_RESULT ")]
        assert r.returncode == 0 and line, (r.stdout + r.stderr)[-3000:]
        tokens.append(json.loads(line[0][len("SMOE_RESULT "):])["tokens"])
    assert tokens[0] == tokens[1]
