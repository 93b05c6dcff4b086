"""Served locality of speculate's predictors, in domain and on a workload the placement never saw.

    python benchmarks/served_locality.py [--fixture qwen3_moe] [--leave-out math] \
        [--predictors tables input-gate router router:off] [--requests 32] [--max-tokens 16] [--json out.json]
    python benchmarks/served_locality.py --fixture deepseek_v2 --predictors tables tables:step learned learned:step

Builds an EP 2 placement with ``smoe-place build`` (``--learned`` for predictor ``learned``) from
the fixture's training trace (without the ``--leave-out`` workload's rows when given), then
serves the held-out trace's requests (only that workload's when given) at TP=2 + EP under mode
speculate with the shuffled reduce-scatter (``--smoe-reduce-scatter on``, so ``input-gate`` runs
as itself rather than as ``router``), one ``vllm serve`` per predictor (``NAME:off``: with
``--smoe-reduce-scatter off``, vLLM's all-reduce; ``NAME:step``: the DeepSeek family with one
order per step, ``--smoe-stack-order step``, where the default orders each MoE layer), and reads
every rank's served share of activations local from the speculate log lines. Each predictor's
greedy completions are compared with the first one's (the order never changes tokens). Needs
the CPU build and 2 cores; about 40 s per predictor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile



def _subset(src: str, dst: str, keep) -> str:
    from vllm_smoe.formats.trace import open_trace, write_trace

    t = open_trace(src)
    mask = keep(t)
    return write_trace(dst, t.meta, **{k: t[k][mask] for k in t.fields})


def main(argv=None) -> int:
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.testbed import FIXTURES
    from vllm_smoe.tools.bench.common import SPEC_LINE, rank_numbers, trace_prompts
    from vllm_smoe.tools.server_process import VllmServer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", default="qwen3_moe", choices=sorted(FIXTURES), help="the trained fixture served")
    ap.add_argument("--leave-out", default=None, help="a workload (the trace's meta.domains) the placement never sees")
    ap.add_argument("--predictors", nargs="+", default=["tables", "input-gate", "router"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="smoe-served-locality-")
    model, traces = FIXTURES[a.fixture]
    train, held = traces["train"], traces["heldout"]
    if a.leave_out is not None:
        domains = list(open_trace(train).meta.domains)
        if a.leave_out not in domains:
            print(f"--leave-out {a.leave_out!r}: not one of the trace's workloads {domains}", file=sys.stderr)
            return 2
        d = domains.index(a.leave_out)
        train = _subset(train, os.path.join(work, "train.npz"), lambda t: t["domain"] != d)
        held = _subset(held, os.path.join(work, "heldout.npz"), lambda t: t["domain"] == d)
    placement = os.path.join(work, "ep2.yaml")
    learned = ("--learned",) if any(p.partition(":")[0] == "learned" for p in a.predictors) else ()
    subprocess.run(["smoe-place", "build", "--trace", train, "--ep-size", "2", "--model", model, *learned,
                    "-o", placement], check=True, stdout=subprocess.DEVNULL)
    prompts = trace_prompts(held, a.requests, a.prompt_tokens)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    res, first = {}, None
    for p in a.predictors:
        name, _, how = p.partition(":")
        if how not in ("", "on", "off", "step", "layer"):
            print(f"--predictors {p!r}: after ':' one of on, off (the shuffled reduce-scatter), step, layer "
                  f"(the DeepSeek family's order)", file=sys.stderr)
            return 2
        flags = ("--tensor-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe", "--smoe-mode",
                 "speculate", "--smoe-placement", placement, "--smoe-predictor", name, "--smoe-reduce-scatter",
                 how if how in ("on", "off") else "on", "--smoe-stack-order", how if how in ("step", "layer")
                 else "layer", "--smoe-log-interval", "0.2")
        log = os.path.join(work, f"{name}-{how or 'on'}.log")
        with VllmServer(model, *flags, log=log, env=env) as s:
            out = s.complete(prompts, max_tokens=a.max_tokens)
        with open(log) as f:
            served = rank_numbers(f.readlines(), SPEC_LINE)
        texts = [t for t, _ in out]
        first = texts if first is None else first
        res[p] = {"local_share": served.get("local_share"), "tokens_per_rank": served.get("tokens_per_rank"),
                  "remote_pairs_per_token": served.get("remote_pairs_per_token"), "same_tokens": texts == first}
        print(f"{p:>12}: {served.get('local_share', float('nan')):.3f} of activations local, "
              f"{served.get('remote_pairs_per_token', float('nan')):.3f} remote pairs per token and layer, "
              f"completions equal to {a.predictors[0]}'s: {texts == first}", flush=True)
    print(f"{len(prompts)} held-out requests{' of ' + a.leave_out if a.leave_out else ''}, placement built "
          f"{'without it' if a.leave_out else 'from every workload'}; logs in {work}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"fixture": a.fixture, "leave_out": a.leave_out, "requests": len(prompts), "max_tokens": a.max_tokens,
                       "predictors": res}, f, indent=1)
    return 0 if all(r["same_tokens"] for r in res.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
