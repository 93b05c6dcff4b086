"""The client, inside namespace 0: waits for the server, warms it, runs each phase's load with
the wire and smoe's counters read around it, and writes the results."""

from __future__ import annotations

import contextlib
import json
import sys
import time

import numpy as np

from .netns import Net
from .readings import collective_counts, collectives_per_step, counters_agree, metric_sum, socket_delta, wire_delta
from .request import one_request
from .slo import latency_summary


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def drive(c, model: str, phase: dict, prompts: list, t0: float) -> list:
    """The requests of ``phase`` on client ``c``, one a prompt: ``phase["arrivals"]`` "fixed"
    (``phase["concurrency"]`` in flight) or "poisson" (at ``phase["rate"]`` req/s from ``t0``,
    ``time.perf_counter``'s clock, the gaps drawn with ``phase["seed"]``). Returns each request's
    (start s, [arrival s of each streamed chunk], completion tokens, error or None), in prompt
    order: :func:`.slo.latency_summary`'s input."""
    from concurrent.futures import ThreadPoolExecutor

    if phase["arrivals"] == "poisson":
        gaps = np.random.default_rng(phase.get("seed", 0)).exponential(1.0 / phase["rate"], len(prompts))
        at = t0 + np.cumsum(gaps) - gaps[0]
        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(lambda i: one_request(c, model, prompts[i], phase["max_tokens"], at[i]), range(len(prompts))))
    with ThreadPoolExecutor(phase["concurrency"]) as ex:
        return list(ex.map(lambda p: one_request(c, model, p, phase["max_tokens"]), prompts))


def _net(net_spec: dict) -> Net:
    """The run's two namespaces, as the parent set them up (nothing is created here)."""
    net = Net.__new__(Net)
    net.ns, net.dev = tuple(net_spec["ns"]), tuple(net_spec["dev"])
    return net


def run_phase(spec: dict, net_spec: dict, phase: dict, prompts: list) -> dict:
    """One load (fixed concurrency or Poisson arrivals, :func:`drive`) with the wire and smoe's
    counters read around it. Runs inside namespace 0."""
    import openai

    net = _net(net_spec)
    net.shape(phase["link"])
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{spec['api']}/v1", api_key="smoe", timeout=900)
    model = spec["model"]
    text0 = _scrape(spec["api"])
    counter = spec.get("counter", "smoe:a2a_bytes")
    m0 = metric_sum(text0, counter) if spec["counts"] else None
    k0 = collective_counts(text0) if spec.get("collectives") else None
    w0, s0 = net.stats(), net.sockets()
    t0 = time.perf_counter()
    outs = drive(c, model, phase, prompts, t0)
    secs = time.perf_counter() - t0
    w1 = net.stats()
    res = {**{k: v for k, v in phase.items() if k != "link"}, **latency_summary(outs, secs)}
    wire = wire_delta(w0, w1)
    if m0 is not None or k0 is not None:  # counters publish once per log interval: wait one, step once to flush
        time.sleep(1.2)
        one_request(c, model, prompts[0][:1], 1)
        time.sleep(1.2)
        text1 = _scrape(spec["api"])
        wire = wire_delta(w0, net.stats())  # the flush request's own bytes on both sides
        if m0 is not None:
            res["counter_bytes"] = metric_sum(text1, counter) - m0
            res["counter"] = counter
        # per served step and rank, the flush step among them (a one-token decode step)
        if k0 is not None:
            res["collectives_per_step"] = collectives_per_step(k0, collective_counts(text1))
    tok = max(1, res["tokens"])
    res["wire"] = wire
    # who sent it: vLLM's workers (collectives on gloo), its engine and API processes (scheduler
    # output to the remote node, results back), by process name
    res["sent_by_process"] = socket_delta(s0, net.sockets())
    res["wire_bytes_per_token"] = wire["payload"] / tok
    res["counter_bytes_per_token"] = res["counter_bytes"] / tok if "counter_bytes" in res else None
    res["counters_vs_wire"] = counters_agree(wire["payload"], res.get("counter_bytes"))
    res["errors"] = sorted({o[3] for o in outs if o[3]})[:3]
    return res


def client_main(spec_path: str) -> int:
    """Inside namespace 0: wait for the server, warm it, run every phase; write the results."""
    import urllib.request

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.monotonic()
    while time.monotonic() - t0 < spec["timeout"]:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{spec['api']}/health",
                                                                  timeout=2) as r:
            if r.status == 200:
                break
        time.sleep(1)
    else:
        sys.exit(f"server not healthy after {spec['timeout']} s")
    out = {"start_s": time.monotonic() - t0, "phases": []}
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{spec['api']}/v1", api_key="smoe", timeout=900)
    out["greedy"] = []  # warm-up, and the tokens every configuration must agree on (lossless)
    for p in spec["prompts"][:4]:
        r = c.completions.create(model=spec["model"], prompt=p[:24], max_tokens=12, temperature=0.0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        ch = r.choices[0]
        out["greedy"].append(list(getattr(ch, "token_ids", None) or []) or ch.text)
    for phase in spec["phases"]:
        if phase.get("kind") == "goodput":
            from .goodput_client import run_goodput

            r = run_goodput(spec, phase, _net(spec["net"]).shape)
        else:
            prompts = [p[: phase["prompt_tokens"]]
                       for p in spec["prompts"][phase["offset"]: phase["offset"] + phase["requests"]]]
            r = run_phase(spec, spec["net"], phase, prompts)
        out["phases"].append(r)
        print(json.dumps({k: r.get(k) for k in ("name", "tpot_ms", "ttft_ms", "p90_itl_ms", "tok_s", "failed",
                                                "wire_bytes_per_token", "counter_bytes_per_token", "goodput")}),
              flush=True)
        with open(spec["out"], "w") as f:
            json.dump(out, f)
    return 0
