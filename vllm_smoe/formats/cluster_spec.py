"""Cluster specs and the fitted backend constants of the all-to-all cost model, read from YAML.

A cluster spec (``vllm_smoe/clusters/NAME.yaml`` or a user's file) holds a node's hardware:
``gpus_per_node``, ``nvlink_GBps`` and ``rdma_GBps`` (per GPU and direction), ``dense_TFLOPs``,
``hbm_TBps``, and ``sources`` (one line per number). ``backends.yaml`` holds, per backend and
phase, the latency and the share of each link's nominal bandwidth that the backend reaches, as
fitted on the calibration cluster by ``smoe-place calibrate``; a cluster's link model is those
shares times its own nominal bandwidths. See docs/cluster-model.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .bounded import load_yaml, short
from ..placement.a2a_cost import BACKENDS, LinkModel, Roofline, Wire

CLUSTER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "clusters")
BACKENDS_FILE = os.path.join(CLUSTER_DIR, "backends.yaml")
CALIBRATION_FILE = os.path.join(CLUSTER_DIR, "deepep-published.yaml")
_NUMBERS = ("nvlink_GBps", "rdma_GBps", "dense_TFLOPs", "hbm_TBps")
# bytes of one row's values per dtype at hidden size H: FP8 rows carry one float32 scale per 128
DTYPES = {"bf16": lambda H: 2.0 * H, "fp8": lambda H: H + 4.0 * -(-H // 128), "fp32": lambda H: 4.0 * H}


def row_bytes(fit: dict, phase: str, hidden: int, top_k: int) -> float:
    """Bytes of one row a backend's ``phase`` sends: the values in its dtype, then its header
    (``{phase}_header``: [bytes, bytes per top-k entry]), padded to ``{phase}_align`` bytes."""
    head = fit.get(f"{phase}_header", [0, 0])
    n = DTYPES[fit[f"{phase}_dtype"]](hidden) + head[0] + head[1] * top_k
    align = fit.get(f"{phase}_align", 1)
    return float(-(-n // align) * align)


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    nvlink_Bps: float
    rdma_Bps: float
    flops: float
    hbm_Bps: float
    path: str


def cluster_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CLUSTER_DIR)
                  if f.endswith(".yaml") and f not in ("backends.yaml", "deepep-published.yaml"))


def load_cluster(spec: str) -> Cluster:
    """A shipped cluster by name, or a user's YAML by path. Raises ValueError naming the file and
    field."""
    path = spec if (os.sep in spec or spec.endswith((".yaml", ".yml"))) else os.path.join(CLUSTER_DIR, spec + ".yaml")
    if not os.path.exists(path) and os.sep not in spec:
        raise ValueError(f"--cluster {spec!r}: no such shipped cluster; choose one of {', '.join(cluster_names())} "
                         f"or give a YAML file")
    doc = load_yaml(path, "cluster spec")
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a cluster spec is a mapping, got {type(doc).__name__}")
    gpn = doc.get("gpus_per_node")
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
        raise ValueError(f"{path}: field 'gpus_per_node' must be a positive integer, got {short(gpn)}")
    vals = {}
    for key in _NUMBERS:
        v = doc.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{path}: field '{key}' must be a positive number, got {short(v)}")
        vals[key] = float(v)
    unknown = set(doc) - {"name", "gpus_per_node", "sources", *_NUMBERS}
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {sorted(unknown)}")
    return Cluster(str(doc.get("name") or os.path.basename(path)), gpn, vals["nvlink_GBps"] * 1e9,
                   vals["rdma_GBps"] * 1e9, vals["dense_TFLOPs"] * 1e12, vals["hbm_TBps"] * 1e12, path)


def load_fits(path: str = BACKENDS_FILE) -> dict:
    """backends.yaml: {backend: {dispatch|combine: {latency_us, nvlink_share, rdma_share},
    dispatch_dtype, combine_dtype, calibrated, ...}}."""
    doc = load_yaml(path, "backend fits")
    if not isinstance(doc, dict) or not isinstance(doc.get("backends"), dict):
        raise ValueError(f"{path}: field 'backends' must be a mapping")
    return doc


def wire_for(cluster: Cluster, backend: str, ep_size: int, hidden: int, top_k: int,
             fits: dict | None = None) -> tuple[Wire, dict]:
    """The cost model of ``backend`` on ``cluster`` for an EP group of ``ep_size`` ranks (ranks
    fill nodes in order; a group smaller than a node is one node). Returns (wire, fit entry)."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: choose from {', '.join(BACKENDS)}")
    fits = fits or load_fits()
    entry = fits["backends"].get(backend)
    if entry is None:
        raise ValueError(f"{BACKENDS_FILE}: no fit for backend {backend!r}")
    if backend == "deepep-ht" and cluster.gpus_per_node > 8:
        raise ValueError(f"--backend deepep-ht on {cluster.name}: DeepEP's normal kernels forward over NVLink "
                         f"among at most 8 ranks (NUM_MAX_NVL_PEERS), not {cluster.gpus_per_node} "
                         f"({cluster.path}: gpus_per_node); not modelled")
    per_node = min(cluster.gpus_per_node, ep_size)
    if ep_size % per_node:
        raise ValueError(f"--ep-size {ep_size} does not fill nodes of {cluster.gpus_per_node} GPUs "
                         f"({cluster.path}: gpus_per_node)")
    phases = {}
    for phase in ("dispatch", "combine"):
        f = entry[phase]
        phases[phase] = LinkModel(f["latency_us"] * 1e-6, f["nvlink_share"] * cluster.nvlink_Bps,
                                  f["rdma_share"] * cluster.rdma_Bps)
    row = {p: row_bytes(entry, p, hidden, top_k) for p in ("dispatch", "combine")}
    return Wire(backend, per_node, phases["dispatch"], phases["combine"], row["dispatch"], row["combine"]), entry


def roofline(cluster: Cluster) -> Roofline:
    return Roofline(cluster.flops, cluster.hbm_Bps)
