"""PNG figures and an HTML page for ``smoe-place report`` (matplotlib, Agg backend)."""

from __future__ import annotations

import html
import os

import numpy as np

from ..placement.counts import rank_sizes


def _coactivation(topk_layer: np.ndarray, num_experts: int) -> np.ndarray:
    """[E, E] same-token co-activation counts of one layer (topk_layer: [T, K])."""
    K = topk_layer.shape[1]
    a = np.repeat(topk_layer, K, axis=1).reshape(-1).astype(np.int64)
    b = np.tile(topk_layer, (1, K)).reshape(-1).astype(np.int64)
    C = np.bincount(a * num_experts + b, minlength=num_experts ** 2).reshape(num_experts, num_experts)
    np.fill_diagonal(C, 0)
    return C


def write_report(out_dir: str, results: dict[str, dict], placement, topk_ids: np.ndarray, num_experts: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, m in results.items():
        ax.plot(range(len(m["lar_per_layer"])), m["lar_per_layer"], marker="o", label=name)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("local activation rate")
    ax.set_title("LAR per layer")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "lar_per_layer.png"), dpi=110)
    plt.close(fig)
    figs.append(("lar_per_layer.png", "Local activation rate per MoE layer, per method."))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(results)
    N = len(results[names[0]]["rank_tokens"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        for ax, key in zip(axes, ("rank_tokens", "rank_compute")):
            v = np.asarray(results[name][key], dtype=float)
            ax.bar(np.arange(N) + i * width, v / v.mean(), width, label=name)
    for ax, title in zip(axes, ("tokens per rank / mean", "activations computed per rank / mean")):
        ax.set_title(title)
        ax.set_xlabel("rank")
        ax.axhline(1.0, color="k", lw=0.5)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "rank_loads.png"), dpi=110)
    plt.close(fig)
    figs.append(("rank_loads.png", "Token load and expert (compute) load per rank, over the whole trace."))

    backends = sorted({k.split(":")[0] for m in results.values() for k in m if k.endswith(":a2a_us")})
    if backends:  # evaluate --cluster: projected time per MoE layer, all-to-all apart from experts
        names = list(results)
        fig, axes = plt.subplots(1, len(backends), figsize=(5 * len(backends), 4), squeeze=False)
        for ax, b in zip(axes[0], backends):
            a2a = [results[n].get(f"{b}:a2a_us", np.nan) for n in names]
            exp = [results[n].get(f"{b}:expert_us", np.nan) for n in names]
            ax.bar(range(len(names)), a2a, label="dispatch + combine")
            ax.bar(range(len(names)), exp, bottom=a2a, label="experts (busiest rank)", alpha=0.6)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel("projected us per MoE layer")
            ax.set_title(f"{b}" + ("" if results[names[0]].get(f"{b}:calibrated") else " (not calibrated)"))
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "cluster_cost.png"), dpi=110)
        plt.close(fig)
        figs.append(("cluster_cost.png", "Projected time per MoE layer on the --cluster given, per backend "
                     "(a projection: docs/cluster-model.md says what it assumes)."))

    C = _coactivation(topk_ids[:, 0, :], num_experts).astype(float)
    order = np.argsort(placement.expert2rank[0], kind="stable")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    axes[0].imshow(np.log1p(C), cmap="viridis")
    axes[0].set_title("layer 0 co-activation, expert id order")
    axes[1].imshow(np.log1p(C[order][:, order]), cmap="viridis")
    for edge in np.cumsum(rank_sizes(num_experts, placement.ep_size))[:-1]:
        axes[1].axhline(edge - 0.5, color="w", lw=0.8)
        axes[1].axvline(edge - 0.5, color="w", lw=0.8)
    axes[1].set_title(f"grouped by rank ({placement.method})")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "coactivation.png"), dpi=110)
    plt.close(fig)
    figs.append(("coactivation.png", "Expert co-activation (log scale) before and after placement: "
                 "after placement the mass should sit in the diagonal blocks (one block per rank)."))

    keys = ("lar", "token_load", "expert_load", "remote_pairs_per_token", "remote_unique_per_token",
            "a2a_bytes_per_token", "hit_rate", "oracle_hit_rate", "solve_seconds")
    rows = "".join(
        "<tr><td>" + html.escape(n) + "</td>" + "".join(
            f"<td>{m[k]:.3f}</td>" if isinstance(m.get(k), float) else "<td>-</td>" for k in keys) + "</tr>"
        for n, m in results.items())
    page = os.path.join(out_dir, "index.html")
    with open(page, "w") as f:
        f.write("<!doctype html><html><head><meta charset='utf-8'><title>smoe placement report</title>"
                "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 8px;text-align:right}"
                "td:first-child{text-align:left}</style></head><body>")
        f.write(f"<h1>smoe placement report</h1><p>placement: {html.escape(placement.path)} "
                f"(method {html.escape(placement.method)}, ep_size {placement.ep_size})</p>")
        f.write("<table><tr><th>method</th>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr>" + rows + "</table>")
        for png, caption in figs:
            f.write(f"<figure><img src='{png}'><figcaption>{html.escape(caption)}</figcaption></figure>")
        f.write("</body></html>")
    return page
