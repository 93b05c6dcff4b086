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
