"""Placement metrics, exactly as smoe reports them: :func:`evaluate` returns them all (each
defined in its docstring), :func:`recommend` reads them.

Notation: T tokens, L MoE layers, K top-k, E experts, N = ep_size ranks."""

from __future__ import annotations

import numpy as np


def holds_from_expert2rank(expert2rank: np.ndarray, ep_size: int,
                           replicas: np.ndarray | None = None) -> np.ndarray:
    """Which rank holds a copy of which expert: [L, N, E] bool.

    expert2rank: [L, E] int, home rank of each expert; replicas: [L, R, 2] int (expert, rank)
    extra copies, -1 = none.
    """
    L, E = expert2rank.shape
    holds = np.zeros((L, ep_size, E), dtype=bool)
    holds[np.repeat(np.arange(L), E), expert2rank.reshape(-1), np.tile(np.arange(E), L)] = True
    if replicas is not None and replicas.size:
        ok = replicas[..., 0] >= 0
        holds[np.nonzero(ok)[0], replicas[..., 1][ok], replicas[..., 0][ok]] = True
    return holds


def local_share(topk_ids: np.ndarray, token2rank: np.ndarray, holds: np.ndarray) -> float:
    """LAR alone: share of activations whose expert has a copy on the token's rank.
    topk_ids: [T, L, K] int; token2rank: [T, L] int; holds: [L, N, E] bool."""
    T, L, K = topk_ids.shape
    local = sum(int(holds[layer][token2rank[:, layer].astype(np.int64)[:, None],
                                 topk_ids[:, layer].astype(np.int64)].sum()) for layer in range(L))
    return local / max(1, T * L * K)


def _hashed_copies(topk: np.ndarray, holds_layer: np.ndarray, row_in_step: np.ndarray) -> np.ndarray:
    """[T, K] the rank whose copy vLLM's EPLB mapping picks for each activation: the expert's
    holders in rank order, indexed by the Knuth hash of the row's index in its step modulo the
    copy count. topk: [T, K] int; holds_layer: [N, E] bool; row_in_step: [T] int."""
    count = holds_layer.sum(axis=0)  # [E]
    order = np.argsort(~holds_layer, axis=0, kind="stable")  # [N, E]: holders first, by rank
    pick = ((row_in_step.astype(np.int64) * 2654435769) & 0xFFFFFFFF)[:, None] % np.maximum(count[topk], 1)
    return order[pick, topk]


def evaluate(topk_ids: np.ndarray, token2rank: np.ndarray, expert2rank: np.ndarray, batch_ids: np.ndarray,
             ep_size: int, holds: np.ndarray | None = None, hidden_size: int = 4096,
             dtype_bytes: int = 2, nodes: int = 1, copies: str = "own") -> dict[str, float]:
    """All metrics of one method on one trace.

    Metrics:
    - ``lar``: share of (token, layer, k) activations whose expert has a copy on the token's rank.
    - ``token_load``: per batch and layer, max/mean tokens per rank; averaged.
    - ``expert_load``: per layer, max/mean activations computed per rank over the trace (a local
      activation is computed on the token's rank, a remote one on the expert's home rank); averaged.
    - ``remote_pairs_per_token``: remote (token, expert) activations per token per MoE layer.
    - ``remote_unique_per_token``: distinct remote ranks per token per MoE layer (de-duplicated
      dispatch: a token crosses each link once).
    - ``a2a_bytes_per_token``: remote_unique_per_token x hidden x dtype bytes x 2 (dispatch + combine).
      With ``nodes`` > 1 (ranks ``n * N/nodes ...`` form node n) also split into
      ``internode_bytes_per_token`` (pairs whose remote rank is on another node) and
      ``intranode_bytes_per_token``.
    - ``rank2rank_rows``: [N, N] list, rows per token per MoE layer from the token's rank (row; under
      attention DP the rank its request runs on) to each remote rank (column), counted as
      ``remote_unique_per_token`` is (they sum to it; the diagonal is 0).
    - ``hit_rate``: share of (token, layer) whose rank holds at least one of its experts;
      ``oracle_hit_rate``: share whose rank holds as many of its experts as the best rank does.

    topk_ids: [T, L, K] int; token2rank: [T, L] int in [0, N); expert2rank: [L, E] int home
    ranks; batch_ids: [T] int non-decreasing; holds: [L, N, E] bool (default: home copies only).
    copies: which copy an activation uses where an expert has several: "own" (smoe's serving:
    the one on the token's rank, else the home) or "hashed" (vLLM's EPLB: one picked by the
    token's row in its step, wherever it is). Returns a dict of floats plus ``lar_per_layer``
    ([L] list), ``rank_tokens``/``rank_compute`` ([N] lists, totals over the trace) and
    ``rank2rank_rows`` ([N, N] nested list, per token and MoE layer).
    """
    T, L, K = topk_ids.shape
    N = ep_size
    if holds is None:
        holds = holds_from_expert2rank(expert2rank, N)
    _, batch = np.unique(batch_ids, return_inverse=True)
    B = int(batch.max()) + 1 if T else 0
    local_total = remote_unique = internode = hits = oracle_hits = 0
    per_node = N // nodes
    lar_layer = np.zeros(L)
    token_load = np.zeros(L)
    expert_load = np.zeros(L)
    rank_tokens = np.zeros(N, dtype=np.int64)
    rank_compute = np.zeros(N, dtype=np.int64)
    traffic = np.zeros(N * N, dtype=np.int64)  # [src * N + dst] distinct remote rows
    single_copy = bool((holds.sum(axis=1) == 1).all())
    if copies not in ("own", "hashed"):
        raise ValueError(f"copies must be 'own' or 'hashed', got {copies!r}")
    hashed = copies == "hashed" and not single_copy
    if hashed:
        row_in_step = np.arange(T) - np.searchsorted(batch, batch)  # batch is non-decreasing
    for layer in range(L):
        e = topk_ids[:, layer, :].astype(np.int64)
        r = token2rank[:, layer].astype(np.int64)
        hl = holds[layer]  # [N, E]
        if hashed:
            used = _hashed_copies(e, hl, row_in_step)  # [T, K] the copy each activation reaches
            local = used == r[:, None]
        else:
            local = hl[r[:, None], e]  # [T, K]
        nloc = local.sum(axis=1)
        local_total += int(nloc.sum())
        lar_layer[layer] = nloc.sum() / max(1, T * K)
        hits += int((nloc > 0).sum())
        # the best rank for each token: most of its experts held
        home = expert2rank[layer][e]
        best = np.zeros(T, dtype=np.int64)
        if single_copy:  # K column compares instead of N rank scans
            for j in range(K):
                best = np.maximum(best, (home == home[:, j: j + 1]).sum(axis=1))
        else:
            for rr in range(N):
                best = np.maximum(best, hl[rr][e].sum(axis=1))
        oracle_hits += int((nloc == best).sum())
        if hashed:
            home = used  # a remote activation goes to the hashed copy
        remote_rank = np.where(local, -1, home)
        srt = np.sort(remote_rank, axis=1)
        distinct = (srt[:, 1:] != srt[:, :-1]) & (srt[:, 1:] >= 0)
        remote_unique += int(((srt[:, 0] >= 0).sum()) + distinct.sum())
        first = np.concatenate([srt[:, :1] >= 0, distinct], axis=1)  # [T, K] each distinct remote rank once
        traffic += np.bincount((r[:, None] * N + srt)[first], minlength=N * N)
        if nodes > 1:  # the distinct remote ranks on another node than the token's rank
            internode += int((first & (srt // per_node != (r // per_node)[:, None])).sum())
        counts = np.bincount(batch * N + r, minlength=B * N).reshape(B, N)
        sizes = counts.sum(axis=1)
        token_load[layer] = float(np.mean(counts.max(axis=1) / (sizes / N)))
        compute_rank = np.where(local, r[:, None], home)
        comp = np.bincount(compute_rank.reshape(-1), minlength=N)
        expert_load[layer] = float(comp.max() / comp.mean())
        rank_tokens += np.bincount(r, minlength=N)
        rank_compute += comp
    pairs = T * L
    rup = remote_unique / max(1, pairs)
    split = {}
    if nodes > 1:
        inter = internode / max(1, pairs)
        split = {"internode_bytes_per_token": inter * hidden_size * dtype_bytes * 2,
                 "intranode_bytes_per_token": (rup - inter) * hidden_size * dtype_bytes * 2}
    return {**split,
        "lar": local_total / max(1, pairs * K),
        "token_load": float(token_load.mean()),
        "expert_load": float(expert_load.mean()),
        "remote_pairs_per_token": (pairs * K - local_total) / max(1, pairs),
        "remote_unique_per_token": rup,
        "a2a_bytes_per_token": rup * hidden_size * dtype_bytes * 2,
        "hit_rate": hits / max(1, pairs),
        "oracle_hit_rate": oracle_hits / max(1, pairs),
        "lar_per_layer": lar_layer.tolist(),
        "rank_tokens": rank_tokens.tolist(),
        "rank_compute": rank_compute.tolist(),
        "rank2rank_rows": (traffic.reshape(N, N) / max(1, pairs)).tolist(),
    }


def recommend(lar: np.ndarray, rows: np.ndarray, expert_load: np.ndarray, max_expert_load: float,
              lar_margin: float = 0.02) -> tuple[int, str]:
    """The candidate to serve: among those whose expert load is at most ``max_expert_load``
    (balanced compute), the one sending the fewest rows per token among those within
    ``lar_margin`` (a share) of the best LAR; on equal rows the higher LAR, then the lower index.

    lar, rows (remote unique ranks per token and MoE layer), expert_load: [M] float, one entry
    per candidate. Returns (index, -1 when no candidate is balanced; the reason, one line)."""
    lar, rows, load = (np.asarray(x, dtype=np.float64) for x in (lar, rows, expert_load))
    ok = np.flatnonzero(load <= max_expert_load + 1e-9)
    if ok.size == 0:
        return -1, f"no candidate keeps its expert load within {max_expert_load:.2f}"
    best = ok[np.argmax(lar[ok])]  # first of the best on ties
    near = ok[lar[ok] >= (1.0 - lar_margin) * lar[best] - 1e-12]
    pick = near[np.lexsort((near, -lar[near], rows[near]))[0]]
    if pick == best:
        return int(pick), (f"the best LAR ({lar[best]:.3f}) at expert load <= {max_expert_load:.2f}, and no "
                           f"candidate within {lar_margin:.0%} of it sends fewer rows")
    return int(pick), (f"the fewest rows per token ({rows[pick]:.3f} against {rows[best]:.3f}) at expert load <= "
                       f"{max_expert_load:.2f}, with LAR {lar[pick]:.3f} within {lar_margin:.0%} of the best "
                       f"({lar[best]:.3f})")
