"""The link derived from a target's proportions and this host's speed."""

from __future__ import annotations

import time

# A target: the accelerator's dense throughput in the serving dtype (FLOP/s), its memory
# bandwidth (B/s), the link one way (B/s) and the link's one-way latency (s).
TARGETS = {
    "ib-ndr": dict(flops=989e12, mem_bw=4.8e12, link_bw=50e9, latency=3e-6,
                   what="H200 (989 TFLOP/s bf16, 4.8 TB/s HBM) with one 400 Gbit/s NDR InfiniBand NIC"),
    "nvlink": dict(flops=989e12, mem_bw=4.8e12, link_bw=450e9, latency=1e-6,
                   what="H200 over NVLink 4 (900 GB/s both directions)"),
    "pcie5": dict(flops=989e12, mem_bw=4.8e12, link_bw=63e9, latency=2e-6,
                  what="H200 over PCIe 5 x16 (s-MoE's slow server)"),
}


def link_settings(host: dict, target: str, phase: str) -> dict:
    """The emulated link for ``phase`` ("decode" or "prefill") at ``target``'s proportions.

    host: {"gemm_flops": FLOP/s, "read_bw": B/s} of one node (one core). The host is slower
    than the target's accelerator by ``scale`` (decode: memory bandwidth, prefill: GEMM
    throughput); the link is slowed by the same factor and its latency stretched by it, which
    keeps the target's bandwidth-delay product in bytes. Returns rate_bytes_s, rate_bit (an
    integer for tc), delay_s, scale, the ratio (accelerator units per link byte) and the phase."""
    if target not in TARGETS:
        raise ValueError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
    t = TARGETS[target]
    if phase == "decode":
        ratio, scale = t["mem_bw"] / t["link_bw"], t["mem_bw"] / host["read_bw"]
    elif phase == "prefill":
        ratio, scale = t["flops"] / t["link_bw"], t["flops"] / host["gemm_flops"]
    else:
        raise ValueError(f"phase {phase!r}: decode or prefill")
    rate = t["link_bw"] / scale
    return {"target": target, "phase": phase, "ratio": ratio, "scale": scale, "rate_bytes_s": rate,
            "rate_bit": int(8 * rate), "delay_s": t["latency"] * scale}


# The GEMM both sides are timed on: a layer's worth of weights (192 MiB in fp32, far over any
# cache), rows against it. The target holds them in bf16 and sends bf16 activations; the host
# fp32 weights and activations: per element the host moves HOST_BYTES / TARGET_BYTES as much.
GEMM_SHAPE = (4096, 12288)
HOST_BYTES, TARGET_BYTES = 4, 2


def roofline_step_s(rows: int, target: str, shape: tuple[int, int] = GEMM_SHAPE) -> float:
    """The target accelerator's time for ``rows`` x shape[0] against shape[0] x shape[1] bf16
    weights: the larger of its FLOPs over peak throughput and its bytes (weights, rows in and
    out) over memory bandwidth."""
    t, (h, n) = TARGETS[target], shape
    flops = 2.0 * rows * h * n
    moved = TARGET_BYTES * (h * n + rows * (h + n))
    return max(flops / t["flops"], moved / t["mem_bw"])


def link_for_rows(host_s: dict, target: str, rows: int, phase: str = "") -> dict:
    """The emulated link for steps of ``rows`` rows per rank at ``target``'s proportions.

    host_s: {rows: seconds} of this host's timed GEMM (:func:`host_step_times`), ``rows`` among
    them. The host is slower than the target by scale = host_s[rows] / roofline_step_s(rows); the
    link is slowed by the same factor (times HOST_BYTES / TARGET_BYTES, since the host sends
    fp32 where the target sends bf16) and its latency stretched by it, so that a step's
    exchange takes the share of the step it would take on the target. Small batches are bound
    by reading weights, large ones by FLOPs; the host's ridge sits elsewhere than the target's,
    so the scale, and the link, change with the batch."""
    if target not in TARGETS:
        raise ValueError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
    if rows not in host_s:
        raise ValueError(f"rows {rows}: the host was timed at {sorted(host_s)} rows only")
    t = TARGETS[target]
    acc = roofline_step_s(rows, target)
    scale = host_s[rows] / acc
    rate = t["link_bw"] * (HOST_BYTES / TARGET_BYTES) / scale
    return {"target": target, "phase": phase or f"rows{rows}", "rows": rows, "host_step_s": host_s[rows],
            "target_step_s": acc, "scale": scale, "rate_bytes_s": rate, "rate_bit": int(8 * rate),
            "delay_s": t["latency"] * scale}


def host_step_times(rows: list[int], seconds: float = 1.0) -> dict:
    """{rows: s} of one host thread: fp32 ``rows`` x GEMM_SHAPE[0] @ GEMM_SHAPE (best of the
    repetitions within ``seconds`` per size, after one warm call)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = torch.randn(GEMM_SHAPE[1], GEMM_SHAPE[0])
        out = {}
        for r in sorted(set(rows)):
            x = torch.randn(r, GEMM_SHAPE[0])
            x @ w.T
            best, t_end = float("inf"), time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                x @ w.T
                best = min(best, time.perf_counter() - t0)
            out[r] = best
    finally:
        torch.set_num_threads(threads)
    return out


def host_speed(seconds: float = 1.0) -> dict:
    """One thread of this host: fp32 GEMM throughput (prefill-like, 256 x 1536 x 4608) and the
    weight-read bandwidth of a decode-like GEMV (8 rows against 192 MiB of weights)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def rate(fn, work):
            fn()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn()
                n += 1
            return n * work / (time.perf_counter() - t0)
        a, b = torch.randn(256, 1536), torch.randn(1536, 4608)
        gemm = rate(lambda: a @ b, 2 * 256 * 1536 * 4608)
        w, x = torch.randn(12288, 4096), torch.randn(8, 4096)
        read = rate(lambda: x @ w.T, w.numel() * 4)
    finally:
        torch.set_num_threads(threads)
    return {"gemm_flops": gemm, "read_bw": read, "dtype": "float32", "threads": 1}
