"""``--exchange-only``: the MoE exchange alone over the shaped link per target, no vLLM; with
``--wire-model`` also the cost model of each run from the host's measured constants."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

from .configs import DEFAULT_WIDTHS
from .link import host_speed, link_settings
from .netns import Net, interrupted, measure_link, tear_down
from .report import exchange_table
from .wire import wire_check, wire_plan


def measure_host(net, hidden: int, work: str, per_node: int, repeats: int = 3) -> dict:
    """The host's constants, unshaped: each pipeline's time a collective from tiny-step wire
    checks (median of ``repeats``), and the veth's payload rate (a 64 MiB TCP transfer,
    :func:`measure_link`)."""
    from ..wire_model import TINY_TOKENS, _median_seconds, calibrate

    net.shape(None)
    lk = measure_link(net, nbytes=64 << 20)
    tiny = [wire_check(net, hidden, work, tokens=TINY_TOKENS, per_node=per_node) for _ in range(repeats)]
    seconds = _median_seconds(tiny)
    plan = wire_plan(hidden, TINY_TOKENS, tiny[0]["steps"], per_node)
    return {"tiny_tokens": TINY_TOKENS, "tiny_seconds": seconds, "link": lk, "local_bytes_s": lk["rate_bytes_s"],
            "collective_s": calibrate(plan, per_node, {"seconds": seconds}, lk["rate_bytes_s"])}


def model_run(net, hidden: int, work: str, per_node: int, wc: dict, link: dict | None, host: dict) -> dict:
    """The model of wire check ``wc`` (just run on ``net`` shaped by ``link``) with ``host``'s
    constants (:func:`measure_host`), compared; ``transport_*`` with gloo's bytes over a half-duplex
    link (:data:`.wire_model.HALF_DUPLEX`). Records :func:`.wire_model.measure_overlap` on the link as it is now (a
    diagnostic). Where the link has a delay, also a tiny-step run there, whose time per
    collective checks :data:`.wire_model.HOPS` (``implied_hops``, not used by the model)."""
    from ..wire_model import (HALF_DUPLEX, HOPS, TINY_TOKENS, compare, implied_hops, measure_overlap,
                             model_wire_check, payload_rate)

    plan = wire_plan(hidden, wc["tokens_per_step"], wc["steps"], per_node)
    rate = host["local_bytes_s"] if link is None else min(payload_rate(link), host["local_bytes_s"])
    ov = measure_overlap(net, per_node, work, rate)
    consts = {"collective_s": host["collective_s"], "local_bytes_s": host["local_bytes_s"], "rate_bytes_s": rate,
              "delay_s": link["delay_s"] if link is not None and net.delay_applied else 0.0, "hops": dict(HOPS),
              "overlap": dict(HALF_DUPLEX)}
    out = {"constants": consts, "overlap_measurement": ov,
           "pipelines": compare(model_wire_check(plan, per_node, consts), wc)}
    if consts["delay_s"] > 0:
        tiny = wire_check(net, hidden, work, tokens=TINY_TOKENS, per_node=per_node)
        tplan = wire_plan(hidden, TINY_TOKENS, tiny["steps"], per_node)
        out["tiny_shaped_seconds"] = tiny["seconds"]
        out["implied_hops"] = implied_hops(tplan, per_node, tiny, host["collective_s"],
                                           {**link, "delay_s": consts["delay_s"]}, host["local_bytes_s"])
    return out


def run_exchange(a, work: str) -> int:
    """``--exchange-only``: the MoE exchange alone (:func:`wire_check`) over two nodes of
    ``--ranks-per-node`` ranks, per target a decode-sized step on the link shaped to the target's
    decode proportions and a prefill-sized one on its prefill link (``--exchange-tokens``): bytes
    between nodes (counted and on the veth) and time, no vLLM."""
    hidden = (json.load(open(os.path.join(a.model, "config.json")))["hidden_size"] if a.model
              else DEFAULT_WIDTHS["hidden"])
    host = host_speed() if any(t != "none" for t in a.target) else None
    net, runs, rc = Net(), {}, 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    constants = None
    try:
        net.up()
        if a.wire_model:  # the host's constants first, unshaped (measure_host)
            from ..wire_model import model_table

            constants = measure_host(net, hidden, work, a.ranks_per_node)
            print(f"host constants: {json.dumps(constants)}", flush=True)
        for target in a.target:
            for phase, tokens in zip(("decode", "prefill"), a.exchange_tokens):
                link = None if target == "none" else link_settings(host, target, phase)
                net.shape(link)
                runs[f"{target} {phase}"] = wc = wire_check(net, hidden, work, tokens=tokens,
                                                            per_node=a.ranks_per_node)
                wc["link"] = link
                for line in exchange_table(wc, f"{target}, {phase} link"):
                    print(line, flush=True)
                if constants is not None:
                    wc["model"] = model_run(net, hidden, work, a.ranks_per_node, wc, link, constants)
                    for line in model_table(wc, f" ({target}, {phase} link)"):
                        print(line, flush=True)
    except (KeyboardInterrupt, SystemExit) as e:
        rc = interrupted(e)
    finally:
        tear_down(net)
    if a.json:
        from ..common import write_json

        write_json(a.json, {"date": datetime.datetime.now().astimezone().isoformat(), "uname": " ".join(os.uname()),
                            "host": host, "args": {k: v for k, v in vars(a).items() if k != "fn"}, "runs": runs,
                            **({"host_constants": constants} if constants is not None else {})})
    return rc
