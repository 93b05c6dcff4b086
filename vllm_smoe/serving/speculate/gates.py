"""The gates a predictor runs ahead of vLLM's own: a block's gate and pure routing step on rows
smoe holds (predictors router and input-gate), and the sum of the gate's logits from each
rank's partial rows (router before the attention's reduce)."""

from __future__ import annotations

import torch

from . import device_predict


def route_ahead(gate: torch.nn.Module, router, x: torch.Tensor, held: torch.Tensor,
                input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictor router: vLLM's own gate and routing step on a block's rows, which every rank
    holds whole before the block chunks them, so each token's ranks are known exactly rather than
    predicted. x: [T, H]; held: [N, E] bool, rank holds a copy of router output e (home or
    replica). Returns (pref [T, 2] int64, conf [T] float32) as :func:`device_predict.prefer_held`.
    Costs one more
    gate GEMM over T rows per layer (vLLM's own runs on the T / N rows of the chunk); the routing
    step is the pure one (no capture, no EPLB bookkeeping). The gate is called through
    ``forward``: its hooks (smoe's capture on a monolithic kernel's gate) belong to the block's
    own pass over its chunk."""
    _, ids = router._compute_routing(x, gate_logits(gate, x), None, input_ids=input_ids)
    return device_predict.prefer_held(ids, held)


def gate_ranks(norm: torch.nn.Module, gate: torch.nn.Module, router, x: torch.Tensor, held: torch.Tensor,
               input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictor input-gate on rows x [n, H] of a layer's input (the residual stream before its
    attention): :func:`route_ahead` on them after the layer's post-attention ``norm``, called
    through ``forward`` (its hook, smoe's shuffled reduce-scatter seam, belongs to the layer's own
    pass). Returns (pref [n, 2] int64, conf [n] float32) as :func:`device_predict.prefer_held`."""
    return route_ahead(gate, router, norm.forward(x), held, input_ids)


def gate_logits(gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gate's logits [n, E] of rows x [n, H], called through ``forward`` (its hooks belong to
    the block's own pass)."""
    logits = gate.forward(x)
    return logits[0] if isinstance(logits, tuple) else logits  # vLLM's linear layers: (output, bias)


def exact_gate_scale(norm: torch.nn.Module, gate: torch.nn.Module, router, hidden: int, dtype: torch.dtype,
                     device) -> tuple[torch.Tensor | None, str]:
    """``(w, reason)`` for predictor ``router`` under the shuffled reduce-scatter: the routed
    experts of a row x = residual + sum_r partial_r are the top-k of ``gate(norm(x))``; when the
    norm is a per-row positive scale times a per-channel weight (RMSNorm and its kin:
    ``norm(x) = s(x) * x * w``), the gate is linear without bias, and the routing step's top-k
    does not change when the logits are scaled (softmax or sigmoid top-k without a correction
    bias), they are also the top-k of ``sum_r gate(w * partial_r) + gate(w * residual)``, a sum
    of [T, E] terms each rank can compute before the reduce. Probes the modules once at load
    (a seeded random input) and returns w [H] in ``dtype`` (up to a common positive factor), or
    None and why not."""
    with torch.no_grad():
        one = norm.forward(torch.ones(1, hidden, dtype=dtype, device=device))
        w = (one[0] if isinstance(one, tuple) else one)[0]
        x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(0)).to(dtype=dtype, device=device)
        y = norm.forward(x)
        y = (y[0] if isinstance(y, tuple) else y).float()
        # y = c * x * w per row, c > 0 (least squares; channels a widened model pads with zero
        # weights are zero on both sides)
        xw = x.float() * w.float()
        c = (y * xw).sum(dim=1) / (xw * xw).sum(dim=1).clamp_min(1e-30)
        err = (y - c[:, None] * xw).norm(dim=1) / y.norm(dim=1).clamp_min(1e-30)
        if not bool(torch.all((c > 0) & (err <= 0.02) & (xw.abs().amax(dim=1) > 0))):
            return None, (f"{type(norm).__name__} is not a per-row scale times a per-channel weight, so the gate's "
                          f"logits cannot be summed from partial rows")
        g0 = gate_logits(gate, torch.zeros(1, hidden, dtype=dtype, device=device)).float()
        ga, gb, gab = (gate_logits(gate, v).float() for v in (x[:4], x[4:], x[:4] + x[4:]))
        if bool(g0.abs().amax() > 0) or not torch.allclose(gab, ga + gb, rtol=0.05,
                                                           atol=0.05 * float(gab.abs().amax())):
            return None, (f"{type(gate).__name__} is not linear without bias, so its logits are not a sum over "
                          f"partial rows")
        E = gate_logits(gate, x).shape[1]
        # float32, as served: the summed logits (unit_rows) reach the routing step in float32
        z = torch.randn(16, E, generator=torch.Generator().manual_seed(1)).to(device=device)
        h, ids = torch.zeros(16, hidden, dtype=dtype, device=device), torch.zeros(16, dtype=torch.long, device=device)
        want = router._compute_routing(h, z, None, input_ids=ids)[1].sort(dim=1).values
        for zz in (z * 0.25, z * 4.0, unit_rows(z)):  # unit_rows: what the routing step is given
            if not torch.equal(router._compute_routing(h, zz, None, input_ids=ids)[1].sort(dim=1).values, want):
                return None, (f"{type(router).__name__}'s experts change when the logits are scaled (a correction "
                              f"bias or a scale-dependent rule), so the norm's per-row scale cannot be left out")
    return w, ""


def unit_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, E] over each row's largest magnitude (a positive per-row factor, which
    :func:`exact_gate_scale` checked the routing step ignores): summed from partial rows they are
    the gate's logits times the row's RMS, which can reach 100 or more on residual streams with
    outliers, where a softmax or sigmoid in float32 rounds the weaker top-k to 0 or 1 and ties."""
    return logits / logits.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)


def sum_gathered(parts: torch.Tensor, N: int) -> torch.Tensor:
    """parts: [N * T, E] the ranks' terms after an all-gather -> [T, E] float32, summed rank by
    rank in rank order (the same bits on every rank, which the same assignment needs)."""
    parts = parts.view(N, -1, parts.shape[-1]).float()
    total = parts[0].clone()
    for r in range(1, N):
        total += parts[r]
    return total

