"""Token -> rank prediction and the capped assignment on the device (pure torch, no vLLM).

The same arbitration as :func:`vllm_smoe.placement.predict.predict_layer` and the same greedy
as :func:`vllm_smoe.placement.assign.assign_tokens` (tests check both against numpy), written
with static shapes only (gathers, stable sorts, scans, scatters): no host synchronisation, so a
step can run under torch.compile or inside a CUDA graph. Notation: T tokens of a step, N ranks,
P preferences per token.
"""

from __future__ import annotations

import torch


def arbitrate(cands: list[tuple[torch.Tensor, torch.Tensor]], prior: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the candidate with the highest confidence (first on ties), the layer prior when
    none has data. cands: [(ranks [T, 2] int, -1 = no data; conf [T] float32)]; prior: [2] int.
    Returns (pref [T, 2] int64, conf [T] float32 >= 0)."""
    T = cands[0][0].shape[0]
    confs = torch.stack([torch.where(r[:, 0] >= 0, c.float(), torch.full_like(c.float(), -2.0)) for r, c in cands]
                        + [torch.full((T,), -1.0, device=prior.device)])
    prefs = torch.stack([r.long() for r, _ in cands] + [prior.long().expand(T, 2)])  # [C, T, 2]
    source = confs.argmax(dim=0)  # [T]
    pref = prefs.gather(0, source.view(1, T, 1).expand(1, T, 2))[0]
    conf = confs.gather(0, source.view(1, T))[0].clamp_min(0.0)
    return pref, conf


def previous_ids(token_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """[T] int64 id of the previous row where it continues the row's sequence (its position one
    less), else -1: :func:`vllm_smoe.placement.predict.previous_ids` for one step."""
    ids = token_ids.long()
    T = ids.shape[0]
    if positions is None or T < 2:
        return torch.full((T,), -1, dtype=torch.long, device=ids.device)
    pos = positions.long()
    ok = torch.cat([torch.zeros(1, dtype=torch.bool, device=ids.device), pos[1:] == pos[:-1] + 1])
    return torch.where(ok, torch.cat([ids[:1], ids[:-1]]), -1)


def bigram_query(token_ids: torch.Tensor, positions: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[T] int64 bigram key of each row (previous id * V + id), -1 where the previous row does not
    continue the row's sequence (:func:`previous_ids`)."""
    prev = previous_ids(token_ids, positions)
    return torch.where(prev >= 0, prev * vocab_size + token_ids.long(), -1)


def learned_logits(token_proj: torch.Tensor, prev_proj: torch.Tensor, hidden_bias: torch.Tensor,
                   out_weight: torch.Tensor, out_bias: torch.Tensor, token_ids: torch.Tensor,
                   prev_ids: torch.Tensor) -> torch.Tensor:
    """The learned predictor's [T, L * N] float32 scores (twin of
    :func:`vllm_smoe.placement.learned.forward`): two gathers and one GEMM. token_proj [V, D],
    prev_proj [V + 1, D] (row V: no previous id; any float dtype, summed as float32),
    hidden_bias [D], out_weight [D, L * N], out_bias [L * N]; token_ids [T] int; prev_ids [T]
    int, -1 = none."""
    V = token_proj.shape[0]
    prev = torch.where(prev_ids >= 0, prev_ids.long(), V)
    h = (token_proj[token_ids.long()].float() + prev_proj[prev].float() + hidden_bias).clamp_min(0.0)
    return torch.addmm(out_bias, h, out_weight)


def learned_layers(logits: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's preference from :func:`learned_logits` (twin of
    :func:`vllm_smoe.placement.learned.preferences`). Returns (pref [L, T, min(2, N)] int64,
    conf [L, T] float32, the best rank's softmax probability)."""
    T = logits.shape[0]
    z = logits.view(T, logits.shape[1] // num_ranks, num_ranks).transpose(0, 1)  # [L, T, N]
    pref = torch.argsort(-z, dim=2, stable=True)[..., : min(2, num_ranks)]
    return pref, 1.0 / torch.exp(z - z.amax(dim=2, keepdim=True)).sum(dim=2)


def learned_or_tables(table_pref: torch.Tensor, table_conf: torch.Tensor, pref: torch.Tensor, conf: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' preference where they are the more confident, else the network's (twin of
    :func:`vllm_smoe.placement.learned.with_tables`). table_pref [L, T, 2], table_conf [L, T];
    pref [L, T, P], conf [L, T]. Returns (pref [L, T, P] int64, conf [L, T] float32)."""
    use = table_conf.float() > conf
    return (torch.where(use[..., None], table_pref[..., : pref.shape[-1]].long(), pref),
            torch.maximum(table_conf.float(), conf))


def learned_step(logits: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One preference per token for the whole step: ranks by expected local activations summed
    over layers (twin of :func:`vllm_smoe.placement.learned.step_preferences`).
    Returns (pref [T, min(2, N)] int64, conf [T] float32)."""
    T = logits.shape[0]
    z = logits.view(T, logits.shape[1] // num_ranks, num_ranks)
    score = torch.softmax(z, dim=2).sum(dim=1)  # [T, N]
    pref = torch.argsort(-score, dim=1, stable=True)[:, : min(2, num_ranks)]
    return pref, score.gather(1, pref[:, :1])[:, 0] / z.shape[1]


def bigram_override(pref: torch.Tensor, conf: torch.Tensor, bigram: tuple | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The token table's rows, replaced by the bigram table's where the row's pair is in it.
    pref: [L, T, 2] int; conf: [L, T] float; bigram: (keys [M] int64 increasing, bigram2rank
    [L, M, 2] int, bigram_conf [L, M] float, query [T] int64 from :func:`bigram_query`) or None."""
    if bigram is None:
        return pref, conf
    keys, b2r, bconf, query = bigram
    j = torch.searchsorted(keys, query.clamp_min(0)).clamp_max(keys.shape[0] - 1)
    hit = (query >= 0) & (keys[j] == query)  # [T]
    return (torch.where(hit[None, :, None], b2r[:, j].long(), pref.long()),
            torch.where(hit[None], bconf[:, j].float(), conf.float()))


def predict_tables(token2rank: torch.Tensor, token_conf: torch.Tensor, markov2rank: torch.Tensor,
                   markov_conf: torch.Tensor, prior2rank: torch.Tensor, token_ids: torch.Tensor,
                   prev_top1: torch.Tensor | None, bigram: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of the placement's tables: token2rank [V, 2] int, token_conf [V] float,
    markov2rank [E, 2] int, markov_conf [E] float, prior2rank [2] int; token_ids: [T] int;
    prev_top1: [T] int logical top-1 expert of the previous MoE layer, None at the first;
    bigram: this layer's :func:`bigram_override` argument (bigram2rank [1, M, 2], bigram_conf [1, M]).
    Returns (pref [T, 2] int64, -1 = none; conf [T] float32)."""
    T = token_ids.shape[0]
    none = (torch.full((T, 2), -1, dtype=torch.long, device=token_ids.device),
            torch.zeros(T, device=token_ids.device))
    ids = token_ids.long()
    r, c = bigram_override(token2rank[ids][None], token_conf[ids].float()[None], bigram)
    cands = [(r[0], c[0])]
    if prev_top1 is not None:
        prev = prev_top1.long()
        cands.append((markov2rank[prev], markov_conf[prev].float()))
    else:
        cands.append(none)
    cands.append(none)  # the request (prefill -> decode) table is not served online
    return arbitrate(cands, prior2rank)


def predict_token_tables(token2rank: torch.Tensor, token_conf: torch.Tensor, prior2rank: torch.Tensor,
                         token_ids: torch.Tensor, bigram: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer at once from the token table alone (what :func:`predict_tables` gives without
    a previous layer): token2rank [L, V, 2] int, token_conf [L, V] float, prior2rank [L, 2] int,
    token_ids [T] int; bigram: :func:`bigram_override`'s argument (optional).
    Returns (pref [L, T, 2] int64, conf [L, T] float32)."""
    ids = token_ids.long()
    r, c = bigram_override(token2rank[:, ids].long(), token_conf[:, ids].float(), bigram)
    seen = r[..., :1] >= 0
    return torch.where(seen, r, prior2rank.long()[:, None, :]), torch.where(seen[..., 0], c, 0.0).clamp_min(0.0)


def vote(pref: torch.Tensor, conf: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One preference list per token from every layer's (the order a whole step keeps when the
    decoder layers keep their rows split between layers). Each layer votes for its first
    preference with 2 * (1 + round(1000 * conf)) and for its second with half that, so layers
    without data still count. Votes are integers: every rank sums them to the same scores in any
    order (float sums on a GPU need not be bit-identical across ranks, and the ranks must agree
    on one permutation). pref: [L, T, P] int, -1 = none; conf: [L, T] float.
    Returns (pref [T, min(2, N)] int64, most votes first, lower rank on ties, -1 = no vote;
    conf [T] float32, the winner's votes as a share of the most a token can get)."""
    L, T, P = pref.shape
    unit = 1 + torch.round(conf.float().clamp(0, 1) * 1000).long()  # [L, T]
    weight = unit[..., None] * (2 // (2 ** torch.arange(P, device=pref.device))).clamp_min(0)  # 2, 1, 0, ...
    rank = torch.where(pref >= 0, pref.long(), num_ranks)  # slot N: no preference, dropped
    score = torch.zeros((T, num_ranks + 1), dtype=torch.long, device=pref.device).scatter_add_(
        1, rank.permute(1, 0, 2).reshape(T, L * P), weight.permute(1, 0, 2).reshape(T, L * P))[:, :num_ranks]
    best = torch.argsort(-score, dim=1, stable=True)[:, : min(2, num_ranks)]
    top = score.gather(1, best)
    best = torch.where(top > 0, best, -1)
    return best, top[:, 0].float() / (L * 2 * 1001)


def prefer_ranks(expert_ranks: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks by how many of a token's experts they hold (most first, lower rank on ties): the
    preference when the step's routing is known. expert_ranks: [T, K] int, the rank of each of the
    token's top-k experts. Returns (pref [T, min(2, N)] int64, conf [T] float32: the best rank's
    share of the K experts). Twin of :func:`vllm_smoe.placement.predict.prefer_ranks`."""
    T, K = expert_ranks.shape
    counts = torch.zeros((T, num_ranks), dtype=torch.long, device=expert_ranks.device).scatter_add_(
        1, expert_ranks.long(), torch.ones_like(expert_ranks, dtype=torch.long))
    return _prefer(counts, K)


def _prefer(counts: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts: [T, N] experts of each token on each rank -> (pref [T, min(2, N)], conf [T])."""
    pref = torch.argsort(-counts, dim=1, stable=True)[:, : min(2, counts.shape[1])]
    return pref, counts.gather(1, pref[:, :1])[:, 0].float() / K


def prefer_held(expert_ids: torch.Tensor, held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefer_ranks` counting every copy: expert_ids [T, K] int, held [N, E] bool (rank
    holds a copy of expert). Twin of :func:`vllm_smoe.placement.predict.known_preferences`."""
    counts = held.T.long()[expert_ids.long()].sum(dim=1)  # [T, N]
    return _prefer(counts, expert_ids.shape[1])


def predict_random(token_ids: torch.Tensor, layer: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A hash of position, layer and token id: the same on every rank, unrelated to routing.
    Returns (pref [T, 1] int64, conf [T] float32)."""
    T = token_ids.shape[0]
    pos = torch.arange(T, device=token_ids.device)
    h = (token_ids.long() * 40503 + pos * 2654435 + (layer + 1) * 97) % 2147483647
    return (h % num_ranks).view(T, 1), torch.ones(T, device=token_ids.device)


def predict_one_rank(token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token prefers rank 0 (the worst case: the cap sends the rest anywhere)."""
    T = token_ids.shape[0]
    return torch.zeros((T, 1), dtype=torch.long, device=token_ids.device), torch.ones(T, device=token_ids.device)


def chunk_caps(num_tokens: int, num_ranks: int, device=None) -> torch.Tensor:
    """[N] int64 rows of each rank in vLLM's sequence-parallel chunk (ceil(T / N), padding last)."""
    c = -(-num_tokens // num_ranks)
    return (num_tokens - torch.arange(num_ranks, device=device) * c).clamp(0, c)


def assign(pref: torch.Tensor, conf: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Capacity-capped assignment of one step, for one layer or several at once.

    pref: [T, P] or [L, T, P] int, -1 = none; conf: [T] or [L, T] float; caps: [N] int64 tokens
    each rank takes, summing to >= T. In each layer the most confident tokens claim their
    preferences first; tokens left over fill the free slots rank by rank, in token order.
    Returns token2rank [T] or [L, T] int64."""
    if pref.dim() == 2:
        return assign(pref[None], conf[None], caps)[0]
    L, T, P = pref.shape
    N = caps.shape[0]
    dev = pref.device
    order = torch.argsort(-conf, dim=1, stable=True)  # [L, T]
    flat = (order + torch.arange(L, device=dev)[:, None] * T).reshape(-1)  # into [L * T]
    base = (torch.arange(L, device=dev) * (N + 1))[:, None].expand(L, T).reshape(-1)
    t2r = torch.full((L * T,), -1, dtype=torch.long, device=dev)
    # slot N of each layer: the "no preference" bucket, never taken
    remaining = torch.cat([caps.long().expand(L, N), caps.new_zeros((L, 1))], dim=1).reshape(-1)
    arange = torch.arange(L * T, device=dev)
    for j in range(P):
        want = pref.reshape(L * T, P)[flat, j].long()
        key = base + torch.where((t2r[flat] < 0) & (want >= 0), want, N)
        srt = torch.argsort(key, stable=True)  # layer by layer, rank by rank, confidence order kept
        ks, idx = key[srt], flat[srt]
        counts = torch.zeros(L * (N + 1), dtype=torch.long, device=dev).scatter_add_(0, ks, torch.ones_like(ks))
        within = arange - (torch.cumsum(counts, 0) - counts)[ks]
        take = (ks % (N + 1) < N) & (within < remaining[ks])
        t2r = t2r.scatter(0, idx, torch.where(take, ks % (N + 1), t2r[idx]))
        remaining = remaining - torch.zeros_like(remaining).scatter_add_(0, ks, take.long())
    t2r = t2r.view(L, T)
    left = t2r < 0
    nth = torch.cumsum(left.long(), dim=1) - 1
    bounds = torch.cumsum(remaining.view(L, N + 1)[:, :N], dim=1).contiguous()
    fill = torch.searchsorted(bounds, nth.contiguous(), right=True)
    return torch.where(left, fill, t2r)


def permutation(token2rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, inv) of token2rank's shape ([T] or [L, T]) int64: rows ``x[perm]`` are grouped
    rank by rank (stable), ``y[inv]`` restores the original order."""
    perm = torch.argsort(token2rank, dim=-1, stable=True)
    ar = torch.arange(perm.shape[-1], device=perm.device).expand_as(perm)
    inv = torch.empty_like(perm).scatter_(-1, perm, ar)
    return perm, inv


def assign_permute(pref: torch.Tensor, conf: torch.Tensor, caps: torch.Tensor, perm: torch.Tensor,
                   inv: torch.Tensor) -> None:
    """:func:`assign` then :func:`permutation`, written into ``perm`` / ``inv`` ([L, >= T] int64,
    first T columns). On CUDA one Triton kernel after one confidence sort
    (:func:`vllm_smoe.kernels.assign.assign_permute`, tested equal to these ops); elsewhere the
    torch ops. pref: [L, T, P]; conf: [L, T]; caps: [N]."""
    from ...kernels import assign as kernel

    T = pref.shape[1]
    if pref.is_cuda and kernel.triton is not None:
        order = torch.argsort(-conf, dim=1, stable=True)
        kernel.assign_permute(pref, order, caps, perm, inv)
        return
    p, i = permutation(assign(pref, conf, caps))
    perm[:, :T].copy_(p)
    inv[:, :T].copy_(i)
