"""``smoe-bench``: benchmarks that are not unit tests (results go to BENCHMARKS.md).

  smoe-bench ilp     -- every placement method against the exact ILP bound on small instances
  smoe-bench plugin  -- start-up time and throughput of plain vLLM vs --plugin smoe (place, record)
  smoe-bench serve   -- vllm serve at TP=2: plain vs mode speculate (tok/s, TTFT, TPOT, p90 ITL)
  smoe-bench comm    -- one EP MoE layer on N gloo ranks: baseline EP vs speculative shuffling
  smoe-bench kernels -- on a CUDA GPU: speculate's assignment + permutation kernel vs the torch ops
  smoe-bench place-scale -- smoe-place build/evaluate on a large trace: wall time, peak memory of all its processes
  smoe-bench migrate -- smoe-place advise --max-moves after a workload shift: LAR kept per share of slots moved
                        (--mode dp: advise of an attention-DP placement)
  smoe-bench load    -- speculate under a workload shift: metrics cost, live re-placement from the recording, plot
  smoe-bench cluster -- vLLM nodes in network namespaces over a link at a real cluster's proportions (needs root)
"""

from __future__ import annotations

# One module per family of subcommands: offline (ilp, place-scale, predictors, migrate), serve (plugin,
# serve, dp), comm, kernels, load, cluster; common holds what they share.

import argparse
import sys


def main(argv=None) -> int:
    from ..cli_util import number
    from . import comm, kernels, offline, serve

    p = argparse.ArgumentParser(prog="smoe-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("ilp", help="placement methods vs the exact ILP (scipy HiGHS) on small instances")
    i.add_argument("--instances", type=int, default=6)
    i.add_argument("--vocab", type=int, default=24)
    i.add_argument("--experts", type=int, default=8)
    i.add_argument("--top-k", type=int, default=2)
    i.add_argument("--tokens", type=int, default=2000)
    i.add_argument("--ep-size", type=int, default=2)
    i.add_argument("--hotness", type=float, default=0.7)
    i.add_argument("--capacity", type=float, default=1.10)
    i.add_argument("--max-expert-load", type=float, default=None,
                   help="also cap expert load in the ILP and in coclust (default: no cap, the plain program)")
    i.add_argument("--time-limit", type=float, default=120.0)
    i.add_argument("--objective", choices=("lar", "bytes"), default="lar",
                   help="lar: local activations (solve_ilp); bytes: de-duplicated remote rows (solve_ilp_bytes)")
    i.set_defaults(fn=offline.run_ilp)
    g = sub.add_parser("plugin", help="vllm serve start-up and throughput: plain vs --plugin smoe (needs vLLM)")
    g.add_argument("--requests", type=int, default=64)
    g.add_argument("--prompt-tokens", type=int, default=96)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--concurrency", type=int, default=8)
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--placement", help="placement YAML (default: configs/tiny-4dom-ep4.yaml)")
    g.set_defaults(fn=serve.run_plugin)
    v = sub.add_parser("serve", help="vllm serve at TP=N: plain vs --plugin smoe --smoe-mode speculate (tok/s, TTFT, "
                                     "TPOT, p90 inter-token latency; needs vLLM)")
    v.add_argument("--model", help="model directory (default: the testbed fixture)")
    v.add_argument("--placement", help="EP=TP placement YAML (default: configs/tiny-4dom-ep2.yaml)")
    v.add_argument("--prompts-trace", help="routing trace whose requests are the prompts (default: fixture held-out)")
    v.add_argument("--tp", type=int, default=2, help="tensor-parallel size = ranks the experts are split over")
    v.add_argument("--requests", type=int, default=32)
    v.add_argument("--prompt-tokens", type=int, default=64)
    v.add_argument("--max-tokens", type=int, default=32)
    v.add_argument("--concurrency", type=int, default=8)
    v.add_argument("--rounds", type=int, default=2)
    v.add_argument("--with-baselines", action="store_true",
                   help="also speculate over vLLM's allgather-reducescatter, and the sparse all2all with a random "
                        "predictor (no speculation)")
    v.add_argument("--json", help="write per-configuration medians and ratios here")
    v.add_argument("--no-cpu-bind", dest="cpu_bind", action="store_false",
                   help="do not set VLLM_CPU_OMP_THREADS_BIND (set it on vLLM's CPU build)")
    v.set_defaults(fn=serve.run_serve)
    d = sub.add_parser("dp", help="vllm serve at DP=N + EP: vLLM's default vs smoe's placement vs smoe's request "
                                  "routing (locality, bytes, tok/s, TTFT, TPOT; needs vLLM)")
    d.add_argument("--model", help="model directory (default: the testbed fixture)")
    d.add_argument("--placement", help="placement YAML with ep_size = DP (default: configs/tiny-4dom-dp<N>.yaml)")
    d.add_argument("--prompts-trace", help="routing trace whose requests are the prompts, drawn over all of it and "
                                           "shuffled (default: fixture held-out, four workloads)")
    d.add_argument("--dp", type=int, default=2, help="data-parallel size (one engine per rank, TP=1)")
    d.add_argument("--requests", type=int, default=64)
    d.add_argument("--prompt-tokens", type=int, default=96)
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--concurrency", type=int, default=8)
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--seed", type=int, default=0, help="order of the prompts")
    d.add_argument("--api-servers", type=int, default=0,
                   help="--api-server-count for vllm serve (default: vLLM's, one per DP rank)")
    d.add_argument("--json", help="write per-configuration medians, locality, bytes and ratios here")
    d.add_argument("--no-cpu-bind", dest="cpu_bind", action="store_false",
                   help="do not set VLLM_CPU_OMP_THREADS_BIND (set it on vLLM's CPU build)")
    d.set_defaults(fn=serve.run_dp)
    c = sub.add_parser("comm", help="one EP MoE layer on gloo ranks: baseline EP vs smoe shuffling (bytes, time)")
    c.add_argument("--routing", default="deepseek-v2-lite",
                   help="'testbed' (the trained fixture's traces) or a synthetic shape (default deepseek-v2-lite)")
    c.add_argument("--layer", type=int, default=0, help="MoE layer of the trace to replay")
    c.add_argument("--ranks", type=int, default=4)
    c.add_argument("--tokens", type=int, default=2048, help="tokens per step")
    c.add_argument("--steps", type=int, default=2)
    c.add_argument("--hidden", type=int, default=2048)
    c.add_argument("--reps", type=int, default=3)
    c.add_argument("--json", help="write times, bytes and ratios here")
    c.set_defaults(fn=comm.run_comm)
    k = sub.add_parser("kernels", help="CUDA only: speculate's assignment + permutation kernel vs the torch ops")
    k.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    k.add_argument("--layers", type=int, default=48)
    k.add_argument("--ranks", type=int, default=8)
    k.add_argument("--reps", type=int, default=20)
    k.add_argument("--json", help="write the rows here")
    k.set_defaults(fn=kernels.run_kernels)
    s = sub.add_parser("place-scale", help="smoe-place build (and evaluate) on large traces: wall time and peak "
                                           "memory summed over its processes")
    s.add_argument("--trace", nargs="+", required=True, help="one trace spec (file, directory or glob) per run")
    s.add_argument("--ep-size", type=int, default=64)
    s.add_argument("--jobs", type=int, default=0, help="smoe-place --jobs (default: its own default, all cores)")
    s.add_argument("--evaluate", action="store_true", help="also time smoe-place evaluate on the same trace")
    s.add_argument("--json", help="write the measurements here")
    s.set_defaults(fn=offline.run_place_scale)
    r = sub.add_parser("predictors", help="each predictor's share of the capped oracle, in domain and with each "
                                          "domain left out of training (traces with a 'domain' field)")
    r.add_argument("--train", help="training trace (default: the fixture's)")
    r.add_argument("--heldout", help="held-out trace (default: the fixture's)")
    r.add_argument("--model", help="checkpoint for smoe-place build --model (default: the fixture's with the "
                                   "fixture's traces, none otherwise)")
    r.add_argument("--ep-size", type=number(int, 1), nargs="+", default=[2, 4, 8])
    r.add_argument("--json", help="write every row here")
    r.set_defaults(fn=offline.run_predictors)
    m = sub.add_parser("migrate", help="smoe-place advise --max-moves after a workload shift: LAR kept per share of "
                                       "expert slots moved (traces with a 'domain' field)")
    m.add_argument("--train", help="training trace (default: the fixture's)")
    m.add_argument("--heldout", help="held-out trace (default: the fixture's)")
    m.add_argument("--ep-size", type=number(int, 1), nargs="+", default=[2, 4, 8])
    m.add_argument("--max-moves", type=number(float, 0.0, 1.0), nargs="+", default=[0.0, 0.1, 0.25, 0.5])
    m.add_argument("--balance-weight", type=number(float, 0.0), nargs="+", default=None, metavar="W",
                   help="advise --balance-weight values, each a row (default: advise's own)")
    m.add_argument("--mode", choices=("tp", "dp"), default="tp",
                   help="dp: the served placement built with --mode dp (requests shuffled), advise's fresh "
                        "candidate judged with the request router; no --max-moves (DP engines take no live swap)")
    m.add_argument("--json", help="write every row here")
    m.set_defaults(fn=offline.run_migrate)
    from .load import add_parser as add_load

    add_load(sub)
    from .cluster.cli import add_parser as add_cluster

    add_cluster(sub)
    from ..cli_util import run_cli

    return run_cli(p, argv)


if __name__ == "__main__":
    sys.exit(main())
