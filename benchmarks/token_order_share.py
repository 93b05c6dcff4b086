"""Local activation share of speculate's token orders on a trace, offline (no vLLM, CPU torch).

    python benchmarks/token_order_share.py --placement configs/tiny-4dom-ep2.yaml \
        --trace vllm_smoe/testbed/assets/traces/heldout.npz --step 64 [--json out.json]

Cuts the trace into steps of ``--step`` tokens and runs the served device code
(``vllm_smoe.serving.speculate.device_predict``: token tables, capped assignment at exactly vLLM's chunk
sizes) for three orders: one per MoE layer (Qwen3-MoE-style blocks), one per step voted over all
layers (the DeepSeek family, whose decoder layers keep rows split between layers), and the random
predictor; when the tables carry a learned predictor (``smoe-place build --learned``), its order
per layer (the network, or the token table where it is the more confident) and per step
(expected local activations summed over layers) too. The bigram table is not used here. Prints the share of
expert activations whose expert lives on the token's rank, and two bounds that know the step's
routing: ``oracle_per_layer`` (each layer's tokens to the ranks holding most of their experts
there, same cap) and ``oracle_per_step`` (one order for the whole step, by activations summed
over layers): what no predictor of one order per step can beat on this placement. And two
ceilings of predictors that see token ids only, fitted on the very trace they are scored on (so
no held-out loss): ``ceiling_token_*`` ranks each id by the activations it had on each rank over
the whole trace, ``ceiling_bigram_*`` each (previous id, id) pair, per layer and per step, same
cap: what any table or network of those inputs could reach at best on this trace.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from vllm_smoe.formats.placement_file import load_placement, load_tables
from vllm_smoe.placement.learned import LEARNED_FIELDS
from vllm_smoe.serving.speculate import device_predict
from vllm_smoe.formats.trace import open_trace


def _by_score(score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pref [L, T, 2], conf [L, T]) from score [L, T, N]: the two best ranks (lower rank on
    ties) and the best one's share of the score."""
    pref = torch.argsort(-score, dim=2, stable=True)[..., :2]
    return pref, score.gather(2, pref[..., :1])[..., 0] / score.sum(2).clamp_min(1e-9)


def _owners(topk: np.ndarray, expert2rank: np.ndarray) -> np.ndarray:
    """int64 [L, T, K]: the rank holding each activation. topk: int64 [T, L, K]; expert2rank:
    int64 [L, E]."""
    L = expert2rank.shape[0]
    owner = np.take_along_axis(expert2rank[None], topk.transpose(1, 0, 2).reshape(1, L, -1), 2)
    return owner.reshape(L, topk.shape[0], -1)


def _id_ceilings(ids: np.ndarray, prev: np.ndarray, owner: np.ndarray,
                 N: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per kind ("token": the id, "bigram": the (previous id, id) pair): (table float32 [L, U, N],
    key int64 [T] in [0, U)), where table[l, u, r] counts the activations that rows with key u
    had on rank r at layer l over the whole trace. ids, prev: int [T] (prev -1 at a request's
    first row); owner: int64 [L, T, K] (:func:`_owners`)."""
    L = owner.shape[0]
    out = {}
    for kind, raw in (("token", ids.astype(np.int64)),
                      ("bigram", (prev.astype(np.int64) + 1) * (int(ids.max()) + 1) + ids)):
        _, key = np.unique(raw, return_inverse=True)
        table = np.zeros((L, int(key.max()) + 1, N), np.float32)
        for layer in range(L):
            np.add.at(table[layer], (np.repeat(key, owner.shape[2]), owner[layer].reshape(-1)), 1.0)
        out[kind] = (table, key.reshape(-1))
    return out


def shares(placement_path: str, trace_path: str, step: int) -> dict[str, float]:
    placement = load_placement(placement_path)
    tables = load_tables(placement)
    trace = open_trace(trace_path)
    ids, topk = trace["token_ids"], trace["topk_ids"].astype(np.int64)  # [T], [T, L, K]
    N = placement.ep_size
    owners = _owners(topk, placement.expert2rank.astype(np.int64))  # [L, T, K]
    arrays = [torch.from_numpy(getattr(tables, k)) for k in ("token2rank", "token_conf", "prior2rank")]
    learned = None
    if tables.learned is not None:
        learned = [torch.from_numpy(getattr(tables.learned, k)) for k in LEARNED_FIELDS]
    positions = torch.from_numpy(trace["positions"].astype(np.int64))
    ceilings = _id_ceilings(ids, device_predict.previous_ids(torch.from_numpy(ids.astype(np.int64)), positions).numpy(),
                            owners, N)
    local = {"per_layer": 0, "per_step": 0, "random": 0, **({"learned_per_layer": 0, "learned_per_step": 0}
                                                             if learned else {}), "oracle_per_layer": 0,
             "oracle_per_step": 0, **{f"ceiling_{k}_{o}": 0 for k in ceilings for o in ("per_layer", "per_step")}}
    acts = 0
    for s in range(0, len(ids) - step + 1, step):
        i = torch.from_numpy(ids[s: s + step].astype(np.int64))
        owner = torch.from_numpy(np.ascontiguousarray(owners[:, s: s + step]))  # [L, T, K] activation ranks
        caps = device_predict.chunk_caps(step, N)
        pref, conf = device_predict.predict_token_tables(*arrays, i)
        orders = {"per_layer": device_predict.assign(pref, conf, caps)[..., None],
                  "per_step": device_predict.assign(*device_predict.vote(pref, conf, N), caps)[None, :, None],
                  "random": device_predict.assign(*device_predict.predict_random(i, 0, N), caps)[None, :, None]}
        if learned:  # the step's previous ids as serving takes them from its positions
            z = device_predict.learned_logits(*learned, i, device_predict.previous_ids(i, positions[s: s + step]))
            orders["learned_per_layer"] = device_predict.assign(*device_predict.learned_or_tables(pref, conf, *device_predict.learned_layers(z, N)),
                                                    caps)[..., None]
            orders["learned_per_step"] = device_predict.assign(*device_predict.learned_step(z, N), caps)[None, :, None]
        held = torch.zeros((owners.shape[0], step, N))  # [L, T, N]: the step's activations on each rank
        held.scatter_add_(2, owner, torch.ones(owner.shape))
        orders["oracle_per_layer"] = device_predict.assign(*_by_score(held), caps)[..., None]
        orders["oracle_per_step"] = device_predict.assign(*_by_score(held.sum(0, keepdim=True)), caps)[..., None]
        for kind, (table, key) in ceilings.items():
            score = torch.from_numpy(table[:, key[s: s + step]])  # [L, T, N]
            orders[f"ceiling_{kind}_per_layer"] = device_predict.assign(*_by_score(score), caps)[..., None]
            orders[f"ceiling_{kind}_per_step"] = device_predict.assign(*_by_score(score.sum(0, keepdim=True)), caps)[..., None]
        for name, t2r in orders.items():
            local[name] += int((owner == t2r).sum())
        acts += owner.numel()
    if not acts:
        raise ValueError(f"{trace_path}: fewer than --step {step} tokens")
    return {name: v / acts for name, v in local.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placement", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--step", type=int, default=64, help="tokens per step (default 64)")
    ap.add_argument("--json", help="write the shares here")
    a = ap.parse_args(argv)
    if a.step < 1:
        ap.error(f"--step must be >= 1, got {a.step}")
    try:
        out = shares(a.placement, a.trace, a.step)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, v in out.items():
        print(f"{name:18s} {v:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"placement": a.placement, "trace": a.trace, "step": a.step, **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
