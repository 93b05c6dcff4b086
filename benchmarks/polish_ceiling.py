"""What swaps of two experts can reach from a placement: polish it on one trace's routing and
score it, before and after, on the held-out trace with the routing known (the capped oracle,
what ``smoe-place evaluate --predictor router`` scores).

    python benchmarks/polish_ceiling.py --placement P.yaml [--fit train|heldout] [--evals N]
        [--max-expert-load X]

``--fit heldout`` polishes on the very rows it is scored on (a ceiling of the search, not a
result); ``--evals 0`` scores every swap until none gains. Placement/traces: the Qwen3-MoE
fixture's by default (``--train``, ``--heldout``). Prints per layer and the mean.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import yaml

from vllm_smoe.placement.polish import polish_routed, routed_local
from vllm_smoe.testbed import FIXTURE_TRACES


def _rows(path: str) -> tuple[np.ndarray, np.ndarray]:
    d = np.load(path)
    order = np.argsort(d["step_ids"], kind="stable")
    return d["topk_ids"][order].astype(np.int64), d["step_ids"][order]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placement", required=True, help="placement YAML (only its expert_to_rank is read)")
    ap.add_argument("--train", default=FIXTURE_TRACES["train"])
    ap.add_argument("--heldout", default=FIXTURE_TRACES["heldout"])
    ap.add_argument("--fit", choices=("train", "heldout"), default="train")
    ap.add_argument("--evals", type=int, default=190, help="exact scores per layer (0: until no swap gains)")
    ap.add_argument("--max-expert-load", type=float, default=1.10)
    a = ap.parse_args(argv)
    doc = yaml.safe_load(open(a.placement))
    N = int(doc["ep_size"])
    fit, fit_batch = _rows(a.train if a.fit == "train" else a.heldout)
    he, he_batch = _rows(a.heldout)
    out = []
    for layer, entry in enumerate(doc["layers"]):
        t0 = time.perf_counter()
        e0 = np.asarray(entry.get("expert_to_rank", entry.get("expert2rank")), dtype=np.int64)
        e1 = polish_routed(fit[:, layer], fit_batch, e0, N, max_expert_load=a.max_expert_load,
                           **({"shortlist": 10**9, "max_evals": 10**9} if a.evals == 0 else {"max_evals": a.evals}))
        before, after = (routed_local(he[:, layer], he_batch, e, N, 1.10) / he[:, layer].size for e in (e0, e1))
        out.append((before, after))
        print(f"layer {layer}: held-out LAR {before:.4f} -> {after:.4f}, {(e0 != e1).sum()} experts moved "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    o = np.array(out)
    print(f"mean over layers: {o[:, 0].mean():.4f} -> {o[:, 1].mean():.4f} (fit on {a.fit})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
