"""``smoe-bench cluster``'s command line, and the package's internal entries (``python -m
vllm_smoe.tools.bench.cluster --client | --markdown | --wire-worker | --probe-sink``)."""

from __future__ import annotations

import argparse
import json
import sys

from .client import client_main
from .goodput_report import markdown_goodput, summarise_goodput
from .link import TARGETS
from .mixes import MIXES
from .netns import probe_sink
from .report import markdown
from .run import run
from .wire import wire_worker


def _mixes(text: str) -> list[str]:
    if text == "none":  # only the large-batch decode phase
        return []
    names = [m for m in text.split(",") if m]
    bad = [m for m in names if m not in MIXES]
    if bad or not names or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"--mixes {text!r}: choose each once from {', '.join(MIXES)}, or none"
                                         + (f" (unknown: {', '.join(bad)})" if bad else ""))
    return names


def add_parser(sub) -> None:

    from ...cli_util import number

    p = sub.add_parser("cluster", help="vLLM nodes in network namespaces over a link shaped to a real cluster's "
                                       "proportions: every configuration end to end (needs root; JSON, plot)")
    p.add_argument("--model", help="checkpoint (default: the trained Qwen3-MoE fixture widened with smoe-testbed "
                                   "inflate to hidden 1536, expert FFN 768, 24/12 heads, with its training trace)")
    p.add_argument("--trace", nargs="+", help="routing trace(s) smoe's placements are built from, as a user would")
    p.add_argument("--placement", help="TP placement (instead of building one from --trace)")
    p.add_argument("--dp-placement", help="DP placement (instead of building one from --trace)")
    p.add_argument("--prompts-trace", help="prompts from this trace's requests (default: the fixture's held-out)")
    p.add_argument("--target", nargs="+",
                   help=f"link proportions: {', '.join(TARGETS)}, or none (no shaping: the veth's speed); default "
                        "ib-ndr none (with --goodput: ib-ndr)")
    p.add_argument("--rate", type=number(float, 0, lo_open=True), help="fixed link rate in bit/s instead of a target")
    p.add_argument("--delay", type=number(float, 0), default=0.0, help="with --rate: one-way delay in s")
    p.add_argument("--configs",
                   help="default tp,tp-ep,tp-ep-speculate,dp-ep,dp-ep-smoe (with --goodput: tp,dp-ep,dp-ep-smoe); "
                        "comma-separated, from: tp, tp-ep, tp-ep-place, tp-ep-speculate, tp-ep-speculate-ar (vLLM's "
                        "attention all-reduce, not smoe's shuffled reduce-scatter), tp-ep-speculate-router, "
                        "tp-ep-speculate-router-ar (predictor router), tp-ep-speculate-step (the DeepSeek "
                        "family's one order per step), tp-ep-speculate-agrs, "
                        "dp-ep, dp-ep-sparse, dp-ep-smoe, dp-ep-smoe-agrs, dptp-ep, dptp-ep-smoe, dptp-ep-smoe-flat "
                        "(TP = 2 inside each node, DP = 2 across them)")
    p.add_argument("--concurrency", type=number(int, 1), nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-level", type=number(int, 1), default=16)
    p.add_argument("--decode-prompt", type=number(int, 1), default=32)
    p.add_argument("--decode-output", type=number(int, 2), default=32)
    p.add_argument("--prefill-prompt", type=number(int, 1), default=384)
    p.add_argument("--prefill-output", type=number(int, 2), default=4)
    p.add_argument("--prefill-requests", type=number(int, 0), default=8)
    p.add_argument("--rates", type=number(float, 0, lo_open=True), nargs="*", default=[0.5, 1.0, 2.0, 4.0],
                   help="Poisson request rates of the SLO ladder (req/s)")
    p.add_argument("--poisson-requests", type=number(int, 1), default=16)
    p.add_argument("--slo-scale", type=number(float, 1), default=3.0,
                   help="p90 TBT bound = this x the best configuration's single-stream p90 TBT; with --goodput: "
                        "the TTFT and TPOT targets = this x the first configuration's unloaded medians")
    g = p.add_argument_group("goodput (--goodput): the highest Poisson rate at which >= --goal of requests meet "
                             "their targets, per request mix (docs/benchmarks/goodput.md)")
    g.add_argument("--goodput", action="store_true",
                   help="the goodput mode instead of the fixed-concurrency mixes and the SLO ladder")
    g.add_argument("--mixes", type=_mixes, default=["prefill-heavy", "decode-heavy"],
                   help=f"comma-separated, from: {', '.join(MIXES)} (default prefill-heavy,decode-heavy); none: only "
                        "the large-batch decode phase")
    g.add_argument("--goodput-requests", type=number(int, 1), default=60, help="counted requests per measured rate")
    g.add_argument("--goodput-warmup", type=number(int, 0), default=8,
                   help="requests sent first at each rate and not counted")
    g.add_argument("--unloaded-requests", type=number(int, 1), default=8,
                   help="requests sent one at a time first: each start's unloaded latencies")
    g.add_argument("--search-steps", type=number(int, 1), default=4, help="measured rates of the bisection per mix")
    g.add_argument("--goal", type=number(float, 0, 1, lo_open=True), default=0.9,
                   help="share of requests that must meet the target")
    g.add_argument("--large-batch", type=number(int, 0), default=64,
                   help="sequences of the fixed-concurrency large-batch decode phase, first (0: none)")
    g.add_argument("--max-seqs", type=number(int, 1), default=64, help="--max-num-seqs of each server in the mode")
    p.add_argument("--wire-check", action=argparse.BooleanOptionalAction, default=True,
                   help="first run the MoE exchange alone across the veth: smoe's counters against the wire")
    p.add_argument("--exchange-only", action="store_true",
                   help="only the MoE exchange alone, once per --target with the decode link's shaping (no vLLM): "
                        "smoe's flat and hierarchical exchange and vLLM's allgather-reducescatter")
    p.add_argument("--wire-model", action="store_true",
                   help="with --exchange-only: also the cost model (placement/a2a_cost.py) of each run from the "
                        "host's measured constants (tiny unshaped steps, the veth's rate; tools/bench/wire_model.py): "
                        "bytes against the counted ones, time against the measured")
    p.add_argument("--ranks-per-node", type=number(int, 1, 15), default=1,
                   help="with --exchange-only: gloo ranks in each of the two namespaces")
    p.add_argument("--exchange-tokens", type=number(int, 1), nargs=2, default=[64, 512], metavar=("DECODE", "PREFILL"),
                   help="with --exchange-only: tokens a step on the decode link and on the prefill link")
    p.add_argument("--memory-share", type=number(float, 0, 1, lo_open=True),
                   help="--gpu-memory-utilization of each rank (on CPU: its share of RAM for weights and KV "
                        "cache); default 0.3 per node, split between its ranks (0.15 each for dptp-*)")
    p.add_argument("--repeats", type=number(int, 1), help="starts of each configuration (spread); default 1 "
                                                              "(with --goodput: 2)")
    p.add_argument("--timeout", type=number(float, 1), default=600.0, help="seconds for a server start")
    p.add_argument("--config-timeout", type=number(float, 1),
                   help="seconds for a configuration's load (default 1800; with --goodput 5400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="directory for logs and placements (default: a temp dir)")
    p.add_argument("--plot", help="PNG: p90 TBT against offered rate, per target")
    p.add_argument("--json")
    p.set_defaults(fn=run)


def main(argv=None) -> int:
    """Internal entries: the client (inside namespace 0) and the link probe's sink."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        return client_main(argv[1])
    if argv[:1] == ["--markdown"]:
        with open(argv[1]) as f:
            payload = json.load(f)
        print(markdown_goodput(summarise_goodput(payload["results"])) if payload.get("args", {}).get("goodput")
              else markdown(payload))
        return 0
    if argv[:1] == ["--wire-worker"]:
        return wire_worker(int(argv[1]), argv[2])
    if argv[:1] == ["--probe-sink"]:
        return probe_sink(int(argv[1]))
    print("use: smoe-bench cluster ...", file=sys.stderr)
    return 2
