"""Synthetic routing traces at production MoE shapes, for scale tests of smoe-place.

The generator mimics the three regularities smoe exploits (token-expert conjugacy, inter-layer
affinity, domain skew), each with its own knob (:func:`generate`).

Optionally group-limited, as DeepSeek-V3 routes (``groups`` = its ``n_group``, ``topk_group``):
each token's experts at a layer then lie in at most ``topk_group`` of the ``groups`` contiguous
blocks of expert ids.

Pure numpy, streamed in chunks; output is the routing-trace format (:mod:`vllm_smoe.formats.trace`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..formats.trace import TraceMeta, TraceWriter


@dataclass(frozen=True)
class MoEShape:
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    hidden_size: int


SHAPES: dict[str, MoEShape] = {
    "deepseek-v3": MoEShape(58, 256, 8, 129280, 7168),
    "qwen3-235b-a22b": MoEShape(94, 128, 8, 151936, 4096),
    "deepseek-v2-lite": MoEShape(26, 64, 6, 102400, 2048),
    "mixtral-8x7b": MoEShape(32, 8, 2, 32000, 4096),
}

_TABLE = 4096  # resolution of the popularity sampling tables


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def _sampling_table(p: np.ndarray) -> np.ndarray:
    """[_TABLE] int32: entries repeated in proportion to ``p`` (p: [E] float64, sums to 1)."""
    cdf = np.cumsum(p)
    return np.searchsorted(cdf, (np.arange(_TABLE) + 0.5) / _TABLE).clip(0, len(p) - 1).astype(np.int32)


def _dedup_rows(x: np.ndarray, num_experts: int, fresh) -> np.ndarray:
    """Make every row of ``x`` ([n, K] int) hold distinct ids, replacing repeats with ``fresh(m)``."""
    n, k = x.shape
    rows = np.arange(n)
    for _ in range(8):
        sub = x[rows]
        dup = np.zeros(sub.shape, dtype=bool)
        for j in range(1, k):  # K(K-1)/2 column compares beat a per-row sort
            dup[:, j] = (sub[:, :j] == sub[:, j: j + 1]).any(axis=1)
        bad = dup.any(axis=1)
        if not bad.any():
            return x
        sub[dup] = fresh(int(dup.sum()))
        x[rows] = sub
        rows = rows[bad]
    # Rare leftovers: replace each repeat by the next id not yet in the row.
    for r in rows:
        seen: set[int] = set()
        for j in range(k):
            v = int(x[r, j])
            while v in seen:
                v = (v + 1) % num_experts
            seen.add(v)
            x[r, j] = v
    return x


def _limit_groups(x: np.ndarray, num_experts: int, groups: int, topk_group: int) -> np.ndarray:
    """Group-limited rows: each row of ``x`` ([n, K] int64, distinct per row) keeps its experts
    in the ``topk_group`` groups holding most of them (the earlier column first on ties); an
    expert elsewhere moves to the same place in one of those groups, then steps along them
    until the row is distinct again. Returns [n, K] int64."""
    n, K = x.shape
    S = num_experts // groups
    g = x // S
    onehot = g[:, :, None] == np.arange(groups)[None, None, :]  # [n, K, G]
    first = np.where(onehot, np.arange(K)[None, :, None], K).min(axis=1)  # [n, G]
    score = onehot.sum(axis=1) * (K + 1) + (K - first)
    allowed = np.argsort(-score, axis=1, kind="stable")[:, :topk_group]  # [n, M]
    where = g[:, :, None] == allowed[:, None, :]  # [n, K, M]
    j = np.where(where.any(-1), where.argmax(-1), np.arange(K)[None, :] % topk_group)  # index into allowed
    a = j * S + x % S  # position among the row's allowed experts
    rows = np.arange(n)[:, None]
    for _ in range(topk_group * S):
        dup = np.zeros(a.shape, dtype=bool)
        for c in range(1, K):
            dup[:, c] = (a[:, :c] == a[:, c: c + 1]).any(axis=1)
        if not dup.any():
            break
        a = np.where(dup, (a + 1) % (topk_group * S), a)
    return allowed[rows, a // S] * S + a % S


def generate(shape: MoEShape, num_tokens: int, seed: int = 0, hotness: float = 0.8, affinity: float = 0.5,
             domain_skew: float = 1.0, num_domains: int = 4, token_zipf: float = 1.1,
             request_tokens: tuple[int, int] = (64, 1024), prefill_share: float = 0.75,
             step_tokens: int = 2048, chunk_tokens: int = 1 << 16, groups: int | None = None,
             topk_group: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Yield trace chunks (dicts of the trace fields) totalling ``num_tokens`` rows.

    The generator mimics the three regularities smoe exploits, each with its own knob:

    - ``hotness``: probability that an activation takes one of the token id's own K preferred
      experts at that layer (token-expert conjugacy); frequent tokens then show top-K hotness
      close to ``hotness``.
    - ``affinity``: of the remaining activations, the share that follow the previous layer's
      experts through a fixed per-layer expert successor map (inter-layer affinity).
    - ``domain_skew``: Zipf exponent of each domain's expert popularity (the rest of activations,
      and the preferred experts themselves, are drawn from the token's domain popularity)."""
    if not 0.0 <= hotness <= 1.0 or not 0.0 <= affinity <= 1.0:
        raise ValueError(f"hotness and affinity must lie in [0, 1], got {hotness}, {affinity}")
    L, E, K, V = shape.num_layers, shape.num_experts, shape.top_k, shape.vocab_size
    if K > E:
        raise ValueError(f"top_k {K} exceeds num_experts {E}")
    if (groups is None) != (topk_group is None):
        raise ValueError("groups and topk_group go together")
    if groups is not None and (groups < 1 or E % groups or not 1 <= topk_group <= groups
                               or topk_group * (E // groups) < K):
        raise ValueError(f"groups {groups} must divide num_experts {E}, and topk_group {topk_group} of them "
                         f"(1..groups) must hold top_k {K} experts")
    rng = np.random.default_rng(seed)
    D = num_domains
    # Expert popularity per (domain, layer): Zipf over a random order of experts.
    tables = np.empty((D, L, _TABLE), dtype=np.int32)
    zw = _zipf_weights(E, domain_skew)
    for d in range(D):
        for layer in range(L):
            p = np.empty(E)
            p[rng.permutation(E)] = zw
            tables[d, layer] = _sampling_table(p)
    # Token ids: Zipf frequency, a domain-specific order over the vocabulary, a home domain each.
    tok_cdf = np.cumsum(_zipf_weights(V, token_zipf))
    tok_perm = np.stack([rng.permutation(V).astype(np.int32) for _ in range(D)])
    home = rng.integers(0, D, size=V, dtype=np.int32)
    # Preferred experts of each token at each layer: K distinct experts around a popular base.
    stride = np.array([_coprime_stride(E, rng) for _ in range(L)], dtype=np.int64)  # [L]
    pref = np.empty((L, V, K), dtype=np.int16)
    for layer in range(L):
        base = tables[home, layer, rng.integers(0, _TABLE, size=V)].astype(np.int64)
        pref[layer] = (base[:, None] + np.arange(K)[None, :] * stride[layer]) % E
    succ = np.stack([rng.permutation(E) for _ in range(L)]).astype(np.int16)  # [L, E]

    produced = 0
    req_id = 0
    req_left = 0
    req_pos = 0
    req_dom = 0
    req_len = 0
    while produced < num_tokens:
        n = min(chunk_tokens, num_tokens - produced)
        # Lay out requests over the chunk.
        req_ids = np.empty(n, dtype=np.int32)
        pos = np.empty(n, dtype=np.int32)
        dom = np.empty(n, dtype=np.int8)
        prefill = np.empty(n, dtype=bool)
        i = 0
        while i < n:
            if req_left == 0:
                req_id += 1 if produced + i > 0 else 0
                req_len = int(rng.integers(request_tokens[0], request_tokens[1] + 1))
                req_left, req_pos, req_dom = req_len, 0, int(rng.integers(0, D))
            m = min(req_left, n - i)
            req_ids[i: i + m] = req_id
            pos[i: i + m] = np.arange(req_pos, req_pos + m)
            dom[i: i + m] = req_dom
            prefill[i: i + m] = np.arange(req_pos, req_pos + m) < int(prefill_share * req_len)
            req_pos += m
            req_left -= m
            i += m
        ranks = np.searchsorted(tok_cdf, rng.random(n)).clip(0, V - 1)
        tok = tok_perm[dom, ranks]
        dom64 = dom.astype(np.int64)
        out = np.empty((n, L, K), dtype=np.int16)
        prev = None
        for layer in range(L):
            def fresh(m: int, _layer=layer) -> np.ndarray:
                rows = rng.integers(0, n, size=m)
                return tables[dom64[rows], _layer, rng.integers(0, _TABLE, size=m)]

            rand = tables[dom64[:, None], layer, rng.integers(0, _TABLE, size=(n, K))]
            u = rng.random((n, K))
            cur = np.where(u < hotness, pref[layer][tok], rand)
            if prev is not None:
                follow = (u >= hotness) & (u < hotness + (1.0 - hotness) * affinity)
                cur = np.where(follow, succ[layer][prev], cur)
            cur = _dedup_rows(cur.astype(np.int64), E, fresh)
            if groups is not None:
                cur = _limit_groups(cur, E, groups, topk_group)
            out[:, layer, :] = cur
            prev = cur
        yield {
            "token_ids": tok.astype(np.int32),
            "request_ids": req_ids,
            "positions": pos,
            "topk_ids": out,
            "step_ids": ((produced + np.arange(n)) // step_tokens).astype(np.int32),
            "is_prefill": prefill,
            "domain": dom,
        }
        produced += n


def _coprime_stride(E: int, rng: np.random.Generator) -> int:
    while True:
        s = int(rng.integers(1, max(2, E)))
        if np.gcd(s, E) == 1:
            return s


def write_synthetic(path: str, shape_name: str, num_tokens: int, seed: int = 0, progress: bool = False,
                    file_tokens: int | None = None, num_layers: int | None = None, **knobs) -> str:
    """Generate ``num_tokens`` rows of ``SHAPES[shape_name]`` into the trace file ``path``, or, with
    ``file_tokens``, into the directory ``path`` as ``trace-00000.npz ...`` of ``file_tokens`` rows
    each: one recording, like the recorder's rotated files (request and step ids run on).
    num_layers: the shape's first MoE layers only (default all), for projections whose cost is per
    layer and whose traces would not fit in memory at every layer."""
    import dataclasses
    import os

    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose one of {', '.join(SHAPES)}")
    shape = SHAPES[shape_name]
    if num_layers is not None:
        if not 1 <= num_layers <= shape.num_layers:
            raise ValueError(f"--layers {num_layers}: {shape_name} has 1 .. {shape.num_layers} MoE layers")
        shape = dataclasses.replace(shape, num_layers=num_layers)
    num_domains = knobs.get("num_domains", 4)
    chunk = knobs.get("chunk_tokens", 1 << 16)
    meta = TraceMeta(num_experts=shape.num_experts, top_k=shape.top_k, num_layers=shape.num_layers,
                     vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                     domains=tuple(f"domain{d}" for d in range(num_domains)),
                     model=f"synthetic:{shape_name}",
                     extra={"synthetic": dict(seed=seed, **knobs)})
    if file_tokens is not None:  # rotated files of one recording, like the recorder's
        meta = dataclasses.replace(meta, extra={**meta.extra, "recording": f"synthetic:{os.path.abspath(path)}"})
    if file_tokens is not None and file_tokens < 1:
        raise ValueError(f"file_tokens must be positive, got {file_tokens}")
    chunks = generate(shape, num_tokens, seed=seed, **knobs)
    if progress:
        from tqdm import tqdm

        chunks = tqdm(chunks, total=-(-num_tokens // chunk), desc=f"synth {shape_name}", unit="chunk")
    if file_tokens is None:
        with TraceWriter(path, meta) as w:
            for ch in chunks:
                w.append(**ch)
        return path
    os.makedirs(path, exist_ok=True)
    if any(f.endswith(".npz") for f in os.listdir(path)):  # they would be read as a second recording
        raise ValueError(f"{path}: already holds trace files; write rotated files into an empty directory")
    w, index, rows = None, 0, 0
    try:
        for ch in chunks:
            n, s = ch["token_ids"].shape[0], 0
            while s < n:  # a chunk may straddle two files
                if w is None:
                    w = TraceWriter(os.path.join(path, f"trace-{index:05d}.npz"), meta)
                    index += 1
                m = min(n - s, file_tokens - rows)
                w.append(**{k: v[s: s + m] for k, v in ch.items()})
                s, rows = s + m, rows + m
                if rows == file_tokens:
                    w.close()
                    w, rows = None, 0
        if w is not None:
            w.close()
    except BaseException:
        if w is not None:
            w.abort()
        raise
    return path
