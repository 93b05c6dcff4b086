"""Expert counts the ranks do not divide (60 experts on 8 ranks): solving for vLLM's split.

vLLM splits E experts over N expert-parallel ranks as evenly as it can, the first E mod N ranks
holding one more (``determine_expert_map``, both its ``linear`` and ``round_robin`` strategies;
:func:`.counts.rank_sizes`).
A placement must give every rank exactly that many experts, since the loader only renames which
expert sits in each of vLLM's slots. The solvers assume E / N experts per rank, so a layer is
solved with N - E mod N *phantom* experts added (no token routes to them; every rank then holds
ceil(E / N)) and :func:`fit_rank_sizes` then moves the phantoms onto the ranks vLLM gives one
expert fewer, trading each misplaced phantom for the real expert that loses least by the move.
Dropping the phantoms leaves vLLM's sizes.

Arrays: A [V', E] token-id x expert counts, occ [V'] occurrences, expert2rank [E] int.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .coclust import cap_expert_load
from .counts import assign_token_ids, expert_gains, rank_scores, rank_sizes


def phantoms(num_experts: int, ep_size: int) -> int:
    """Experts to add so that ep_size divides the count (0 when it already does)."""
    return -num_experts % ep_size


def with_phantoms(A: sp.spmatrix, ep_size: int) -> sp.csr_matrix:
    """A [V', E] with :func:`phantoms` zero columns appended: [V', E + pad] csr."""
    pad = phantoms(A.shape[1], ep_size)
    A = sp.csr_matrix(A)
    return A if pad == 0 else sp.hstack([A, sp.csr_matrix((A.shape[0], pad), dtype=A.dtype)], format="csr")


def fit_rank_sizes(A: sp.spmatrix, occ: np.ndarray, padded: np.ndarray, ep_size: int,
                   capacity: float = 1.10, max_expert_load: float | None = None) -> np.ndarray:
    """The real experts' ranks of a placement solved with phantoms, each rank holding vLLM's count.

    A: [V', E] counts of the real experts; occ: [V'] float; padded: [E + pad] int, ceil(E / N)
    experts per rank, experts E.. the phantoms (:func:`phantoms`). Ranks r >= E mod N must hold
    one phantom each, the others none: each phantom on a rank with too many moves to a rank
    with none, and one real expert of that rank moves back in its place, the one whose gain
    (activations its rank's token ids give it, :func:`.counts.expert_gains` under the padded
    placement's token assignment) drops least; with ``max_expert_load``, then
    :func:`.coclust.cap_expert_load`'s swaps bring the busiest rank's activations back within
    that multiple of the mean where they can. Returns expert2rank [E] int32 with
    ``bincount == rank_sizes(E, N)``."""
    E, N = A.shape[1], ep_size
    pad = phantoms(E, N)
    padded = np.asarray(padded, dtype=np.int64)
    if padded.shape != (E + pad,) or (np.bincount(padded, minlength=N) != (E + pad) // N).any():
        got = np.bincount(padded, minlength=N).tolist() if padded.ndim == 1 and padded.size else padded.shape
        raise ValueError(f"padded must be [{E + pad}] with {(E + pad) // N} experts on each of {N} ranks, got "
                         f"shape {padded.shape}, ranks holding {got}")
    e2r = padded.copy()
    if pad == 0:
        return e2r.astype(np.int32)
    want = (rank_sizes(E, N) < -(-E // N)).astype(np.int64)  # [N]: phantoms each rank must hold
    A = sp.csr_matrix(A, dtype=np.float64)
    act = np.asarray(A.sum(axis=0)).ravel()  # [E]: activations of each expert
    G = expert_gains(A, assign_token_ids(rank_scores(A, e2r[:E], N), np.asarray(occ, dtype=np.float64), capacity), N)
    ghost = np.arange(E, E + pad)
    while True:
        have = np.bincount(e2r[ghost], minlength=N)
        over = np.flatnonzero(have > want)
        if over.size == 0:
            if max_expert_load is None:
                return e2r[:E].astype(np.int32)
            # a phantom's rank held only real experts' load up to the cap: the one that came in may
            # push it past; swaps of two real experts keep every rank's count
            return cap_expert_load(e2r[:E], G, act, N, max_expert_load)
        a = int(over[0])
        f = int(ghost[e2r[ghost] == a][0])
        under = np.flatnonzero(have < want)
        real = np.flatnonzero(np.isin(e2r[:E], under))  # experts that could come back to a
        loss = G[real, e2r[real]] - G[real, a]  # lowest first, then the lowest expert id
        e = int(real[np.argmin(loss)])
        e2r[f], e2r[e] = e2r[e], a
