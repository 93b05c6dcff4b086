"""The configurations served, each by name: vLLM's flags of each, and the placements smoe's
ones serve, built from the trace as a user would."""

from __future__ import annotations

import json
import os
import sys

from .netns import sh

UNCAPPED = 1000.0  # --max-expert-load of dp-ep-smoe-uncapped's placement: no cap in effect
DEFAULT_WIDTHS = dict(hidden=1536, moe_intermediate=768, heads=24, kv_heads=12)


def configurations(tp_placement: str, dp_placement: str, metrics_dir: str, dp_uncapped: str | None = None,
                   dptp_placement: str | None = None) -> dict:
    """name -> {kind: tp|dp, smoe: whether smoe orders, routes or places anything, flags}.
    vLLM's peers run as vLLM's docs run them across nodes; every one loads the plugin with smoe's
    metrics (its communicator counts collectives per served step); the CPU build needs smoe's CPU
    fixes for expert parallelism (nothing placed or ordered, vLLM's all2all), and MLA models its
    rotary fix even for plain TP. ``dp-ep-smoe-uncapped`` serves ``dp_uncapped``, a DP placement
    built with ``--max-expert-load`` :data:`UNCAPPED`: neither the co-clustering nor its bytes
    refinement bounds expert load. ``dptp-*``: TP = 2 inside each node, DP = 2 across the
    nodes, expert parallel over all 4 ranks (``dptp_placement``: a DP placement over 4 ranks built
    with ``--nodes 2``); ``dptp-ep-smoe`` sends prefill-sized steps hierarchically across the nodes,
    ``dptp-ep-smoe-flat`` each row to each rank."""
    ep = ("--enable-expert-parallel", "--plugin", "smoe", "--smoe-log-interval", "0.5",
          "--additional-config", json.dumps({"smoe": {"metrics_dir": metrics_dir}}))
    # "counts": the configuration's all2all is smoe's sparse exchange, whose counters are read
    cfgs = {
        "tp": {"kind": "tp", "smoe": False, "flags": ep[1:]},  # the plugin for its counters, no EP
        "tp-ep": {"kind": "tp", "smoe": False, "flags": ep + ("--smoe-all2all", "vllm")},
        "tp-ep-place": {"kind": "tp", "smoe": True, "flags": ep + ("--smoe-placement", tp_placement)},
        "tp-ep-speculate": {"kind": "tp", "smoe": True,
                            "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement)},
        "tp-ep-speculate-ar": {"kind": "tp", "smoe": True,  # before the shuffled reduce-scatter
                               "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                              "--smoe-reduce-scatter", "off")},
        # predictor router: its gate's logits summed from the partial rows before the shuffled
        # reduce-scatter (one [T, E] all-gather more), or over vLLM's all-reduce
        "tp-ep-speculate-router": {"kind": "tp", "smoe": True,
                                   "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                  "--smoe-predictor", "router")},
        "tp-ep-speculate-router-ar": {"kind": "tp", "smoe": True,
                                      "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                     "--smoe-predictor", "router", "--smoe-reduce-scatter", "off")},
        # the DeepSeek family's one order per step (the default orders each MoE layer)
        "tp-ep-speculate-step": {"kind": "tp", "smoe": True,
                                 "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                "--smoe-stack-order", "step")},
        "tp-ep-speculate-agrs": {"kind": "tp", "smoe": True,
                                 "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                "--smoe-all2all", "vllm")},
        "dp-ep": {"kind": "dp", "smoe": False, "flags": ep + ("--smoe-all2all", "vllm")},
        "dp-ep-sparse": {"kind": "dp", "smoe": True, "flags": ep},
        "dp-ep-smoe": {"kind": "dp", "smoe": True, "flags": ep + ("--smoe-placement", dp_placement)},
        "dp-ep-smoe-uncapped": {"kind": "dp", "smoe": True, "flags": ep + ("--smoe-placement", dp_uncapped or dp_placement)},
        "dp-ep-smoe-agrs": {"kind": "dp", "smoe": True,
                            "flags": ep + ("--smoe-placement", dp_placement, "--smoe-all2all", "vllm")},
        "dptp-ep": {"kind": "dptp", "smoe": False, "flags": ep + ("--smoe-all2all", "vllm")},
        "dptp-ep-smoe": {"kind": "dptp", "smoe": True, "flags": ep + ("--smoe-placement", dptp_placement or "")},
        "dptp-ep-smoe-flat": {"kind": "dptp", "smoe": True, "flags": ep + ("--smoe-placement", dptp_placement or "",
                                                                           "--smoe-hierarchical", "off")},
    }
    for c in cfgs.values():
        c["counts"] = "--enable-expert-parallel" in c["flags"] and "vllm" not in c["flags"]
        # the veth carries only what crosses between nodes: where a node holds two ranks, the
        # bytes between the node's own ranks (shared memory, loopback) are not on it
        c["counter"] = "smoe:a2a_node_bytes" if c["kind"] == "dptp" else "smoe:a2a_bytes"
        c["collectives"] = "--additional-config" in c["flags"]
    return cfgs


def build_placements(a, work: str, names: list[str]) -> dict:
    """The placements the configurations ``names`` serve: {"tp", "dp", "dp_uncapped", "dptp"}
    (paths; None where no configuration of ``names`` needs one). ``--placement`` and
    ``--dp-placement`` where given, the rest built from ``--trace`` with ``smoe-place build`` into
    ``work``, as a user would; ValueError naming what is missing when there is no trace."""
    tp_pl, dp_pl = a.placement, a.dp_placement
    for mode, given, flags in (("tp", tp_pl, ()), ("dp", dp_pl, ("--mode", "dp"))):
        if given:
            continue
        if not a.trace:
            raise ValueError(f"--trace is needed to build the {mode} placement (or give --{mode}-placement)")
        out = os.path.join(work, f"placement-{mode}.yaml")
        sh(sys.executable, "-m", "vllm_smoe.tools.place_cli", "build", "--trace", *a.trace, "--ep-size", "2", "--model",
           a.model, *flags, "-o", out)
        tp_pl, dp_pl = (out, dp_pl) if mode == "tp" else (tp_pl, out)
    dp_uncapped = None
    if "dp-ep-smoe-uncapped" in names:
        if not a.trace:
            raise ValueError("--configs dp-ep-smoe-uncapped: --trace is needed to build its placement")
        dp_uncapped = os.path.join(work, "placement-dp-uncapped.yaml")
        sh(sys.executable, "-m", "vllm_smoe.tools.place_cli", "build", "--trace", *a.trace, "--ep-size", "2", "--model",
           a.model, "--mode", "dp", "--max-expert-load", str(UNCAPPED), "-o", dp_uncapped)
    dptp_pl = None
    if any(n.startswith("dptp-ep-smoe") for n in names):
        if not a.trace:
            raise ValueError("--configs dptp-ep-smoe*: --trace is needed to build its placement")
        dptp_pl = os.path.join(work, "placement-dptp.yaml")
        sh(sys.executable, "-m", "vllm_smoe.tools.place_cli", "build", "--trace", *a.trace, "--ep-size", "4", "--model",
           a.model, "--mode", "dp", "--nodes", "2", "-o", dptp_pl)
    return {"tp": tp_pl, "dp": dp_pl, "dp_uncapped": dp_uncapped, "dptp": dptp_pl}
