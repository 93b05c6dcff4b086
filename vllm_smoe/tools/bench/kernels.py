"""``smoe-bench kernels``: speculate's assignment + permutation kernel against the torch ops (CUDA)."""

from __future__ import annotations

import json

import numpy as np


def run_kernels(a) -> int:
    """Speculate's per-step ordering on one GPU: the Triton assignment + permutation kernel
    (after one confidence sort) against the torch ops it replaces, same inputs, exact equality,
    eager and as a CUDA-graph replay; times per step (median of --reps graph replays)."""
    import torch

    from ...serving.speculate import device_predict as dp

    if not torch.cuda.is_available():
        raise ValueError("smoe-bench kernels needs a CUDA device (the CPU path is the torch ops)")
    dev = torch.device("cuda")
    rows = []
    for T in a.tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        L, N = a.layers, a.ranks
        pref = torch.randint(-1, N, (L, T, 2), device=dev, generator=g)
        conf = torch.rand((L, T), device=dev, generator=g)
        caps = dp.chunk_caps(T, N, dev)
        perm, inv = (torch.empty((L, T), dtype=torch.long, device=dev) for _ in range(2))
        want = dp.permutation(dp.assign(pref, conf, caps))
        dp.assign_permute(pref, conf, caps, perm, inv)
        ok = torch.equal(perm, want[0]) and torch.equal(inv, want[1])

        def fused():
            dp.assign_permute(pref, conf, caps, perm, inv)

        def ops():
            dp.permutation(dp.assign(pref, conf, caps))

        times = {}
        for name, fn in (("kernel", fused), ("torch", ops)):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            samples = []
            for _ in range(a.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            times[name] = float(np.median(samples))
        replay_ok = torch.equal(perm, want[0])
        rows.append({"layers": L, "ranks": N, "tokens": T, "equal": ok and replay_ok,
                     "kernel_us": times["kernel"], "torch_us": times["torch"]})
        print(f"L={L} N={N} T={T:6d}: {'equal' if ok and replay_ok else 'MISMATCH'}; kernel {times['kernel']:8.1f} us, "
              f"torch ops {times['torch']:8.1f} us per step (graph replay, median of {a.reps}); "
              f"{times['torch'] / times['kernel']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1
