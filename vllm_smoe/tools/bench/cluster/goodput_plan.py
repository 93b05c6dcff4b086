"""The goodput mode's phases: per mix the link derived at the mix's rows per rank, the requests
(the same for every configuration and start), the search settings; and the large-batch decode
phase. The targets are filled in from the first configuration's unloaded latencies."""

from __future__ import annotations

import zlib

from .link import link_for_rows
from .mixes import MIXES, draw_lengths, workload_prompts

DEFAULT_CONFIGS = "tp,dp-ep,dp-ep-smoe"  # plain TP, vLLM's DP + EP, smoe's DP + EP


def host_rows(a) -> list[int]:
    """The batch sizes (rows per rank) the host's GEMM is timed at for ``a.mixes``."""
    rows = {MIXES[m]["rows_per_rank"] for m in a.mixes}
    if a.large_batch:
        rows.add(max(1, a.large_batch // 2))
    return sorted(rows)


def plan_goodput(a, host_s: dict, target: str, trace_path: str) -> list[dict]:
    """Phases for ``target`` ("none": no shaping): with ``a.large_batch`` first a fixed-concurrency
    decode phase of that many sequences, then per mix of ``a.mixes`` one goodput phase; host_s:
    {rows: s}, :func:`.link.host_step_times`."""
    from ....formats.trace import read_traces

    _, arr, _ = read_traces([trace_path], ("token_ids", "domain"))
    phases = []
    if a.large_batch:  # decode-heavy's median lengths, all sequences at once
        m, rows = MIXES["decode-heavy"], max(1, a.large_batch // 2)
        phases.append({"name": f"decode-c{a.large_batch}", "mix": "decode", "arrivals": "fixed",
                       "concurrency": a.large_batch, "requests": a.large_batch, "prompt_tokens": int(m["prompt"][0]),
                       "max_tokens": int(m["output"][0]), "offset": 8,
                       "link": None if target == "none" else link_for_rows(host_s, target, rows, "large-batch")})
    for mix in a.mixes:
        m, seed = MIXES[mix], a.seed + zlib.crc32(mix.encode()) % 1000  # a mix draws the same alone or not
        link = None if target == "none" else link_for_rows(host_s, target, m["rows_per_rank"], mix)
        n = a.unloaded_requests + (a.search_steps + 1) * (a.goodput_warmup + a.goodput_requests)
        plen, olen = draw_lengths(mix, n, seed)
        phases.append({"name": f"goodput-{mix}", "kind": "goodput", "arrivals": "goodput", "mix": mix,
                       "criterion": m["criterion"], "goal": a.goal, "scale": a.slo_scale,
                       "warmup": a.goodput_warmup, "requests": a.goodput_requests,
                       "unloaded": a.unloaded_requests, "rates": list(m["rates"]), "steps": a.search_steps,
                       "seed": seed, "targets": None, "concurrency": a.max_seqs, "link": link,
                       "prompts": workload_prompts(arr["token_ids"], arr["domain"], plen, seed),
                       "outputs": olen.tolist()})
    return phases


def adopt_targets(phases: list[dict], result: dict, key: str = "") -> None:
    """The targets of the first start that measured them (``key``, e.g. ``dp-ep#0``), from its
    unloaded latencies, for every later start: one set of targets for every configuration."""
    got = {p["name"]: p["targets"] for p in result.get("phases", []) if p.get("kind") == "goodput"}
    for p in phases:
        if p.get("kind") == "goodput" and p["targets"] is None and p["name"] in got:
            p["targets"] = {**got[p["name"]], "set_by": key or "the first start"}
