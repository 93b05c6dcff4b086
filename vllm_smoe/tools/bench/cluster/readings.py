"""Readings taken around a load and compared: the veth's counters, the sockets' bytes by
process (``ss``), and smoe's own counters on ``/metrics`` (Prometheus text)."""

from __future__ import annotations

import re

from ..veth import HEADER_BYTES


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
