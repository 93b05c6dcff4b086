"""`smoe-testbed inflate`: a widened checkpoint computes what its source computes.

Checked against transformers (logits, every MoE layer's top-k, argmax) for every shipped
architecture, and in vLLM (greedy tokens and logprobs of the source and the widened model, fp32)."""

from vllm_smoe.testbed.inflate import inflate_checkpoint
from tests.support import vllm_runs
from tests.unit.test_inflate import WIDE, _ids, _source

# the trained fixtures, and two whose norms' eps vLLM fixes whatever the config says (OLMoE,
# GPT-OSS: only the residual stream's scale keeps them exact) and stacked experts (GPT-OSS)
ARCHS = ["qwen3_moe", "deepseek_v2", "olmoe", "gpt_oss"]


def test_widened_models_give_the_same_tokens_in_vllm(tmp_path):
    runs = []
    for arch in ARCHS:
        hidden, inter, heads, kv = WIDE[arch]
        src, dst = _source(arch, tmp_path / arch), str(tmp_path / arch / "wide")
        inflate_checkpoint(src, dst, hidden, inter, heads=heads, kv_heads=kv)
        prompts = [p[: 5 + 3 * i].tolist() for i, p in enumerate(_ids(arch, n=6, length=30))]
        # MLA on vLLM's CPU build needs the plugin's rotary fix (its CPU fixes alone, nothing placed)
        extra = {"smoe": {}} if arch.startswith("deepseek") else None
        runs += [dict(model=m, prompts=prompts, max_tokens=16, extra=extra, ep=False) for m in (src, dst)]
    out = vllm_runs(runs, tmp_path)
    for k, arch in enumerate(ARCHS):
        (a, _), (b, _) = out[2 * k], out[2 * k + 1]
        assert a["tokens"] == b["tokens"], arch
        worst = max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))
        assert worst < 1e-4, (arch, worst)
