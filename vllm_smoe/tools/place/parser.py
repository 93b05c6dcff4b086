"""``smoe-place``'s flags: build, evaluate, report, advise and calibrate, each subcommand's
function set as its ``fn``."""

from __future__ import annotations

import argparse

from ...placement.dp import WINDOW as DP_WINDOW
from ...placement.layout import SOLVERS
from ...placement.learned import MAX_WIDTH
from ...placement.migrate import BALANCE_WEIGHT
from ...placement.online import PREDICTORS as SIM_PREDICTORS
from ...placement.spans import EVAL_WINDOWS
from ..cli_util import number
from ..cluster_cost import add_args as add_cost_args
from ..cluster_cost import add_calibrate_parser
from ..parallel import default_jobs
from .advise import cmd_advise
from .build import cmd_build
from .evaluate import BIGRAM_TOKENS, COMPARE_ALL, cmd_evaluate, cmd_report
from .solve import POLISH_TOKENS

DESCRIPTION = """``smoe-place``: learn route predictors and a balanced token-expert placement from routing
traces, write it as YAML, and compare it with the placements users run today."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smoe-place", description=DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s):
        s.add_argument("--predictor", choices=SIM_PREDICTORS, default="tables-markov",
                       help="the token -> rank predictor simulated for smoe's placements and every X+pred form: "
                            "tables-markov (default: token and bigram tables, Markov table on the previous layer's "
                            "top-1, prefill -> decode table; the largest confidence wins), tables (the token and "
                            "bigram tables alone: what serving's default predictor uses), learned (the placement's "
                            "learned predictor: build --learned), router (every token's routing known: serving's "
                            "predictor that runs vLLM's gate ahead, and the capped oracle every predicted form is "
                            "also scored against as oracle_lar / oracle_share)")
        s.add_argument("--bigram-pairs", type=number(int, -1), default=-1,
                       help="at most this many (previous token, token) pairs in the bigram table, learned from the "
                            "first --metrics-tokens training rows (build) or first %d (evaluate --compare): the "
                            "pairs the token table predicts worst; -1 (default) = as many as fit in the token table's "
                            "bytes, so the tables at most double; 0 = none" % BIGRAM_TOKENS)
        s.add_argument("--capacity", type=number(float, 1.0), default=1.10,
                       help="per-batch token cap per rank, as a multiple of the fair share, >= 1 (default 1.10)")
        s.add_argument("--shuffle-requests", type=number(int, 0), default=None, metavar="SEED",
                       help="--mode dp: requests arrive in a random order (this seed) instead of the trace's, for "
                            "traces recorded one workload after another (the simulated routing only: build "
                            "learns from the same requests either way)")
        s.add_argument("--decode-concurrency", type=number(int, 1), default=None,
                       help="--mode dp: requests decoding at once when scoring the placement's lock-step cost "
                            "(step_imbalance: the busiest rank's distinct experts per MoE layer over the mean's; "
                            "default 8)")
        s.add_argument("--in-flight", type=number(int, 1), default=None, metavar="R",
                       help="--mode dp: requests in flight the simulated server balances over (its router's window "
                            "is the larger of this and %d, its in-flight count when serving); token load is judged "
                            "per window of that many arrivals (default %d)" % (DP_WINDOW, DP_WINDOW))
        s.add_argument("--group-workloads", action="store_true",
                       help="--mode dp: route each request by its workload's running score (the trace's 'domain' "
                            "field) instead of its own, so that a workload's requests land together")
        s.add_argument("--batch-tokens", type=number(int, 1), default=512,
                       help="batch size for traces without step_ids (default 512)")
        s.add_argument("--theta", type=number(float, 0.0, 1.0), default=0.5,
                       help="balance weight of ceo/alternating, in [0, 1] (default 0.5)")
        s.add_argument("--max-expert-load", type=number(float, 1.0), default=1.10,
                       help="coclust, bytes, --mode dp: cap on each rank's expert (compute) load, x mean, >= 1 "
                            "(default 1.10; --mode dp with routing groups: not capped, only kept from rising)")
        s.add_argument("--seed", type=number(int, 0), default=0)
        s.add_argument("--hidden-size", type=number(int, 1), default=4096,
                       help="for a2a bytes when the trace meta has no hidden_size (default 4096)")
        s.add_argument("--dtype-bytes", type=number(int, 1), default=2,
                       help="activation bytes per element (default 2)")
        s.add_argument("--instance-tokens", type=number(int, 1), default=1 << 17,
                       help="bytes: the objective is scored on the whole expert sets of this many leading "
                            "training tokens (default 131072)")
        s.add_argument("--jobs", type=number(int, 1), default=default_jobs(),
                       help=f"worker processes solving layers in parallel (default: all cores, here "
                            f"{default_jobs()}); the result does not depend on it")

    def polish(s):
        s.add_argument("--polish-tokens", type=number(int, 0), default=POLISH_TOKENS,
                       help=f"polish each coclust layer on the routing of this many leading rows: swaps of two experts "
                            f"scored by the capped order a served step gets (default {POLISH_TOKENS}; 0 = the solver's "
                            f"placement as is)")
        s.add_argument("--polish-kicks", type=number(int, 0), default=0,
                       help="after the polish, this many rounds of an iterated local search per layer: a kick of "
                            "3 random swaps, a polish at the same budget, kept where it scores higher (default 0; "
                            "each round costs about one polish: BENCHMARKS.md, 'Kicked polish')")

    b = sub.add_parser("build", help="place experts and build predictor tables; writes YAML + .tables.npz")
    b.add_argument("--trace", nargs="+", required=True, help="trace files, directories or globs")
    b.add_argument("--ep-size", type=number(int, 1), required=True)
    b.add_argument("--method", choices=tuple(SOLVERS) + ("eplb", "auto"), default="coclust",
                   help="coclust (default: most local activations), bytes (fewest all-to-all rows), auto (both "
                        "solved, the one sending fewer rows per token kept where its LAR is within 2%% of the "
                        "other's at balanced load, judged on the trace's last quarter), or a peer")
    b.add_argument("--nodes", type=number(int, 1), default=1,
                   help="hierarchical: nodes first, then ranks inside a node")
    b.add_argument("--replicas", type=number(int, 0), default=0,
                   help="redundant copies per layer (multiple of ep-size)")
    b.add_argument("--model", help="checkpoint directory: fingerprint, embeddings for unseen tokens, and its "
                                   "routing groups (n_group)")
    b.add_argument("--groups", type=number(int, 1),
                   help="grouped top-k routing (DeepSeek's n_group): keep every group of experts whole, so "
                        "that loading the placement leaves the routing unchanged (default: the --model's "
                        "n_group, else 1)")
    b.add_argument("--mode", choices=("tp", "dp"), default="tp",
                   help="tp: tokens shuffled to ranks per layer (speculate, default); dp: attention data "
                        "parallel, each request runs on one rank, so experts are co-clustered with whole "
                        "requests (those of --metrics-tokens tokens); serve it with TP = 1")
    b.add_argument("-o", "--output", required=True, help="placement YAML to write")
    b.add_argument("--learned", action="store_true",
                   help="also train the learned predictor (a small network over the token's and the previous "
                        "token's input embeddings, from --model, else per-id rows) on the first --metrics-tokens "
                        "rows, for serving with --smoe-predictor learned")
    b.add_argument("--learned-width", type=number(int, 1, MAX_WIDTH), default=None,
                   help=f"hidden width of the learned predictor (default 16 x --ep-size within 64..{MAX_WIDTH})")
    polish(b)
    b.add_argument("--metrics-tokens", type=number(int, 1), default=131072,
                   help="in-sample metrics stored in the YAML use this many leading tokens (default 131072); "
                        "--mode dp also learns from the requests of this many tokens, in evenly spaced windows")
    common(b)
    b.set_defaults(fn=cmd_build)

    for name, fn, helptext in (("evaluate", cmd_evaluate, "metrics of a placement on a trace, peers side by side"),
                               ("report", cmd_report, "evaluate, then draw PNGs and an HTML page")):
        e = sub.add_parser(name, help=helptext)
        e.add_argument("--trace", nargs="+", required=True, help="test trace files, directories or globs")
        e.add_argument("--placement", required=True)
        e.add_argument("--compare", help="'all' or a comma list of " + ", ".join(COMPARE_ALL))
        e.add_argument("--train", nargs="+", help="training traces for --compare (default: the placement's)")
        e.add_argument("--max-tokens", type=number(int, 0), default=1 << 20,
                       help=f"evaluate at most this many test tokens, in {EVAL_WINDOWS} evenly spaced windows "
                            "(default 1048576; 0 = all, held in memory)")
        e.add_argument("--mode", choices=("tp", "dp"), default="tp",
                       help="tp: attention in tensor parallel, tokens shuffled per layer (default); "
                            "dp: attention data parallel, whole requests scheduled on ranks")
        e.add_argument("--nodes", type=number(int, 1), default=None,
                       help="split the all-to-all bytes into inter- and intra-node as if ranks n*N/nodes .. "
                            "(n+1)*N/nodes - 1 formed node n (default: the placement's nodes); every placement "
                            "is still solved as the placement was")
        common(e)
        add_cost_args(e)
        if name == "evaluate":
            e.add_argument("--json", help="write {method: {metric: value}} here")
        else:
            e.add_argument("-o", "--output", required=True, help="report directory")
        e.set_defaults(fn=fn, replicas=0)

    v = sub.add_parser("advise", help="what a placement built from a live recording would gain over the served one",
                       description="Trains a candidate on each DP engine's first half of engine steps (the "
                                   "served placement's method, ep_size, nodes, groups, copies and capacity) and "
                                   "scores both on the second halves. --predictor defaults to tables here (serving's "
                                   "default). A --mode dp placement (method dp-coclust): pass every DP engine's "
                                   "recording; the candidate co-clusters their requests with experts, and both are "
                                   "judged with the server's request routing (--in-flight, --shuffle-requests: "
                                   "default the --seed, which interleaves the engines' requests).")
    v.add_argument("--trace", nargs="+", required=True,
                   help="the live recording (trace files, directories or globs, e.g. a --smoe-record directory)")
    v.add_argument("--placement", required=True, help="the placement being served")
    v.add_argument("--model", help="checkpoint directory, as build --model: its input embeddings give tokens the "
                                   "recording never saw a rank, and feed the learned predictor a candidate gets "
                                   "when the served tables hold one")
    v.add_argument("--max-tokens", type=number(int, 0), default=1 << 20,
                   help=f"use at most this many recorded tokens, in {EVAL_WINDOWS} evenly spaced windows "
                        "(default 1048576; 0 = all, held in memory)")
    v.add_argument("--max-moves", type=number(float, 0.0, 1.0), default=None, metavar="F",
                   help="also a candidate that moves at most this share of the served expert slots (a live swap "
                        "moves what changes): the fresh candidate's exchange cycles that pay most per moved slot, "
                        "its ranks renamed to agree with the served ones; -o then writes this one")
    v.add_argument("--rename", choices=("layer", "model"), default=None,
                   help="rename the fresh candidate's ranks to agree with the served ones per MoE layer (fewer "
                        "slots move) or once for the whole model (keeps its layers' rank names agreeing, for the "
                        "DeepSeek family served with one order per step, --smoe-stack-order step); default: model "
                        "where the recording says it was served so (its meta.token_order = step), else layer")
    v.add_argument("--balance-weight", type=number(float, 0.0), default=None, metavar="W",
                   help="with --max-moves: local activations one activation of a layer's busiest rank past "
                        f"--max-expert-load is worth (default {BALANCE_WEIGHT:g}; 0: the cap only guards, the load a "
                        "workload shift left stays)")
    v.add_argument("-o", "--output", help="also write the candidate placement here (POST /smoe/placement swaps it "
                                          "in live)")
    v.add_argument("--json", help="write {placement: {metric: value}} here")
    polish(v)
    common(v)
    # the predictor is serving's default (cmd_advise); capacity and copies come from the served placement
    v.set_defaults(fn=cmd_advise, predictor=None, capacity=None, replicas=None)
    add_calibrate_parser(sub)
    return p
