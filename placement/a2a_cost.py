"""What an expert-parallel all-to-all backend moves, and how long a MoE layer then takes.

Arrays in, arrays out (numpy): no I/O, no torch. Notation: T tokens of one step (every rank's
together), K top-k, N = ep_size ranks, ``per_node`` ranks a node (rank r is on node
r // per_node), L MoE layers. The docs page ``docs/cluster-model.md`` derives each rule and the
time model with a worked example; ``smoe-place evaluate --cluster`` is its front end.

Inputs of one layer and step:
- ``dest``: [T, K] int64, the rank that computes each activation (the copy it uses), -1 = none;
- ``src``: [T] int64, the rank that holds the token (its attention rank or sequence chunk).

Each backend's byte rule (``BACKENDS``) is in :func:`backend_rows`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BACKENDS = ("allgather-rs", "nccl-a2a", "smoe-p2p", "smoe-hier", "deepep-ht", "deepep-ll")
NVLINK, RDMA = 0, 1  # link classes: the first axis of a rows array
OUT, IN = 0, 1  # its second axis


@dataclass(frozen=True)
class LinkModel:
    """One phase (dispatch or combine) of one backend on one cluster: ``latency_s`` plus the
    busiest rank's bytes on each link class over that class's bandwidth (the two classes run
    concurrently: the slower one sets the time). Bandwidths in bytes/s per GPU and direction."""
    latency_s: float
    nvlink_Bps: float
    rdma_Bps: float


@dataclass(frozen=True)
class Roofline:
    """One GPU's expert compute: dense ``flops`` (FLOP/s) and ``hbm_Bps`` (bytes/s)."""
    flops: float
    hbm_Bps: float


def _check(dest: np.ndarray, src: np.ndarray, ep_size: int, per_node: int) -> None:
    assert dest.ndim == 2 and src.shape == (dest.shape[0],), (dest.shape, src.shape)
    assert ep_size % per_node == 0, (ep_size, per_node)


def _rows(snd: np.ndarray, rcv: np.ndarray, ep_size: int, per_node: int) -> np.ndarray:
    """[2 link, 2 out/in, N] float64 rows of (sender, receiver) pairs, one row each. snd, rcv:
    [P] int64 ranks, already filtered by :func:`_pairs` (no -1, no self pair)."""
    link = (snd // per_node != rcv // per_node).astype(np.int64)
    rows = np.zeros((2, 2, ep_size))
    rows[:, OUT] = np.bincount(link * ep_size + snd, minlength=2 * ep_size).reshape(2, ep_size)
    rows[:, IN] = np.bincount(link * ep_size + rcv, minlength=2 * ep_size).reshape(2, ep_size)
    return rows


def _distinct(x: np.ndarray) -> np.ndarray:
    """[T, K] int64: each row's distinct non-negative values once (sorted), -1 elsewhere."""
    s = np.sort(x, axis=1)
    first = np.ones_like(s, dtype=bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    return np.where(first & (s >= 0), s, -1)


def _pairs(dest: np.ndarray, src: np.ndarray, ep_size: int, per_node: int, backend: str
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row the dispatch sends as (sender [P], receiver [P], token [P]) int64, by
    ``backend``'s rule (:func:`backend_rows`); a rank's rows to itself are left out."""
    _check(dest, src, ep_size, per_node)
    T, K = dest.shape
    dest = dest.astype(np.int64)
    src = src.astype(np.int64)
    tok = np.arange(T, dtype=np.int64)
    if backend == "allgather-rs":
        snd, rcv, who = np.repeat(src, ep_size), np.tile(np.arange(ep_size), T), np.repeat(tok, ep_size)
    elif backend == "deepep-ll":
        snd, rcv, who = np.repeat(src, K), dest.ravel(), np.repeat(tok, K)
    elif backend in ("nccl-a2a", "smoe-p2p"):
        snd, rcv, who = np.repeat(src, K), _distinct(dest).ravel(), np.repeat(tok, K)
    elif backend in ("deepep-ht", "smoe-hier"):
        ranks = _distinct(dest)  # [T, K]
        node = np.where(ranks >= 0, ranks // per_node, -1)
        own = (src // per_node)[:, None]
        same_index = node * per_node + (src % per_node)[:, None]  # that node's rank of src's local index
        if backend == "deepep-ht":
            gw = same_index
        else:  # the same-index rank where it is a destination, else the node's lowest destination
            hit = np.zeros_like(ranks, dtype=bool)
            for j in range(K):
                hit |= (ranks == same_index[:, j: j + 1]) & (ranks >= 0)
            hit_node = np.zeros_like(hit)
            lowest = np.full_like(ranks, -1)
            for j in range(K - 1, -1, -1):  # ranks ascend: the last write per node is its lowest
                on = (node == node[:, j: j + 1]) & (ranks[:, j: j + 1] >= 0)
                lowest = np.where(on, ranks[:, j: j + 1], lowest)
                hit_node |= on & hit[:, j: j + 1]
            gw = np.where(hit_node, same_index, lowest)
        gw = np.where(ranks < 0, -1, np.where(node == own, src[:, None], gw))  # own node: direct
        far = _distinct(np.where(node != own, node, -1))  # the other destination nodes, once each
        far_gw = np.where(far >= 0, far * per_node + (src % per_node)[:, None], -1)
        if backend == "smoe-hier":  # that node's gateway as the fan-out uses it
            for j in range(K):
                m = (node == far[:, j: j + 1]) & (far[:, j: j + 1] >= 0)
                far_gw[:, j] = np.where(m.any(axis=1), gw[np.arange(T), m.argmax(axis=1)], -1)
        snd = np.concatenate([np.repeat(src, K), gw.ravel()])  # over RDMA to gateways, then fan-out
        rcv = np.concatenate([far_gw.ravel(), ranks.ravel()])
        who = np.concatenate([np.repeat(tok, K), np.repeat(tok, K)])
    else:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    ok = (snd >= 0) & (rcv >= 0) & (snd != rcv)
    return snd[ok], rcv[ok], who[ok]


def messages(dest: np.ndarray, src: np.ndarray, ep_size: int, per_node: int, backend: str) -> np.ndarray:
    """[N] float64 messages each rank's dispatch sends: one per (receiver) with rows, its rows
    in one transfer; under deepep-ll one per row (each (token, expert) is its own RDMA put or
    NVLink copy, internode_ll.cu l.255-276)."""
    snd, rcv, _ = _pairs(dest, src, ep_size, per_node, backend)
    return _messages(snd, rcv, ep_size, backend)


def _messages(snd: np.ndarray, rcv: np.ndarray, ep_size: int, backend: str) -> np.ndarray:
    if backend == "deepep-ll":
        return np.bincount(snd, minlength=ep_size).astype(np.float64)
    pair = np.unique(snd * ep_size + rcv)
    return np.bincount(pair // ep_size, minlength=ep_size).astype(np.float64)


def backend_rows(dest: np.ndarray, src: np.ndarray, ep_size: int, per_node: int, backend: str) -> np.ndarray:
    """Rows one step's dispatch sends, per link class, direction and rank: [2, 2, N] float64
    (``rows[NVLINK|RDMA, OUT|IN, r]``). dest: [T, K] int64 (-1 none); src: [T] int64. The combine
    sends the same rows the other way: ``rows[:, ::-1]``.

    Byte rules (``BACKENDS``), for the dispatch; the combine sends the same rows back, each way
    reversed, in its own dtype. A rank never sends to itself. Link class: NVLink between ranks of one
    node, RDMA between nodes.
    - ``allgather-rs``: vLLM's default (all-gather then reduce-scatter): every token to every other
      EP rank, whatever its experts.
    - ``nccl-a2a`` and ``smoe-p2p``: each token once to each distinct rank among its activations'.
    - ``deepep-ht`` (DeepEP's normal kernels): to each distinct rank of its own node over NVLink; to
      each other node holding one of its experts once over RDMA, to the rank with the sender's local
      index there, which forwards it over NVLink to that node's other destination ranks.
    - ``smoe-hier`` (smoe's hierarchical exchange): as deepep-ht, but the gateway on a node is the
      rank with the sender's local index only where it holds one of the token's experts (else that
      node's lowest such rank), so a token whose experts there sit on one rank crosses no NVLink.
    - ``deepep-ll`` (DeepEP's low-latency kernels): once per (token, expert) pair, into that expert's
      receive buffer on its rank: a token with two experts on one rank goes twice."""
    snd, rcv, _ = _pairs(dest, src, ep_size, per_node, backend)
    return _rows(snd, rcv, ep_size, per_node)


def token_rows(dest: np.ndarray, src: np.ndarray, ep_size: int, per_node: int, backend: str,
               link: int | None = None) -> np.ndarray:
    """[T] float64 rows each token's dispatch sends (on ``link`` only, if given)."""
    snd, rcv, who = _pairs(dest, src, ep_size, per_node, backend)
    if link is not None:
        keep = (snd // per_node != rcv // per_node) == bool(link)
        who = who[keep]
    return np.bincount(who, minlength=dest.shape[0]).astype(np.float64)


def oracle_rows(dest: np.ndarray, ep_size: int, per_node: int, backend: str, link: int | None = None) -> np.ndarray:
    """[T] float64 a lower bound on the rows each token's dispatch sends wherever the token is
    held, from its routing alone: every destination rank but one receives a row (distinct ranks
    - 1; under deepep-ll every activation but those of its busiest rank); over RDMA (``link``
    RDMA) every destination node but one is reached once (the per-rank backends: every
    destination rank, or activation, outside its busiest node). The per-rank backends attain it
    with the token on its busiest destination rank (node). dest:
    [T, K] int64 (-1 none), the ranks computing its activations whichever rank holds it."""
    if backend == "allgather-rs":
        raise ValueError("allgather-rs sends every token to every rank: no routing-dependent bound")
    if backend in ("deepep-ll", "nccl-a2a", "smoe-p2p"):  # each activation (distinct rank) but those
        # of its busiest rank, or over RDMA of its busiest node
        units = dest if backend == "deepep-ll" else _distinct(dest)
        node = np.where(units >= 0, units // per_node, -1)
        key = node if link == RDMA else units
        valid = units >= 0
        most = np.zeros(dest.shape[0], dtype=np.int64)
        for j in range(dest.shape[1]):
            most = np.maximum(most, ((key == key[:, j: j + 1]) & valid).sum(axis=1))
        total = valid.sum(axis=1) - most
    elif link == RDMA:
        nodes = _distinct(np.where(dest >= 0, dest // per_node, -1))
        total = np.maximum((nodes >= 0).sum(axis=1) - 1, 0)
    else:
        total = np.maximum((_distinct(dest) >= 0).sum(axis=1) - 1, 0)
    if link == NVLINK:  # no routing-only bound inside nodes: a token on the node that holds all of
        # its experts may still send none over NVLink (its experts all on its own rank)
        return np.zeros(dest.shape[0])
    return total.astype(np.float64)


def phase_seconds(rows: np.ndarray, row_bytes: float, link: LinkModel) -> float:
    """Seconds of one phase: latency + the busiest (rank, direction)'s bytes on each link class
    over its bandwidth, the slower class. rows: [2 link, 2 out/in, N] float64; row_bytes: bytes."""
    b = rows * row_bytes
    return link.latency_s + max(float(b[NVLINK].max()) / link.nvlink_Bps, float(b[RDMA].max()) / link.rdma_Bps)


def expert_seconds(dest: np.ndarray, experts: np.ndarray, ep_size: int, hidden: int, intermediate: int,
                   roof: Roofline, weight_bytes: float, act_bytes: float) -> tuple[float, np.ndarray]:
    """The busiest rank's expert compute in lock-step (every rank waits for it): per rank,
    max(FLOPs / flops, bytes / hbm) with FLOPs = rows x 6 x hidden x intermediate (gate, up, down)
    and bytes = its experts that got a row x 3 x hidden x intermediate x weight_bytes plus the
    rows in and out. dest, experts: [T, K] int64 (-1 none). Returns (seconds, [N] rows)."""
    ok = dest >= 0
    d, e = dest[ok].astype(np.int64), experts[ok].astype(np.int64)
    rows = np.bincount(d, minlength=ep_size).astype(np.float64)
    E = int(e.max()) + 1 if e.size else 1
    active = np.bincount(np.unique(d * E + e) // E, minlength=ep_size).astype(np.float64)
    flops = rows * 6.0 * hidden * intermediate
    nbytes = active * 3.0 * hidden * intermediate * weight_bytes + rows * 2.0 * hidden * act_bytes
    t = np.maximum(flops / roof.flops, nbytes / roof.hbm_Bps)
    return float(t.max()), rows


@dataclass(frozen=True)
class Wire:
    """One backend on one cluster: its rule (``backend``, one of BACKENDS), ranks a node
    (``per_node``), each phase's link model and bytes of one row it sends (dispatch, combine)."""
    backend: str
    per_node: int
    dispatch: LinkModel
    combine: LinkModel
    dispatch_row_bytes: float
    combine_row_bytes: float


def step_cost(dest: np.ndarray, src: np.ndarray, experts: np.ndarray, ep_size: int, wire: Wire,
              hidden: int, intermediate: int, roof: Roofline, weight_bytes: float, act_bytes: float) -> dict:
    """One MoE layer of one step: dispatch, expert compute (the busiest rank), combine, in
    seconds, and the rows behind them. dest, experts: [T, K] int64 (-1 none); src: [T] int64."""
    snd, rcv, _ = _pairs(dest, src, ep_size, wire.per_node, wire.backend)
    rows = _rows(snd, rcv, ep_size, wire.per_node)
    back = rows[:, ::-1]
    t_exp, expert_rows = expert_seconds(dest, experts, ep_size, hidden, intermediate, roof, weight_bytes, act_bytes)
    return {"dispatch_s": phase_seconds(rows, wire.dispatch_row_bytes, wire.dispatch),
            "combine_s": phase_seconds(back, wire.combine_row_bytes, wire.combine),
            "expert_s": t_exp, "rows": rows, "expert_rows": expert_rows,
            "messages": _messages(snd, rcv, ep_size, wire.backend)}


def trace_cost(topk_ids: np.ndarray, dest: np.ndarray, token2rank: np.ndarray, step_ids: np.ndarray,
               ep_size: int, wire: Wire, hidden: int, intermediate: int, roof: Roofline,
               weight_bytes: float = 2.0, act_bytes: float = 2.0) -> dict[str, float]:
    """Mean cost per MoE layer and step over a trace, every step in lock-step.

    topk_ids, dest: [T, L, K] int64 (-1 none): each activation's expert and the rank that
    computes it; token2rank: [T, L] int64; step_ids: [T] int, non-decreasing, the rows of one
    step of the whole EP group (tokens per rank x N tokens). Returns microseconds per MoE layer
    (``dispatch_us``, ``combine_us``, ``a2a_us`` = both, ``expert_us``, ``moe_us`` = all three),
    bytes per token and MoE layer on each link class (dispatch and combine, all ranks:
    ``nvlink_bytes_per_token``, ``rdma_bytes_per_token``), the busiest rank's RDMA bytes per
    step and layer (``rdma_busiest_bytes``: its bytes out, or in, over both phases, the larger), its share
    of the expert rows (``expert_rows_load``: max / mean) and the most messages a rank's dispatch
    sends (``messages_busiest``, :func:`messages`)."""
    T, L, K = topk_ids.shape
    cuts = np.flatnonzero(np.diff(step_ids)) + 1
    bounds = np.concatenate([[0], cuts, [T]])
    acc = dict.fromkeys(("dispatch_s", "combine_s", "expert_s", "nvl", "rdma", "busiest", "load", "msgs"), 0.0)
    n = 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        for layer in range(L):
            c = step_cost(dest[lo:hi, layer], token2rank[lo:hi, layer], topk_ids[lo:hi, layer], ep_size, wire,
                          hidden, intermediate, roof, weight_bytes, act_bytes)
            for k in ("dispatch_s", "combine_s", "expert_s"):
                acc[k] += c[k]
            per_row = wire.dispatch_row_bytes + wire.combine_row_bytes
            acc["nvl"] += c["rows"][NVLINK, OUT].sum() * per_row
            acc["rdma"] += c["rows"][RDMA, OUT].sum() * per_row
            r = c["rows"][RDMA]  # [2 out/in, N]: dispatch; the combine sends the same rows back
            db, cb = wire.dispatch_row_bytes, wire.combine_row_bytes
            acc["busiest"] += float(np.maximum(r[OUT] * db + r[IN] * cb, r[IN] * db + r[OUT] * cb).max())
            acc["msgs"] += float(c["messages"].max())
            er = c["expert_rows"]
            acc["load"] += float(er.max() / max(er.mean(), 1e-12))
            n += 1
    n = max(n, 1)
    us = {k[:-2] + "_us": 1e6 * acc[k] / n for k in ("dispatch_s", "combine_s", "expert_s")}
    us["a2a_us"] = us["dispatch_us"] + us["combine_us"]
    us["moe_us"] = us["a2a_us"] + us["expert_us"]
    return {**us, "nvlink_bytes_per_token": acc["nvl"] / max(T * L, 1), "rdma_bytes_per_token": acc["rdma"] / max(T * L, 1),
            "rdma_busiest_bytes": acc["busiest"] / n, "expert_rows_load": acc["load"] / n,
            "messages_busiest": acc["msgs"] / n}


def fit_link(cases: list[tuple[np.ndarray, float, float]], nominal: LinkModel) -> tuple[LinkModel, np.ndarray]:
    """The latency and bandwidths that best reproduce measured phase times (least squares on
    log(model / measured)). cases: (rows [2, 2, N], row_bytes, seconds) per measurement;
    nominal: the starting point, each link's upper bound (its line rate), and the bandwidth a
    link class no case uses keeps. Returns
    the fitted model and [len(cases)] relative errors (model / measured - 1)."""
    from scipy.optimize import least_squares

    peaks = np.array([[float((r * b)[NVLINK].max()), float((r * b)[RDMA].max())] for r, b, _ in cases])  # bytes
    t = np.array([s for _, _, s in cases])
    used = peaks.max(axis=0) > 0

    def model(x):
        lat, bw = np.exp(x[0]), np.exp(x[1:])
        return lat + np.max(np.where(used, peaks / bw, 0.0), axis=1)

    # a link carries at most its nominal bandwidth: the fit may not explain time away by more
    hi = np.array([np.inf, np.log(nominal.nvlink_Bps), np.log(nominal.rdma_Bps)])
    x0s = [np.minimum(np.log([max(nominal.latency_s, 1e-7), nominal.nvlink_Bps, nominal.rdma_Bps]) + d, hi - 1e-3)
           for d in (np.zeros(3), np.array([1.0, -0.5, -0.5]), np.array([-1.0, -1.0, -1.0]))]
    best = None
    for x0 in x0s:
        r = least_squares(lambda x: np.log(model(x) / t), x0, method="trf", bounds=(-np.inf, hi))
        if best is None or r.cost < best.cost:
            best = r
    lat, nvl, rdma = np.exp(best.x)
    fitted = LinkModel(float(lat), float(nvl) if used[0] else nominal.nvlink_Bps,
                       float(rdma) if used[1] else nominal.rdma_Bps)
    return fitted, model(best.x) / t - 1.0


def random_routing(num_tokens: int, num_experts: int, top_k: int, rng: np.random.Generator,
                   groups: int = 1, topk_groups: int = 1) -> np.ndarray:
    """[num_tokens, top_k] int64 uniform random routing as DeepEP's benchmarks draw it: top-k of
    random scores, optionally limited to the ``topk_groups`` best of ``groups`` equal expert groups
    (a group's score: its best expert's)."""
    out = np.empty((num_tokens, top_k), dtype=np.int64)
    for a in range(0, num_tokens, 8192):  # chunks: EP 64 x 4096 tokens x 256 experts of scores at once is 0.5 GB
        n = min(8192, num_tokens - a)
        scores = np.abs(rng.standard_normal((n, num_experts), dtype=np.float32)) + 1.0
        if groups > 1 and topk_groups < groups:
            g = scores.reshape(n, groups, -1).max(axis=2)
            keep = np.argsort(-g, axis=1)[:, :topk_groups]
            mask = np.zeros((n, groups), dtype=bool)
            mask[np.arange(n)[:, None], keep] = True
            scores = np.where(np.repeat(mask, num_experts // groups, axis=1), scores, 0.0)
        out[a: a + n] = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    return out


def deepep_logical_rows(experts: np.ndarray, num_experts: int, ep_size: int, per_node: int, counted: str) -> float:
    """The rows DeepEP's tests divide by the time to print a bandwidth, mean per rank (they print
    rank 0's; routing is uniform). experts: [T, K] int64 (-1 none), every rank's tokens.
    counted: "nvl_recv" (test_intranode: rows each rank receives, its own included), "rdma_send"
    (test_internode: (token, destination node) pairs, the own node included), "ll_send"
    (test_low_latency: valid top-k entries of the rank's own tokens)."""
    if counted == "ll_send":
        return float((experts >= 0).sum()) / ep_size
    per_rank = num_experts // ep_size
    ranks = _distinct(np.where(experts >= 0, experts // per_rank, -1))
    if counted == "nvl_recv":
        return float((ranks >= 0).sum()) / ep_size
    if counted == "rdma_send":
        return float((_distinct(np.where(ranks >= 0, ranks // per_node, -1)) >= 0).sum()) / ep_size
    raise ValueError(f"counted must be nvl_recv, rdma_send or ll_send, got {counted!r}")
