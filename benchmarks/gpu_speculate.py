"""Device-side token order (vllm_smoe/serving/device_predict.py) on one GPU: exactness and cost.

With the project installed (make install SMOE_EXTRA=gpu), on a machine with one NVIDIA GPU:

    python benchmarks/gpu_speculate.py --json out.json        # CUDA (default)
    python benchmarks/gpu_speculate.py --device cpu           # smoke check without a GPU

1. predict_tables / predict_random + assign(chunk_caps) + permutation against the numpy
   reference (placement.predict.predict_layer, placement.assign.assign_tokens) on random inputs;
2. one step (predict -> assign -> permutation -> order -> restore) for hidden size 2048: eager vs
   a CUDA-graph replay (must be equal), median ms of 50 calls;
3. on CUDA, the eager step under torch.cuda.set_sync_debug_mode("error") (no host sync).
Prints PASS/FAIL lines and a timing table; exits 1 on any FAIL, 2 if CUDA is asked for but absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vllm_smoe.placement.assign import assign_tokens, chunk_caps
from vllm_smoe.placement.predict import predict_layer
from vllm_smoe.placement_file import load_placement, load_tables
from vllm_smoe.serving import device_predict as dp

KEYS = ("token2rank", "token_conf", "markov2rank", "markov_conf", "prior2rank")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-4dom-ep2.yaml"
checks: list[dict] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    checks.append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"{'PASS' if ok else 'FAIL'} {name}{'  ' + detail if detail else ''}", flush=True)


def same(a: torch.Tensor, b: np.ndarray) -> bool:
    a = a.cpu().numpy()
    return a.shape == b.shape and np.array_equal(a.astype(b.dtype) if b.dtype.kind == "f" else a, b)


def check_exact(tab, dt: dict, dev: torch.device, rng: np.random.Generator) -> None:
    L, V = tab.token_conf.shape
    E = tab.markov_conf.shape[1]
    for T in (1, 3, 8, 1000, 4096):
        ids, prev = rng.integers(0, V, T), rng.integers(0, E, T)
        d_ids, d_prev = torch.from_numpy(ids).to(dev), torch.from_numpy(prev).to(dev)
        bad, preds = [], {}
        for layer in range(L):
            rp, rc, _ = predict_layer(tab, layer, ids, prev if layer > 0 else None)
            p, c = dp.predict_tables(*(dt[k][layer] for k in KEYS), d_ids, d_prev if layer > 0 else None)
            if not (same(p, rp.astype(np.int64)) and same(c, rc.astype(np.float32))):
                bad.append(layer)
            preds[layer] = (rp, rc, p, c)
        report(f"predict_tables T={T}", not bad, f"layers {bad} differ" if bad else f"{L} layers")
        for N in (2, 4, 8):
            caps, d_caps = chunk_caps(T, N), dp.chunk_caps(T, N, dev)
            rand_p = rng.integers(-1, N, (T, 2))
            rand_c = (rng.integers(0, 4, T) / 4).astype(np.float32)  # many ties
            hp, hc = dp.predict_random(d_ids, 1, N)
            cases = {"tables": preds[1],
                     "random": (rand_p, rand_c, torch.from_numpy(rand_p).to(dev), torch.from_numpy(rand_c).to(dev)),
                     "hash": (hp.cpu().numpy(), hc.cpu().numpy(), hp, hc)}
            bad = []
            for name, (np_p, np_c, d_p, d_c) in cases.items():
                ref = assign_tokens(np_p, np_c, np.zeros(T, np.int64), N, rank_caps=caps[None]).astype(np.int64)
                got = dp.assign(d_p, d_c, d_caps)
                perm, inv = (v.cpu() for v in dp.permutation(got))  # grouped by rank, inv restores
                if not (same(got, ref) and same(d_caps, caps) and bool((got.cpu()[perm].diff() >= 0).all())
                        and torch.equal(perm[inv], torch.arange(T))):
                    bad.append(name)
            report(f"assign T={T} N={N}", not bad, f"{bad} differ" if bad else "tables, random, hash")


def median_ms(fn, dev: torch.device, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter(); fn(); times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_checks(step, new, x, ids, prev, T: int, row: dict) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x, ids, prev)
        report(f"no host sync T={T}", True)
    except RuntimeError as err:
        report(f"no host sync T={T}", False, str(err).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    try:  # capture as the PyTorch docs say: static inputs, warm-up on a side stream
        sx, sids, sprev = x.clone(), ids.clone(), prev.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step(sx, sids, sprev)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gy, gt2r = step(sx, sids, sprev)
        x2, ids2, prev2 = new(T)
        sx.copy_(x2); sids.copy_(ids2); sprev.copy_(prev2)
        g.replay()
        ey, et2r = step(x2, ids2, prev2)
        report(f"graph == eager T={T}", torch.equal(gy, ey) and torch.equal(gt2r, et2r) and torch.equal(gy, x2))
        row["graph_ms"] = median_ms(g.replay, torch.device("cuda"))
    except RuntimeError as err:
        report(f"graph capture T={T}", False, str(err).splitlines()[0])


def bench_step(tab, dt: dict, N: int, dev: torch.device, rng: np.random.Generator, hidden: int = 2048) -> list[dict]:
    V, E, t, rows = tab.token_conf.shape[1], tab.markov_conf.shape[1], [dt[k][1] for k in KEYS], []

    def step(x, ids, prev):  # layer 1: token and Markov tables
        pref, conf = dp.predict_tables(*t, ids, prev)
        t2r = dp.assign(pref, conf, dp.chunk_caps(x.shape[0], N, x.device))
        perm, inv = dp.permutation(t2r)
        return x.index_select(0, perm).index_select(0, inv), t2r
    new = lambda T: (torch.randn(T, hidden, device=dev, dtype=torch.bfloat16),
                     torch.from_numpy(rng.integers(0, V, T)).to(dev), torch.from_numpy(rng.integers(0, E, T)).to(dev))
    for T in (1, 64, 512):
        x, ids, prev = new(T)
        report(f"round trip T={T}", torch.equal(step(x, ids, prev)[0], x))
        rows.append({"T": T, "eager_ms": median_ms(lambda: step(x, ids, prev), dev), "graph_ms": None})
        if dev.type == "cuda":
            cuda_checks(step, new, x, ids, prev, T, rows[-1])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--json", metavar="PATH", help="write the checks and timings here")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {a.device} but torch.cuda.is_available() is False "
              f"(torch {torch.__version__}); use --device cpu for a smoke check", file=sys.stderr)
        return 2
    rng = np.random.default_rng(a.seed)
    p = load_placement(str(CONFIG))
    tab = load_tables(p)  # int16 -> long, float16 -> float32
    dt = {k: torch.from_numpy(v.astype(np.int64 if v.dtype.kind == "i" else np.float32)).to(dev)
          for k, v in tab.arrays().items() if k in KEYS}
    check_exact(tab, dt, dev, rng)
    rows = bench_step(tab, dt, p.ep_size, dev, rng)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"\nstep (N={p.ep_size}, hidden 2048, bf16) on {name}")
    print(f"{'T':>5} {'eager ms':>9} {'graph ms':>9}")
    for r in rows:
        print(f"{r['T']:>5} {r['eager_ms']:>9.3f} {'-' if r['graph_ms'] is None else format(r['graph_ms'], '.3f'):>9}")
    ok = all(c["ok"] for c in checks)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": str(dev), "name": name, "torch": torch.__version__, "ok": ok,
                                            "checks": checks, "timing": rows}, indent=2))
    print("ALL PASS" if ok else f"{sum(not c['ok'] for c in checks)} FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
