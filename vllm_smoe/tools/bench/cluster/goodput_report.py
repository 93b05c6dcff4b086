"""What the goodput mode reports: per target, mix and configuration the goodput of each start,
its median and spread; smoe's best against vLLM's best; the large-batch decode phase; the
printed table, markdown and a plot of attainment against rate."""

from __future__ import annotations

import numpy as np

from .goodput import crossing, spread


def summarise_goodput(results: dict) -> dict:
    """results: {target: {config or config#start: a start's result or {"error"}}}. Returns
    {target: {"mixes": {mix: {"configs": {config: {...}}, "best_smoe", "best_vllm", "ratio"}},
    "greedy_equal_tp": {config: bool | None}, "errors": {start: str}}}."""
    out = {}
    for target, res in results.items():
        ok = {k: r for k, r in res.items() if "error" not in r}
        ref = next((r["greedy"] for k, r in ok.items() if k.split("#")[0] == "tp" and r.get("greedy")), None)
        mixes: dict = {}
        for key, r in ok.items():
            name = key.split("#")[0]
            for p in r["phases"]:
                if p.get("kind") == "goodput":
                    row = mixes.setdefault(p["mix"], {"criterion": p["criterion"], "targets": p["targets"],
                                                      "configs": {}})["configs"].setdefault(
                        name, {"smoe": r["smoe"], "goodput": [], "grid": [], "open": [], "unloaded_ttft_s": [],
                               "unloaded_tpot_s": [], "link_bit": p["link"] and p["link"]["rate_bit"]})
                    rate, open_ = crossing([[x["rate"], x["attainment"][p["criterion"]]] for x in p["runs"]], p["goal"])
                    row["goodput"].append(rate)
                    row["open"].append(open_)
                    row["grid"].append(p["goodput"])
                    row["unloaded_ttft_s"].append(p["own_unloaded"]["unloaded_ttft_s"])
                    row["unloaded_tpot_s"].append(p["own_unloaded"]["unloaded_tpot_s"])
                elif p["name"].startswith("decode-c"):
                    lb = mixes.setdefault("large-batch", {"configs": {}})["configs"].setdefault(
                        name, {"smoe": r["smoe"], "tpot_ms": [], "tok_s": [], "concurrency": p["concurrency"]})
                    lb["tpot_ms"].append(p["tpot_ms"])
                    lb["tok_s"].append(p["tok_s"])
        for mix, m in mixes.items():
            for row in m["configs"].values():
                key = "goodput" if "goodput" in row else "tok_s"
                row["median"] = float(np.median(row[key])) if row[key] else None
                row["spread"] = spread(row[key])
            best = {s: max(((n, r["median"]) for n, r in m["configs"].items() if r["smoe"] == s and r["median"]
                            is not None), key=lambda x: x[1], default=(None, None)) for s in (True, False)}
            m["best_smoe"], m["best_vllm"] = best[True], best[False]
            # a goodput above its search's range is a lower bound: smoe's open makes the ratio one
            # too ("at least"), vLLM's open makes it an upper bound, both open: no ratio
            opened = {side: n is not None and any(m["configs"][n].get("open", [])) for side, (n, _) in best.items()}
            both = best[True][1] and best[False][1]
            m["ratio"] = best[True][1] / best[False][1] if both and not (opened[True] and opened[False]) else None
            m["ratio_bound"] = ">=" if opened[True] and not opened[False] else "<=" if opened[False] and \
                not opened[True] else "="
        out[target] = {"mixes": mixes, "greedy_reference": ref is not None,
                       "greedy_equal_tp": {k: None if ref is None or not r.get("greedy") else r["greedy"] == ref
                                           for k, r in ok.items()},
                       "errors": {k: r["error"] for k, r in res.items() if "error" in r}}
    return out


def _fmt(v, f="{:.3g}"):
    return "-" if v is None else f.format(v)


def markdown_goodput(summary: dict) -> str:
    """The tables BENCHMARKS.md shows, one per target and mix."""
    lines = []
    for target, s in summary.items():
        for mix, m in s["mixes"].items():
            if mix == "large-batch":
                lines += ["", f"**{target}, large-batch decode** (fixed concurrency, output tok/s across both nodes)", "",
                          "| config | smoe | sequences | tok/s per start | median | spread | TPOT ms per start |",
                          "|---|---|---|---|---|---|---|"]
                for n, r in m["configs"].items():
                    lines.append(f"| {n} | {'yes' if r['smoe'] else 'no'} | {r['concurrency']} | "
                                 f"{', '.join(_fmt(v, '{:.1f}') for v in r['tok_s'])} | {_fmt(r['median'], '{:.1f}')} | "
                                 f"{_fmt(r['spread'], '{:.0%}')} | {', '.join(_fmt(v, '{:.0f}') for v in r['tpot_ms'])} |")
                continue
            t = m["targets"]
            lines += ["", f"**{target}, {mix}** (goodput under the {m['criterion'].upper()} target; targets TTFT "
                          f"{1e3 * t['ttft_s']:.0f} ms, TPOT {1e3 * t['tpot_s']:.0f} ms = {t['scale']:g} x the unloaded "
                          f"medians of {t.get('set_by', 'the first start')})", "",
                      "| config | smoe | link Mbit/s | unloaded TTFT / TPOT ms | goodput req/s per start (bisection's "
                      "highest met) | median | spread |",
                      "|---|---|---|---|---|---|---|"]
            for n, r in m["configs"].items():
                link = "-" if r["link_bit"] is None else f"{r['link_bit'] / 1e6:.1f}"
                per = ", ".join(("&ge; " if o else "") + f"{_fmt(v)} ({_fmt(g)})"
                                for v, g, o in zip(r["goodput"], r["grid"], r["open"]))
                lines.append(f"| {n} | {'yes' if r['smoe'] else 'no'} | {link} | "
                             f"{1e3 * np.median(r['unloaded_ttft_s']):.0f} / {1e3 * np.median(r['unloaded_tpot_s']):.0f} | "
                             f"{per} | {_fmt(r['median'])} | {_fmt(r['spread'], '{:.0%}')} |")
            if m["ratio"] is not None:
                bound = {">=": "at least ", "<=": "at most ", "=": ""}[m["ratio_bound"]]
                lines.append(f"\nsmoe's best ({m['best_smoe'][0]}) / vLLM's best ({m['best_vllm'][0]}): "
                             f"{bound}{m['ratio']:.2f}x")
            elif m["best_smoe"][0] and m["best_vllm"][0]:
                lines.append("\nno ratio: both best goodputs are above their search's range (lower bounds)")
        bad = [k for k, v in s["greedy_equal_tp"].items() if v is False]
        lines.append("\ngreedy tokens equal plain TP's: " + ("not checked (no plain TP start)" if not s.get(
            "greedy_reference", True) else "every start" if not bad else "NOT " + ", ".join(bad)))
        for k, e in s["errors"].items():
            lines.append(f"\nstart {k} failed: {e.splitlines()[0]}")
    return "\n".join(lines)


def plot_goodput(results: dict, path: str) -> None:
    """Attainment of each mix's criterion against offered rate, a line per start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, p["mix"]) for t, res in results.items() for r in res.values() if "error" not in r
              for p in r["phases"] if p.get("kind") == "goodput"]
    panels = list(dict.fromkeys(panels))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (target, mix) in zip(axes[0], panels):
        for key, r in results[target].items():
            for p in r.get("phases", []):
                if p.get("kind") == "goodput" and p["mix"] == mix:
                    pts = sorted((x["rate"], x["attainment"][p["criterion"]]) for x in p["runs"])
                    ax.plot(*zip(*pts), marker="o", label=key, linestyle="--" if r["smoe"] else "-")
                    ax.axhline(p["goal"], color="gray", linewidth=0.5)
        ax.set_xscale("log")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("share of requests meeting the target")
        ax.set_title(f"{target}: {mix}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
