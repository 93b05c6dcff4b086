"""The exact 0-1 co-clustering program, solved with scipy's HiGHS (``scipy.optimize.milp``).

Maximise the activations whose token id and expert share a rank:
    max  sum_{v,e,r} A[v,e] z[v,e,r]
    s.t. z <= x[e,r], z <= y[v,r]                         (local only if both are on r)
         sum_r x[e,r] = 1, sum_e x[e,r] = E/N             (each expert once, equal experts)
         sum_r y[v,r] = 1, sum_v occ[v] y[v,r] <= cap     (each id once, token capacity)
with cap = capacity * sum(occ) / N, and optionally sum_e load[e] x[e,r] <= max_expert_load *
mean rank load (the expert-load cap smoe's solvers honour). Small instances only (variables ~ nnz(A) * N).
With ``fixed_expert2rank`` the experts are pinned, giving the best token assignment for a
given placement: that is how other methods are scored against the bound.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


class _Rows:
    """Sparse constraint rows lo <= M x <= hi, one :meth:`add` a row."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []

    def add(self, cidx, cval, lb, ub) -> None:
        self.rows.extend([len(self.lo)] * len(cidx))
        self.cols.extend(cidx)
        self.vals.extend(cval)
        self.lo.append(lb)
        self.hi.append(ub)

    def constraint(self, n: int):
        from scipy.optimize import LinearConstraint

        M = sp.coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), n))
        return LinearConstraint(M, self.lo, self.hi)


def _placement_rows(c: _Rows, A: np.ndarray, occ: np.ndarray, N: int, X, Y, capacity: float,
                    max_expert_load: float | None) -> None:
    """Each expert on one rank, E/N per rank; each token id on one rank within the token capacity;
    optionally the expert-load cap. X(e, r), Y(v, r): variable indices."""
    V, E = A.shape
    for e in range(E):
        c.add([X(e, r) for r in range(N)], [1.0] * N, 1, 1)
    for r in range(N):
        c.add([X(e, r) for e in range(E)], [1.0] * E, E // N, E // N)
    for v in range(V):
        c.add([Y(v, r) for r in range(N)], [1.0] * N, 1, 1)
    cap = capacity * occ.sum() / N
    for r in range(N):
        c.add([Y(v, r) for v in range(V)], occ.tolist(), -np.inf, cap)
    if max_expert_load is not None:
        load = A.sum(axis=0)
        for r in range(N):
            c.add([X(e, r) for e in range(E)], load.tolist(), -np.inf, max_expert_load * load.sum() / N)


def solve_ilp(A: np.ndarray, occ: np.ndarray, ep_size: int, capacity: float = 1.10,
              fixed_expert2rank: np.ndarray | None = None, max_expert_load: float | None = None,
              time_limit: float = 60.0
              ) -> tuple[float, np.ndarray, np.ndarray, bool]:
    """A: [V, E] float dense counts; occ: [V] float; max_expert_load: optional cap on each rank's
    expert load (sum of its experts' activations) as a multiple of the mean. Returns (objective, expert2rank [E] int32,
    token2rank [V] int32, proven_optimal). Raises ValueError when infeasible."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    V, E = A.shape
    N = ep_size
    if E % N:
        raise ValueError(f"ep_size {N} must divide num_experts {E}")
    vv, ee = np.nonzero(A > 0)
    nz = vv.size
    nx, ny, nzv = E * N, V * N, nz * N
    n = nx + ny + nzv
    X = lambda e, r: e * N + r  # noqa: E731
    Y = lambda v, r: nx + v * N + r  # noqa: E731
    c = np.zeros(n)
    r_all = np.tile(np.arange(N), nz)
    zi = nx + ny + np.arange(nzv)
    c[zi] = -np.repeat(A[vv, ee], N)
    # z - x <= 0 and z - y <= 0, vectorised
    zv, ze = np.repeat(vv, N), np.repeat(ee, N)
    m = nzv
    base = np.arange(m)
    Z1 = sp.coo_matrix((np.r_[np.ones(m), -np.ones(m)], (np.r_[base, base], np.r_[zi, X(ze, r_all)])), shape=(m, n))
    Z2 = sp.coo_matrix((np.r_[np.ones(m), -np.ones(m)], (np.r_[base, base], np.r_[zi, Y(zv, r_all)])), shape=(m, n))
    rows = _Rows()
    _placement_rows(rows, A, occ, N, X, Y, capacity, max_expert_load)
    lb = np.zeros(n)
    ub = np.ones(n)
    if fixed_expert2rank is not None:
        fx = np.zeros(nx)
        fx[X(np.arange(E), np.asarray(fixed_expert2rank))] = 1.0
        lb[:nx] = ub[:nx] = fx
    else:
        lb[X(0, 0)] = 1.0  # ranks are interchangeable: pin expert 0 to rank 0
    cons = [rows.constraint(n), LinearConstraint(Z1, -np.inf, 0), LinearConstraint(Z2, -np.inf, 0)]
    integrality = np.ones(n)
    integrality[zi] = 0  # z is integral at the optimum once x and y are
    res = milp(c, constraints=cons, integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": time_limit, "disp": False})
    if res.x is None:
        raise ValueError(f"ILP found no solution ({res.message})")
    x = res.x[:nx].reshape(E, N)
    y = res.x[nx:nx + ny].reshape(V, N)
    return float(-res.fun), x.argmax(axis=1).astype(np.int32), y.argmax(axis=1).astype(np.int32), res.status == 0


def solve_ilp_bytes(A: np.ndarray, occ: np.ndarray, instances: tuple[np.ndarray, np.ndarray, np.ndarray],
                    ep_size: int, capacity: float = 1.10, max_expert_load: float | None = None,
                    time_limit: float = 60.0) -> tuple[float, np.ndarray, np.ndarray, bool]:
    """The exact program of :mod:`.bytes`: minimise the de-duplicated remote rows
        min  sum_h w_h (sum_r s[h,r] - sum_r u[h,r])
        s.t. s[h,r] >= x[e,r] for e in set h          (set h spans rank r)
             u[h,r] <= s[h,r], u[h,r] <= y[v_h,r]     (its token sits on one of its ranks)
    with the expert, token-capacity and optional expert-load constraints of :func:`solve_ilp`.
    A: [V, E] dense counts (loads); occ: [V]; instances: (hv [H], sets [H, K] (-1 = none), w [H]).
    Returns (rows, expert2rank [E] int32, token2rank [V] int32, proven_optimal)."""
    from scipy.optimize import Bounds, milp

    hv, sets, w = instances
    V, E = A.shape
    N = ep_size
    H = sets.shape[0]
    if E % N:
        raise ValueError(f"ep_size {N} must divide num_experts {E}")
    nx, ny, ns = E * N, V * N, H * N
    n = nx + ny + 2 * ns
    X = lambda e, r: e * N + r  # noqa: E731
    Y = lambda v, r: nx + v * N + r  # noqa: E731
    S = lambda h, r: nx + ny + h * N + r  # noqa: E731
    U = lambda h, r: nx + ny + ns + h * N + r  # noqa: E731
    c = np.zeros(n)
    hh, rr = np.repeat(np.arange(H), N), np.tile(np.arange(N), H)
    c[S(hh, rr)] = w[hh]
    c[U(hh, rr)] = -w[hh]
    rows = _Rows()
    _placement_rows(rows, A, occ, N, X, Y, capacity, max_expert_load)
    for h in range(H):
        for e in sets[h][sets[h] >= 0]:
            for r in range(N):
                rows.add([S(h, r), X(e, r)], [1.0, -1.0], 0, np.inf)
        for r in range(N):
            rows.add([U(h, r), S(h, r)], [1.0, -1.0], -np.inf, 0)
            rows.add([U(h, r), Y(hv[h], r)], [1.0, -1.0], -np.inf, 0)
    lb, ub = np.zeros(n), np.ones(n)
    lb[X(0, 0)] = 1.0  # ranks are interchangeable: pin expert 0 to rank 0
    integrality = np.zeros(n)
    integrality[:nx + ny] = 1  # s and u are integral at the optimum once x and y are
    res = milp(c, constraints=[rows.constraint(n)], integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": time_limit, "disp": False})
    if res.x is None:
        raise ValueError(f"ILP found no solution ({res.message})")
    x = res.x[:nx].reshape(E, N)
    y = res.x[nx:nx + ny].reshape(V, N)
    return float(res.fun), x.argmax(axis=1).astype(np.int32), y.argmax(axis=1).astype(np.int32), res.status == 0
