"""Two network namespaces joined by a veth pair, shaped with tc; the link probe across it; the
teardown that no signal interrupts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from ..veth import ADDR
from .readings import parse_ss

BURST_PACKETS, BURST_SECONDS = 4, 50e-6  # tbf's bucket: a few frames, never a whole message


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


def probe_sink(port: int) -> int:
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


def interrupted(e: BaseException) -> int:
    """The exit status of a run stopped by Ctrl-C (130) or SIGTERM (143)."""
    print("interrupted: cleaning up", file=sys.stderr)
    return 130 if isinstance(e, KeyboardInterrupt) else 143


def tear_down(net: Net) -> None:
    """Remove the namespaces, no signal taking the cleanup down half way."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    net.down()
