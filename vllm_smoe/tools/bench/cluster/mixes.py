"""The request mixes of the goodput mode: prompt and output lengths drawn from shipped
distributions, prompts cut from the held-out trace's workloads.

Lengths are log-normal (median, sigma) clipped to [lo, hi], in tokens, sized for the testbed's
512-token context (``--max-model-len 512``): the proportions, not the sizes, stand for real
traffic. Each mix also names the rows per rank of its typical step (the link is derived at that
batch, :func:`.link.link_for_rows`), the target its goodput is searched under, and the rate range
of the search relative to one request's unloaded time (so that it fits any model's speed).
"""

from __future__ import annotations

import numpy as np

# name -> prompt (median, sigma, lo, hi), output (...), rows_per_rank, criterion, the search's
# rate range in units of 1 / S (S: the median unloaded time of one request, first token to last),
# what it stands for
MIXES = {
    "prefill-heavy": dict(prompt=(96, 0.35, 48, 192), output=(4, 0.5, 2, 12), rows_per_rank=128,
                          criterion="ttft", rates=(0.5, 8.0),
                          stands_for="long prompts and short answers: summarisation, retrieval-augmented "
                                     "questions, code completion"),
    "chat": dict(prompt=(128, 0.6, 16, 384), output=(32, 0.6, 8, 96), rows_per_rank=64,
                 criterion="both", rates=(0.5, 8.0),
                 stands_for="a conversation turn: a moderate prompt, an answer of a few sentences"),
    "decode-heavy": dict(prompt=(32, 0.5, 8, 96), output=(64, 0.4, 32, 160), rows_per_rank=32,
                         criterion="tpot", rates=(1.0, 16.0),
                         stands_for="short prompts and long answers: generation, reasoning traces"),
}


def _lognormal(rng, median: float, sigma: float, lo: int, hi: int, n: int) -> np.ndarray:
    return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), lo, hi).astype(np.int64)


def draw_lengths(mix: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_len int64[n], output_len int64[n]) of ``n`` requests of ``mix``, seeded."""
    if mix not in MIXES:
        raise ValueError(f"mix {mix!r}: choose one of {', '.join(MIXES)}")
    m, rng = MIXES[mix], np.random.default_rng(seed)
    return _lognormal(rng, *m["prompt"], n), _lognormal(rng, *m["output"], n)


def workload_prompts(token_ids: np.ndarray, domain: np.ndarray, lengths: np.ndarray, seed: int) -> list[list[int]]:
    """One prompt per entry of ``lengths``: a window of that many tokens of one workload's text
    (the trace's requests of that domain, in order), the workload drawn evenly, the window's
    start drawn at random, a start not drawn before, so that prompts rarely share a prefix (vLLM's prefix cache would answer
    a repeated prompt's prefill).

    token_ids: int[T] the trace's tokens, requests contiguous; domain: int[T] each token's
    workload; lengths: int[n] tokens per prompt."""
    rng = np.random.default_rng(seed)
    doms = [d for d in np.unique(domain) if (domain == d).sum() > int(lengths.max(initial=1))]
    if not doms:
        raise ValueError(f"no workload of the trace has {int(lengths.max(initial=1))} tokens for one prompt")
    texts = {d: token_ids[domain == d] for d in doms}
    used: dict = {d: set() for d in doms}
    out = []
    for i, n in enumerate(lengths):
        d = doms[i % len(doms)]
        t = texts[d]
        for _ in range(64):  # a start not drawn before, while the workload's text has one
            s = int(rng.integers(0, t.size - n + 1))
            if s not in used[d]:
                break
        used[d].add(s)
        out.append(t[s: s + n].tolist())
    return out
