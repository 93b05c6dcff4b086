"""What a run reports: the summary per target and configuration (headline numbers, SLO
throughput), the printed table, BENCHMARKS.md's markdown from the JSON, the plot."""

from __future__ import annotations

import json
import os

from .slo import slo_rate
from .wire import NODE_PIPELINES, PIPELINES


def summarise(results: dict, slo_scale: float) -> dict:
    """Per target and configuration: the JSON's headline numbers (concurrency-8 decode mix),
    and the SLO throughput against a bound of slo_scale x the best single-stream p90 TBT."""
    out = {}
    for target, res in results.items():
        ok = {n: r for n, r in res.items() if "error" not in r}
        single = [p["p90_itl_ms"] for r in ok.values() for p in r["phases"]
                  if p["name"] == "decode-c1" and p.get("p90_itl_ms")]
        bound = slo_scale * min(single) if single else None
        rows = {}
        ref = next((r["greedy"] for n, r in ok.items() if n.split("#")[0] == "tp" and r.get("greedy")), None)
        for name, r in res.items():
            if "error" in r:
                rows[name] = {"error": r["error"], "smoe": r.get("smoe")}
                continue
            by = {p["name"]: p for p in r["phases"]}
            head = by.get("decode-c8") or next(iter(by.values()))
            ladder = [p for p in r["phases"] if p["arrivals"] == "poisson"]
            rows[name] = {"smoe": r["smoe"], "tpot_ms": head["tpot_ms"], "ttft_ms": head["ttft_ms"],
                          "p90_itl_ms": head["p90_itl_ms"], "tok_s": head["tok_s"],
                          "slo_rps": slo_rate(ladder, "p90_itl_ms", bound) if bound and ladder else None,
                          "slo_bound_ms": bound,
                          "wire_bytes_per_token": head["wire_bytes_per_token"],
                          "counter_bytes_per_token": head["counter_bytes_per_token"],
                          "counter": head.get("counter"),
                          "counters_vs_wire": head["counters_vs_wire"],
                          "greedy_equal_tp": None if ref is None or not r.get("greedy") else r["greedy"] == ref,
                          "collectives_per_step": head.get("collectives_per_step"),
                          "phases": {p["name"]: {k: p.get(k) for k in ("tpot_ms", "ttft_ms", "p90_itl_ms", "tok_s",
                                                                       "failed", "wire_bytes_per_token",
                                                                       "counter_bytes_per_token")}
                                     for p in r["phases"]},
                          "smoe_log": r.get("smoe_log")}
        out[target] = rows
    return out

def exchange_table(wc: dict, target: str = "none") -> list[str]:
    """A wire check's markdown table: per transport, bytes between nodes counted and on the veth,
    and time."""
    link = wc.get("link")
    shaped = f"link {link['rate_bit'] / 1e6:.0f} Mbit/s" if link else "no shaping"
    per = wc.get("ranks_per_node", 1)
    lines = ["", f"exchange alone, {wc['steps']} steps x {wc['tokens_per_step']} tokens, hidden {wc['hidden']}, "
                 f"2 nodes x {per} gloo rank{'s' * (per > 1)} over the veth ({target}: {shaped}):", "",
             "| transport | counted MB between nodes | veth payload MB | counted / wire | time ms |",
             "|---|---|---|---|---|"]
    for name in [n for n in NODE_PIPELINES + PIPELINES if n in wc and isinstance(wc[n], dict) and "wire" in wc[n]]:
        if any(line.startswith(f"| {name} |") for line in lines):
            continue
        w = wc[name]
        lines.append(f"| {name} | {w['counted_bytes'] / 1e6:.2f} | {w['wire']['payload'] / 1e6:.2f} | "
                     f"{w['agreement']['ratio']:.3f} | {1e3 * wc.get('seconds', {}).get(name, float('nan')):.0f} |")
    return lines


def print_wire_check(wc: dict) -> None:
    """The wire check's line per pipeline of :data:`.wire.PIPELINES`: counted against the veth."""
    for name in PIPELINES:
        ag = wc[name]["agreement"]
        print(f"wire check, {name} exchange alone ({1e3 * wc['seconds'][name]:.0f} ms): counted {wc[name]['counted_bytes'] / 1e6:.2f} MB, veth "
              f"payload {wc[name]['wire']['payload'] / 1e6:.2f} MB (counted / wire {ag['ratio']:.3f}, "
              f"{'within' if ag['within'] else 'NOT within'} {100 * ag['tol']:.0f}%)", flush=True)


def print_summary(summary: dict) -> None:
    for target, rows in summary.items():
        print(f"\ntarget {target} (decode mix at concurrency 8; SLO: p90 TBT bound)")
        print(f"{'config':>22} {'smoe':>5} {'TPOT ms':>8} {'TTFT ms':>8} {'p90 ITL':>8} {'tok/s':>7} {'SLO rps':>8} "
              f"{'wire B/tok':>10} {'ctr B/tok':>10}")
        for name, r in rows.items():
            if "error" in r:
                print(f"{name:>22} failed: {r['error'].splitlines()[0]}")
                continue

            def f(v, fmt):
                return format(v, fmt) if v is not None else "-"
            print(f"{name:>22} {str(r['smoe']):>5} {f(r['tpot_ms'], '8.1f')} {f(r['ttft_ms'], '8.0f')} "
                  f"{f(r['p90_itl_ms'], '8.1f')} {f(r['tok_s'], '7.1f')} {f(r['slo_rps'], '8.2f')} "
                  f"{f(r['wire_bytes_per_token'], '10.0f')} {f(r['counter_bytes_per_token'], '10.0f')}")


def markdown(payload: dict) -> str:
    """The JSON of a run as BENCHMARKS.md tables: per target, every configuration's headline
    (decode mix at concurrency 8), its concurrency sweep, the prefill mix and SLO throughput."""
    lines = []
    host = payload["host"]
    lines.append(f"host, one thread: {host['gemm_flops'] / 1e9:.0f} GFLOP/s fp32 GEMM, {host['read_bw'] / 1e9:.2f} GB/s "
                 "weight reads")
    if "wire_check" in payload:
        lines += exchange_table(payload["wire_check"])
    for target, rows in payload["summary"].items():
        links = payload["links"].get(target) or {}
        m = payload["measured_link"].get(target, {})
        dec, pre = links.get("decode"), links.get("prefill")
        shaped = (f"decode {dec['rate_bit'] / 1e6:.0f} Mbit/s, prefill mix {pre['rate_bit'] / 1e6:.0f} Mbit/s; "
                  f"delay {'applied' if m.get('delay_applied') else 'not applied'}" if dec else "no shaping")
        lines += ["", f"**{target}** ({shaped}; a 4 MB TCP stream measured {8 * m.get('rate_bytes_s', 0) / 1e6:.0f} "
                      f"Mbit/s)", "",
                  "| config | smoe | TPOT ms | TTFT ms | p90 ITL ms | tok/s | SLO req/s | wire B/token | counters "
                  "B/token | TPOT c1 / c32 | TTFT prefill mix ms | greedy = tp |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | {r.get('smoe')} | failed: {r['error'].splitlines()[0]} |")
                continue
            ph = r["phases"]
            c1, c32, pf = ph.get("decode-c1", {}), ph.get("decode-c32", {}), ph.get("prefill-c8", {})
            eq = {True: "yes", False: "NO", None: "-"}[r.get("greedy_equal_tp")]
            lines.append(f"| {name} | {'yes' if r['smoe'] else 'no'} | {f(r['tpot_ms'], '.1f')} | {f(r['ttft_ms'], '.0f')} | "
                         f"{f(r['p90_itl_ms'], '.1f')} | {f(r['tok_s'], '.1f')} | {f(r['slo_rps'], '.1f')} | "
                         f"{f(r['wire_bytes_per_token'], ',.0f')} | {f(r['counter_bytes_per_token'], ',.0f')} | "
                         f"{f(c1.get('tpot_ms'), '.1f')} / {f(c32.get('tpot_ms'), '.1f')} | {f(pf.get('ttft_ms'), '.0f')} "
                         f"| {eq} |")
        node = [n for n, r in rows.items() if r.get("counter") == "smoe:a2a_node_bytes"]
        if node:
            lines.append(f"\ncounters: the bytes between nodes (smoe:a2a_node_bytes) for {', '.join(node)}, "
                         "as the veth carries nothing else of theirs")
        bound = next((r.get("slo_bound_ms") for r in rows.values() if r.get("slo_bound_ms")), None)
        if bound:
            lines.append(f"\nSLO: p90 TBT <= {bound:.0f} ms (the best single-stream p90 TBT x the run's --slo-scale); "
                         f"ladder {payload['args'].get('rates')} req/s")
        lines += collectives_table(rows, payload.get("moe_layers"))
    return "\n".join(lines)


def collectives_table(rows: dict, moe_layers: int | None) -> list[str]:
    """Markdown lines: each configuration's collectives per served step and rank (decode mix at
    concurrency 8), by group and kind, counted by smoe's communicator; per MoE layer too, which
    includes each step's own few (the embedding's all-reduce, the logits' gather)."""
    counted = {n: r["collectives_per_step"] for n, r in rows.items() if r.get("collectives_per_step")}
    if not counted:
        return []
    L = moe_layers or 0
    out = ["", f"collectives per served step and rank, counted (decode mix at concurrency 8"
               f"{f'; {L} MoE layers' if L else ''}):", "",
           "| config | per step | per MoE layer | by group and kind (per step) |", "|---|---|---|---|"]
    for name, c in counted.items():
        total = sum(c.values())
        out.append(f"| {name} | {total:.1f} | {f'{total / L:.2f}' if L else '-'} | "
                   + ", ".join(f"{k} {v:.2f}" for k, v in c.items()) + " |")
    return out


def count_moe_layers(model: str) -> int | None:
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    from ....formats.model_info import moe_layer_indices

    return len(moe_layer_indices(cfg.get("text_config", cfg)))


def plot(summary: dict, results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (target, res) in zip(axes[0], results.items()):
        for name, r in res.items():
            if "error" in r:
                continue
            ladder = [p for p in r["phases"] if p["arrivals"] == "poisson" and p.get("p90_itl_ms")]
            ax.plot([p["rate"] for p in ladder], [p["p90_itl_ms"] for p in ladder], "o-", label=name)
        bound = next((r.get("slo_bound_ms") for r in summary[target].values() if r.get("slo_bound_ms")), None)
        if bound:
            ax.axhline(bound, color="gray", ls="--", lw=1, label="SLO")
        ax.set(title=f"link: {target}", xlabel="offered requests/s (Poisson)", ylabel="p90 inter-token latency (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

