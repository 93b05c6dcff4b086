"""The goodput phase, inside namespace 0: a mix's unloaded latencies (the targets, when not
given), then the rate search, each measured rate a Poisson load of warm-up plus counted
requests of the mix's own lengths."""

from __future__ import annotations

import time

import numpy as np

from .request import one_request
from .goodput import attainment, request_latencies, search_rate, unloaded_targets
from .slo import latency_summary


def poisson(c, model: str, prompts: list, outputs: list, rate: float, seed: int) -> tuple[list, float]:
    """Every prompt sent at Poisson arrivals of ``rate`` req/s (gaps drawn with ``seed``), each
    asking for its own ``outputs[i]`` tokens. Returns (:func:`.client.drive`'s per-request
    tuples in prompt order, seconds from the first send to the last answer)."""
    from concurrent.futures import ThreadPoolExecutor

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
    t0 = time.perf_counter()
    at = t0 + np.cumsum(gaps) - gaps[0]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda i: one_request(c, model, prompts[i], int(outputs[i]), at[i]), range(len(prompts))))
    return outs, time.perf_counter() - t0


def run_goodput(spec: dict, phase: dict, shape) -> dict:
    """The goodput search of ``phase`` (a mix's prompts, outputs and settings, :func:`..run.plan_goodput`)
    on the server of ``spec``; ``shape(link)`` sets the emulated link first."""
    import openai

    shape(phase["link"])
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{spec['api']}/v1", api_key="smoe", timeout=900)
    model, prompts, outputs = spec["model"], phase["prompts"], phase["outputs"]
    nu = phase["unloaded"]
    unloaded = [one_request(c, model, prompts[i], int(outputs[i])) for i in range(nu)]
    own = unloaded_targets(request_latencies(unloaded), outputs[:nu], phase["scale"])
    targets = phase.get("targets") or own
    # the range in req/s: the mix's multiples of 1 / S, S of the start that set the targets
    rates = [k / targets["unloaded_request_s"] for k in phase["rates"]]
    pool, per = list(range(nu, len(prompts))), phase["warmup"] + phase["requests"]
    runs = []

    def measure(rate: float) -> float:
        k = len(runs)
        idx = [pool[(k * per + j) % len(pool)] for j in range(per)]  # fresh requests per rate while the pool lasts
        outs, secs = poisson(c, model, [prompts[i] for i in idx], [outputs[i] for i in idx], rate,
                             phase["seed"] + 1000 * (k + 1))
        counted = outs[phase["warmup"]:]
        att = attainment(request_latencies(counted), targets)
        runs.append({"rate": rate, "attainment": att, "seconds": secs,
                     **latency_summary(counted, secs)})
        print(f"  {phase['name']} at {rate:.3g} req/s: attainment ttft {att['ttft']:.2f} tpot {att['tpot']:.2f} "
              f"both {att['both']:.2f} ({secs:.0f} s)", flush=True)
        return att[phase["criterion"]]

    found = search_rate(measure, *rates, phase["steps"], phase["goal"])
    keep = ("name", "mix", "kind", "criterion", "goal", "scale", "warmup", "requests", "unloaded", "rates", "steps")
    return {**{k: phase[k] for k in keep}, "link": phase["link"], "targets": targets, "own_unloaded": own,
            "rate_range": rates, "goodput": found["goodput"], "bracket": found["bracket"], "runs": runs,
            "arrivals": "goodput"}
