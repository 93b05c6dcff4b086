"""What several ``smoe-bench`` subcommands share: prompts from traces, streaming clients, the
log lines of vLLM's ranks, JSON output."""

from __future__ import annotations

import json
import os
import time

import numpy as np


def trace_prompts(trace_path: str, requests: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` token ids of the first ``requests`` requests of a trace."""
    from ...formats.trace import open_trace

    t = open_trace(trace_path)
    tok, req = t["token_ids"], t["request_ids"]
    return [tok[req == r][:prompt_tokens].tolist() for r in np.unique(req)[:requests]]


def placement_arg(given: str | None, default: str, ep_size: int, build_flags: str = "") -> str:
    """--placement, or the repository's configs/<default>; a missing file is a usage error."""
    path = given or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", default)
    if not os.path.isfile(path):
        raise ValueError(f"--placement {path}: no such file (the default lives in the repository's configs/; "
                         f"build one with smoe-place build {build_flags}--ep-size {ep_size})")
    return path


def stream(client, model: str, prompt, max_tokens: int) -> tuple[float, list[float], int]:
    """One streamed greedy completion: (start, arrival time of each chunk, completion tokens)."""
    t0 = time.perf_counter()
    times, n = [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.choices:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return t0, times, n


def drive(server, model: str, prompts, concurrency: int, max_tokens: int, into: dict) -> None:
    """Send every prompt streamed from ``concurrency`` clients; add the run's output tok/s and
    each request's TTFT, TPOT and inter-token gaps to ``into`` (lists, created on first use)."""
    from concurrent.futures import ThreadPoolExecutor

    c = server.client()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda p: stream(c, model, p, max_tokens), prompts))
    secs = time.perf_counter() - t0
    for key in ("tok_s", "ttft", "tpot", "itl"):
        into.setdefault(key, [])
    into["tok_s"].append(sum(n for _, _, n in outs) / secs)
    into["ttft"] += [ts[0] - st for st, ts, _ in outs if ts]
    into["tpot"] += [(ts[-1] - ts[0]) / (n - 1) for _, ts, n in outs if len(ts) > 1 and n > 1]
    into["itl"] += [d for _, ts, _ in outs for d in np.diff(ts)]


LATENCY = {"tok_s": ("output tok/s", lambda v: float(np.median(v))),  # column: (label, statistic)
           "ttft": ("TTFT ms", lambda v: 1e3 * float(np.median(v))),
           "tpot": ("TPOT ms", lambda v: 1e3 * float(np.median(v))),
           "itl": ("p90 ITL ms", lambda v: 1e3 * float(np.percentile(v, 90)))}


def median_tpot(rows: list[dict]) -> float:
    """Median time per output token of the rows that have one (NaN when none)."""
    v = [r["tpot"] for r in rows if r.get("tpot") is not None]
    return float(np.median(v)) if v else float("nan")


def null_nan(x):
    if isinstance(x, float) and not np.isfinite(x):
        return None  # strict JSON has no NaN
    if isinstance(x, dict):
        return {k: null_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [null_nan(v) for v in x]
    return x


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(null_nan(payload), f, indent=1)


SPEC_LINE = (r"speculate \(predictor [\w-]+\): rank (\d+) served ([0-9.]+) of its expert activations locally "
              r"\((\d+) tokens\)(?:; sparse all2all: ([0-9.]+) remote \(token, rank\) pairs and ([0-9.]+) B per token)?")


DP_LINE = (r"dp rank (\d+) served ([0-9.]+) of its requests' expert activations locally \((\d+) tokens"
            r".*?([0-9.]+) remote \(token, rank\) pairs and ([0-9.]+) B per token")


def rank_numbers(lines, pattern: str) -> dict:
    """Every rank's last line of ``pattern`` (groups: rank, local share, tokens, remote pairs and
    bytes per token, the last two optional), combined over ranks weighted by their tokens."""
    import re

    last: dict[int, tuple] = {}
    pat = re.compile(pattern)
    for ln in lines:
        m = pat.search(ln)
        if m:
            last[int(m.group(1))] = (float(m.group(2)), int(m.group(3)),
                                     *(None if m.group(i) is None else float(m.group(i)) for i in (4, 5)))
    if not last:
        return {}
    tok = max(1, sum(v[1] for v in last.values()))
    out = {"local_share": sum(v[0] * v[1] for v in last.values()) / tok,
           "tokens_per_rank": {r: v[1] for r, v in sorted(last.items())}}
    if all(v[2] is not None for v in last.values()):
        out["remote_pairs_per_token"] = sum(v[2] * v[1] for v in last.values()) / tok
        out["bytes_per_token_layer"] = sum(v[3] * v[1] for v in last.values()) / tok
    return out


def dp_numbers(log_path: str) -> dict:
    """Served-step locality of every DP rank from its last ``dp rank d served ...`` log line,
    combined over ranks weighted by their tokens: local activation share, remote (token, rank)
    pairs and bytes per token and MoE layer; plus the front ends' routing counts."""
    import re

    with open(log_path) as f:
        lines = f.readlines()
    out = rank_numbers(lines, DP_LINE)
    routed = {}
    rpat = re.compile(r"\((ApiServer_\d+|APIServer) pid=\d+\).*smoe dp routing: (\d+) requests: (\d+) by the placement "
                      r"\((\d+) on their best-scoring engine\), (\d+) left to vLLM's balancer, (\d+) with their own rank")
    for ln in lines:
        m = rpat.search(ln)
        if m:
            routed[m.group(1)] = tuple(int(m.group(i)) for i in range(2, 7))
    if out and routed:
        out["routed"] = {k: sum(v[i] for v in routed.values()) for i, k in
                         enumerate(("requests", "by_placement", "best_engine", "by_vllm", "explicit"))}
    return out


def mixed_prompts(trace_path: str, requests: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """``requests`` requests drawn evenly over the whole trace (every workload in it), in a
    seeded random order: a mix of clients, not one workload after another."""
    from ...formats.trace import open_trace

    t = open_trace(trace_path)
    tok, req = t["token_ids"], t["request_ids"]
    ids = np.unique(req)
    pick = ids[np.linspace(0, ids.size - 1, min(requests, ids.size)).round().astype(int)]
    pick = pick[np.random.default_rng(seed).permutation(pick.size)]
    return [tok[req == r][:prompt_tokens].tolist() for r in pick]


def scale_dependent_routing(model_dir: str) -> bool:
    """Whether the checkpoint routes by sigmoid scores with a correction bias (DeepSeek-V3's
    ``noaux_tc``, GLM-4.5's), whose experts depend on the logits' scale: speculate's router on
    the DeepSeek family refuses it."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        cfg = json.load(f)
    return cfg.get("topk_method") == "noaux_tc" or cfg.get("scoring_func") == "sigmoid"


def is_mla(model_dir: str) -> bool:
    """Whether the checkpoint's attention is DeepSeek's MLA (its config names a kv_lora_rank)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return bool(json.load(f).get("kv_lora_rank"))
