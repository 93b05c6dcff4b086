"""``smoe-bench cluster``: vLLM nodes in network namespaces, joined by a link shaped to a real
cluster's proportions; every configuration served end to end on the same prompts and model.

Why proportions: what decides the all-to-all's share of a step is a GPU's own speed over its
link, not the link's absolute rate. The host is measured first (fp32 GEMM throughput for
prefill, weight-read bandwidth for a decode-like GEMV, one thread: one core is one node here),
then the link gets ``rate = host speed / target ratio`` (``TARGETS``: an H200 over NDR
InfiniBand, NVLink, PCIe 5) and a delay of the target's latency times the same slow-down, so
the bandwidth-delay product in bytes stays the target's. tbf shapes each veth end with a bucket of a few
frames, so that every message pays its size; netem adds the delay where the kernel has it (the
JSON says whether it did).

Each configuration starts one vLLM node per namespace (TP across nodes with ``--nnodes``, or
vLLM's multi-node data parallel with ``--data-parallel-size-local 1`` and ``--headless``); a
client inside namespace 0 runs fixed-concurrency mixes and Poisson arrivals, reading the veth
byte counters (``/sys/class/net/*/statistics``) and smoe's own counters (``smoe:a2a_bytes`` on
``/metrics``) around each. Needs root and iproute2 (ip, tc; ethtool turns segmentation offloads off); everything it
makes (namespaces, veth, processes) is removed on exit and its traffic stays on its own veth.

The pure parts (rate derivation, wire payload from counters, SLO throughput) are functions
below that CI tests without root.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from .veth import ADDR, HEADER_BYTES, run_ranks  # the emulated link's, shared with wire_model

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
BURST_PACKETS, BURST_SECONDS = 4, 50e-6  # tbf's bucket: a few frames, never a whole message
UNCAPPED = 1000.0  # --max-expert-load of dp-ep-smoe-uncapped's placement: no cap in effect
DEFAULT_WIDTHS = dict(hidden=1536, moe_intermediate=768, heads=24, kv_heads=12)


# ----- pure parts (tested in CI) ------------------------------------------------------------

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


def wire_delta(before: dict, after: dict) -> dict:
    """What crossed the link between two readings of the veth counters.

    before, after: {device: {"tx_bytes": int, "tx_packets": int}} for every veth end. Returns
    bytes (frames, all ends summed: both directions), packets, and payload (bytes less
    HEADER_BYTES per packet: TCP payload when segmentation offloads are off)."""
    if set(before) != set(after):
        raise ValueError(f"veth readings of different devices: {sorted(before)} vs {sorted(after)}")
    b = sum(after[d]["tx_bytes"] - before[d]["tx_bytes"] for d in after)
    p = sum(after[d]["tx_packets"] - before[d]["tx_packets"] for d in after)
    if b < 0 or p < 0:
        raise ValueError("veth counters went backwards: a device was recreated between the readings")
    return {"bytes": b, "packets": p, "payload": b - HEADER_BYTES * p}


def counters_agree(wire_payload: float, counter_bytes: float | None, tol: float = 0.05) -> dict | None:
    """smoe's byte counters against the wire: ratio counter / wire and whether it is within
    ``tol``. None where smoe counts nothing."""
    if counter_bytes is None:
        return None
    ratio = counter_bytes / wire_payload if wire_payload > 0 else float("inf")
    return {"ratio": ratio, "within": bool(abs(ratio - 1.0) <= tol), "tol": tol}


def slo_rate(ladder: list[dict], key: str, bound_ms: float) -> float:
    """The highest offered request rate of a Poisson ladder whose ``key`` (e.g. p90_itl_ms)
    stays under ``bound_ms`` with no failed request, every lower rate meeting it too (a
    configuration that misses the SLO at a low rate does not count a lucky higher one).
    ladder: [{"rate": req/s, key: ms, "failed": int}, ...]. 0.0 when even the lowest misses."""
    def meets(row):
        v = row.get(key)
        return v is not None and np.isfinite(v) and v <= bound_ms and not row.get("failed", 0)
    best = 0.0
    for rate in sorted({r["rate"] for r in ladder}):
        if not all(meets(r) for r in ladder if r["rate"] == rate):
            break
        best = rate
    return best


def latency_summary(outs: list, seconds: float) -> dict:
    """outs: per request (start s, [arrival s of each streamed chunk], completion tokens, error
    or None). Median TPOT and TTFT, p90 inter-token latency (TBT), output tok/s."""
    ok = [o for o in outs if o[3] is None]
    tpot = [(ts[-1] - ts[0]) / (n - 1) for _, ts, n, _ in ok if len(ts) > 1 and n > 1]
    ttft = [ts[0] - st for st, ts, _, _ in ok if ts]
    itl = [d for _, ts, _, _ in ok for d in np.diff(ts)]
    tokens = sum(n for _, _, n, _ in ok)

    def ms(v, f):
        return 1e3 * float(f(v)) if v else None
    return {"tpot_ms": ms(tpot, np.median), "ttft_ms": ms(ttft, np.median),
            "p90_itl_ms": ms(itl, lambda v: np.percentile(v, 90)), "p90_ttft_ms": ms(ttft, lambda v: np.percentile(v, 90)),
            "tok_s": tokens / seconds if seconds > 0 else None, "tokens": tokens, "requests": len(ok),
            "failed": len(outs) - len(ok), "seconds": seconds}


def parse_ss(text: str) -> dict:
    """``ss -tinpH`` output -> {(local, peer): (process name, bytes_sent)} for TCP sockets between
    two different hosts (a socket within one namespace never touches the veth)."""
    out, key = {}, None
    for ln in text.splitlines():
        m = re.match(r"^\S+\s+\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)\s*(.*)$", ln)
        if m:
            local, peer = m.group(1).replace("[::ffff:", "").rstrip("]"), m.group(3).replace("[::ffff:", "").rstrip("]")
            who = re.search(r'users:\(\("([^"]+)"', m.group(5))
            key = (f"{local}:{m.group(2)}", f"{peer}:{m.group(4)}", who.group(1) if who else "?") \
                if local != peer else None
            continue
        b = re.search(r"bytes_sent:(\d+)", ln)
        if key is not None and b:
            out[key[:2]] = (key[2], int(b.group(1)))
            key = None
    return out


def socket_delta(before: dict, after: dict) -> dict:
    """TCP payload sent between two :func:`parse_ss` readings, summed per process name (a
    socket opened in between counts whole)."""
    out: dict[str, int] = {}
    for k, (who, sent) in after.items():
        out[who] = out.get(who, 0) + sent - (before[k][1] if k in before else 0)
    return out


def metric_sum(text: str, name: str) -> float | None:
    """Sum of every sample of Prometheus family ``name`` (a counter's ``_total`` too) in an
    exposition text; None when the family is absent."""
    pat = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)\s*$", re.M)
    vals = [float(v) for v in pat.findall(text)]
    return sum(vals) if vals else None


def collective_counts(text: str) -> tuple[dict[str, float], float]:
    """smoe's collectives on ``/metrics``, summed over ranks: ({"group kind": count}, served
    steps); ({}, 0) when the server publishes none (no smoe settings)."""
    counts: dict[str, float] = {}
    pat = re.compile(r'^smoe:collectives_total\{([^}]*)\}\s+([0-9.eE+-]+)\s*$', re.M)
    for labels, v in pat.findall(text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = f"{lab.get('group', '?')} {lab.get('kind', '?')}"
        counts[key] = counts.get(key, 0.0) + float(v)
    return counts, metric_sum(text, "smoe:collective_steps") or 0.0


def collectives_per_step(before: tuple, after: tuple) -> dict[str, float] | None:
    """Collectives per served step and rank between two readings of :func:`collective_counts`
    (None without served steps between them)."""
    steps = after[1] - before[1]
    if steps <= 0:
        return None
    return {k: round((v - before[0].get(k, 0.0)) / steps, 3) for k, v in sorted(after[0].items())
            if v - before[0].get(k, 0.0) > 0}


# ----- host and link --------------------------------------------------------------------------

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


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class Net:
    """Two namespaces joined by one veth pair; names carry this process's pid."""

    def __init__(self) -> None:
        tag = os.getpid()
        self.ns = (f"smoecl-{tag}-0", f"smoecl-{tag}-1")
        self.dev = (f"scl{tag}a", f"scl{tag}b")
        self.shaping: dict | None = None
        self.delay_applied = False

    def up(self) -> None:
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, ADDR):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
            # real packets: the wire counts frames of the MTU, and the shaper charges each its size
            sh("ip", "netns", "exec", ns, "ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", check=False)

    def shape(self, link: dict | None) -> None:
        """Both ends: tbf at the link's rate with a burst of a few packets, so that every message
        pays its size, under netem's delay where the kernel has netem (None: no shaping)."""
        self.delay_applied = False
        for ns, dev in zip(self.ns, self.dev):
            tc = ("ip", "netns", "exec", ns, "tc", "qdisc")
            sh(*tc, "del", "dev", dev, "root", check=False)
            if link is None:
                continue
            # a few frames, or 50 us at the rate where the kernel's timers cannot refill a few
            # frames fast enough (seen: 4 frames held a 4.7 Gbit/s target to 1.1 Gbit/s)
            burst = max(BURST_PACKETS * 1514, int(link["rate_bytes_s"] * BURST_SECONDS))
            tbf = ("tbf", "rate", f"{link['rate_bit']}bit", "burst", str(burst), "limit", "8000000")
            if link["delay_s"] > 0 and sh(*tc, "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                                          f"{1e6 * link['delay_s']:.0f}us", "limit", "100000", check=False).returncode == 0:
                sh(*tc, "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
                self.delay_applied = True
            else:
                sh(*tc, "add", "dev", dev, "root", *tbf)
        self.shaping = link

    def stats(self) -> dict:
        out = {}
        for ns, dev in zip(self.ns, self.dev):
            vals = sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
                      f"/sys/class/net/{dev}/statistics/tx_packets").stdout.split()
            out[dev] = {"tx_bytes": int(vals[0]), "tx_packets": int(vals[1])}
        return out

    def sockets(self) -> dict:
        out = {}
        for ns in self.ns:
            out.update(parse_ss(sh("ip", "netns", "exec", ns, "ss", "-tinpH", check=False).stdout))
        return out

    def kill_all(self) -> None:
        for ns in self.ns:
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    def down(self) -> None:
        self.kill_all()
        time.sleep(0.5)
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)  # deleting a namespace deletes its veth end
        sh("ip", "link", "del", self.dev[0], check=False)


def _probe_sink(port: int) -> int:
    """Inside namespace 1: echo short messages, count bulk bytes (the link probe's far end)."""
    import socket

    with socket.create_server((ADDR[1], port)) as srv:
        srv.settimeout(60)
        for _ in range(2):
            conn, _ = srv.accept()
            with conn:
                kind = conn.recv(1)
                if kind == b"p":  # ping-pong
                    while data := conn.recv(64):
                        conn.sendall(data)
                else:
                    n = 0
                    while data := conn.recv(1 << 20):
                        n += len(data)
                    conn.sendall(str(n).encode())
    return 0


def measure_link(net: Net, port: int = 29500, nbytes: int = 4 << 20) -> dict:
    """Round-trip time of 64-byte messages and the rate of a bulk TCP transfer, 0 -> 1."""
    sink = subprocess.Popen(["ip", "netns", "exec", net.ns[1], sys.executable, "-m", "vllm_smoe.tools.bench.cluster",
                             "--probe-sink", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    code = f"""
import socket, time, json
def conn():
    for _ in range(100):
        try:
            return socket.create_connection(("{ADDR[1]}", {port}), timeout=60)
        except OSError:
            time.sleep(0.1)
c = conn(); c.sendall(b"p"); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); rtt = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"x" * 64); got = 0
    while got < 64:
        got += len(c.recv(64))
    rtt.append(time.perf_counter() - t)
c.close(); c = conn(); c.sendall(b"b"); t = time.perf_counter(); c.sendall(b"\\0" * {nbytes})
c.shutdown(socket.SHUT_WR); n = int(c.recv(64)); s = time.perf_counter() - t
print(json.dumps({{"rtt_s": sorted(rtt)[10], "bulk_bytes": n, "bulk_s": s}}))
"""
    try:
        r = sh("ip", "netns", "exec", net.ns[0], sys.executable, "-c", code)
        out = json.loads(r.stdout)
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            sink.wait(10)
        if sink.poll() is None:
            sink.kill()
    out["rate_bytes_s"] = out["bulk_bytes"] / out["bulk_s"]
    return out


# ----- the exchange alone on the wire ---------------------------------------------------------

# smoe's sparse exchange over the shared-memory transport's gather (as it would run over a
# network before the point-to-point one), over its point-to-point transport, and vLLM's
# allgather-reducescatter; smoe-p2p sends its sizes first (three all-to-alls), smoe-p2p-slots
# pads every peer's rows to the step's row count with the sizes riding along (two), as served
# steps do up to sparse_a2a.PAD_BYTES; with several ranks a node, smoe-hier is the hierarchical
# exchange (a row crosses to another node once, then fans out inside it; as served past the slots)
PIPELINES = ("smoe-gather", "smoe-p2p", "smoe-p2p-slots", "vllm")
NODE_PIPELINES = ("smoe-p2p", "smoe-p2p-slots", "smoe-hier", "vllm")


def exchange_step(name: str, rank: int, per_node: int, hidden: int, step: dict, owner, gather, reduce_scatter,
                  all_to_all, g) -> int:
    """One step of pipeline ``name`` (:data:`NODE_PIPELINES`, smoe-gather) on ``rank`` of two
    nodes of ``per_node`` ranks, over the given collectives (``SparseExchange``'s): this rank's
    chunk of ``step`` (rows ``step["order"][rank * c: (rank + 1) * c]``, c = ceil(T / N); vLLM's
    in arange order), random fp32 rows from ``g``. Returns the bytes it counts between nodes."""
    import torch

    from ...serving.exchange.sparse_a2a import SparseExchange

    N = 2 * per_node
    ids_all = torch.as_tensor(step["ids"]).long()
    T, K = ids_all.shape
    c = -(-T // N)
    order = torch.arange(T) if name == "vllm" else torch.as_tensor(step["order"])
    rows = order[rank * c: (rank + 1) * c]
    ids = ids_all[rows]
    x, w = torch.randn(len(rows), hidden, generator=g), torch.full((len(rows), K), 1.0 / K)
    if name != "vllm":
        ex = SparseExchange(rank, N, owner, gather, reduce_scatter, exact=True,
                            all_to_all=None if name == "smoe-gather" else all_to_all,
                            pad_bytes=1 << 40 if name.endswith("-slots") else 0,
                            node_of=torch.arange(N) // per_node, hierarchical=name.startswith("smoe-hier"))
        h, ww, ii = ex.dispatch(x, w, ids)
        ex.combine(h * (ww * (owner[ii] == rank)).sum(1, keepdim=True))
        return int(ex.stats[5])  # the bytes that cross between nodes
    # vLLM's: every row to every rank (ids, weights too), full partial sums back;
    # counted: what crosses to the other node's ranks, were each peer sent its share once
    full = gather(x)
    gather(w), gather(ids)
    reduce_scatter(full.contiguous())
    return (N - per_node) * x.shape[0] * (2 * hidden * x.element_size() + 8 * K)


def _wire_worker(rank: int, spec_path: str) -> int:
    """One gloo rank of ``spec["per_node"]`` in its node's namespace: the MoE layer's exchange
    alone on the veth, smoe's sparse one and vLLM's allgather-reducescatter, each step as served
    over a network (exact sizes, all_gather_into_tensor and reduce_scatter_tensor as smoe's CPU
    communicator uses on gloo). Writes each pipeline's counted bytes between nodes and, on a
    node's first rank, the node's veth tx counters around it."""
    import torch
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    plan, per_node = spec["plan"], spec["per_node"]
    N, dev = 2 * per_node, spec["dev"][rank // per_node]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{ADDR[0]}:{spec['port']}", rank=rank, world_size=N)

    def tx():
        if rank % per_node:
            return None
        vals = [int(open(f"/sys/class/net/{dev}/statistics/{k}").read()) for k in ("tx_bytes", "tx_packets")]
        return {"tx_bytes": vals[0], "tx_packets": vals[1]}

    from .comm import gloo_collectives

    gather, reduce_scatter = gloo_collectives(N)

    def all_to_all(o, x, out_splits, in_splits):
        dist.all_to_all_single(o, x, out_splits, in_splits)

    H, g = plan["hidden"], torch.Generator().manual_seed(rank)
    out = {}
    for name in spec["pipelines"]:
        owner = torch.as_tensor(plan["baseline" if name == "vllm" else "smoe"]["expert2rank"]).long()
        counted = 0
        dist.barrier()
        before = tx()
        # no rank sends before every node's first rank has read its counter: a rank leaving the
        # first barrier early put a step's rows on the veth before its node's reading (counted /
        # wire 1.02-1.03 on some runs)
        dist.barrier()
        t0 = time.perf_counter()
        for step in plan["steps"]:
            counted += exchange_step(name, rank, per_node, H, step, owner, gather, reduce_scatter, all_to_all, g)
        dist.barrier()
        out[name] = {"counted": counted, "before": before, "after": tx(), "seconds": time.perf_counter() - t0}
    with open(spec["out"].format(rank=rank), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


def wire_plan(hidden: int, tokens: int = 64, steps: int = 24, per_node: int = 1) -> dict:
    """:func:`wire_check`'s plan (JSON types): the fixture's held-out routing of layer 1, its
    placement and predicted order over two nodes of ``per_node`` ranks (``smoe-bench comm``'s)."""
    import argparse

    from .comm import comm_plan

    plan = comm_plan(argparse.Namespace(routing="testbed", layer=1, tokens=tokens, steps=steps, ranks=2 * per_node,
                                        hidden=hidden))
    return json.loads(json.dumps(plan, default=lambda o: o.tolist()))


def wire_check(net: Net, hidden: int, work: str, tokens: int = 64, steps: int = 24, port: int = 29650,
               per_node: int = 1) -> dict:
    """smoe's byte counters (and the bytes vLLM's allgather-reducescatter is modelled to carry)
    against the veth, on the exchange alone: the fixture's held-out routing, its placement and
    predictor (as ``smoe-bench comm``), ``steps`` steps of ``tokens`` tokens at ``hidden``, over
    two nodes of ``per_node`` ranks each (the placement built for all of them)."""
    N = 2 * per_node
    pipelines = PIPELINES if per_node == 1 else NODE_PIPELINES
    plan = wire_plan(hidden, tokens, steps, per_node)
    spec = {"plan": plan, "dev": net.dev, "port": port, "out": os.path.join(work, "wire-{rank}.json"),
            "per_node": per_node, "pipelines": pipelines}
    path = os.path.join(work, "wire-spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    # a prefill-sized step on a slow host's prefill link (tens of Mbit/s) takes minutes a pipeline
    run_ranks(net, per_node, "vllm_smoe.tools.bench.cluster", "--wire-worker", path, 3600, "wire check")
    ranks = [json.load(open(spec["out"].format(rank=r))) for r in range(N)]
    heads = range(0, N, per_node)  # each node's first rank read its veth
    res = {"tokens_per_step": tokens, "steps": steps, "hidden": hidden, "ranks_per_node": per_node,
           "lar": {"smoe": plan["lar"], "vllm": plan["base_lar"]}}
    res["seconds"] = {name: max(ranks[r][name]["seconds"] for r in range(N)) for name in pipelines}
    for name in pipelines:
        w = wire_delta({r: ranks[r][name]["before"] for r in heads}, {r: ranks[r][name]["after"] for r in heads})
        counted = sum(ranks[r][name]["counted"] for r in range(N))
        res[name] = {"counted_bytes": counted, "wire": w, "agreement": counters_agree(w["payload"], counted)}
    return res


# ----- configurations ---------------------------------------------------------------------------

def configurations(tp_placement: str, dp_placement: str, metrics_dir: str, dp_uncapped: str | None = None,
                   dptp_placement: str | None = None) -> dict:
    """name -> {kind: tp|dp, smoe: whether smoe orders, routes or places anything, flags}.
    vLLM's peers run as vLLM's docs run them across nodes; every one loads the plugin with smoe's
    metrics (its communicator counts collectives per served step); the CPU build needs smoe's CPU
    fixes for expert parallelism (nothing placed or ordered, vLLM's all2all), and MLA models its
    rotary fix even for plain TP. ``dp-ep-smoe-uncapped`` serves ``dp_uncapped``, a DP placement
    built with ``--max-expert-load`` :data:`UNCAPPED`: neither the co-clustering nor its bytes
    refinement bounds expert load. ``dptp-*``: TP = 2 inside each node, DP = 2 across the
    nodes, expert parallel over all 4 ranks (``dptp_placement``: a DP placement over 4 ranks built
    with ``--nodes 2``); ``dptp-ep-smoe`` sends prefill-sized steps hierarchically across the nodes,
    ``dptp-ep-smoe-flat`` each row to each rank."""
    ep = ("--enable-expert-parallel", "--plugin", "smoe", "--smoe-log-interval", "0.5",
          "--additional-config", json.dumps({"smoe": {"metrics_dir": metrics_dir}}))
    # "counts": the configuration's all2all is smoe's sparse exchange, whose counters are read
    cfgs = {
        "tp": {"kind": "tp", "smoe": False, "flags": ep[1:]},  # the plugin for its counters, no EP
        "tp-ep": {"kind": "tp", "smoe": False, "flags": ep + ("--smoe-all2all", "vllm")},
        "tp-ep-place": {"kind": "tp", "smoe": True, "flags": ep + ("--smoe-placement", tp_placement)},
        "tp-ep-speculate": {"kind": "tp", "smoe": True,
                            "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement)},
        "tp-ep-speculate-ar": {"kind": "tp", "smoe": True,  # before the shuffled reduce-scatter
                               "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                              "--smoe-reduce-scatter", "off")},
        # predictor router: its gate's logits summed from the partial rows before the shuffled
        # reduce-scatter (one [T, E] all-gather more), or over vLLM's all-reduce
        "tp-ep-speculate-router": {"kind": "tp", "smoe": True,
                                   "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                  "--smoe-predictor", "router")},
        "tp-ep-speculate-router-ar": {"kind": "tp", "smoe": True,
                                      "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                     "--smoe-predictor", "router", "--smoe-reduce-scatter", "off")},
        # the DeepSeek family's one order per step (the default orders each MoE layer)
        "tp-ep-speculate-step": {"kind": "tp", "smoe": True,
                                 "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                "--smoe-stack-order", "step")},
        "tp-ep-speculate-agrs": {"kind": "tp", "smoe": True,
                                 "flags": ep + ("--smoe-mode", "speculate", "--smoe-placement", tp_placement,
                                                "--smoe-all2all", "vllm")},
        "dp-ep": {"kind": "dp", "smoe": False, "flags": ep + ("--smoe-all2all", "vllm")},
        "dp-ep-sparse": {"kind": "dp", "smoe": True, "flags": ep},
        "dp-ep-smoe": {"kind": "dp", "smoe": True, "flags": ep + ("--smoe-placement", dp_placement)},
        "dp-ep-smoe-uncapped": {"kind": "dp", "smoe": True, "flags": ep + ("--smoe-placement", dp_uncapped or dp_placement)},
        "dp-ep-smoe-agrs": {"kind": "dp", "smoe": True,
                            "flags": ep + ("--smoe-placement", dp_placement, "--smoe-all2all", "vllm")},
        "dptp-ep": {"kind": "dptp", "smoe": False, "flags": ep + ("--smoe-all2all", "vllm")},
        "dptp-ep-smoe": {"kind": "dptp", "smoe": True, "flags": ep + ("--smoe-placement", dptp_placement or "")},
        "dptp-ep-smoe-flat": {"kind": "dptp", "smoe": True, "flags": ep + ("--smoe-placement", dptp_placement or "",
                                                                           "--smoe-hierarchical", "off")},
    }
    for c in cfgs.values():
        c["counts"] = "--enable-expert-parallel" in c["flags"] and "vllm" not in c["flags"]
        # the veth carries only what crosses between nodes: where a node holds two ranks, the
        # bytes between the node's own ranks (shared memory, loopback) are not on it
        c["counter"] = "smoe:a2a_node_bytes" if c["kind"] == "dptp" else "smoe:a2a_bytes"
        c["collectives"] = "--additional-config" in c["flags"]
    return cfgs


def node_command(model: str, cfg: dict, node: int, api: int, port: int, max_seqs: int,
                 mem_share: float = 0.3) -> list[str]:
    from ..server_process import CPU_ARGS, attention_args, vllm_executable

    # KV cache: vLLM's CPU budget is a share of RAM less the weights, and production-width
    # weights take more than the tests' 0.15 leaves
    cmd = [vllm_executable(), "serve", model, *CPU_ARGS, "--max-num-seqs", str(max_seqs),
           "--gpu-memory-utilization", str(mem_share), *attention_args(model), *cfg["flags"]]
    if cfg["kind"] == "tp":
        cmd += ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr", ADDR[0],
                "--master-port", str(port)]
    else:
        if cfg["kind"] == "dptp":
            cmd += ["--tensor-parallel-size", "2"]
        # one API server: with several, smoe's families reach /metrics only through its endpoint plugin
        # (VLLM_PLUGINS=smoe), which these nodes do not load
        cmd += ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", ADDR[0],
                "--data-parallel-rpc-port", str(port)]
        if node:
            cmd += ["--data-parallel-start-rank", "1"]
    if not node and cfg["kind"] in ("dp", "dptp"):
        cmd += ["--api-server-count", "1"]
    return cmd + (["--headless"] if node else ["--host", "127.0.0.1", "--port", str(api)])


# ----- the client, inside namespace 0 ---------------------------------------------------------

def _one(client, model, prompt, max_tokens, start_at=None):
    from .common import stream

    if start_at is not None:
        time.sleep(max(0.0, start_at - time.perf_counter()))
    try:
        st, ts, n = stream(client, model, prompt, max_tokens)
        return st, ts, n, None
    except Exception as e:  # a failed request counts as failed, the run goes on
        return time.perf_counter(), [], 0, repr(e)


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def run_phase(spec: dict, net_spec: dict, phase: dict, prompts: list) -> dict:
    """One load (fixed concurrency or Poisson arrivals) with the wire and smoe's counters read
    around it. Runs inside namespace 0."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    net = Net.__new__(Net)
    net.ns, net.dev = tuple(net_spec["ns"]), tuple(net_spec["dev"])
    net.shape(phase["link"])
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{spec['api']}/v1", api_key="smoe", timeout=900)
    model = spec["model"]
    text0 = _scrape(spec["api"])
    counter = spec.get("counter", "smoe:a2a_bytes")
    m0 = metric_sum(text0, counter) if spec["counts"] else None
    k0 = collective_counts(text0) if spec.get("collectives") else None
    w0, s0 = net.stats(), net.sockets()
    t0 = time.perf_counter()
    if phase["arrivals"] == "poisson":
        gaps = np.random.default_rng(phase.get("seed", 0)).exponential(1.0 / phase["rate"], len(prompts))
        at = t0 + np.cumsum(gaps) - gaps[0]
        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda i: _one(c, model, prompts[i], phase["max_tokens"], at[i]), range(len(prompts))))
    else:
        with ThreadPoolExecutor(phase["concurrency"]) as ex:
            outs = list(ex.map(lambda p: _one(c, model, p, phase["max_tokens"]), prompts))
    secs = time.perf_counter() - t0
    w1 = net.stats()
    res = {**{k: v for k, v in phase.items() if k != "link"}, **latency_summary(outs, secs)}
    wire = wire_delta(w0, w1)
    if m0 is not None or k0 is not None:  # counters publish once per log interval: wait one, step once to flush
        time.sleep(1.2)
        _one(c, model, prompts[0][:1], 1)
        time.sleep(1.2)
        text1 = _scrape(spec["api"])
        wire = wire_delta(w0, net.stats())  # the flush request's own bytes on both sides
        if m0 is not None:
            res["counter_bytes"] = metric_sum(text1, counter) - m0
            res["counter"] = counter
        # per served step and rank, the flush step among them (a one-token decode step)
        if k0 is not None:
            res["collectives_per_step"] = collectives_per_step(k0, collective_counts(text1))
    tok = max(1, res["tokens"])
    res["wire"] = wire
    # who sent it: vLLM's workers (collectives on gloo), its engine and API processes (scheduler
    # output to the remote node, results back), by process name
    res["sent_by_process"] = socket_delta(s0, net.sockets())
    res["wire_bytes_per_token"] = wire["payload"] / tok
    res["counter_bytes_per_token"] = res["counter_bytes"] / tok if "counter_bytes" in res else None
    res["counters_vs_wire"] = counters_agree(wire["payload"], res.get("counter_bytes"))
    res["errors"] = sorted({o[3] for o in outs if o[3]})[:3]
    return res


def client_main(spec_path: str) -> int:
    """Inside namespace 0: wait for the server, warm it, run every phase; write the results."""
    import urllib.request

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.monotonic()
    while time.monotonic() - t0 < spec["timeout"]:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{spec['api']}/health",
                                                                  timeout=2) as r:
            if r.status == 200:
                break
        time.sleep(1)
    else:
        sys.exit(f"server not healthy after {spec['timeout']} s")
    out = {"start_s": time.monotonic() - t0, "phases": []}
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{spec['api']}/v1", api_key="smoe", timeout=900)
    out["greedy"] = []  # warm-up, and the tokens every configuration must agree on (lossless)
    for p in spec["prompts"][:4]:
        r = c.completions.create(model=spec["model"], prompt=p[:24], max_tokens=12, temperature=0.0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        ch = r.choices[0]
        out["greedy"].append(list(getattr(ch, "token_ids", None) or []) or ch.text)
    for phase in spec["phases"]:
        prompts = [p[: phase["prompt_tokens"]] for p in spec["prompts"][phase["offset"]: phase["offset"] + phase["requests"]]]
        r = run_phase(spec, spec["net"], phase, prompts)
        out["phases"].append(r)
        print(json.dumps({k: r.get(k) for k in ("name", "tpot_ms", "ttft_ms", "p90_itl_ms", "tok_s", "failed",
                                                "wire_bytes_per_token", "counter_bytes_per_token")}), flush=True)
        with open(spec["out"], "w") as f:
            json.dump(out, f)
    return 0


# ----- the orchestrator ---------------------------------------------------------------------------

def _tail(log: str, n: int = 8) -> str:
    lines = [re.sub(r"^.*?\[\S+\.py:\d+\] ", "", ln) for ln in open(log, errors="replace").read().splitlines()
             if ln.strip()]
    errors = list(dict.fromkeys(ln for ln in lines if re.match(r"[\w.]+(Error|Exception): ", ln)))
    return "\n".join(errors[:n] or lines[-n:])


def _stop(procs) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run_config(net: Net, name: str, cfg: dict, idx: int, work: str, a, phases: list, prompts: list) -> dict:
    api, port = 8200 + idx, 29700 + 2 * idx  # fresh ports per start: no TIME_WAIT clashes
    procs, logs = [], []
    metrics = json.loads(cfg["flags"][cfg["flags"].index("--additional-config") + 1])["smoe"]["metrics_dir"] \
        if "--additional-config" in cfg["flags"] else None
    if metrics:  # no snapshot of an earlier configuration's ranks may be read as this one's
        import shutil

        shutil.rmtree(metrics, ignore_errors=True)
        os.makedirs(metrics)
    try:
        for node in (1, 0):
            # a node's core for each of its ranks (TP = 2 inside a node shares it)
            bind = f"{node}|{node}" if cfg["kind"] == "dptp" else str(node)
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_HOST_IP": ADDR[node],
                   "GLOO_SOCKET_IFNAME": net.dev[node]}
            log = os.path.join(work, f"{idx:02d}-{name}-node{node}.log")
            cmd = ["ip", "netns", "exec", net.ns[node],
                   *node_command(a.model, cfg, node, api, port, max(phase.get("concurrency", 0) for phase in phases)
                                 or 8, a.memory_share)]
            procs.insert(0, subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                             start_new_session=True, env=env, cwd=work))
            logs.insert(0, log)
        spec = {"api": api, "model": a.model, "timeout": a.timeout, "prompts": prompts, "phases": phases,
                "counts": cfg["counts"], "counter": cfg["counter"], "collectives": cfg["collectives"],
                "net": {"ns": net.ns, "dev": net.dev}, "out": os.path.join(work, f"{idx:02d}-{name}-client.json")}
        with open(spec["out"] + ".spec", "w") as f:
            json.dump(spec, f)
        logs.append(spec["out"].replace(".json", ".log"))
        client = subprocess.Popen(["ip", "netns", "exec", net.ns[0], sys.executable, "-m", "vllm_smoe.tools.bench.cluster",
                                   "--client", spec["out"] + ".spec"], stdout=open(logs[2], "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(client)
        deadline = time.monotonic() + a.timeout + a.config_timeout
        while client.poll() is None:
            dead = [(n, p.returncode) for n, p in enumerate(procs[:2]) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"node {dead[0][0]} exited with {dead[0][1]}" if dead else "timeout"
                raise RuntimeError(f"{name}: {why}" + "".join(f"\n--- {log}\n{_tail(log)}" for log in logs))
            time.sleep(0.5)
        if client.returncode:
            raise RuntimeError(f"{name}: client exited with {client.returncode}\n{_tail(logs[2])}")
        with open(spec["out"]) as f:
            res = json.load(f)
    finally:
        _stop(procs)
        net.kill_all()
        net.shape(None)
    text = open(logs[0], errors="replace").read() + open(logs[1], errors="replace").read()
    res["logs"] = logs
    res["smoe_log"] = [ln.split("smoe: ", 1)[1].strip() for ln in text.splitlines()
                       if re.search(r"smoe: (speculate \(|dp rank \d+ served)", ln)][-2:] + sorted(
        {ln.split("smoe: advice: ", 1)[1].strip() for ln in text.splitlines() if "smoe: advice: " in ln})
    return res


def plan_phases(a, links: dict) -> list:
    """Fixed-concurrency mixes, then the Poisson ladder (rates filled in per run)."""
    phases, off = [], 2
    for c in a.concurrency:
        n = max(c, a.requests_per_level if c > 1 else max(2, a.requests_per_level // 4))
        phases.append({"name": f"decode-c{c}", "mix": "decode", "arrivals": "fixed", "concurrency": c, "requests": n,
                       "prompt_tokens": a.decode_prompt, "max_tokens": a.decode_output, "offset": off,
                       "link": links["decode"]})
        off += n
    if a.prefill_requests:
        phases.append({"name": "prefill-c8", "mix": "prefill", "arrivals": "fixed", "concurrency": 8,
                       "requests": a.prefill_requests, "prompt_tokens": a.prefill_prompt,
                       "max_tokens": a.prefill_output, "offset": off, "link": links["prefill"]})
        off += a.prefill_requests
    for i, rate in enumerate(a.rates):
        phases.append({"name": f"poisson-{rate:g}", "mix": "decode", "arrivals": "poisson", "rate": rate, "seed": i,
                       "requests": a.poisson_requests, "prompt_tokens": a.decode_prompt,
                       "max_tokens": a.decode_output, "offset": off, "link": links["decode"]})
        off += a.poisson_requests
    return phases


def summarise(results: dict, slo_scale: float) -> dict:
    """Per target and configuration: the JSON's headline numbers (concurrency-8 decode mix),
    and the SLO throughput against a bound of slo_scale x the best single-stream p90 TBT."""
    out = {}
    for target, res in results.items():
        ok = {n: r for n, r in res.items() if "error" not in r}
        single = [p["p90_itl_ms"] for r in ok.values() for p in r["phases"]
                  if p["name"] == "decode-c1" and p.get("p90_itl_ms")]
        bound = slo_scale * min(single) if single else None
        rows = {}
        ref = next((r["greedy"] for n, r in ok.items() if n.split("#")[0] == "tp" and r.get("greedy")), None)
        for name, r in res.items():
            if "error" in r:
                rows[name] = {"error": r["error"], "smoe": r.get("smoe")}
                continue
            by = {p["name"]: p for p in r["phases"]}
            head = by.get("decode-c8") or next(iter(by.values()))
            ladder = [p for p in r["phases"] if p["arrivals"] == "poisson"]
            rows[name] = {"smoe": r["smoe"], "tpot_ms": head["tpot_ms"], "ttft_ms": head["ttft_ms"],
                          "p90_itl_ms": head["p90_itl_ms"], "tok_s": head["tok_s"],
                          "slo_rps": slo_rate(ladder, "p90_itl_ms", bound) if bound and ladder else None,
                          "slo_bound_ms": bound,
                          "wire_bytes_per_token": head["wire_bytes_per_token"],
                          "counter_bytes_per_token": head["counter_bytes_per_token"],
                          "counter": head.get("counter"),
                          "counters_vs_wire": head["counters_vs_wire"],
                          "greedy_equal_tp": None if ref is None or not r.get("greedy") else r["greedy"] == ref,
                          "collectives_per_step": head.get("collectives_per_step"),
                          "phases": {p["name"]: {k: p.get(k) for k in ("tpot_ms", "ttft_ms", "p90_itl_ms", "tok_s",
                                                                       "failed", "wire_bytes_per_token",
                                                                       "counter_bytes_per_token")}
                                     for p in r["phases"]},
                          "smoe_log": r.get("smoe_log")}
        out[target] = rows
    return out


def run(a) -> int:
    from ..cli_util import check_output_file
    from .common import mixed_prompts

    if a.json:
        check_output_file(a.json, "--json")
    if bad := [t for t in a.target if t not in TARGETS and t != "none"]:
        raise ValueError(f"--target {' '.join(bad)}: choose from {', '.join(TARGETS)}, none")
    if a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
        raise ValueError(f"--model {a.model}: no config.json there")
    import shutil

    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        print(f"smoe-bench cluster: needs root (namespaces, veth, tc) and iproute2's ip and tc; uid "
              f"{os.geteuid()}, not found: {', '.join(missing) or 'none'}", file=sys.stderr)
        return 2
    from ...testbed import FIXTURE_MODEL, FIXTURE_TRACES

    work = a.work or tempfile.mkdtemp(prefix="smoe-cluster-")
    os.makedirs(work, exist_ok=True)
    print(f"logs in {work}", flush=True)
    if a.exchange_only:
        return run_exchange(a, work)
    if a.model is None:  # the trained fixture at production row sizes, its routing unchanged
        from ...testbed.inflate import inflate_checkpoint

        a.model = os.path.join(work, "fixture-wide")
        if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
            inflate_checkpoint(FIXTURE_MODEL, a.model, **DEFAULT_WIDTHS)
        a.trace = a.trace or [FIXTURE_TRACES["train"]]
    a.model = os.path.abspath(a.model)
    tp_pl, dp_pl = a.placement, a.dp_placement
    for mode, given, flags in (("tp", tp_pl, ()), ("dp", dp_pl, ("--mode", "dp"))):
        if given:
            continue
        if not a.trace:
            raise ValueError(f"--trace is needed to build the {mode} placement (or give --{mode}-placement)")
        out = os.path.join(work, f"placement-{mode}.yaml")
        sh(sys.executable, "-m", "vllm_smoe.tools.place_cli", "build", "--trace", *a.trace, "--ep-size", "2", "--model",
           a.model, *flags, "-o", out)
        tp_pl, dp_pl = (out, dp_pl) if mode == "tp" else (tp_pl, out)
    names = [c for c in a.configs.split(",") if c]
    dp_uncapped = None
    if "dp-ep-smoe-uncapped" in names:
        if not a.trace:
            raise ValueError("--configs dp-ep-smoe-uncapped: --trace is needed to build its placement")
        dp_uncapped = os.path.join(work, "placement-dp-uncapped.yaml")
        sh(sys.executable, "-m", "vllm_smoe.tools.place_cli", "build", "--trace", *a.trace, "--ep-size", "2", "--model",
           a.model, "--mode", "dp", "--max-expert-load", str(UNCAPPED), "-o", dp_uncapped)
    dptp_pl = None
    if any(n.startswith("dptp-ep-smoe") for n in names):
        if not a.trace:
            raise ValueError("--configs dptp-ep-smoe*: --trace is needed to build its placement")
        dptp_pl = os.path.join(work, "placement-dptp.yaml")
        sh(sys.executable, "-m", "vllm_smoe.tools.place_cli", "build", "--trace", *a.trace, "--ep-size", "4", "--model",
           a.model, "--mode", "dp", "--nodes", "2", "-o", dptp_pl)
    metrics_dir = os.path.join(work, "metrics")
    os.makedirs(metrics_dir, exist_ok=True)
    all_cfgs = configurations(tp_pl, dp_pl, metrics_dir, dp_uncapped, dptp_pl)
    if bad := [c for c in names if c not in all_cfgs]:
        raise ValueError(f"--configs: unknown {bad}; choose from {', '.join(all_cfgs)}")
    host = host_speed()
    print(f"host, one thread: {host['gemm_flops'] / 1e9:.0f} GFLOP/s fp32 GEMM, {host['read_bw'] / 1e9:.1f} GB/s "
          f"weight reads", flush=True)
    need = len(a.concurrency) * a.requests_per_level + max(a.concurrency) + a.prefill_requests \
        + a.poisson_requests * len(a.rates) + 8
    prompts = mixed_prompts(a.prompts_trace or FIXTURE_TRACES["heldout"], need,
                             max(a.decode_prompt, a.prefill_prompt), a.seed)
    if len(prompts) < need:
        prompts = (prompts * (need // max(1, len(prompts)) + 1))[:need]
    net, results, meta, idx, rc = Net(), {}, {"links": {}, "measured_link": {}}, 0, 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        net.up()
        if a.wire_check:
            hidden = json.load(open(os.path.join(a.model, "config.json")))["hidden_size"]
            meta["wire_check"] = wc = wire_check(net, hidden, work)
            for name in PIPELINES:
                ag = wc[name]["agreement"]
                print(f"wire check, {name} exchange alone ({1e3 * wc['seconds'][name]:.0f} ms): counted {wc[name]['counted_bytes'] / 1e6:.2f} MB, veth "
                      f"payload {wc[name]['wire']['payload'] / 1e6:.2f} MB (counted / wire {ag['ratio']:.3f}, "
                      f"{'within' if ag['within'] else 'NOT within'} {100 * ag['tol']:.0f}%)", flush=True)
        for target in a.target:
            links = ({"decode": None, "prefill": None} if target == "none" else
                     {ph: link_settings(host, target, ph) for ph in ("decode", "prefill")})
            if a.rate:  # a fixed rate instead of the target's proportions
                links = {ph: {"target": "fixed", "phase": ph, "rate_bytes_s": a.rate / 8, "rate_bit": int(a.rate),
                              "delay_s": a.delay} for ph in ("decode", "prefill")}
            meta["links"][target] = links
            net.shape(links["decode"])
            meta["measured_link"][target] = {**measure_link(net), "delay_applied": net.delay_applied}
            net.shape(None)
            m = meta["measured_link"][target]
            print(f"[{target}] decode link {links['decode'] and links['decode']['rate_bit'] / 1e6}"
                  f" Mbit/s: measured {8 * m['rate_bytes_s'] / 1e6:.1f} Mbit/s, RTT {1e3 * m['rtt_s']:.2f} ms",
                  flush=True)
            phases = plan_phases(a, links)
            results[target] = {}
            for name in names:
                for rnd in range(a.repeats):
                    idx += 1
                    t = time.monotonic()
                    key = name if a.repeats == 1 else f"{name}#{rnd}"
                    try:
                        r = run_config(net, name, all_cfgs[name], idx, work, a, phases, prompts)
                        r["smoe"] = all_cfgs[name]["smoe"]
                        results[target][key] = r
                        head = next((p for p in r["phases"] if p["name"] == "decode-c8"), r["phases"][0])
                        print(f"[{target}] {key}: TPOT {head['tpot_ms']:.1f} ms, wire "
                              f"{head['wire_bytes_per_token']:.0f} B/token ({time.monotonic() - t:.0f} s)", flush=True)
                    except RuntimeError as e:
                        results[target][key] = {"error": str(e), "smoe": all_cfgs[name]["smoe"]}
                        print(f"FAILED {e}", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C, or SIGTERM: what was measured is still written
        rc = _interrupted(e)
    finally:
        _tear_down(net)
    summary = summarise(results, a.slo_scale)
    _print(summary)
    payload = {"date": datetime.datetime.now().astimezone().isoformat(), "uname": " ".join(os.uname()),
               "model": a.model, "moe_layers": _moe_layers(a.model), "placements": {"tp": tp_pl, "dp": dp_pl},
               "host": host, **meta,
               "targets": {t: TARGETS.get(t) for t in a.target},
               "args": {k: v for k, v in vars(a).items() if k != "fn"},
               "configs": {n: {k: list(v) if k == "flags" else v for k, v in all_cfgs[n].items()} for n in names},
               "summary": summary, "results": results}
    if a.json:
        from .common import write_json

        write_json(a.json, payload)
    if a.plot:
        _plot(summary, results, a.plot)
    return rc or int(any("error" in r for res in results.values() for r in res.values()))


def _interrupted(e: BaseException) -> int:
    """The exit status of a run stopped by Ctrl-C (130) or SIGTERM (143)."""
    print("interrupted: cleaning up", file=sys.stderr)
    return 130 if isinstance(e, KeyboardInterrupt) else 143


def _tear_down(net: Net) -> None:
    """Remove the namespaces, no signal taking the cleanup down half way."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    net.down()


def measure_host(net, hidden: int, work: str, per_node: int, repeats: int = 3) -> dict:
    """The host's constants, unshaped: each pipeline's time a collective from tiny-step wire
    checks (median of ``repeats``), and the veth's payload rate (a 64 MiB TCP transfer,
    :func:`measure_link`)."""
    from .wire_model import TINY_TOKENS, _median_seconds, calibrate

    net.shape(None)
    lk = measure_link(net, nbytes=64 << 20)
    tiny = [wire_check(net, hidden, work, tokens=TINY_TOKENS, per_node=per_node) for _ in range(repeats)]
    seconds = _median_seconds(tiny)
    plan = wire_plan(hidden, TINY_TOKENS, tiny[0]["steps"], per_node)
    return {"tiny_tokens": TINY_TOKENS, "tiny_seconds": seconds, "link": lk, "local_bytes_s": lk["rate_bytes_s"],
            "collective_s": calibrate(plan, per_node, {"seconds": seconds}, lk["rate_bytes_s"])}


def model_run(net, hidden: int, work: str, per_node: int, wc: dict, link: dict | None, host: dict) -> dict:
    """The model of wire check ``wc`` (just run on ``net`` shaped by ``link``) with ``host``'s
    constants (:func:`measure_host`), compared; ``transport_*`` with gloo's bytes over a half-duplex
    link (:data:`.wire_model.HALF_DUPLEX`). Records :func:`.wire_model.measure_overlap` on the link as it is now (a
    diagnostic). Where the link has a delay, also a tiny-step run there, whose time per
    collective checks :data:`.wire_model.HOPS` (``implied_hops``, not used by the model)."""
    from .wire_model import (HALF_DUPLEX, HOPS, TINY_TOKENS, compare, implied_hops, measure_overlap,
                             model_wire_check, payload_rate)

    plan = wire_plan(hidden, wc["tokens_per_step"], wc["steps"], per_node)
    rate = host["local_bytes_s"] if link is None else min(payload_rate(link), host["local_bytes_s"])
    ov = measure_overlap(net, per_node, work, rate)
    consts = {"collective_s": host["collective_s"], "local_bytes_s": host["local_bytes_s"], "rate_bytes_s": rate,
              "delay_s": link["delay_s"] if link is not None and net.delay_applied else 0.0, "hops": dict(HOPS),
              "overlap": dict(HALF_DUPLEX)}
    out = {"constants": consts, "overlap_measurement": ov,
           "pipelines": compare(model_wire_check(plan, per_node, consts), wc)}
    if consts["delay_s"] > 0:
        tiny = wire_check(net, hidden, work, tokens=TINY_TOKENS, per_node=per_node)
        tplan = wire_plan(hidden, TINY_TOKENS, tiny["steps"], per_node)
        out["tiny_shaped_seconds"] = tiny["seconds"]
        out["implied_hops"] = implied_hops(tplan, per_node, tiny, host["collective_s"],
                                           {**link, "delay_s": consts["delay_s"]}, host["local_bytes_s"])
    return out


def run_exchange(a, work: str) -> int:
    """``--exchange-only``: the MoE exchange alone (:func:`wire_check`) over two nodes of
    ``--ranks-per-node`` ranks, per target a decode-sized step on the link shaped to the target's
    decode proportions and a prefill-sized one on its prefill link (``--exchange-tokens``): bytes
    between nodes (counted and on the veth) and time, no vLLM."""
    hidden = (json.load(open(os.path.join(a.model, "config.json")))["hidden_size"] if a.model
              else DEFAULT_WIDTHS["hidden"])
    host = host_speed() if any(t != "none" for t in a.target) else None
    net, runs, rc = Net(), {}, 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    constants = None
    try:
        net.up()
        if a.wire_model:  # the host's constants first, unshaped (wire_model.measure_host)
            from .wire_model import model_table

            constants = measure_host(net, hidden, work, a.ranks_per_node)
            print(f"host constants: {json.dumps(constants)}", flush=True)
        for target in a.target:
            for phase, tokens in zip(("decode", "prefill"), a.exchange_tokens):
                link = None if target == "none" else link_settings(host, target, phase)
                net.shape(link)
                runs[f"{target} {phase}"] = wc = wire_check(net, hidden, work, tokens=tokens,
                                                            per_node=a.ranks_per_node)
                wc["link"] = link
                for line in exchange_table(wc, f"{target}, {phase} link"):
                    print(line, flush=True)
                if constants is not None:
                    wc["model"] = model_run(net, hidden, work, a.ranks_per_node, wc, link, constants)
                    for line in model_table(wc, f" ({target}, {phase} link)"):
                        print(line, flush=True)
    except (KeyboardInterrupt, SystemExit) as e:
        rc = _interrupted(e)
    finally:
        _tear_down(net)
    if a.json:
        from .common import write_json

        write_json(a.json, {"date": datetime.datetime.now().astimezone().isoformat(), "uname": " ".join(os.uname()),
                            "host": host, "args": {k: v for k, v in vars(a).items() if k != "fn"}, "runs": runs,
                            **({"host_constants": constants} if constants is not None else {})})
    return rc


def exchange_table(wc: dict, target: str = "none") -> list[str]:
    """A wire check's markdown table: per transport, bytes between nodes counted and on the veth,
    and time."""
    link = wc.get("link")
    shaped = f"link {link['rate_bit'] / 1e6:.0f} Mbit/s" if link else "no shaping"
    per = wc.get("ranks_per_node", 1)
    lines = ["", f"exchange alone, {wc['steps']} steps x {wc['tokens_per_step']} tokens, hidden {wc['hidden']}, "
                 f"2 nodes x {per} gloo rank{'s' * (per > 1)} over the veth ({target}: {shaped}):", "",
             "| transport | counted MB between nodes | veth payload MB | counted / wire | time ms |",
             "|---|---|---|---|---|"]
    for name in [n for n in NODE_PIPELINES + PIPELINES if n in wc and isinstance(wc[n], dict) and "wire" in wc[n]]:
        if any(line.startswith(f"| {name} |") for line in lines):
            continue
        w = wc[name]
        lines.append(f"| {name} | {w['counted_bytes'] / 1e6:.2f} | {w['wire']['payload'] / 1e6:.2f} | "
                     f"{w['agreement']['ratio']:.3f} | {1e3 * wc.get('seconds', {}).get(name, float('nan')):.0f} |")
    return lines


def _print(summary: dict) -> None:
    for target, rows in summary.items():
        print(f"\ntarget {target} (decode mix at concurrency 8; SLO: p90 TBT bound)")
        print(f"{'config':>22} {'smoe':>5} {'TPOT ms':>8} {'TTFT ms':>8} {'p90 ITL':>8} {'tok/s':>7} {'SLO rps':>8} "
              f"{'wire B/tok':>10} {'ctr B/tok':>10}")
        for name, r in rows.items():
            if "error" in r:
                print(f"{name:>22} failed: {r['error'].splitlines()[0]}")
                continue

            def f(v, fmt):
                return format(v, fmt) if v is not None else "-"
            print(f"{name:>22} {str(r['smoe']):>5} {f(r['tpot_ms'], '8.1f')} {f(r['ttft_ms'], '8.0f')} "
                  f"{f(r['p90_itl_ms'], '8.1f')} {f(r['tok_s'], '7.1f')} {f(r['slo_rps'], '8.2f')} "
                  f"{f(r['wire_bytes_per_token'], '10.0f')} {f(r['counter_bytes_per_token'], '10.0f')}")


def markdown(payload: dict) -> str:
    """The JSON of a run as BENCHMARKS.md tables: per target, every configuration's headline
    (decode mix at concurrency 8), its concurrency sweep, the prefill mix and SLO throughput."""
    lines = []
    host = payload["host"]
    lines.append(f"host, one thread: {host['gemm_flops'] / 1e9:.0f} GFLOP/s fp32 GEMM, {host['read_bw'] / 1e9:.2f} GB/s "
                 "weight reads")
    if "wire_check" in payload:
        lines += exchange_table(payload["wire_check"])
    for target, rows in payload["summary"].items():
        links = payload["links"].get(target) or {}
        m = payload["measured_link"].get(target, {})
        dec, pre = links.get("decode"), links.get("prefill")
        shaped = (f"decode {dec['rate_bit'] / 1e6:.0f} Mbit/s, prefill mix {pre['rate_bit'] / 1e6:.0f} Mbit/s; "
                  f"delay {'applied' if m.get('delay_applied') else 'not applied'}" if dec else "no shaping")
        lines += ["", f"**{target}** ({shaped}; a 4 MB TCP stream measured {8 * m.get('rate_bytes_s', 0) / 1e6:.0f} "
                      f"Mbit/s)", "",
                  "| config | smoe | TPOT ms | TTFT ms | p90 ITL ms | tok/s | SLO req/s | wire B/token | counters "
                  "B/token | TPOT c1 / c32 | TTFT prefill mix ms | greedy = tp |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | {r.get('smoe')} | failed: {r['error'].splitlines()[0]} |")
                continue
            ph = r["phases"]
            c1, c32, pf = ph.get("decode-c1", {}), ph.get("decode-c32", {}), ph.get("prefill-c8", {})
            eq = {True: "yes", False: "NO", None: "-"}[r.get("greedy_equal_tp")]
            lines.append(f"| {name} | {'yes' if r['smoe'] else 'no'} | {f(r['tpot_ms'], '.1f')} | {f(r['ttft_ms'], '.0f')} | "
                         f"{f(r['p90_itl_ms'], '.1f')} | {f(r['tok_s'], '.1f')} | {f(r['slo_rps'], '.1f')} | "
                         f"{f(r['wire_bytes_per_token'], ',.0f')} | {f(r['counter_bytes_per_token'], ',.0f')} | "
                         f"{f(c1.get('tpot_ms'), '.1f')} / {f(c32.get('tpot_ms'), '.1f')} | {f(pf.get('ttft_ms'), '.0f')} "
                         f"| {eq} |")
        node = [n for n, r in rows.items() if r.get("counter") == "smoe:a2a_node_bytes"]
        if node:
            lines.append(f"\ncounters: the bytes between nodes (smoe:a2a_node_bytes) for {', '.join(node)}, "
                         "as the veth carries nothing else of theirs")
        bound = next((r.get("slo_bound_ms") for r in rows.values() if r.get("slo_bound_ms")), None)
        if bound:
            lines.append(f"\nSLO: p90 TBT <= {bound:.0f} ms (the best single-stream p90 TBT x the run's --slo-scale); "
                         f"ladder {payload['args'].get('rates')} req/s")
        lines += collectives_table(rows, payload.get("moe_layers"))
    return "\n".join(lines)


def collectives_table(rows: dict, moe_layers: int | None) -> list[str]:
    """Markdown lines: each configuration's collectives per served step and rank (decode mix at
    concurrency 8), by group and kind, counted by smoe's communicator; per MoE layer too, which
    includes each step's own few (the embedding's all-reduce, the logits' gather)."""
    counted = {n: r["collectives_per_step"] for n, r in rows.items() if r.get("collectives_per_step")}
    if not counted:
        return []
    L = moe_layers or 0
    out = ["", f"collectives per served step and rank, counted (decode mix at concurrency 8"
               f"{f'; {L} MoE layers' if L else ''}):", "",
           "| config | per step | per MoE layer | by group and kind (per step) |", "|---|---|---|---|"]
    for name, c in counted.items():
        total = sum(c.values())
        out.append(f"| {name} | {total:.1f} | {f'{total / L:.2f}' if L else '-'} | "
                   + ", ".join(f"{k} {v:.2f}" for k, v in c.items()) + " |")
    return out


def _moe_layers(model: str) -> int | None:
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    from ...formats.model_info import moe_layer_indices

    return len(moe_layer_indices(cfg.get("text_config", cfg)))


def _plot(summary: dict, results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (target, res) in zip(axes[0], results.items()):
        for name, r in res.items():
            if "error" in r:
                continue
            ladder = [p for p in r["phases"] if p["arrivals"] == "poisson" and p.get("p90_itl_ms")]
            ax.plot([p["rate"] for p in ladder], [p["p90_itl_ms"] for p in ladder], "o-", label=name)
        bound = next((r.get("slo_bound_ms") for r in summary[target].values() if r.get("slo_bound_ms")), None)
        if bound:
            ax.axhline(bound, color="gray", ls="--", lw=1, label="SLO")
        ax.set(title=f"link: {target}", xlabel="offered requests/s (Poisson)", ylabel="p90 inter-token latency (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_parser(sub) -> None:
    import argparse

    from ..cli_util import number

    p = sub.add_parser("cluster", help="vLLM nodes in network namespaces over a link shaped to a real cluster's "
                                       "proportions: every configuration end to end (needs root; JSON, plot)")
    p.add_argument("--model", help="checkpoint (default: the trained Qwen3-MoE fixture widened with smoe-testbed "
                                   "inflate to hidden 1536, expert FFN 768, 24/12 heads, with its training trace)")
    p.add_argument("--trace", nargs="+", help="routing trace(s) smoe's placements are built from, as a user would")
    p.add_argument("--placement", help="TP placement (instead of building one from --trace)")
    p.add_argument("--dp-placement", help="DP placement (instead of building one from --trace)")
    p.add_argument("--prompts-trace", help="prompts from this trace's requests (default: the fixture's held-out)")
    p.add_argument("--target", nargs="+", default=["ib-ndr", "none"],
                   help=f"link proportions: {', '.join(TARGETS)}, or none (no shaping: the veth's speed)")
    p.add_argument("--rate", type=number(float, 0, lo_open=True), help="fixed link rate in bit/s instead of a target")
    p.add_argument("--delay", type=number(float, 0), default=0.0, help="with --rate: one-way delay in s")
    p.add_argument("--configs", default="tp,tp-ep,tp-ep-speculate,dp-ep,dp-ep-smoe",
                   help="comma-separated, from: tp, tp-ep, tp-ep-place, tp-ep-speculate, tp-ep-speculate-ar (vLLM's "
                        "attention all-reduce, not smoe's shuffled reduce-scatter), tp-ep-speculate-router, "
                        "tp-ep-speculate-router-ar (predictor router), tp-ep-speculate-step (the DeepSeek "
                        "family's one order per step), tp-ep-speculate-agrs, "
                        "dp-ep, dp-ep-sparse, dp-ep-smoe, dp-ep-smoe-agrs, dptp-ep, dptp-ep-smoe, dptp-ep-smoe-flat "
                        "(TP = 2 inside each node, DP = 2 across them)")
    p.add_argument("--concurrency", type=number(int, 1), nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-level", type=number(int, 1), default=16)
    p.add_argument("--decode-prompt", type=number(int, 1), default=32)
    p.add_argument("--decode-output", type=number(int, 2), default=32)
    p.add_argument("--prefill-prompt", type=number(int, 1), default=384)
    p.add_argument("--prefill-output", type=number(int, 2), default=4)
    p.add_argument("--prefill-requests", type=number(int, 0), default=8)
    p.add_argument("--rates", type=number(float, 0, lo_open=True), nargs="*", default=[0.5, 1.0, 2.0, 4.0],
                   help="Poisson request rates of the SLO ladder (req/s)")
    p.add_argument("--poisson-requests", type=number(int, 1), default=16)
    p.add_argument("--slo-scale", type=number(float, 1), default=3.0,
                   help="p90 TBT bound = this x the best configuration's single-stream p90 TBT")
    p.add_argument("--wire-check", action=argparse.BooleanOptionalAction, default=True,
                   help="first run the MoE exchange alone across the veth: smoe's counters against the wire")
    p.add_argument("--exchange-only", action="store_true",
                   help="only the MoE exchange alone, once per --target with the decode link's shaping (no vLLM): "
                        "smoe's flat and hierarchical exchange and vLLM's allgather-reducescatter")
    p.add_argument("--wire-model", action="store_true",
                   help="with --exchange-only: also the cost model (placement/a2a_cost.py) of each run from the "
                        "host's measured constants (tiny unshaped steps, the veth's rate; tools/bench/wire_model.py): "
                        "bytes against the counted ones, time against the measured")
    p.add_argument("--ranks-per-node", type=number(int, 1, 15), default=1,
                   help="with --exchange-only: gloo ranks in each of the two namespaces")
    p.add_argument("--exchange-tokens", type=number(int, 1), nargs=2, default=[64, 512], metavar=("DECODE", "PREFILL"),
                   help="with --exchange-only: tokens a step on the decode link and on the prefill link")
    p.add_argument("--memory-share", type=number(float, 0, 1, lo_open=True), default=0.3,
                   help="--gpu-memory-utilization of each node (on CPU: the share of RAM for weights and KV cache)")
    p.add_argument("--repeats", type=number(int, 1), default=1, help="starts of each configuration (spread)")
    p.add_argument("--timeout", type=number(float, 1), default=600.0, help="seconds for a server start")
    p.add_argument("--config-timeout", type=number(float, 1), default=1800.0, help="seconds for a configuration's load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="directory for logs and placements (default: a temp dir)")
    p.add_argument("--plot", help="PNG: p90 TBT against offered rate, per target")
    p.add_argument("--json")
    p.set_defaults(fn=run)


def main(argv=None) -> int:
    """Internal entries: the client (inside namespace 0) and the link probe's sink."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        return client_main(argv[1])
    if argv[:1] == ["--markdown"]:
        with open(argv[1]) as f:
            print(markdown(json.load(f)))
        return 0
    if argv[:1] == ["--wire-worker"]:
        return _wire_worker(int(argv[1]), argv[2])
    if argv[:1] == ["--probe-sink"]:
        return _probe_sink(int(argv[1]))
    print("use: smoe-bench cluster ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
