"""The wire check's exchange (``smoe-bench cluster --exchange-only --wire-model``) from the cost
model of ``placement/a2a_cost.py``: bytes between the two nodes by each pipeline's byte rule, and
time as latency per collective plus, per collective, the busiest direction's bytes over the
link's rate.

The byte rules: :func:`step_transfers`; the time model and gloo's transport: :func:`model_wire_check`.

Pure apart from reading the plan; :func:`measure_host` and :func:`model_run` take the
measurements (root, cluster.netns.Net's namespaces)."""

from __future__ import annotations

import numpy as np

from .veth import ADDR, HEADER_BYTES, run_ranks
from ...placement.a2a_cost import IN, NVLINK, OUT, RDMA, LinkModel, backend_rows, phase_seconds

RULES = {"smoe-gather": "smoe-p2p", "smoe-p2p": "smoe-p2p", "smoe-p2p-slots": "smoe-p2p",
         "smoe-hier": "smoe-hier", "vllm": "allgather-rs"}
# gloo collectives a step makes, per pipeline (SparseExchange over gloo, as the wire check runs it):
# p2p counts + rows, rows back; slots: rows in slots, rows back; hierarchical: counts + rows to the
# gateways, counts + rows forwarded, and both back; vLLM: all-gathers of rows, weights, ids and a
# reduce-scatter; gather: the rows' count, the rows, a reduce-scatter of the partial rows
COLLECTIVES = {"smoe-p2p": ("all_to_all",) * 3, "smoe-p2p-slots": ("all_to_all",) * 2,
               "smoe-hier": ("all_to_all",) * 6, "vllm": ("all_gather",) * 3 + ("reduce_scatter",),
               "smoe-gather": ("all_gather",) * 2 + ("reduce_scatter",)}
MSS = 1448  # TCP payload of a 1500-byte MTU frame with timestamps
# one-way delays a gloo collective waits on the link, per kind (gloo's tcp pairs send only once the
# receiver has posted its buffer, so each message pays the receiver's notice, then its data; the
# reduce-scatter is an all-reduce: two rounds). Assumed, not yet checked: model_run's implied_hops
# checks them where the kernel applies netem's delay (the development VM's has no netem)
HOPS = {"all_to_all": 2.0, "all_gather": 2.0, "reduce_scatter": 4.0}


def step_routing(plan: dict, step: dict, per_node: int, pipeline: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dest [T, K] rank computing each activation, src [T] the token's rank, t [N] rows per rank)
    of one step as the wire check runs ``pipeline``."""
    N = 2 * per_node
    ids = np.asarray(step["ids"], dtype=np.int64)
    T = ids.shape[0]
    c = -(-T // N)
    order = np.arange(T) if pipeline == "vllm" else np.asarray(step["order"], dtype=np.int64)
    src = np.empty(T, dtype=np.int64)
    src[order] = np.arange(T) // c
    owner = np.asarray(plan["baseline" if pipeline == "vllm" else "smoe"]["expert2rank"], dtype=np.int64)
    return owner[ids], src, np.bincount(src, minlength=N)


def _nodes(rows: np.ndarray, per_node: int) -> np.ndarray:
    """[2, 2, N] rank rows -> [2, 2, nodes]: a node's ranks share its link."""
    return rows.reshape(2, 2, -1, per_node).sum(axis=3)


def _ring(per_node: int, units: float) -> np.ndarray:
    """[2, 2, 2] node rows of a gloo ring collective whose every ring link carries ``units`` rows:
    the ring 0 -> 1 -> ... -> N-1 -> 0 crosses once each way, and has per_node - 1 links inside each
    node."""
    r = np.zeros((2, 2, 2))
    r[RDMA, OUT] = r[RDMA, IN] = units
    r[NVLINK, OUT] = r[NVLINK, IN] = (per_node - 1) * units
    return r


def step_transfers(plan: dict, step: dict, per_node: int, pipeline: str) -> dict:
    """One step of ``pipeline``: ``bytes`` between nodes by its rule (what the exchange counts),
    ``rule``: [(node rows [2, 2, nodes], bytes a row)] per collective that carries rows, and for
    gloo's collective transports ``transport``: the same for what gloo moves.

    Rules (:data:`RULES`): ``smoe-p2p`` and ``smoe-gather`` count what the smoe-p2p rule sends
    (each (token, remote rank) pair: its row with ids and weights out, a partial row back),
    ``smoe-p2p-slots`` the same rows back but every peer's ``t`` row slots out (padding counted),
    ``smoe-hier`` the smoe-hier rule's rows to another node (row, ids, weights and a mask word out, a
    partial row back), ``vllm`` the allgather-rs rule (every row to every other rank, ids and weights
    as 8 bytes a top-k entry, a full partial row back). A token's rank is its chunk: position in the
    step's order (vLLM's: arange) // ceil(T / N). These bytes are the exchange's counted ones."""
    H, K = plan["hidden"], int(np.asarray(step["ids"]).shape[1])
    row = 4 * H  # fp32
    N = 2 * per_node
    dest, src, t = step_routing(plan, step, per_node, pipeline)
    rows = backend_rows(dest, src, N, per_node, RULES[pipeline])
    back = rows[:, ::-1]
    out = {}
    if pipeline in ("smoe-p2p", "smoe-gather", "vllm"):
        out["rule"] = [(_nodes(rows, per_node), row + 8 * K), (_nodes(back, per_node), row)]
        out["bytes"] = rows[RDMA, OUT].sum() * (2 * row + 8 * K)
    elif pipeline == "smoe-p2p-slots":  # t row slots to every other rank, a flag word each
        slots = np.zeros((2, 2, N))
        far = N - per_node
        slots[RDMA, OUT] = slots[RDMA, IN] = far * t  # every rank holds t rows here (equal chunks)
        slots[NVLINK, OUT] = slots[NVLINK, IN] = (per_node - 1) * t
        slot_bytes = 4 * (H + 2 * K + 1)
        out["rule"] = [(_nodes(slots, per_node), slot_bytes), (_nodes(back, per_node), row)]
        out["bytes"] = slots[RDMA, OUT].sum() * slot_bytes + rows[RDMA, OUT].sum() * row
    elif pipeline == "smoe-hier":
        hop = 4 * (H + 2 * K + 1)  # row, ids, weights, the mask word
        first = rows.copy()
        first[NVLINK] = 0  # forwarding inside a node: its own collectives (rows to gateways first)
        fwd = np.zeros_like(rows)
        fwd[NVLINK] = rows[NVLINK]
        out["rule"] = [(_nodes(first, per_node), hop), (_nodes(fwd, per_node), hop),
                       (_nodes(fwd[:, ::-1], per_node), row), (_nodes(first[:, ::-1], per_node), row)]
        out["bytes"] = rows[RDMA, OUT].sum() * (hop + row)
    else:
        raise ValueError(f"pipeline {pipeline!r}: choose from {', '.join(RULES)}")
    c = int(t.max())
    if pipeline == "vllm":  # ring all-gathers of x, weights (fp32), ids (int64); reduce-scatter = all-reduce
        out["transport"] = [(_ring(per_node, (N - 1) * c), row + 4 * K + 8 * K),
                            (_ring(per_node, 2 * (N - 1) * c), row)]
    elif pipeline == "smoe-gather":  # rows leaving each rank, padded to the most any rank sends
        leaving = np.zeros(N, dtype=np.int64)
        remote = (dest != src[:, None]).any(axis=1)
        np.add.at(leaving, src[remote], 1)
        m = max(1, int(leaving.max()))
        out["transport"] = [(_ring(per_node, (N - 1) * m), 4 * (H + 2 * K + 1)),
                            (_ring(per_node, 2 * (N - 1) * m), row)]
    out["bytes"] = int(out["bytes"])
    return out


def _seconds(transfers: list, kinds: tuple, link: LinkModel, overlap: dict | None) -> float:
    """Transfer time of a step's collectives: each collective's rows (``transfers``, paired with
    the ``kinds`` carrying rows, in order) on their busiest node and direction over its class's
    rate (a2a_cost's :func:`phase_seconds`, latency apart), or with ``overlap`` {kind: k} the
    busier direction between nodes plus k x the other (k = 1: the two directions one after the
    other; 0: at once)."""
    t = 0.0
    for (rows, b), kind in zip(transfers, kinds):
        if not overlap:
            t += phase_seconds(rows, b, link)
            continue
        d = np.sort(rows[RDMA, OUT] * b)  # bytes node -> other node, each way
        t += max(float((rows[NVLINK] * b).max()) / link.nvlink_Bps,
                 (float(d[-1]) + overlap.get(kind, 0.0) * float(d[:-1].sum())) / link.rdma_Bps)
    return t


# the kinds of the collectives that carry rows, in step_transfers' order
CARRIERS = {"smoe-p2p": ("all_to_all",) * 2, "smoe-p2p-slots": ("all_to_all",) * 2,
            "smoe-hier": ("all_to_all",) * 4, "smoe-gather": ("all_gather", "reduce_scatter"),
            "vllm-rule": ("all_to_all",) * 2, "vllm": ("all_gather", "reduce_scatter")}


def model_wire_check(plan: dict, per_node: int, host_constants: dict) -> dict:
    """Each pipeline of the wire check on ``plan`` (:func:`cluster.wire.wire_plan`) over two nodes of
    ``per_node`` ranks: {pipeline: {bytes (between nodes, all steps: the exchange's counted
    bytes), seconds (all steps, a2a_cost's time: latency + busiest direction), latency_s,
    transfer_s, rule, collectives (a step), transport_bytes and transport_seconds (what gloo
    moves, vllm and smoe-gather: its ring collectives; the rule's bytes elsewhere, each way's
    overlap as measured: ``host_constants["overlap"]``)}}.

    Time, per step: each collective's latency (``host_constants["collective_s"][pipeline]``, from
    tiny steps on the unshaped veth, plus ``hops`` of the link's one-way delay where the kernel
    applies one) and each row-carrying collective's payload on its busiest (node, direction) over
    its class's rate (``rate_bytes_s`` between nodes: the tbf rate less frame headers;
    ``local_bytes_s`` inside a node, where a node's ranks share one namespace), as a2a_cost's
    :func:`phase_seconds` on rows summed per node. That is ``seconds``.

    ``transport_seconds`` is the same with what gloo really moves: its all-gathers are rings (N - 1
    chunks on a link) and its reduce-scatter an all-reduce of the whole buffer
    (``ProcessGroupGloo.reduce_scatter_tensor``; 2 (N - 1) chunks), for ``vllm`` and
    ``smoe-gather``; and each collective kind's overlap of the link's two directions
    (``host_constants["overlap"]``: time = busier direction + k x the other, over the rate;
    a2a_cost assumes k = 0; :func:`model_run` sets k = 1, :data:`HALF_DUPLEX`: the emulated link
    carries a collective's two directions partly one after the other, so the two times bracket it).

    host_constants: collective_s {pipeline: s} (host time a collective, the link's delay
    aside), rate_bytes_s (payload bytes/s between nodes), local_bytes_s (inside a node),
    delay_s (one-way delay of the link, 0 unshaped), hops {kind: one-way delays a collective
    waits} (default :data:`HOPS`), overlap {kind: k} (the other direction's share of the time,
    :func:`measure_overlap`; default 0: both directions at once, as a2a_cost assumes)."""
    hops = {**HOPS, **host_constants.get("hops", {})}
    overlap = host_constants.get("overlap") or {}
    link = LinkModel(0.0, float(host_constants["local_bytes_s"]), float(host_constants["rate_bytes_s"]))
    pipelines = ("smoe-gather", "smoe-p2p", "smoe-p2p-slots", "vllm") if per_node == 1 else \
        ("smoe-p2p", "smoe-p2p-slots", "smoe-hier", "vllm")
    out = {}
    for name in pipelines:
        if name not in host_constants["collective_s"]:
            continue
        kinds = COLLECTIVES[name]
        lat_step = (len(kinds) * host_constants["collective_s"][name]
                    + host_constants.get("delay_s", 0.0) * sum(hops[k] for k in kinds))
        steps = [step_transfers(plan, s, per_node, name) for s in plan["steps"]]
        lat = lat_step * len(steps)
        rule_kinds = CARRIERS["vllm-rule" if name == "vllm" else name]
        xfer = sum(_seconds(s["rule"], rule_kinds, link, None) for s in steps)
        r = {"rule": RULES[name], "collectives": len(kinds), "bytes": int(sum(s["bytes"] for s in steps)),
             "latency_s": lat, "transfer_s": xfer, "seconds": lat + xfer}
        moved = "transport" if "transport" in steps[0] else "rule"
        tx = sum(_seconds(s[moved], CARRIERS[name], link, overlap) for s in steps)
        r["transport_bytes"] = int(sum(sum(rw[RDMA, OUT].sum() * b for rw, b in s[moved]) for s in steps))
        r["transport_transfer_s"] = tx
        r["transport_seconds"] = lat + tx
        out[name] = r
    return out


def calibrate(plan: dict, per_node: int, tiny: dict, local_bytes_s: float, rate_bytes_s: float | None = None) -> dict:
    """``collective_s`` per pipeline from a tiny-step unshaped wire check ``tiny`` (on ``plan``):
    its time less the modelled transfer (at ``rate_bytes_s``, default ``local_bytes_s``), over
    its steps' collectives; transport pipelines by their transport's transfer."""
    rate = local_bytes_s if rate_bytes_s is None else rate_bytes_s
    zero = {"collective_s": {n: 0.0 for n in tiny["seconds"]}, "local_bytes_s": local_bytes_s,
            "rate_bytes_s": rate, "delay_s": 0.0}
    m = model_wire_check(plan, per_node, zero)
    n_steps = len(plan["steps"])
    return {n: max(0.0, (tiny["seconds"][n] - m[n].get("transport_transfer_s", m[n]["transfer_s"]))
                   / (n_steps * m[n]["collectives"])) for n in m}


def implied_hops(plan: dict, per_node: int, tiny_shaped: dict, collective_s: dict, link: dict,
                 local_bytes_s: float) -> dict:
    """One-way delays per collective a tiny-step run on a shaped link implies: (its time - the
    host's collectives - modelled transfer) / (delay x collectives), per pipeline (a check on
    :data:`HOPS`)."""
    c = {"collective_s": collective_s, "local_bytes_s": local_bytes_s, "delay_s": 0.0,
         "rate_bytes_s": payload_rate(link)}
    m = model_wire_check(plan, per_node, c)
    n_steps = len(plan["steps"])
    return {n: (tiny_shaped["seconds"][n] - m[n].get("transport_seconds", m[n]["seconds"]))
            / (link["delay_s"] * n_steps * m[n]["collectives"]) for n in m}


def payload_rate(link: dict) -> float:
    """TCP payload bytes/s of a tbf link of ``link["rate_bytes_s"]`` (it charges whole frames:
    MSS payload plus veth.HEADER_BYTES)."""
    return link["rate_bytes_s"] * MSS / (MSS + HEADER_BYTES)


def compare(model: dict, wc: dict) -> dict:
    """Model against a wire check: per pipeline counted and modelled bytes (equal?), measured
    and modelled seconds and their ratio (model / measured), and the transport's where modelled."""
    out = {}
    for name, m in model.items():
        if name not in wc.get("seconds", {}):
            continue
        meas = wc["seconds"][name]
        r = {"counted_bytes": wc[name]["counted_bytes"], "model_bytes": m["bytes"],
             "bytes_equal": m["bytes"] == wc[name]["counted_bytes"], "wire_payload": wc[name]["wire"]["payload"],
             "measured_s": meas, "model_s": m["seconds"], "ratio": m["seconds"] / meas,
             "model_latency_s": m["latency_s"], "model_transfer_s": m["transfer_s"]}
        if "transport_seconds" in m:
            r.update(transport_bytes=m["transport_bytes"], transport_s=m["transport_seconds"],
                     transport_ratio=m["transport_seconds"] / meas)
        out[name] = r
    return out


# ----- the measurements around it (need cluster.netns.Net's namespaces: root) -------------------

TINY_TOKENS = 8  # a step whose bytes take microseconds on the unshaped veth: time = collectives
OVERLAP_KINDS = ("all_to_all", "all_gather", "reduce_scatter", "one_way")


def overlap_bytes(kind: str, per_node: int, S: int) -> int:
    """Bytes each way between the nodes of :func:`_overlap_worker`'s ``kind`` with ``S`` bytes a
    rank: all_to_all S to every rank, all_gather S (ring: N - 1 chunks a link), reduce_scatter
    N x S (gloo: ring all-reduce, 2 (N - 1)), one_way: node 0's ranks S to each rank of node 1."""
    N = 2 * per_node
    return {"all_to_all": per_node * per_node * S, "one_way": per_node * per_node * S,
            "all_gather": (N - 1) * S, "reduce_scatter": 2 * (N - 1) * S}[kind]


def _overlap_worker(rank: int, spec_path: str) -> int:
    """One gloo rank in its node's namespace: each collective kind of S bytes a rank, median of
    three, written by rank 0."""
    import json
    import time

    import torch
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    per_node, S = spec["per_node"], spec["bytes"]
    N, n = 2 * per_node, spec["bytes"] // 4
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{ADDR[0]}:{spec['port']}", rank=rank, world_size=N)
    far = [q // per_node != rank // per_node for q in range(N)]
    out = {}
    for kind in OVERLAP_KINDS:
        ts = []
        for _ in range(3):
            if kind in ("all_to_all", "reduce_scatter"):
                x = torch.zeros(N * n)
            elif kind == "one_way":
                send = [n if (rank < per_node and far[q]) else 0 for q in range(N)]
                recv = [n if (rank >= per_node and far[q]) else 0 for q in range(N)]
                x, o = torch.zeros(sum(send)), torch.empty(sum(recv))
            else:
                x = torch.zeros(n)
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "all_to_all":
                dist.all_to_all_single(torch.empty_like(x), x)
            elif kind == "one_way":
                dist.all_to_all_single(o, x, recv, send)
            elif kind == "all_gather":
                dist.all_gather_into_tensor(torch.empty(N * n), x)
            else:
                dist.reduce_scatter_tensor(torch.empty(n), x)
            dist.barrier()
            ts.append(time.perf_counter() - t0)
        out[kind] = sorted(ts)[1]
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
    return 0


def measure_overlap(net, per_node: int, work: str, rate_bytes_s: float, seconds: float = 0.3,
                    port: int = 29720) -> dict:
    """How gloo's collectives share the link's two directions, on ``net`` as shaped now: each
    kind with about ``seconds`` of bytes each way at ``rate_bytes_s``; ``overlap`` {kind: k} with
    time = (1 + k) x bytes each way / rate (0: both ways at once, 1: one after the other;
    ``one_way`` checks the rate: k ~ 0)."""
    import json
    import os

    S = int(min(32 << 20, rate_bytes_s * seconds) // (per_node * per_node)) // 4 * 4
    spec = {"per_node": per_node, "bytes": S, "port": port, "out": os.path.join(work, "overlap.json")}
    path = os.path.join(work, "overlap-spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    run_ranks(net, per_node, "vllm_smoe.tools.bench.wire_model", "--overlap-worker", path, 600, "overlap measurement")
    with open(spec["out"]) as f:
        t = json.load(f)
    D = {k: overlap_bytes(k, per_node, S) for k in t}
    return {"bytes_per_rank": S, "seconds": t, "bytes_each_way": D,
            "overlap": {k: t[k] * rate_bytes_s / D[k] - 1.0 for k in t}}


def _median_seconds(runs: list[dict]) -> dict:
    return {n: float(np.median([r["seconds"][n] for r in runs])) for n in runs[0]["seconds"]}


# gloo over the emulated link does not carry a collective's two directions at once as a2a_cost
# assumes (two-way TCP over tbf's deep FIFO: one direction's ACKs queue behind the other's data),
# by a share that changes with layout and load (docs/history.md#vllm_smoetoolsbenchwire_modelpy).
# So the model gives a bracket: ``seconds`` both directions at once (a2a_cost), ``transport_seconds``
# with gloo's bytes and every collective's two directions one after the other (half duplex)
HALF_DUPLEX = {"all_to_all": 1.0, "all_gather": 1.0, "reduce_scatter": 1.0}


def model_table(wc: dict, title: str = "") -> list[str]:
    """Markdown: per pipeline, bytes between nodes counted and modelled, time measured and
    modelled: a2a_cost's (both directions at once) and gloo's bytes over a half-duplex link
    (:data:`HALF_DUPLEX`)."""
    m = wc["model"]
    c = m["constants"]
    lines = ["", f"model of the exchange alone{title}: a collective "
                 f"{', '.join(f'{n} {1e3 * s:.2f} ms' for n, s in c['collective_s'].items())}; link "
                 f"{c['rate_bytes_s'] * 8 / 1e6:.1f} Mbit/s payload, delay {1e3 * c['delay_s']:.2f} ms; overlap measured "
                 f"{', '.join(f'{k} {v:.2f}' for k, v in m['overlap_measurement']['overlap'].items())}", "",
             "| pipeline | counted MB | model MB | equal | measured s | model s (a2a_cost) | ratio | "
             "model s (gloo bytes, half duplex) | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in m["pipelines"].items():
        lines.append(f"| {name} | {r['counted_bytes'] / 1e6:.3f} | {r['model_bytes'] / 1e6:.3f} | {r['bytes_equal']} | "
                     f"{r['measured_s']:.3f} | {r['model_s']:.3f} | {r['ratio']:.2f} | {r['transport_s']:.3f} | "
                     f"{r['transport_ratio']:.2f} |")
    if "implied_hops" in m:
        lines += ["", "one-way delays a collective waited, tiny steps on this link: "
                  + ", ".join(f"{n} {h:.2f}" for n, h in m["implied_hops"].items())]
    return lines


def main(argv=None) -> int:
    """Internal entry: ``--overlap-worker RANK SPEC`` (inside a node's namespace)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--overlap-worker"]:
        return _overlap_worker(int(argv[1]), argv[2])
    print("use: smoe-bench cluster --exchange-only --wire-model", file=sys.stderr)
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(main())
