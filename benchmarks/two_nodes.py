"""Two emulated nodes on one machine: per-token latency of TP=2 serving across a rate-limited link.

Each rank of the fixture model is one vLLM node in its own network namespace (``vllm serve
--nnodes 2 --node-rank 0|1 --master-addr 10.213.0.1``, node 1 ``--headless``), the two joined by
a veth pair shaped with ``tc tbf`` on both ends. At each rate it compares plain vLLM TP=2,
vllm-ep (``--enable-expert-parallel --plugin smoe --smoe-all2all vllm``) and speculate
(``... --smoe-mode speculate --smoe-placement configs/tiny-4dom-ep2.yaml``) on streamed
completions (held-out fixture prompts of 64 tokens, 32 output tokens with ignore_eos, 8
concurrent, one warm-up request), the client inside node 0's namespace. Needs root, ip and tc.

    sudo .venv/bin/python benchmarks/two_nodes.py --rates 1gbit,10gbit,25gbit --requests 16 --json out.json
    sudo .venv/bin/python benchmarks/two_nodes.py --rates 1gbit --requests 4 --configs plain,speculate

Logs go to a printed temporary directory; namespaces, veth and processes are removed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
ADDR = ("10.213.0.1", "10.213.0.2")
from vllm_smoe.server_process import CPU_ARGS  # noqa: E402  (after the sys.path line)
EP = ("--enable-expert-parallel", "--plugin", "smoe", "--smoe-log-interval", "1")  # as vllm_smoe/bench.py
CONFIGS = {"plain": (),
           "vllm-ep": EP + ("--smoe-all2all", "vllm"),
           "speculate": EP + ("--smoe-mode", "speculate", "--smoe-placement",
                              os.path.join(REPO, "configs", "tiny-4dom-ep2.yaml"))}


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class Net:
    """Two namespaces joined by a veth pair (names carry this process's pid)."""

    def __init__(self) -> None:
        tag = os.getpid()
        self.ns = (f"smoe2n-{tag}-0", f"smoe2n-{tag}-1")
        self.dev = (f"s2n{tag}a", f"s2n{tag}b")

    def up(self) -> None:
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, ADDR):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")

    def rate(self, rate: str, burst: str) -> None:
        for ns, dev in zip(self.ns, self.dev):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
               "burst", burst, "latency", "50ms")

    def kill_all(self) -> None:
        """SIGKILL whatever still runs in our namespaces (only processes this script started)."""
        for ns in self.ns:
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    def down(self) -> None:
        self.kill_all()
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)  # deleting a namespace deletes its veth end
        sh("ip", "link", "del", self.dev[0], check=False)  # in case setup stopped before moving it


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # also what the leader left behind in its group
        p.wait()


def tail(log: str, n: int = 6) -> str:
    """The first distinct exception lines of a log (else its last lines)."""
    lines = [re.sub(r"^.*?\[\S+\.py:\d+\] ", "", ln) for ln in open(log).read().splitlines() if ln.strip()]
    errors = list(dict.fromkeys(ln for ln in lines if re.match(r"[\w.]+(Error|Exception): ", ln)))  # first, once
    return "\n".join(errors[:n] or lines[-n:])


def run_config(net: Net, name: str, idx: int, work: str, a) -> dict:
    """Serve one config across both namespaces, run the client in namespace 0; its numbers."""
    from vllm_smoe.testbed import FIXTURE_MODEL

    api, master = 8100 + idx, 29600 + 2 * idx  # fresh ports per run: no TIME_WAIT clashes
    procs, logs = [], []
    try:
        for node in (1, 0):
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(node), "VLLM_HOST_IP": ADDR[node],
                   "GLOO_SOCKET_IFNAME": net.dev[node]}
            cmd = ["ip", "netns", "exec", net.ns[node], os.path.join(os.path.dirname(sys.executable), "vllm"),
                   "serve", FIXTURE_MODEL, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(node),
                   "--master-addr", ADDR[0], "--master-port", str(master), *CPU_ARGS, *CONFIGS[name]]
            cmd += ["--headless"] if node else ["--host", "127.0.0.1", "--port", str(api)]
            logs.insert(0, os.path.join(work, f"{idx:02d}-{name}-node{node}.log"))
            procs.insert(0, subprocess.Popen(cmd, stdout=open(logs[0], "w"), stderr=subprocess.STDOUT,
                                             start_new_session=True, env=env, cwd=work))
        out = os.path.join(work, f"{idx:02d}-{name}-client.json")
        logs.append(out.replace(".json", ".log"))
        client = subprocess.Popen(["ip", "netns", "exec", net.ns[0], sys.executable, os.path.abspath(__file__),
                                   "--client", str(api), "--requests", str(a.requests), "--timeout", str(a.timeout),
                                   "--json", out], stdout=open(logs[2], "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=REPO)
        procs.append(client)
        deadline = time.monotonic() + a.timeout + 900
        while client.poll() is None or client.returncode:
            dead = [(n, p.returncode) for n, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{['node 0', 'node 1', 'client'][dead[0][0]]} exited with {dead[0][1]}" if dead else "timeout"
                raise RuntimeError(f"{name}: {why}" + "".join(f"\n--- {log}\n{tail(log)}" for log in logs))
            time.sleep(0.5)
        res = json.load(open(out))
    finally:
        stop(procs)
        net.kill_all()
    text = open(logs[0]).read() + open(logs[1]).read()
    res["tp_over_link"] = text.count("falling back to torch.distributed") == 2  # TP not through /dev/shm
    if not res["tp_over_link"]:
        print(f"WARNING {name}: no 'falling back to torch.distributed' on both nodes: is TP on the link?")
    spec = [ln.split("smoe: ", 1)[1].strip() for ln in text.splitlines() if "smoe: speculate (" in ln]
    res["last_smoe_log"] = spec[-1] if spec else None
    res["logs"] = logs
    return res


def client(a) -> int:
    """Inside namespace 0: wait for /health, one warm-up request, then the streamed load."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import openai

    from vllm_smoe.bench import _stream, _trace_prompts
    from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES

    port, t0 = int(a.client), time.monotonic()
    while time.monotonic() - t0 < a.timeout:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                break
        time.sleep(1)
    else:
        sys.exit(f"server not healthy after {a.timeout} s")
    start_s = time.monotonic() - t0
    prompts = _trace_prompts(FIXTURE_TRACES["heldout"], a.requests, a.prompt_tokens)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="smoe", timeout=600)
    _stream(c, FIXTURE_MODEL, prompts[0], a.max_tokens)  # warm-up
    t1 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as ex:
        outs = list(ex.map(lambda p: _stream(c, FIXTURE_MODEL, p, a.max_tokens), prompts))
    secs = time.perf_counter() - t1
    tpot = [(ts[-1] - ts[0]) / (n - 1) for _, ts, n in outs if len(ts) > 1 and n > 1]
    ttft = [ts[0] - st for st, ts, _ in outs if ts]
    res = {"tpot_ms": 1e3 * float(np.median(tpot)), "ttft_ms": 1e3 * float(np.median(ttft)),
           "tok_s": sum(n for _, _, n in outs) / secs, "start_s": start_s, "requests": len(outs),
           "tpot_all_ms": [1e3 * t for t in tpot], "ttft_all_ms": [1e3 * t for t in ttft]}
    with open(a.json, "w") as f:
        json.dump(res, f)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="1gbit,10gbit,25gbit", help="tc rates, comma-separated")
    p.add_argument("--configs", default="plain,vllm-ep,speculate", help="from: " + ",".join(CONFIGS))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each server start")
    p.add_argument("--json", default=None, help="write all numbers here")
    p.add_argument("--burst", default="256kb", help="tbf burst")
    for flag, default in (("--max-tokens", 32), ("--prompt-tokens", 64), ("--concurrency", 8)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: API port, in namespace 0
    a = p.parse_args(argv)
    if a.client:
        return client(a)
    configs = [c for c in a.configs.split(",") if c]
    if bad := [c for c in configs if c not in CONFIGS]:
        p.error(f"unknown configs {bad}; choose from {list(CONFIGS)}")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        print(f"two_nodes.py: needs root (namespaces, veth, tc) and iproute2's ip and tc; uid {os.geteuid()}, "
              f"not found: {', '.join(missing) or 'none'}", file=sys.stderr)
        return 2
    rates = [r for r in a.rates.split(",") if r]
    work = tempfile.mkdtemp(prefix="smoe-two-nodes-")
    print(f"logs in {work}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` cleans up on SIGTERM too
    net, results, idx, rc = Net(), {}, 0, 0
    try:
        net.up()
        for rate in rates:
            net.rate(rate, a.burst)
            results[rate] = {}
            for name in configs:
                t, idx = time.monotonic(), idx + 1
                try:
                    r = results[rate][name] = run_config(net, name, idx, work, a)
                    print(f"[{rate}] {name}: TPOT {r['tpot_ms']:.1f} ms ({time.monotonic() - t:.0f} s)", flush=True)
                except RuntimeError as e:
                    results[rate][name] = {"error": str(e)}
                    print(f"FAILED {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr)
        rc = 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not stop the clean-up
            signal.signal(sig, signal.SIG_IGN)
        net.down()
    print(f"\n{a.requests} requests x {a.max_tokens} tokens, prompts {a.prompt_tokens} tokens, "
          f"{a.concurrency} concurrent, TP=2 over 2 namespaces (one rank each); medians")
    for rate, res in results.items():
        print(f"\nlink {rate}\n{'config':>10} {'TPOT ms':>9} {'TTFT ms':>9} {'tok/s':>8} {'TPOT/plain':>11}")
        base = res.get("plain", {}).get("tpot_ms")
        for name, r in res.items():
            ratio = f"{r['tpot_ms'] / base:.2f}x" if base and "error" not in r else "-"
            print(f"{name:>10} {'failed':>9}" if "error" in r else
                  f"{name:>10} {r['tpot_ms']:9.1f} {r['ttft_ms']:9.1f} {r['tok_s']:8.1f} {ratio:>11}")
            if r.get("last_smoe_log"):
                print(f"{'':>10} smoe: {r['last_smoe_log']}")
    if a.json:
        meta = {"uname": sh("uname", "-a").stdout.strip(), "date": datetime.datetime.now().astimezone().isoformat(),
                "args": vars(a), "addresses": ADDR, "logs": work, "configs": {c: list(CONFIGS[c]) for c in configs}}
        with open(a.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)
    return rc or int(any("error" in r for res in results.values() for r in res.values()))


if __name__ == "__main__":
    sys.exit(main())
