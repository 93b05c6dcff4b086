"""How far any placement could cut DeepEP high-throughput's RDMA rows on a trace, over 2 nodes:
the share of tokens whose whole expert set fits on one node, for the best 32/32 expert split a
swap hill-climb finds on the training trace (4 random starts per layer), judged on held-out rows.
Under deepep-ht a token crosses RDMA once unless every expert it routes to is on its own node, so
RDMA rows per token >= 1 - that share (linear order: ~1.0).

    python benchmarks/node_closure_ceiling.py TRAIN.npz HELDOUT.npz
"""

import sys

import numpy as np

from vllm_smoe.formats.trace import open_trace


def closed_share(topk: np.ndarray, side: np.ndarray) -> float:
    s = side[topk]
    return float((s == s[:, :1]).all(axis=1).mean())


def best_split(topk: np.ndarray, rng: np.random.Generator, starts: int = 4) -> np.ndarray:
    E = int(topk.max()) + 1
    m = np.zeros(len(topk), dtype=np.uint64)
    for j in range(topk.shape[1]):
        m |= np.left_shift(np.uint64(1), topk[:, j].astype(np.uint64))
    u, c = np.unique(m, return_counts=True)

    def score(side):
        one = np.uint64(0)
        for e in np.flatnonzero(side):
            one |= np.uint64(1) << np.uint64(e)
        return c[((u & one) == 0) | ((u & ~one) == 0)].sum()

    best = None
    for _ in range(starts):
        side = np.zeros(E, dtype=np.int64)
        side[rng.permutation(E)[: E // 2]] = 1
        cur, improved = score(side), True
        while improved:  # first-improvement swaps until none helps
            improved = False
            for a in rng.permutation(np.flatnonzero(side == 0)):
                for b in rng.permutation(np.flatnonzero(side == 1)):
                    side[a], side[b] = 1, 0
                    s = score(side)
                    if s > cur:
                        cur, improved = s, True
                        break
                    side[a], side[b] = 0, 1
        if best is None or cur > best[0]:
            best = (cur, side.copy())
    return best[1]


def main() -> None:
    tr, te = open_trace(sys.argv[1])["topk_ids"], open_trace(sys.argv[2])["topk_ids"]
    rng = np.random.default_rng(0)
    E = int(tr.max()) + 1
    for layer in range(tr.shape[1]):
        side = best_split(tr[:, layer], rng)
        print(f"layer {layer}: one node holds every expert of {closed_share(tr[:, layer], side):.3f} of training "
              f"tokens, {closed_share(te[:, layer], side):.3f} held out (linear order: "
              f"{closed_share(te[:, layer], (np.arange(E) >= E // 2).astype(np.int64)):.3f})", flush=True)


if __name__ == "__main__":
    main()
