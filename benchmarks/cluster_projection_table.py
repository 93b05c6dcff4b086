"""Markdown table of `smoe-place evaluate --cluster` JSONs (benchmarks/cluster_projection.sh):
smoe's placement against vLLM's linear order and EPLB per backend, as time ratios.

    python benchmarks/cluster_projection_table.py docs/cluster-projection [--backends deepep-ht,deepep-ll]
"""

import argparse
import glob
import json
import os


def rows(path: str, backends: list[str]) -> list[str]:
    out = []
    for f in sorted(glob.glob(os.path.join(path, "*.json"))):
        d = json.load(open(f))
        smoe = next(k for k in d if k.startswith("placement"))
        for b in backends:
            if f"{b}:a2a_us" not in d[smoe]:
                continue
            s, lin, ep = (d[k][f"{b}:a2a_us"] for k in (smoe, "linear", "eplb"))
            moe = [d[k][f"{b}:moe_us"] for k in (smoe, "linear", "eplb")]
            rdma = d[smoe][f"{b}:rdma_bytes_per_token"] / max(d["linear"][f"{b}:rdma_bytes_per_token"], 1e-9)
            out.append(f"| {os.path.basename(f)[:-5]} | {b} | {s:.0f} | {lin:.0f} | {ep:.0f} | **{s / lin:.2f}** | "
                       f"**{s / ep:.2f}** | {rdma:.2f} | {moe[0] / moe[1]:.2f} | {moe[0] / moe[2]:.2f} | "
                       f"{d[smoe]['lar']:.3f} | {d[smoe]['expert_load']:.2f} / {d['eplb']['expert_load']:.2f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--backends", default="deepep-ht,deepep-ll,allgather-rs")
    a = p.parse_args()
    print("| run | backend | smoe a2a us | linear a2a us | EPLB a2a us | smoe / linear | smoe / EPLB | RDMA bytes "
          "smoe / linear | MoE layer smoe / linear | MoE layer smoe / EPLB | smoe LAR | expert load smoe / EPLB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for line in rows(a.path, a.backends.split(",")):
        print(line)


if __name__ == "__main__":
    main()
