"""Two predictors tried offline for the token order and not built (BENCHMARKS.md, "What one order
per step can reach at all"); kept so that their numbers can be reproduced.

    python benchmarks/predictor_probes.py layer0 --placement P.yaml --train TRAIN.npz --heldout HELDOUT.npz
    python benchmarks/predictor_probes.py context --placement P.yaml --model MODEL_DIR

``layer0``: one order per step, scored on the held-out trace in 64-token steps at vLLM's chunk
caps, from (a) the learned predictor's summed softmax (as served), (b) the first MoE layer's
routing known exactly plus the network's softmax for the other layers, (c) that plus a layer-0
expert -> layer-l rank co-occurrence table from the training trace instead of the network.
The placement must carry a learned predictor (``smoe-place build --learned``).
``context``: the learned network (same width rule, 6 epochs, Adam 3e-3, soft cross-entropy) with
and without a third input, the mean input embedding of the earlier rows of the same request in
the 64-row step; prints the held-out share of activations local per layer (network alone).
CPU torch; no vLLM.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

STEP = 64


def _owner_counts(e2r: torch.Tensor, topk: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """owner [L, T, K] home rank of each activation; held [L, T, N] activations on each rank."""
    L = e2r.shape[0]
    T, _, K = topk.shape
    owner = e2r.gather(1, topk.permute(1, 0, 2).reshape(L, -1)).view(L, T, K)
    held = torch.zeros(L, T, N)
    held.scatter_add_(2, owner, torch.ones(owner.shape))
    return owner, held


def _by_score(score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pref = torch.argsort(-score, dim=-1, stable=True)[..., :2]
    return pref, score.gather(-1, pref[..., :1])[..., 0] / score.sum(-1).clamp_min(1e-9)


def layer0(a) -> None:
    from vllm_smoe.formats.placement_file import load_placement, load_tables
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.placement.learned import LEARNED_FIELDS
    from vllm_smoe.serving import device_predict as dp

    p = load_placement(a.placement)
    tables = load_tables(p)
    N, e2r = p.ep_size, p.expert2rank.astype(np.int64)
    L, E = e2r.shape
    train, held = open_trace(a.train), open_trace(a.heldout)
    tk = train["topk_ids"].astype(np.int64)
    M = np.zeros((L, E, N))  # [L, E, N]: layer-l activations on rank n of tokens with expert e at layer 0
    for layer in range(1, L):
        cnt = np.zeros((tk.shape[0], N))
        np.add.at(cnt, (np.arange(tk.shape[0])[:, None], e2r[layer][tk[:, layer]]), 1)
        for k in range(tk.shape[2]):
            np.add.at(M[layer], tk[:, 0, k], cnt)
    M = torch.from_numpy(M / np.maximum(M.sum(2, keepdims=True), 1)).float()
    net = [torch.from_numpy(getattr(tables.learned, k)) for k in LEARNED_FIELDS]
    ids, topk = held["token_ids"], held["topk_ids"].astype(np.int64)
    pos = torch.from_numpy(held["positions"].astype(np.int64))
    e2rt = torch.from_numpy(e2r)
    local = {"learned_per_step": 0, "layer0_exact_plus_network": 0, "layer0_exact_plus_cooccurrence": 0}
    acts = 0
    for s in range(0, len(ids) - STEP + 1, STEP):
        i = torch.from_numpy(ids[s: s + STEP].astype(np.int64))
        t = torch.from_numpy(topk[s: s + STEP])
        owner, cnt = _owner_counts(e2rt, t, N)
        K = t.shape[2]
        caps = dp.chunk_caps(STEP, N)
        z = dp.learned_logits(*net, i, dp.previous_ids(i, pos[s: s + STEP]))
        soft = torch.softmax(z.view(STEP, L, N), 2)
        co = M[1:][:, t[:, 0]].mean(2).permute(1, 0, 2)  # [T, L-1, N]
        scores = {"learned_per_step": None, "layer0_exact_plus_network": cnt[0] / K + soft[:, 1:].sum(1),
                  "layer0_exact_plus_cooccurrence": cnt[0] / K + co.sum(1)}
        for name, score in scores.items():
            pref, conf = dp.learned_step(z, N) if score is None else _by_score(score)
            local[name] += int((owner == dp.assign(pref[None], conf[None], caps)[..., None]).sum())
        acts += owner.numel()
    for name, v in local.items():
        print(f"{name:32s} {v / acts:.3f}")


def context(a) -> None:
    from safetensors.numpy import load_file

    from vllm_smoe.formats.placement_file import load_placement
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.placement.learned import default_width, layer_targets
    from vllm_smoe.serving import device_predict as dp
    from vllm_smoe.testbed import FIXTURE_TRACES

    p = load_placement(a.placement)
    N, e2r = p.ep_size, p.expert2rank.astype(np.int64)
    L, E = e2r.shape
    holds = np.zeros((L, N, E), bool)
    for layer in range(L):
        holds[layer, e2r[layer], np.arange(E)] = True
    w = load_file(f"{a.model}/model.safetensors")
    emb = torch.from_numpy(next(v for k, v in w.items() if "embed_tokens" in k)).float()
    emb = emb / emb.pow(2).sum(1).mean().sqrt()

    def feats(tr):
        ids = torch.from_numpy(tr["token_ids"].astype(np.int64))
        req = torch.from_numpy(tr["request_ids"].astype(np.int64))
        prev = dp.previous_ids(ids, torch.from_numpy(tr["positions"].astype(np.int64)))
        x = emb[ids]
        xp = torch.where(prev[:, None] >= 0, emb[prev.clamp_min(0)], torch.zeros(1, emb.shape[1]))
        ctx = torch.zeros_like(x)  # mean of the earlier rows of the same request in the step
        for s in range(0, ids.numel(), STEP):
            r = req[s: s + STEP]
            same = ((r[:, None] == r[None, :]) & torch.tril(torch.ones(len(r), len(r), dtype=torch.bool), -1)).float()
            ctx[s: s + STEP] = (same @ x[s: s + STEP]) / same.sum(1, keepdim=True).clamp_min(1)
        return x, xp, ctx, torch.from_numpy(layer_targets(tr["topk_ids"], holds))

    train, held = open_trace(a.train or FIXTURE_TRACES["train"]), open_trace(a.heldout or FIXTURE_TRACES["heldout"])
    Xtr, Xte = feats(train), feats(held)
    owner = torch.from_numpy(np.stack([e2r[layer][held["topk_ids"][:, layer].astype(np.int64)] for layer in range(L)]))
    for use_ctx in (False, True):
        torch.manual_seed(0)
        D, H = default_width(N), emb.shape[1]
        net = torch.nn.ModuleDict({"t": torch.nn.Linear(H, D), "p": torch.nn.Linear(H, D, bias=False),
                                   "c": torch.nn.Linear(H, D, bias=False), "o": torch.nn.Linear(D, L * N)})
        opt = torch.optim.AdamW(net.parameters(), 3e-3, weight_decay=1e-4)

        def fwd(X):
            h = net["t"](X[0]) + net["p"](X[1]) + (net["c"](X[2]) if use_ctx else 0)
            return net["o"](torch.relu(h)).view(-1, L, N)

        for _ in range(6):
            order = torch.randperm(Xtr[0].shape[0])
            for s in range(0, order.numel(), 1024):
                rows = order[s: s + 1024]
                loss = -(Xtr[3][rows] * torch.log_softmax(fwd([x[rows] for x in Xtr]), 2)).sum(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            z = fwd(Xte)
            loc = acts = 0
            for s in range(0, z.shape[0] - STEP + 1, STEP):
                zz = z[s: s + STEP].permute(1, 0, 2)
                pref = torch.argsort(-zz, dim=2, stable=True)[..., :2]
                t2r = dp.assign(pref, torch.softmax(zz, 2).amax(2), dp.chunk_caps(STEP, N))
                o = owner[:, s: s + STEP]
                loc += int((o == t2r[..., None]).sum())
                acts += o.numel()
        print(f"{'with' if use_ctx else 'without'} the step's context: held-out share per layer {loc / acts:.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn in (("layer0", layer0), ("context", context)):
        s = sub.add_parser(name)
        s.add_argument("--placement", required=True)
        s.add_argument("--train", required=name == "layer0")
        s.add_argument("--heldout", required=name == "layer0")
        if name == "context":
            s.add_argument("--model", required=True, help="checkpoint directory (input embeddings)")
        s.set_defaults(fn=fn)
    a = ap.parse_args(argv)
    a.fn(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
