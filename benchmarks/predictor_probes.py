"""Two predictors tried offline for the token order and not built (BENCHMARKS.md, "What one order
per step can reach at all"); kept so that their numbers can be reproduced.

    python benchmarks/predictor_probes.py layer0 --placement P.yaml --train TRAIN.npz --heldout HELDOUT.npz
    python benchmarks/predictor_probes.py context --placement P.yaml --model MODEL_DIR
    python benchmarks/predictor_probes.py hidden --placement P2.yaml P4.yaml P8.yaml --model MODEL_DIR \
        --train TRAIN.npz --heldout HELDOUT.npz [--leave-out-domains]

``layer0``: one order per step, scored on the held-out trace in 64-token steps at vLLM's chunk
caps, from (a) the learned predictor's summed softmax (as served), (b) the first MoE layer's
routing known exactly plus the network's softmax for the other layers, (c) that plus a layer-0
expert -> layer-l rank co-occurrence table from the training trace instead of the network.
The placement must carry a learned predictor (``smoe-place build --learned``).
``context``: the learned network (same width rule, 6 epochs, Adam 3e-3, soft cross-entropy) with
and without a third input, the mean input embedding of the earlier rows of the same request in
the 64-row step; prints the held-out share of activations local per layer (network alone).
``hidden``: per-layer predictors that see the hidden state at the MoE layer's *input* (before its
attention, the rows every rank holds whole before the attention's reduce-scatter): ``ahead``, the
layer's own gate on that input after the layer's post-attention norm (no training); ``mlp``, that
gate plus a two-layer network (width 256, SiLU, 8 epochs, AdamW 2e-3, soft cross-entropy on the
router's top-k) trained on the training trace's rows; ``input_gate``, the served predictor of that name:
the first MoE layer from the id count table, the others ``ahead``'s top-k or the table where it is
the more confident; ``mix``, the mean of
``ahead``'s and a token-id count table's expert distributions. Each rank score sums its experts' probabilities.
Against the served token tables, an id count table from the same training rows, and the capped
oracle; with ``--leave-out-domains``, each workload's held-out rows scored by predictors trained
on the other workloads' training rows. Runs the checkpoint in transformers over every recorded
request (Qwen3-MoE-style softmax routers with ``mlp.gate``).
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
    from vllm_smoe.serving.speculate import device_predict

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
        caps = device_predict.chunk_caps(STEP, N)
        z = device_predict.learned_logits(*net, i, device_predict.previous_ids(i, pos[s: s + STEP]))
        soft = torch.softmax(z.view(STEP, L, N), 2)
        co = M[1:][:, t[:, 0]].mean(2).permute(1, 0, 2)  # [T, L-1, N]
        scores = {"learned_per_step": None, "layer0_exact_plus_network": cnt[0] / K + soft[:, 1:].sum(1),
                  "layer0_exact_plus_cooccurrence": cnt[0] / K + co.sum(1)}
        for name, score in scores.items():
            pref, conf = device_predict.learned_step(z, N) if score is None else _by_score(score)
            local[name] += int((owner == device_predict.assign(pref[None], conf[None], caps)[..., None]).sum())
        acts += owner.numel()
    for name, v in local.items():
        print(f"{name:32s} {v / acts:.3f}")


def context(a) -> None:
    from safetensors.numpy import load_file

    from vllm_smoe.formats.placement_file import load_placement
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.placement.learned import default_width, layer_targets
    from vllm_smoe.serving.speculate import device_predict
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
        prev = device_predict.previous_ids(ids, torch.from_numpy(tr["positions"].astype(np.int64)))
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
                t2r = device_predict.assign(pref, torch.softmax(zz, 2).amax(2), device_predict.chunk_caps(STEP, N))
                o = owner[:, s: s + STEP]
                loc += int((o == t2r[..., None]).sum())
                acts += o.numel()
        print(f"{'with' if use_ctx else 'without'} the step's context: held-out share per layer {loc / acts:.4f}")


def _hidden_inputs(model_dir: str, trace) -> tuple[np.ndarray, np.ndarray]:
    """(X float32 [T, L, H]: each MoE layer's input rows after that layer's post-attention norm,
    gates float32 [L, E, H]) from the checkpoint run in transformers over each recorded request."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = m.model.layers
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
    if not moe or not hasattr(layers[moe[0]].mlp.gate, "weight"):
        raise ValueError(f"{model_dir}: no MoE layer with a linear mlp.gate (Qwen3-MoE-style blocks only)")
    H = m.config.hidden_size
    seen = {}
    for j, i in enumerate(moe):
        layers[i].register_forward_pre_hook(
            lambda mod, args, kwargs, j=j: seen.__setitem__(j, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True)
    ids, req, pos = trace["token_ids"], trace["request_ids"], trace["positions"]
    X = np.zeros((len(ids), len(moe), H), np.float32)
    with torch.no_grad():
        for r in np.unique(req):
            rows = np.nonzero(req == r)[0]
            rows = rows[np.argsort(pos[rows], kind="stable")]
            m(torch.from_numpy(ids[rows].astype(np.int64))[None])
            for j, i in enumerate(moe):
                X[rows, j] = layers[i].post_attention_layernorm(seen[j].reshape(-1, H)).numpy()
        gates = np.stack([layers[i].mlp.gate.weight.numpy() for i in moe])
    return X, gates


def _train_hidden(X: torch.Tensor, topk: torch.Tensor, gate: torch.Tensor, width: int = 256,
                  epochs: int = 8) -> torch.nn.Module:
    """One layer's network: logits = X @ gate.T + net(X), fitted to the router's top-k."""
    torch.manual_seed(0)
    E, K = gate.shape[0], topk.shape[1]
    net = torch.nn.Sequential(torch.nn.Linear(X.shape[1], width), torch.nn.SiLU(), torch.nn.Linear(width, E))
    opt = torch.optim.AdamW(net.parameters(), 2e-3, weight_decay=1e-4)
    target = torch.zeros(X.shape[0], E).scatter_(1, topk, 1.0 / K)
    base = X @ gate.T
    for _ in range(epochs):
        order = torch.randperm(X.shape[0])
        for s in range(0, order.numel(), 512):
            r = order[s: s + 512]
            loss = -(target[r] * torch.log_softmax(base[r] + net(X[r]), -1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net


def _id_table(ids: np.ndarray, topk: np.ndarray, V: int, E: int) -> np.ndarray:
    """float32 [V, L, E]: each id's expert distribution on the rows given, smoothed by the prior."""
    L, K = topk.shape[1], topk.shape[2]
    tab = np.zeros((V, L, E))
    for j in range(L):
        for k in range(K):
            np.add.at(tab[:, j], (ids, topk[:, j, k]), 1)
    prior = tab.sum(0, keepdims=True)
    tab += prior / prior.sum(-1, keepdims=True)
    return (tab / tab.sum(-1, keepdims=True)).astype(np.float32)


def _shares(probs: dict, topk: torch.Tensor, e2r: torch.Tensor, N: int, step: int = STEP) -> dict[str, int]:
    """Local activations of each predictor's per-layer order (expert distributions [T, L, E])
    and of the oracle, in steps of ``step`` rows at vLLM's chunk caps; "acts" the activations."""
    T, L, K = topk.shape
    E = e2r.shape[1]
    from vllm_smoe.serving.speculate import device_predict

    local = dict.fromkeys(["oracle", *probs, "acts"], 0)
    for s in range(0, T - step + 1, step):
        t = topk[s: s + step]
        owner = torch.stack([e2r[j][t[:, j]] for j in range(L)])  # [L, step, K]
        caps = device_predict.chunk_caps(step, N)
        def scored(pe):  # [step, L, E] expert distribution -> (pref, conf) per layer
            return _by_score(torch.stack([torch.zeros(step, N).index_add_(1, e2r[j], pe[:, j]) for j in range(L)]))

        for name in ["oracle", *probs]:
            if name == "oracle":
                pref, conf = scored(torch.zeros(step, L, E).scatter_(2, t, 1.0 / K))
            elif isinstance(probs[name], tuple):  # (table, predictor): the table where it is the surer
                pref, conf = device_predict.learned_or_tables(*scored(probs[name][0][s: s + step]),
                                                  *scored(probs[name][1][s: s + step]))
            else:
                pref, conf = scored(probs[name][s: s + step])
            local[name] += int((owner == device_predict.assign(pref, conf, caps)[..., None]).sum())
        local["acts"] += owner.numel()
    return local


def hidden(a) -> None:
    from vllm_smoe.formats.placement_file import load_placement, load_tables
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.serving.speculate import device_predict

    train, held = open_trace(a.train), open_trace(a.heldout)
    Xtr, gates = _hidden_inputs(a.model, train)
    Xte, _ = _hidden_inputs(a.model, held)
    Xtr, Xte, gates = torch.from_numpy(Xtr), torch.from_numpy(Xte), torch.from_numpy(gates)
    ktr = torch.from_numpy(train["topk_ids"].astype(np.int64))
    kte = torch.from_numpy(held["topk_ids"].astype(np.int64))
    ids_tr, ids_te = train["token_ids"].astype(np.int64), held["token_ids"].astype(np.int64)
    L, E = gates.shape[:2]
    K = ktr.shape[2]
    V = int(max(ids_tr.max(), ids_te.max())) + 1
    ahead = torch.stack([torch.softmax(Xte[:, j] @ gates[j].T, -1) for j in range(L)], 1)  # [T, L, E]

    def fitted(rows_tr: np.ndarray, rows_te: np.ndarray) -> dict[str, torch.Tensor]:
        nets = [_train_hidden(Xtr[rows_tr, j], ktr[rows_tr, j], gates[j]) for j in range(L)]
        with torch.no_grad():
            mlp = torch.stack([torch.softmax(Xte[rows_te, j] @ gates[j].T + nets[j](Xte[rows_te, j]), -1)
                               for j in range(L)], 1)
        table = torch.from_numpy(_id_table(ids_tr[rows_tr], ktr[rows_tr].numpy(), V, E)[ids_te[rows_te]])
        # as served (predictor input-gate): the first layer from the id table, the others the gate's
        # top-k on the layer's input (each rank scored by its count of them), or the table where
        # its best rank's share is the larger (_shares decides, per placement)
        top = ahead[rows_te].topk(K, dim=2).indices
        gate_topk = torch.zeros_like(table).scatter_(2, top, 1.0 / K)
        gate_topk[:, 0] = table[:, 0]
        return {"id_table": table, "ahead": ahead[rows_te], "input_gate": (table, gate_topk),
                "mix": (ahead[rows_te] + table) / 2, "mlp": mlp}

    placements = [load_placement(p) for p in a.placement]
    if not a.leave_out_domains:
        probs = fitted(np.arange(len(ids_tr)), np.arange(len(ids_te)))
        for path, p in zip(a.placement, placements):
            N, tables = p.ep_size, load_tables(p)
            pref = [torch.from_numpy(getattr(tables, k)) for k in ("token2rank", "token_conf", "prior2rank")]
            served = 0
            for s in range(0, len(ids_te) - STEP + 1, STEP):  # the served token tables, as in token_order_share
                i = torch.from_numpy(ids_te[s: s + STEP])
                t2r = device_predict.assign(*device_predict.predict_token_tables(*pref, i), device_predict.chunk_caps(STEP, N))
                owner = torch.stack([torch.from_numpy(p.expert2rank.astype(np.int64))[j][kte[s: s + STEP, j]]
                                     for j in range(L)])
                served += int((owner == t2r[..., None]).sum())
            local = _shares(probs, kte, torch.from_numpy(p.expert2rank.astype(np.int64)), N)
            local["served_tables"] = served
            print(f"{path} (EP {N}): " + ", ".join(
                f"{k} {v / local['acts']:.3f} ({v / local['oracle']:.3f})" for k, v in local.items() if k != "acts"))
        return
    dom_tr, dom_te = train["domain"], held["domain"]
    totals = [dict() for _ in placements]
    for d in np.unique(dom_te):
        probs = fitted(np.nonzero(dom_tr != d)[0], np.nonzero(dom_te == d)[0])
        for tot, p in zip(totals, placements):
            local = _shares(probs, kte[dom_te == d], torch.from_numpy(p.expert2rank.astype(np.int64)), p.ep_size)
            for k, v in local.items():
                tot[k] = tot.get(k, 0) + v
    for path, p, tot in zip(a.placement, placements, totals):
        print(f"{path} (EP {p.ep_size}), each workload left out: " + ", ".join(
            f"{k} {v / tot['acts']:.3f} ({v / tot['oracle']:.3f})" for k, v in tot.items() if k != "acts"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn in (("layer0", layer0), ("context", context), ("hidden", hidden)):
        s = sub.add_parser(name)
        s.add_argument("--placement", required=True, nargs="+" if name == "hidden" else None)
        s.add_argument("--train", required=name in ("layer0", "hidden"))
        s.add_argument("--heldout", required=name in ("layer0", "hidden"))
        if name == "hidden":
            s.add_argument("--model", required=True, help="checkpoint directory, run in transformers")
            s.add_argument("--leave-out-domains", action="store_true")
        if name == "context":
            s.add_argument("--model", required=True, help="checkpoint directory (input embeddings)")
        s.set_defaults(fn=fn)
    a = ap.parse_args(argv)
    a.fn(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
