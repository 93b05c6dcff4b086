"""Attention-DP request routing (Sem-MoE): whole requests go to data-parallel ranks.

A request's affinity to rank r is how many of its prompt tokens the token tables send to r
(weighted by confidence), summed over MoE layers. Requests are routed one at a time, in
arrival order, exactly as a server must: each goes to its best-scoring rank among those the
balance mask leaves open, where a rank is masked while its routed work in the sliding window of
the last ``window`` requests would pass ``capacity`` x the fair share (the least loaded rank is
never masked). A request with no preference (no rank scores strictly higher than the others
left open) is left to the caller's own choice (vLLM's load balancer when serving). The engine's
router (:mod:`vllm_smoe.serving.dp.router`) and ``smoe-place evaluate --mode dp`` call these same
functions, so the offline simulation is the online rule.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from .coclust import cap_expert_load
from .counts import assign_token_ids

WINDOW = 64  # requests in the sliding balance window
CAPACITY = 1.10  # default cap on a rank's share of the window's work, x fair share
DECODE_CONCURRENCY = 8  # requests decoding at once in step_imbalance's default
NODE_WEIGHT = 0.5  # a vote's weight on the other engines of its rank's node (placements with nodes > 1)


def request_index(request_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request ids [Q] in order of first appearance, q [T] int64 each token's index in it)."""
    uniq, first, inv = np.unique(request_ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    q_of = np.empty(uniq.size, dtype=np.int64)
    q_of[order] = np.arange(uniq.size)
    return uniq[order], q_of[inv.reshape(-1)]


def token_votes(token2rank: np.ndarray, token_conf: np.ndarray, ep_size: int, engines: int | None = None,
                nodes: int = 1, node_weight: float = NODE_WEIGHT) -> np.ndarray:
    """[V, engines] float64: what each token id adds to a request's score on each engine, summed
    over MoE layers: its confidence for the engine holding its best rank (engine = rank //
    (ep_size / engines); default one engine per rank), and with ``nodes`` > 1 (ranks
    ``n * ep_size/nodes ...`` form node n) ``node_weight`` x that for every engine on the best
    rank's node, the engine itself included: a hierarchical placement (``place_requests(...,
    nodes)``) put a request's experts on one node first, so where its own engine is full the
    next best is a sibling, not whichever engine is least loaded (no node votes where there are
    fewer engines than nodes or engines straddle nodes). token2rank: [L, V, 2] int16
    (-1 = unseen); token_conf: [L, V] float."""
    L, V = token_conf.shape
    engines = engines or ep_size
    if ep_size % engines:
        raise ValueError(f"placement ep_size {ep_size} is not a multiple of the {engines} DP engines")
    if nodes < 1 or ep_size % nodes:
        raise ValueError(f"placement nodes {nodes} does not divide its ep_size {ep_size}")
    votes = np.zeros(V * engines)
    for layer in range(L):
        r = token2rank[layer, :, 0].astype(np.int64)
        ok = r >= 0
        votes += np.bincount(np.flatnonzero(ok) * engines + r[ok] // (ep_size // engines),
                             weights=token_conf[layer, ok].astype(np.float64), minlength=V * engines)
    votes = votes.reshape(V, engines)
    per = engines // nodes  # engines on a node; none where engines straddle nodes or are fewer than nodes
    if nodes > 1 and per > 1 and engines % nodes == 0:
        node = votes.reshape(V, nodes, per).sum(axis=2, keepdims=True)
        votes = votes + node_weight * np.broadcast_to(node, (V, nodes, per)).reshape(V, engines)
    return votes


def request_affinity(token2rank: np.ndarray, token_conf: np.ndarray, token_ids: np.ndarray,
                     request_ids: np.ndarray, is_prefill: np.ndarray | None, ep_size: int,
                     votes: np.ndarray | None = None, nodes: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Score every request against every rank from its prompt tokens (:func:`token_votes`).

    token2rank: [L, V, 2] int16 (-1 = unseen) and token_conf: [L, V] float tables;
    token_ids, request_ids: [T] int; is_prefill: [T] bool or None (all tokens count); votes:
    the tables' :func:`token_votes`, when already made; nodes: the placement's (for those votes).
    Token ids outside the tables score nothing.
    Returns (request ids [Q] in first-appearance order, scores [Q, N] float64, tokens [Q] int64).
    """
    if votes is None:
        votes = token_votes(token2rank, token_conf, ep_size, nodes=nodes)
    V, N = votes.shape
    reqs, q = request_index(request_ids)
    Q = reqs.size
    use = np.ones(token_ids.size, dtype=bool) if is_prefill is None else is_prefill.astype(bool)
    use &= (token_ids >= 0) & (token_ids < V)
    scores = np.zeros((Q, N))
    np.add.at(scores, q[use], votes[token_ids[use]])
    tokens = np.bincount(q, minlength=Q).astype(np.int64)
    return reqs, scores, tokens


def balance_mask(load: np.ndarray, weight: float, capacity: float, slack: float = 0.0) -> np.ndarray:
    """[N] bool, True = rank may take a request of ``weight``. load: [N] float work already on
    each rank (window tokens offline; vLLM's waiting requests when serving). A rank is open while
    its load plus the request stays within ``capacity`` x the fair share of the total, or
    within the least loaded rank's load plus the request (so some rank is always open), plus
    ``slack`` (for loads counted in whole requests, where one request is already 10%)."""
    total = load.sum() + weight
    limit = max(capacity * total / load.size, load.min() + weight) + slack
    return load + weight <= limit * (1 + 1e-9)


def pick_rank(scores: np.ndarray, allowed: np.ndarray) -> int:
    """The open rank with the strictly highest score, or -1 = no preference (a prompt that
    scores every rank the same, e.g. one the tables have never seen, or a tie between the best
    open ranks, or no open rank). scores: [N]; allowed: [N] bool."""
    if np.ptp(scores) <= 1e-9 * max(float(np.abs(scores).max()), 1.0):
        return -1
    s = np.where(allowed, scores, -np.inf)
    best = int(np.argmax(s))
    top = s[best]
    if not np.isfinite(top) or np.count_nonzero(s >= top - 1e-9 * max(abs(top), 1.0)) > 1:
        return -1
    return best


def assign_requests(scores: np.ndarray, tokens: np.ndarray, ep_size: int, capacity: float = CAPACITY,
                    window: int = WINDOW) -> np.ndarray:
    """request2rank: [Q] int64 for requests in arrival order, routed one at a time as the server
    does. scores: [Q, N] float; tokens: [Q] int work of each request. A request without a
    preference goes where the least work of the window is (the load balancer's stand-in)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 request, got {window}")
    Q = scores.shape[0]
    out = np.empty(Q, dtype=np.int64)
    load = np.zeros(ep_size)
    for q in range(Q):
        if q > window:  # the window holds the last ``window`` requests routed before this one
            load[out[q - window - 1]] -= tokens[q - window - 1]
        r = pick_rank(scores[q], balance_mask(load, float(tokens[q]), capacity))
        out[q] = int(np.argmin(load)) if r < 0 else r
        load[out[q]] += tokens[q]
    return out


def workload_scores(scores: np.ndarray, workload: np.ndarray) -> np.ndarray:
    """Workload-aware grouping: score every request by its workload's running centroid, so that
    requests of one workload prefer the same rank (the balance mask still spreads them).
    scores: [Q, N] float, requests in arrival order; workload: [Q] int label (e.g. a trace's
    ``domain``). Returns [Q, N] float64: the sum of the workload's requests' scores so far
    (itself included), each normalised to sum 1 (unscored requests add nothing)."""
    tot = scores.sum(axis=1, keepdims=True)
    norm = np.divide(scores, tot, out=np.zeros(scores.shape), where=tot > 0)
    out = np.empty_like(norm)
    for w in np.unique(workload):
        idx = np.flatnonzero(workload == w)
        out[idx] = np.cumsum(norm[idx], axis=0)
    return out


def round_robin_requests(num_requests: int, ep_size: int) -> np.ndarray:
    """Plain attention-DP: request q on rank q mod N. [Q] int64."""
    return np.arange(num_requests, dtype=np.int64) % ep_size


def request_counts(request_ids: np.ndarray, topk_ids: np.ndarray, num_experts: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Activations of every request. request_ids: [T] int; topk_ids: [T, L, K] int (-1 = none).
    Returns (A [Q, L, E] float32 activations of each request per layer and expert, requests in
    order of first appearance; tokens [Q] int64)."""
    T, L, K = topk_ids.shape
    reqs, q = request_index(request_ids)
    Q = reqs.size
    A = np.zeros((Q, L, num_experts), dtype=np.float32)
    rows = np.repeat(q, K) * num_experts
    for layer in range(L):  # one layer at a time: [T, K] int64 temporaries, not [T, L, K]
        ids = topk_ids[:, layer].astype(np.int64).ravel()
        ok = ids >= 0
        A[:, layer] = np.bincount(rows[ok] + ids[ok], minlength=Q * num_experts).reshape(Q, num_experts)
    return A, np.bincount(q, minlength=Q).astype(np.int64)


def _request_scores(A: np.ndarray, expert2rank: np.ndarray, ep_size: int) -> np.ndarray:
    """[Q, N] float64: activations of each request on each rank's experts, summed over layers."""
    S = np.zeros((A.shape[0], ep_size))
    for layer in range(A.shape[1]):
        S += A[:, layer].astype(np.float64) @ np.eye(ep_size)[expert2rank[layer]]
    return S


def _balanced(gain: np.ndarray, per: int) -> np.ndarray:
    """[n] int: item i -> column, ``per`` items per column, maximising the summed gain [n, c]
    (an exact linear assignment)."""
    rows, slots = linear_sum_assignment(np.repeat(gain, per, axis=1), maximize=True)
    out = np.empty(gain.shape[0], dtype=np.int64)
    out[rows] = slots // per
    return out


def _experts_for(A: np.ndarray, request2rank: np.ndarray, ep_size: int, groups: int = 1,
                 max_expert_load: float | None = None) -> np.ndarray:
    """[L, E] int32: per layer, E / N experts per rank, each rank's the experts its requests use
    most (exact balanced assignments), then, with ``max_expert_load``, the fewest-loss swaps that
    bring every rank's activations within that multiple of the mean
    (:func:`.coclust.cap_expert_load`). With routing groups (contiguous blocks of E / groups ids)
    every group stays whole: whole groups go to ranks (groups >= N), or each group to a block of
    N / groups ranks and its experts over that block (groups < N); a swap of single experts would
    split a group, so grouped layers are not capped."""
    Q, L, E = A.shape
    per = E // ep_size
    onehot = np.eye(ep_size)[request2rank]
    e2r = np.empty((L, E), dtype=np.int32)
    size = E // groups
    for layer in range(L):
        gain = A[:, layer].T.astype(np.float64) @ onehot  # [E, N]
        if groups == 1:
            e2r[layer] = _balanced(gain, per)
            if max_expert_load is not None:
                e2r[layer] = cap_expert_load(e2r[layer], gain, A[:, layer].sum(axis=0).astype(np.float64), ep_size,
                                             max_expert_load)
            continue
        by_group = gain.reshape(groups, size, ep_size).sum(axis=1)  # [G, N]
        if groups >= ep_size:
            e2r[layer] = np.repeat(_balanced(by_group, groups // ep_size), size)
            continue
        width = ep_size // groups  # ranks per group
        block = _balanced(by_group.reshape(groups, groups, width).sum(axis=2), 1)  # group -> rank block
        for g in range(groups):
            ranks = block[g] * width + np.arange(width)
            e2r[layer, g * size:(g + 1) * size] = ranks[_balanced(gain[g * size:(g + 1) * size][:, ranks], per)]
    return e2r


def place_requests(A: np.ndarray, tokens: np.ndarray, ep_size: int, capacity: float = CAPACITY,
                   restarts: int = 4, iters: int = 50, seed: int = 0, groups: int = 1,
                   max_expert_load: float | None = None, nodes: int = 1) -> tuple[np.ndarray, np.ndarray, float]:
    """Experts for attention DP: co-cluster requests and experts so each request's activations
    sit on one rank (the rank it will run on), every rank holding E / N experts per layer and at
    most ``capacity`` x the fair share of the tokens.

    Alternates two exact steps from ``restarts`` random balanced starts (the best kept): experts
    to the ranks whose requests use them most (linear assignment per layer), requests to the
    ranks holding most of their activations (capped assignment). A: [Q, L, E] activations (see
    :func:`request_counts`); tokens: [Q] int. Returns (expert2rank [L, E] int32, request2rank
    [Q] int64, local share of the activations in-sample). groups: routing groups of grouped
    top-k (DeepSeek's ``n_group``), kept whole (see ``groups.check_groups``). max_expert_load:
    cap on each rank's share of a layer's activations, x mean (None: uncapped). DP engines step
    in lock-step, so the rank with the most expert work sets every engine's step time where
    decode is compute bound; the cap trades locality for that balance (ungrouped layers only,
    see :func:`_experts_for`). nodes: ranks ``n * N/nodes ...`` form node n; with nodes > 1 the
    slow link comes first: requests and experts are co-clustered onto nodes (E / nodes experts
    each, the cap on each node's share), then inside each node onto its ranks from that node's
    requests and experts alone, so an activation leaves its node only where the node-level
    solution sends it; the cap then applies once more to the ranks (the two levels' caps
    compound), by the swaps that cost least, a node's gain counting too (not with routing groups,
    as for the flat solve). Same seed, same result."""
    Q, L, E = A.shape
    if E % ep_size:
        raise ValueError(f"{E} experts do not split evenly over ep_size {ep_size}: placements for attention DP "
                         f"need ep_size to divide the expert count (the token-level methods do not)")
    if iters < 1 or Q == 0:
        raise ValueError(f"place_requests needs iters >= 1 and at least one request (got {iters}, {Q})")
    if groups > 1 and (E % groups or (groups % ep_size and ep_size % groups)):
        raise ValueError(f"{groups} routing groups of {E} experts cannot stay whole over ep_size {ep_size}")
    if nodes < 1 or ep_size % nodes:
        raise ValueError(f"nodes {nodes} does not divide ep_size {ep_size}")
    if 1 < nodes < ep_size and groups > 1 and groups % nodes and nodes % groups:
        raise ValueError(f"{groups} routing groups and {nodes} nodes: one must divide the other")
    if 1 < nodes < ep_size:  # nodes == ep_size: one rank a node, the flat problem
        return _place_by_node(A, tokens, ep_size, nodes, capacity, restarts, iters, seed, groups, max_expert_load)
    total = max(float(A.sum()), 1e-12)
    rng = np.random.default_rng(seed)
    best = (None, None, -1.0)
    for _ in range(max(1, restarts)):
        r2r = rng.permutation(Q) % ep_size
        for _ in range(iters):
            e2r = _experts_for(A, r2r, ep_size, groups, max_expert_load)
            S = _request_scores(A, e2r, ep_size)
            new = assign_token_ids(S, tokens.astype(np.float64), capacity)
            if np.array_equal(new, r2r):
                break
            r2r = new
        share = float(S[np.arange(Q), r2r].sum()) / total
        if share > best[2] + 1e-12:
            best = (e2r, r2r.astype(np.int64), share)
    return best


def _place_by_node(A: np.ndarray, tokens: np.ndarray, ep_size: int, nodes: int, capacity: float, restarts: int,
                   iters: int, seed: int, groups: int, max_expert_load: float | None
                   ) -> tuple[np.ndarray, np.ndarray, float]:
    """:func:`place_requests` with nodes > 1: nodes first, then each node's ranks."""
    Q, L, E = A.shape
    per = ep_size // nodes
    e2n, r2n, _ = place_requests(A, tokens, nodes, capacity, restarts, iters, seed, groups, max_expert_load)
    # a node holds whole groups (groups >= nodes) or part of one (groups < nodes: one group inside)
    sub_groups = groups // nodes if groups >= nodes else 1
    e2r = np.empty((L, E), dtype=np.int32)
    r2r = np.empty(Q, dtype=np.int64)
    for n in range(nodes):
        qs = np.flatnonzero(r2n == n)
        ids = np.stack([np.flatnonzero(e2n[layer] == n) for layer in range(L)])  # [L, E / nodes], ascending
        sub = np.take_along_axis(A[qs], ids[None], axis=2) if qs.size else None
        if sub is None:  # no request chose this node: its experts spread over its ranks in order
            e2r[np.arange(L)[:, None], ids] = n * per + np.arange(ids.shape[1]) // (ids.shape[1] // per)
            continue
        se2r, sr2r, _ = place_requests(sub, tokens[qs], per, capacity, restarts, iters, seed + n + 1, sub_groups,
                                       max_expert_load)
        e2r[np.arange(L)[:, None], ids] = n * per + se2r
        r2r[qs] = n * per + sr2r
    if max_expert_load is not None and groups == 1:  # the levels' caps compound (up to cap x cap): once more,
        onehot = np.eye(ep_size)[r2r]  # a swap across nodes costing its node's gain too
        for layer in range(L):
            gain = A[:, layer].T.astype(np.float64) @ onehot  # [E, N]
            node_gain = np.repeat(gain.reshape(E, nodes, per).sum(axis=2), per, axis=1)
            e2r[layer] = cap_expert_load(e2r[layer], gain + node_gain, A[:, layer].sum(axis=0).astype(np.float64),
                                         ep_size, max_expert_load)
    share = float(_request_scores(A, e2r, ep_size)[np.arange(Q), r2r].sum()) / max(float(A.sum()), 1e-12)
    return e2r, r2r, share


def step_imbalance(topk_ids: np.ndarray, request_ids: np.ndarray, expert2rank: np.ndarray, ep_size: int,
                   concurrency: int = DECODE_CONCURRENCY, steps: int = 256, seed: int = 0) -> float:
    """What lock-step costs a placement in attention-DP decode: sum over steps and MoE layers of
    the busiest rank's work over the mean rank's (1.0 = every rank equally busy at every layer).

    DP engines wait for each other at every MoE layer's exchange, so a layer takes as long as its
    busiest rank; at decode batch sizes a rank's expert work is reading the weights of each
    distinct local expert its step's tokens activate, which is what is counted. ``concurrency``
    requests are in flight (a seeded random order of the trace's requests; one finishing is
    replaced by the next), each adding its next token to every step, for ``steps`` steps.
    topk_ids: [T, L, K] int expert ids; request_ids: [T] int (a request's tokens in trace order);
    expert2rank: [L, E] int. Which rank a request runs on does not change where its experts
    are, so request routing leaves this number unchanged; the placement sets it."""
    topk = np.asarray(topk_ids)
    T, L, K = topk.shape
    e2r = np.asarray(expert2rank, dtype=np.int64)
    E = e2r.shape[1]
    if T == 0 or steps < 1 or concurrency < 1:
        raise ValueError(f"step_imbalance needs tokens, steps >= 1 and concurrency >= 1 (got {T}, {steps}, "
                         f"{concurrency})")
    _, q = request_index(request_ids)
    rows_of = np.argsort(q, kind="stable")  # tokens grouped by request, each in trace order
    ends = np.cumsum(np.bincount(q))
    starts = ends - np.bincount(q)
    order = np.random.default_rng(seed).permutation(starts.size)
    C = min(concurrency, starts.size)
    live = [[int(order[i]), 0] for i in range(C)]
    nxt = C
    layer = np.repeat(np.arange(L), C * K)
    busiest = mean = 0.0
    for _ in range(steps):
        rows = np.array([rows_of[starts[r] + p] for r, p in live])
        ex = topk[rows].transpose(1, 0, 2).reshape(-1).astype(np.int64)  # [L * C * K], layer-major
        present = np.zeros(L * E, dtype=bool)
        present[layer * E + ex] = True
        li, ei = np.divmod(np.flatnonzero(present), E)
        work = np.bincount(li * ep_size + e2r[li, ei], minlength=L * ep_size).reshape(L, ep_size)
        busiest += float(work.max(axis=1).sum())
        mean += float(work.mean(axis=1).sum())
        for c in live:
            c[1] += 1
            if starts[c[0]] + c[1] >= ends[c[0]]:
                c[0], c[1] = int(order[nxt % order.size]), 0
                nxt += 1
    return busiest / mean  # every step activates some expert: mean > 0


def request_token_table(token_ids: np.ndarray, request_ids: np.ndarray, request2rank: np.ndarray,
                        vocab_size: int, ep_size: int, is_prefill: np.ndarray | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """What a prompt's tokens say about the rank its request belongs on, learned from the
    training requests' ranks (:func:`place_requests`): a token votes for the rank holding most of
    the training requests whose prompt contains it (each request counted once), with confidence
    (share - 1/N) / (1 - 1/N), so a token found evenly on every rank (a template, punctuation)
    votes nothing. token_ids, request_ids: [T] int of the training requests; request2rank: [Q]
    int, requests in order of first appearance; is_prefill: [T] bool (None: every token is a
    prompt token). Returns (token2rank [V, 2] int16 best / second rank, -1 = unseen;
    token_conf [V] float16, 0 = unseen or no preference)."""
    _, q = request_index(request_ids)
    ok = (token_ids >= 0) & (token_ids < vocab_size)
    if is_prefill is not None:
        ok &= is_prefill.astype(bool)
    pairs = np.unique(q[ok] * vocab_size + token_ids[ok].astype(np.int64))  # distinct (request, token)
    tok, req = pairs % vocab_size, pairs // vocab_size
    C = np.bincount(tok * ep_size + request2rank[req], minlength=vocab_size * ep_size
                    ).reshape(vocab_size, ep_size).astype(np.float64)
    seen = C.sum(axis=1) > 0
    order = np.argsort(-C, axis=1, kind="stable")[:, :2]
    t2r = np.full((vocab_size, 2), -1, dtype=np.int16)
    t2r[seen, : order.shape[1]] = order[seen]
    if ep_size > 1:  # a second rank only where some request containing the token was placed there
        t2r[seen & (C[np.arange(vocab_size), order[:, 1]] == 0), 1] = -1
    conf = np.zeros(vocab_size, dtype=np.float16)
    if ep_size > 1:
        share = C[seen].max(axis=1) / C[seen].sum(axis=1)
        conf[seen] = np.maximum(0.0, (share - 1 / ep_size) / (1 - 1 / ep_size))
    else:
        conf[seen] = 1.0
    return t2r, conf
