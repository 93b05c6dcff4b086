"""``smoe-testbed``: build, train and record tiny MoE models offline; synthesise traces."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from .cli_util import number, run_cli
from ..testbed import ALL_FIXTURE_TRACES, FIXTURE_MODEL, FIXTURE_TRACES, FIXTURES, TRACE_ONLY_FIXTURES


def _cmd_build(a) -> int:
    from ..testbed.models import build_random

    build_random(a.arch, a.output, a.tokenizer, seed=a.seed, num_layers=a.layers, num_experts=a.experts,
                 top_k=a.top_k)
    print(f"wrote {a.arch} checkpoint to {a.output}")
    return 0


def _cmd_train(a) -> int:
    from ..testbed.corpus import load_corpus
    from ..testbed.train import train_model, train_tokenizer

    split = load_corpus()
    with tempfile.TemporaryDirectory() as tok_dir:
        if a.tokenizer:
            tok_dir = a.tokenizer
        else:
            train_tokenizer(split, tok_dir, vocab_size=a.vocab_size)
        last = train_model(split, tok_dir, a.output, steps=a.steps, batch=a.batch, seq_len=a.seq_len,
                           lr=a.lr, seed=a.seed, arch=a.arch, num_experts=a.experts, top_k=a.top_k,
                           threads=a.threads)
    print(json.dumps(last))
    return 0


def _cmd_record(a) -> int:
    from ..testbed.corpus import load_corpus
    from ..testbed.record import record_domains
    from ..testbed.train import encode_domains

    split = load_corpus()
    texts = split.heldout if a.split == "heldout" else split.train
    ids = encode_domains(a.model, texts)
    record_domains(a.model, ids, a.output, seq_len=a.seq_len, max_requests_per_domain=a.requests)
    print(f"wrote {a.output}")
    return 0


def _cmd_stats(a) -> int:
    from ..placement.stats import domain_specificity, expert_usage, interlayer_precision, token_hotness
    from ..formats.trace import open_trace

    t = open_trace(a.trace, validate=True)
    tok, topk = t["token_ids"], t["topk_ids"]
    m = t.meta
    hot = token_hotness(tok, topk, min_count=a.min_count)
    markov, popular = interlayer_precision(topk, m.num_experts)
    res: dict[str, object] = {
        "trace": a.trace, "tokens": t.num_tokens,
        "token_hotness": [round(float(x), 4) for x in hot],
        "interlayer_markov_precision": [round(float(x), 4) for x in markov],
        "interlayer_popular_precision": [round(float(x), 4) for x in popular],
    }
    if t.has("domain"):
        usage = expert_usage(topk, m.num_experts, t["domain"], len(m.domains))
        res["domain_specificity"] = [round(float(x), 4) for x in domain_specificity(usage)]
        res["domains"] = list(m.domains)
        # how concentrated each domain is: share of its layer-0 activations on its 25% top experts
        q = max(1, m.num_experts // 4)
        res["domain_top25pct_share_layer0"] = {
            d: round(float(np.sort(usage[i, 0])[::-1][:q].sum()), 4) for i, d in enumerate(m.domains)}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{a.trace}: {t.num_tokens} tokens, {m.num_layers} MoE layers, {m.num_experts} experts, top-{m.top_k}")
    print("layer  hotness  markov_prec  popular_prec" + ("  domain_spec" if "domain_specificity" in res else ""))
    for layer in range(m.num_layers):
        row = f"{layer:5d}  {hot[layer]:7.3f}"
        row += f"  {markov[layer - 1]:11.3f}  {popular[layer - 1]:12.3f}" if layer else f"  {'-':>11}  {'-':>12}"
        if "domain_specificity" in res:
            row += f"  {res['domain_specificity'][layer]:11.3f}"
        print(row)
    if "domain_top25pct_share_layer0" in res:
        print("layer-0 share of each domain's activations on its top 25% experts:",
              res["domain_top25pct_share_layer0"])
    return 0


def _cmd_synth(a) -> int:
    from ..testbed.synthetic import write_synthetic

    t0 = time.time()
    if (a.groups is None) != (a.topk_group is None):
        raise ValueError("--groups and --topk-group go together")
    grouped = dict(groups=a.groups, topk_group=a.topk_group) if a.groups else {}
    if a.file_tokens is None:
        from ..formats.bounded import refuse_special

        refuse_special(a.output, "-o")  # before generating: never a file renamed over a device node
    write_synthetic(a.output, a.shape, a.tokens, seed=a.seed, progress=True, hotness=a.hotness,
                    affinity=a.affinity, domain_skew=a.domain_skew, num_domains=a.domains, file_tokens=a.file_tokens,
                    num_layers=a.layers, **grouped)
    print(f"wrote {a.tokens} tokens of {a.shape} to {a.output} in {time.time() - t0:.1f} s")
    return 0


def _cmd_inflate(a) -> int:
    from .cli_util import check_output_dir
    from ..testbed.inflate import inflate_checkpoint

    if os.path.abspath(a.output) == os.path.abspath(a.source):
        raise ValueError(f"{a.output}: -o must differ from the source checkpoint")
    if os.path.isdir(a.output) and os.listdir(a.output) and not a.force:
        raise ValueError(f"{a.output}: -o names a non-empty directory (--force writes into it)")
    check_output_dir(a.output, "-o")
    t0 = time.time()
    s = inflate_checkpoint(a.source, a.output, a.hidden, a.moe_intermediate, heads=a.heads, kv_heads=a.kv_heads,
                           intermediate=a.intermediate)
    o, n = s["old"], s["new"]
    print(f"wrote {a.output}: hidden {o['H']} -> {n['H']}, expert FFN {o['I']} -> {n['I']}, heads "
          f"{o['nh']}/{o['nkv']} -> {n['nh']}/{n['nkv']}, {s['parameters']['old'] / 1e6:.1f}M -> "
          f"{s['parameters']['new'] / 1e6:.1f}M parameters in {time.time() - t0:.1f} s")
    return 0


def _cmd_path(a) -> int:
    if a.what == "model" and a.fixture in TRACE_ONLY_FIXTURES:
        raise ValueError(f"fixture {a.fixture}: its checkpoint is not shipped (only its traces are); reproduce it "
                         f"with: {TRACE_ONLY_FIXTURES[a.fixture][1]}")
    print(FIXTURES[a.fixture][0] if a.what == "model" else ALL_FIXTURE_TRACES[a.fixture][a.what])
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ..testbed.synthetic import SHAPES
    from ..testbed.models import ARCHS, TRAINABLE

    p = argparse.ArgumentParser(prog="smoe-testbed", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="random-weight tiny checkpoint (save_pretrained layout)")
    b.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    b.add_argument("-o", "--output", required=True, help="output directory")
    b.add_argument("--tokenizer", default=FIXTURE_MODEL, help="directory with a tokenizer (default: the fixture's)")
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--experts", type=int, default=32)
    b.add_argument("--top-k", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=_cmd_build)

    t = sub.add_parser("train", help="reproduce a trained multi-domain fixture (~10-25 min on 2 cores)")
    t.add_argument("-o", "--output", required=True)
    t.add_argument("--arch", choices=TRAINABLE, default="qwen3_moe",
                   help="qwen3_moe (router balancing loss), deepseek_v2 (MLA, shared expert, balancing loss) or "
                        "deepseek_v3 (MLA, shared expert, grouped sigmoid routing, bias balancing)")
    t.add_argument("--tokenizer", help="directory with a tokenizer to use instead of training one (the shipped "
                                       "fixtures share the Qwen3-MoE fixture's)")
    t.add_argument("--steps", type=int, default=2400)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--experts", type=number(int, 1), default=32,
                   help="routed experts per MoE layer (default 32, the shipped fixtures'; the traces-only fixture "
                        "qwen3_moe_e64 has 64)")
    t.add_argument("--top-k", type=number(int, 1), default=4,
                   help="experts per token (default 4, the shipped fixtures'; qwen3_moe_e64 has 8)")
    t.add_argument("--threads", type=number(int, 1), default=2,
                   help="torch threads (default 2, what the shipped fixtures were trained with)")
    t.set_defaults(fn=_cmd_train)

    r = sub.add_parser("record", help="routing of a checkpoint on each domain's text, via transformers")
    r.add_argument("--model", default=FIXTURE_MODEL)
    r.add_argument("--split", choices=("train", "heldout"), default="heldout")
    r.add_argument("--requests", type=int, default=64, help="requests (text windows) per domain")
    r.add_argument("--seq-len", type=int, default=128)
    r.add_argument("-o", "--output", required=True)
    r.set_defaults(fn=_cmd_record)

    s = sub.add_parser("stats", help="hotness, inter-layer predictability and domain skew of a trace")
    s.add_argument("--trace", default=FIXTURE_TRACES["heldout"])
    s.add_argument("--min-count", type=int, default=20, help="occurrences for a token to count as frequent")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_cmd_stats)

    y = sub.add_parser("synth", help="synthetic trace at a production MoE shape")
    y.add_argument("--shape", choices=tuple(SHAPES), default="deepseek-v3")
    y.add_argument("--tokens", type=int, default=100_000)
    y.add_argument("--hotness", type=float, default=0.8)
    y.add_argument("--affinity", type=float, default=0.5)
    y.add_argument("--domain-skew", type=float, default=1.0)
    y.add_argument("--domains", type=int, default=4)
    y.add_argument("--seed", type=int, default=0)
    y.add_argument("--layers", type=number(int, 1), help="the shape's first N MoE layers only (default: all)")
    y.add_argument("--file-tokens", type=number(int, 1),
                   help="write a directory of trace files of this many tokens each, like the recorder's "
                        "rotated files (default: one file)")
    y.add_argument("--groups", type=number(int, 1),
                   help="group-limited routing as DeepSeek-V3's (n_group 8 there): expert ids in this many "
                        "contiguous groups, with --topk-group (4 there) of them per token (default: not limited)")
    y.add_argument("--topk-group", type=number(int, 1), help="groups a token may use, with --groups")
    y.add_argument("-o", "--output", required=True, help="trace file, or directory with --file-tokens")
    y.set_defaults(fn=_cmd_synth)

    w = sub.add_parser("inflate", help="widen a checkpoint losslessly to production row sizes (same routing, "
                                       "same tokens)")
    w.add_argument("source", help="save_pretrained directory (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Granite-MoE, GPT-OSS, "
                                     "Llama 4 text, GLM-4.5, EXAONE-MoE, DeepSeek-V2/V3)")
    w.add_argument("-o", "--output", required=True, help="output directory")
    w.add_argument("--hidden", type=number(int, 1), required=True, help="new hidden size (a multiple of 32)")
    w.add_argument("--moe-intermediate", type=number(int, 1), required=True,
                   help="new FFN size of each routed expert (shared experts widen in proportion)")
    w.add_argument("--heads", type=number(int, 1), help="new attention heads (default: unchanged; where vLLM takes head_dim = hidden / "
                                                          "heads (Qwen2-MoE, OLMoE, Granite-MoE): grown with the hidden size)")
    w.add_argument("--kv-heads", type=number(int, 1), help="new kv heads for GQA models (default: unchanged, or grown with the heads where "
                                                             "those follow the hidden size)")
    w.add_argument("--intermediate", type=number(int, 1),
                   help="new dense-MLP size (default: widened in proportion to the hidden size)")
    w.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    w.set_defaults(fn=_cmd_inflate)

    q = sub.add_parser("path", help="print where an embedded fixture or its traces live")
    q.add_argument("what", choices=("model", "train", "heldout"))
    q.add_argument("--fixture", choices=tuple(ALL_FIXTURE_TRACES), default="qwen3_moe",
                   help="qwen3_moe (default), deepseek_v2 (MLA, a shared expert, dense first layer), "
                        "deepseek_v3 (as V2, plus sigmoid grouped top-k with correction bias and a scaling "
                        "factor) or qwen3_moe_e64 (as qwen3_moe with 64 experts, top-8; traces only, its "
                        "checkpoint is not shipped)")
    q.set_defaults(fn=_cmd_path)
    return p


def main(argv=None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
