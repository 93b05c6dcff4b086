"""``smoe-bench cluster``'s run: checks, the model and placements, the host's speed and the
prompts, then per target the link shaped and measured and every configuration served
(:mod:`.nodes`), the summary printed and written (:mod:`.report`)."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import signal
import sys
import tempfile
import time

from .configs import DEFAULT_WIDTHS, build_placements, configurations
from .exchange_only import run_exchange
from .goodput_plan import DEFAULT_CONFIGS, adopt_targets, host_rows, plan_goodput
from .goodput_report import markdown_goodput, plot_goodput, summarise_goodput
from .link import TARGETS, host_speed, host_step_times, link_settings
from .netns import Net, interrupted, measure_link, tear_down
from .nodes import run_config
from .report import count_moe_layers, plot, print_summary, print_wire_check, summarise
from .wire import wire_check


def plan_phases(a, links: dict) -> list:
    """Fixed-concurrency mixes, then the Poisson ladder (rates filled in per run)."""
    phases, off = [], 2
    for c in a.concurrency:
        n = max(c, a.requests_per_level if c > 1 else max(2, a.requests_per_level // 4))
        phases.append({"name": f"decode-c{c}", "mix": "decode", "arrivals": "fixed", "concurrency": c, "requests": n,
                       "prompt_tokens": a.decode_prompt, "max_tokens": a.decode_output, "offset": off,
                       "link": links["decode"]})
        off += n
    if a.prefill_requests:
        phases.append({"name": "prefill-c8", "mix": "prefill", "arrivals": "fixed", "concurrency": 8,
                       "requests": a.prefill_requests, "prompt_tokens": a.prefill_prompt,
                       "max_tokens": a.prefill_output, "offset": off, "link": links["prefill"]})
        off += a.prefill_requests
    for i, rate in enumerate(a.rates):
        phases.append({"name": f"poisson-{rate:g}", "mix": "decode", "arrivals": "poisson", "rate": rate, "seed": i,
                       "requests": a.poisson_requests, "prompt_tokens": a.decode_prompt,
                       "max_tokens": a.decode_output, "offset": off, "link": links["decode"]})
        off += a.poisson_requests
    return phases


def target_links(a, host: dict, target: str) -> dict:
    """{"decode": link, "prefill": link} for ``target`` (:func:`.link.link_settings`; None: no
    shaping), or ``--rate`` and ``--delay`` for both where given."""
    links = ({"decode": None, "prefill": None} if target == "none" else
             {ph: link_settings(host, target, ph) for ph in ("decode", "prefill")})
    if a.rate:  # a fixed rate instead of the target's proportions
        links = {ph: {"target": "fixed", "phase": ph, "rate_bytes_s": a.rate / 8, "rate_bit": int(a.rate),
                      "delay_s": a.delay} for ph in ("decode", "prefill")}
    return links


def serve_target(net: Net, target: str, a, names: list, cfgs: dict, work: str, phases: list, prompts: list,
                 starts, rows: dict) -> None:
    """Each configuration of ``names`` (``cfgs``: name -> configuration), ``--repeats`` starts
    each, on the link as ``phases`` shape it; each start's results (or its error) go into
    ``rows`` as they come, so that an interrupted run keeps what was measured. ``starts``: an
    iterator of start numbers, fresh over the whole run (ports, log names)."""
    # goodput: start 0 of every configuration, then start 1, so that the host's drift over the run
    # spreads over the configurations instead of separating them
    order = ([(n, r) for r in range(a.repeats) for n in names] if getattr(a, "goodput", False) else
             [(n, r) for n in names for r in range(a.repeats)])
    for name, rnd in order:
        cfg = cfgs[name]
        idx = next(starts)
        t = time.monotonic()
        key = name if a.repeats == 1 else f"{name}#{rnd}"
        try:
            r = run_config(net, name, cfg, idx, work, a, phases, prompts)
            r["smoe"] = cfg["smoe"]
            rows[key] = r
            adopt_targets(phases, r, key)
            good = [f"{p['mix']} {p['goodput']:.3g} req/s" for p in r["phases"] if p.get("kind") == "goodput"]
            head = next((p for p in r["phases"] if p["name"] == "decode-c8"), r["phases"][0])
            print(f"[{target}] {key}: " + (f"goodput {', '.join(good)}" if good else
                                           f"TPOT {head['tpot_ms']:.1f} ms, wire "
                                           f"{head['wire_bytes_per_token']:.0f} B/token")
                  + f" ({time.monotonic() - t:.0f} s)", flush=True)
        except RuntimeError as e:
            rows[key] = {"error": str(e), "smoe": cfg["smoe"]}
            print(f"FAILED {e}", file=sys.stderr, flush=True)


def run(a) -> int:
    from ...cli_util import check_output_file
    from ..common import mixed_prompts

    if a.json:
        check_output_file(a.json, "--json")
    # the goodput mode's defaults: one target, vLLM's and smoe's best against plain TP, two starts
    a.target = a.target or (["ib-ndr"] if a.goodput else ["ib-ndr", "none"])
    a.configs = a.configs or (DEFAULT_CONFIGS if a.goodput else "tp,tp-ep,tp-ep-speculate,dp-ep,dp-ep-smoe")
    a.repeats = a.repeats or (2 if a.goodput else 1)
    a.config_timeout = a.config_timeout or (5400.0 if a.goodput else 1800.0)
    if a.goodput and not a.mixes and not a.large_batch:
        raise ValueError("--mixes none with --large-batch 0: nothing to measure")
    if a.goodput and a.rate:
        raise ValueError(f"--rate {a.rate:g} with --goodput: its links are derived per mix (--target); drop --rate")
    if bad := [t for t in a.target if t not in TARGETS and t != "none"]:
        raise ValueError(f"--target {' '.join(bad)}: choose from {', '.join(TARGETS)}, none")
    if a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
        raise ValueError(f"--model {a.model}: no config.json there")
    import shutil

    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        print(f"smoe-bench cluster: needs root (namespaces, veth, tc) and iproute2's ip and tc; uid "
              f"{os.geteuid()}, not found: {', '.join(missing) or 'none'}", file=sys.stderr)
        return 2
    from ....testbed import FIXTURE_MODEL, FIXTURE_TRACES

    work = a.work or tempfile.mkdtemp(prefix="smoe-cluster-")
    os.makedirs(work, exist_ok=True)
    print(f"logs in {work}", flush=True)
    if a.exchange_only:
        return run_exchange(a, work)
    if a.model is None:  # the trained fixture at production row sizes, its routing unchanged
        from ....testbed.inflate import inflate_checkpoint

        a.model = os.path.join(work, "fixture-wide")
        if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
            inflate_checkpoint(FIXTURE_MODEL, a.model, **DEFAULT_WIDTHS)
        a.trace = a.trace or [FIXTURE_TRACES["train"]]
    a.model = os.path.abspath(a.model)
    names = [c for c in a.configs.split(",") if c]
    pl = build_placements(a, work, names)
    metrics_dir = os.path.join(work, "metrics")
    os.makedirs(metrics_dir, exist_ok=True)
    all_cfgs = configurations(pl["tp"], pl["dp"], metrics_dir, pl["dp_uncapped"], pl["dptp"])
    if bad := [c for c in names if c not in all_cfgs]:
        raise ValueError(f"--configs: unknown {bad}; choose from {', '.join(all_cfgs)}")
    host = host_speed()
    print(f"host, one thread: {host['gemm_flops'] / 1e9:.0f} GFLOP/s fp32 GEMM, {host['read_bw'] / 1e9:.1f} GB/s "
          f"weight reads", flush=True)
    if a.goodput:
        host["step_s"] = host_step_times(host_rows(a))
        print("host, one thread, GEMM of a step: " + ", ".join(f"{r} rows {1e3 * t:.0f} ms"
                                                              for r, t in host["step_s"].items()), flush=True)
        need = 8 + a.large_batch + 8
    else:
        need = len(a.concurrency) * a.requests_per_level + max(a.concurrency) + a.prefill_requests \
            + a.poisson_requests * len(a.rates) + 8
    prompts = mixed_prompts(a.prompts_trace or FIXTURE_TRACES["heldout"], need,
                             max(a.decode_prompt, a.prefill_prompt), a.seed)
    if len(prompts) < need:
        prompts = (prompts * (need // max(1, len(prompts)) + 1))[:need]
    net, results, meta, starts, rc = Net(), {}, {"links": {}, "measured_link": {}}, itertools.count(1), 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        net.up()
        if a.wire_check:
            hidden = json.load(open(os.path.join(a.model, "config.json")))["hidden_size"]
            meta["wire_check"] = wc = wire_check(net, hidden, work)
            print_wire_check(wc)
        for target in a.target:
            meta["links"][target] = links = target_links(a, host, target)
            if a.goodput:
                phases = plan_goodput(a, host["step_s"], target, a.prompts_trace or FIXTURE_TRACES["heldout"])
                links = {"decode": next((p["link"] for p in phases), links["decode"])}  # the probe's shaping
                meta["links"][target] = {p["name"]: p["link"] for p in phases}
            net.shape(links["decode"])
            meta["measured_link"][target] = {**measure_link(net), "delay_applied": net.delay_applied}
            net.shape(None)
            m = meta["measured_link"][target]
            print(f"[{target}] {'first phase' if a.goodput else 'decode'} link "
                  f"{links['decode'] and links['decode']['rate_bit'] / 1e6}"
                  f" Mbit/s: measured {8 * m['rate_bytes_s'] / 1e6:.1f} Mbit/s, RTT {1e3 * m['rtt_s']:.2f} ms",
                  flush=True)
            if not a.goodput:
                phases = plan_phases(a, links)
            results[target] = {}
            serve_target(net, target, a, names, all_cfgs, work, phases, prompts, starts, results[target])
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C, or SIGTERM: what was measured is still written
        rc = interrupted(e)
    finally:
        tear_down(net)
    if a.goodput:
        summary = summarise_goodput(results)
        print(markdown_goodput(summary), flush=True)
    else:
        summary = summarise(results, a.slo_scale)
        print_summary(summary)
    payload = {"date": datetime.datetime.now().astimezone().isoformat(), "uname": " ".join(os.uname()),
               "model": a.model, "moe_layers": count_moe_layers(a.model),
               "placements": {"tp": pl["tp"], "dp": pl["dp"]}, "host": host, **meta,
               "targets": {t: TARGETS.get(t) for t in a.target},
               "args": {k: v for k, v in vars(a).items() if k != "fn"},
               "configs": {n: {k: list(v) if k == "flags" else v for k, v in all_cfgs[n].items()} for n in names},
               "summary": summary, "results": results}
    if a.json:
        from ..common import write_json

        write_json(a.json, payload)
    if a.plot:
        plot_goodput(results, a.plot) if a.goodput else plot(summary, results, a.plot)
    return rc or int(any("error" in r for res in results.values() for r in res.values()))
