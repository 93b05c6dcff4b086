"""``smoe-place evaluate --cluster``: projected all-to-all bytes and time per MoE layer on a real
cluster (placement/a2a_cost.py), and ``smoe-place calibrate``, which fits the backends' constants
to DeepEP's published numbers (vllm_smoe/clusters/deepep-published.yaml)."""

from __future__ import annotations

import argparse
import datetime
import json

import numpy as np

from ..formats.cluster_spec import (BACKENDS_FILE, CALIBRATION_FILE, cluster_names, load_cluster, load_fits,
                                    roofline, wire_for)
from ..placement.a2a_cost import BACKENDS, LinkModel, backend_rows, fit_link, phase_seconds, trace_cost
from ..placement.metrics import _hashed_copies
from .cli_util import number

# hidden and MoE intermediate sizes of the shapes a projection is made at
COST_SHAPES = {"deepseek-v3": (7168, 2048), "qwen3-235b-a22b": (4096, 1536), "deepseek-v2-lite": (2048, 1408),
               "mixtral-8x7b": (4096, 14336)}


def add_args(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("projected cost on a cluster (docs/cluster-model.md)")
    g.add_argument("--cluster", help="a shipped cluster (" + ", ".join(cluster_names()) + ") or a cluster YAML: adds "
                   "projected all-to-all bytes and time per MoE layer for every method")
    g.add_argument("--backend", default="deepep-ht",
                   help="comma list of all2all backends to project (" + ", ".join(BACKENDS) + "; default deepep-ht)")
    g.add_argument("--tokens-per-rank", type=number(int, 1), default=128,
                   help="tokens each rank holds per step (default 128, a decode step; 4096 for prefill)")
    g.add_argument("--cost-shape", help="hidden and MoE intermediate size the bytes and FLOPs are projected at: "
                   + ", ".join(COST_SHAPES) + ", or H:I (required with --cluster)")


def cost_setup(a, ep_size: int, top_k: int):
    """The projection of --cluster (a callable for _measure, with ``note``, ``backends`` and
    ``steps``), or None when --cluster is not given."""
    if not getattr(a, "cluster", None):
        return None
    if not a.cost_shape:
        raise ValueError("--cluster needs --cost-shape: " + ", ".join(COST_SHAPES) + " or H:I (hidden:intermediate)")
    if a.cost_shape in COST_SHAPES:
        hidden, inter = COST_SHAPES[a.cost_shape]
    else:
        try:
            hidden, inter = (int(x) for x in a.cost_shape.split(":"))
            assert hidden > 0 and inter > 0
        except (ValueError, AssertionError):
            raise ValueError(f"--cost-shape {a.cost_shape!r}: one of {', '.join(COST_SHAPES)} or H:I with two "
                             f"positive integers") from None
    cluster = load_cluster(a.cluster)
    fits = load_fits()
    backends = [b.strip() for b in a.backend.split(",") if b.strip()]
    if not backends:
        raise ValueError(f"--backend {a.backend!r}: name at least one of {', '.join(BACKENDS)}")
    wires = {b: wire_for(cluster, b, ep_size, hidden, top_k, fits) for b in backends}
    roof = roofline(cluster)
    step_rows = a.tokens_per_rank * ep_size

    def whole_steps(T: int) -> int:
        if T < step_rows:
            raise ValueError(f"--tokens-per-rank {a.tokens_per_rank}: a step of EP {ep_size} holds {step_rows} "
                             f"tokens, the evaluated trace only {T}; lower --tokens-per-rank or pass more "
                             f"tokens (--max-tokens)")
        return (T // step_rows) * step_rows

    def steps(arr: dict) -> tuple[dict, np.ndarray]:
        """The trace's rows (in order) cut into the cluster's steps of tokens_per_rank x N rows,
        whole steps only: (rows, [n] step ids), the batches every placement is judged on."""
        n = whole_steps(arr["token_ids"].size)
        return {k: v[:n] for k, v in arr.items()}, np.arange(n) // step_rows

    def cost(arr, t2r, e2r, holds, copies, batch) -> dict:
        """The projection of one placement: batch [T] are its steps (tp mode: :func:`steps`'s;
        dp mode: the rows in scheduling order, cut into windows of tokens_per_rank x N)."""
        topk = arr["topk_ids"].astype(np.int64)
        T, L, K = topk.shape
        dest = activation_ranks(topk, t2r, e2r, holds, copies, batch)
        n = whole_steps(T)
        steps = np.arange(n) // step_rows
        out = {"cost_steps": int(steps[-1]) + 1}
        for b, (wire, entry) in wires.items():
            c = trace_cost(topk[:n], dest[:n], t2r[:n], steps, ep_size, wire, hidden, inter, roof)
            for k, v in c.items():
                out[f"{b}:{k}"] = v
            out[f"{b}:calibrated"] = bool(entry.get("calibrated"))
        return out

    ll_note = ""
    if "deepep-ll" in backends and a.tokens_per_rank > 256:
        ll_note = (f"; deepep-ll at {a.tokens_per_rank} tokens per rank is outside what vLLM runs (its batched "
                   f"backends take 256 a rank by default) and outside DeepEP's published rows (128)")
    cost.note = (f"projected on {cluster.name} ({a.cluster}): EP {ep_size} over {ep_size // wires[backends[0]][0].per_node} "
                 f"node(s), {a.tokens_per_rank} tokens per rank per step, hidden {hidden}, intermediate {inter}; "
                 + "; ".join(f"{b}: {'calibrated' if e.get('calibrated') else 'NOT calibrated (' + e.get('note', '') + ')'}"
                             for b, (_, e) in wires.items()) + ll_note)
    cost.backends = backends
    cost.steps = steps
    return cost


def activation_ranks(topk: np.ndarray, t2r: np.ndarray, e2r: np.ndarray, holds: np.ndarray, copies: str,
                     batch: np.ndarray) -> np.ndarray:
    """[T, L, K] int64 the rank that computes each activation, as metrics.evaluate decides it: the
    copy on the token's rank where there is one, else the home (copies "own"), or vLLM's hashed
    pick among the copies by the row's index in its step (copies "hashed"; batch: [T] step ids,
    non-decreasing)."""
    T, L, K = topk.shape
    dest = np.empty_like(topk)
    hashed = copies == "hashed" and not bool((holds.sum(axis=1) == 1).all())
    if hashed:
        _, b = np.unique(batch, return_inverse=True)
        row_in_step = np.arange(T) - np.searchsorted(b, b)
    for layer in range(L):
        e, r = topk[:, layer], t2r[:, layer].astype(np.int64)
        if hashed:
            dest[:, layer] = _hashed_copies(e, holds[layer], row_in_step)
            continue
        local = holds[layer][r[:, None], e]
        dest[:, layer] = np.where(local, r[:, None], e2r[layer][e])
    return dest


def print_costs(results: dict, backends: list[str]) -> None:
    head = ("dispatch us", "combine us", "a2a us", "expert us", "RDMA B/tok", "NVL B/tok", "rows load")
    keys = ("dispatch_us", "combine_us", "a2a_us", "expert_us", "rdma_bytes_per_token", "nvlink_bytes_per_token",
            "expert_rows_load")
    w = max(len(k) for k in results) + 2
    for b in backends:
        print(f"\nprojected per MoE layer, backend {b}:")
        print(f"{'method':<{w}}" + "".join(f"{h:>12}" for h in head))
        for name, m in results.items():
            if f"{b}:a2a_us" not in m:
                continue
            print(f"{name:<{w}}" + "".join(f"{m[f'{b}:{k}']:>12.{0 if 'B/tok' in h else 1 if 'us' in h else 3}f}"
                                           for k, h in zip(keys, head)))


# what each backend's rows carry besides the values (bytes, bytes per top-k entry) and their
# padding; DeepEP's from its code (docs/cluster-model.md), the others' as smoe's and vLLM's send them
ROW_FORMATS = {
    "deepep-ht": {"dispatch_dtype": "fp8", "dispatch_header": [8, 8], "dispatch_align": 16,
                  "combine_dtype": "bf16", "combine_header": [8, 4], "combine_align": 16},
    "deepep-ll": {"dispatch_dtype": "fp8", "dispatch_header": [16, 0], "combine_dtype": "bf16"},
    "allgather-rs": {"dispatch_dtype": "bf16", "dispatch_header": [0, 8], "combine_dtype": "bf16"},
    "nccl-a2a": {"dispatch_dtype": "bf16", "dispatch_header": [0, 8], "combine_dtype": "bf16"},
    "smoe-p2p": {"dispatch_dtype": "bf16", "dispatch_header": [0, 8], "combine_dtype": "bf16"},
    "smoe-hier": {"dispatch_dtype": "bf16", "dispatch_header": [4, 8], "combine_dtype": "bf16"},
}
LOGICAL_ROW = {"fp8": lambda H: H * (1 + 4 / 128), "bf16": lambda H: 2.0 * H}  # DeepEP's tests' bytes per row


_ROW_INTS = ("ep", "tokens_per_rank", "experts")


def check_calibration(doc, path: str) -> None:
    """Raises ValueError naming the file and field of a calibration file that cannot be fitted."""
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a calibration file is a mapping")
    for key in ("hidden", "top_k"):
        if not isinstance(doc.get(key), int) or doc[key] < 1:
            raise ValueError(f"{path}: field '{key}' must be a positive integer, got {doc.get(key)!r}")
    if not isinstance(doc.get("cluster"), str):
        raise ValueError(f"{path}: field 'cluster' must name a cluster spec")
    rows = doc.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: field 'rows' must be a non-empty list")
    for i, row in enumerate(rows):
        where = f"{path}: rows[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where} must be a mapping")
        if row.get("backend") not in ("deepep-ht", "deepep-ll"):
            raise ValueError(f"{where}.backend must be deepep-ht or deepep-ll, got {row.get('backend')!r}")
        if row.get("phase") not in ("dispatch", "combine"):
            raise ValueError(f"{where}.phase must be dispatch or combine, got {row.get('phase')!r}")
        for key in _ROW_INTS:
            if not isinstance(row.get(key), int) or row[key] < 1:
                raise ValueError(f"{where}.{key} must be a positive integer, got {row.get(key)!r}")
        if row["experts"] % row["ep"]:
            raise ValueError(f"{where}.experts {row['experts']} does not split over ep {row['ep']}")
        if "latency_us" in row:
            ok = isinstance(row["latency_us"], (int, float)) and row["latency_us"] > 0
            if not ok:
                raise ValueError(f"{where}.latency_us must be a positive number")
        elif not (isinstance(row.get("bandwidth_GBps"), (int, float)) and row["bandwidth_GBps"] > 0
                  and row.get("counted") in ("nvl_recv", "rdma_send", "ll_send") and row.get("dtype") in LOGICAL_ROW):
            raise ValueError(f"{where}: give latency_us, or bandwidth_GBps with counted (nvl_recv | rdma_send | "
                             f"ll_send) and dtype (fp8 | bf16)")
    if not any(r["backend"] == "deepep-ht" for r in rows):
        raise ValueError(f"{path}: no deepep-ht rows: the backends without published numbers borrow its fit")


def calibration_cases(doc: dict, cluster, seed: int = 0) -> dict:
    """{(backend, phase): [(rows, row_bytes, seconds, row)]} for every published row: DeepEP's
    routing drawn as its test draws it, the model's rows for it, and the published time."""
    from ..formats.cluster_spec import row_bytes
    from ..placement.a2a_cost import deepep_logical_rows, random_routing

    H, K = doc["hidden"], doc["top_k"]
    rng = np.random.default_rng(seed)
    cases: dict = {}
    for row in doc["rows"]:
        b, phase, N, T, E = row["backend"], row["phase"], row["ep"], row["tokens_per_rank"], row["experts"]
        nodes = max(1, N // cluster.gpus_per_node)
        per_node = N // nodes
        tg = row.get("topk_groups", 0)
        experts = random_routing(N * T, E, K, rng, groups=nodes if tg else 1, topk_groups=tg or 1)
        src = np.repeat(np.arange(N), T)
        dest = experts // (E // N)
        link_node = per_node if (b != "deepep-ll" or row.get("ll_nvlink", True)) else 1  # pure RDMA: all remote
        rows = backend_rows(dest, src, N, link_node, b)
        if phase == "combine":
            rows = rows[:, ::-1]
        if "latency_us" in row:
            seconds = row["latency_us"] * 1e-6
        else:
            logical = deepep_logical_rows(experts, E, N, per_node, row["counted"])
            seconds = logical * LOGICAL_ROW[row["dtype"]](H) / (row["bandwidth_GBps"] * 1e9)
        cases.setdefault((b, phase), []).append((rows, row_bytes(ROW_FORMATS[b], phase, H, K), seconds, row))
    return cases


def calibrate(doc: dict, seed: int = 0) -> tuple[dict, list[dict]]:
    """Fits every calibrated backend's phases on ``doc`` (deepep-published.yaml). Returns the
    backends.yaml document and one record per published row (model and published microseconds)."""
    cluster = load_cluster(doc["cluster"])
    nominal = LinkModel(10e-6, cluster.nvlink_Bps, cluster.rdma_Bps)
    fits, table = {}, []
    for (b, phase), cs in calibration_cases(doc, cluster, seed).items():
        link, err = fit_link([(r, rb, s) for r, rb, s, _ in cs], nominal)
        fits.setdefault(b, {"calibrated": True, **ROW_FORMATS[b]})[phase] = {
            "latency_us": round(link.latency_s * 1e6, 3), "nvlink_share": round(link.nvlink_Bps / cluster.nvlink_Bps, 4),
            "rdma_share": round(link.rdma_Bps / cluster.rdma_Bps, 4), "max_error": round(float(np.abs(err).max()), 4)}
        for i, ((_, _, s, row), e) in enumerate(zip(cs, err)):
            # the row predicted by a fit to the other rows: how far the model carries off its data
            held = [(r, rb, t) for j, (r, rb, t, _) in enumerate(cs) if j != i]
            r, rb, _, _ = cs[i]
            left_out = phase_seconds(r, rb, fit_link(held, nominal)[0]) / s - 1.0 if held else None
            table.append({"backend": b, "phase": phase, "ep": row["ep"], "published_us": s * 1e6,
                          "model_us": s * 1e6 * (1 + e), "error": float(e), "left_out_error": left_out})
    ht = fits["deepep-ht"]
    for b in BACKENDS:
        if b not in fits:  # no published numbers: DeepEP's normal kernels' latency and link shares
            fits[b] = {"calibrated": False, "note": "no published measurement; deepep-ht's fitted constants",
                       **ROW_FORMATS[b], "dispatch": dict(ht["dispatch"]), "combine": dict(ht["combine"])}
    out = {"fitted_on": f"{CALIBRATION_FILE.split('/')[-1]} ({doc['cluster']}), seed {seed}",
           "shares_of": "the cluster spec's nvlink_GBps and rdma_GBps", "backends": fits}
    return out, table


def cmd_calibrate(a) -> int:
    from ..formats.bounded import load_yaml

    import yaml

    doc = load_yaml(a.published, "calibration rows")
    check_calibration(doc, a.published)
    fits, table = calibrate(doc, a.seed)
    print("| backend | phase | EP | published us | model us | error | error left out of the fit |\n"
          "|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['backend']} | {t['phase']} | {t['ep']} | {t['published_us']:.0f} | {t['model_us']:.0f} | "
              f"{100 * t['error']:+.1f}% | "
              + ("-" if t["left_out_error"] is None else f"{100 * t['left_out_error']:+.1f}%") + " |")
    for b, f in fits["backends"].items():
        if f["calibrated"]:
            for phase in ("dispatch", "combine"):
                p = f[phase]
                print(f"{b} {phase}: latency {p['latency_us']:.1f} us, NVLink {100 * p['nvlink_share']:.0f}% and RDMA "
                      f"{100 * p['rdma_share']:.0f}% of nominal, worst row {100 * p['max_error']:.1f}%")
    worst = max(abs(t["error"]) for t in table)
    print(f"worst calibration row: {100 * worst:.1f}% ({'within' if worst <= 0.2 else 'OUTSIDE'} 20%)")
    if a.output:
        with open(a.output, "w") as f:
            f.write("# Written by `smoe-place calibrate` (vllm_smoe/tools/cluster_cost.py); do not edit by hand.\n")
            yaml.safe_dump(fits, f, sort_keys=False)
        print(f"wrote {a.output}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.datetime.now().astimezone().isoformat(), "rows": table, "fits": fits}, f, indent=2)
    return 0


def add_calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="fit the all2all backends' constants to DeepEP's published numbers")
    c.add_argument("--published", default=CALIBRATION_FILE, help="calibration rows (default: the shipped DeepEP table)")
    c.add_argument("--seed", type=number(int, 0), default=0)
    c.add_argument("-o", "--output", help=f"write the fits here (the shipped file: {BACKENDS_FILE})")
    c.add_argument("--json", help="write the table and fits here")
    c.set_defaults(fn=cmd_calibrate)
