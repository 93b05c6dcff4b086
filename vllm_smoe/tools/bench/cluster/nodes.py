"""One configuration served end to end: its two vLLM nodes, each in its namespace, and the client
in namespace 0 (:mod:`.client`) running the phases; logs kept, everything stopped after."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

from ..veth import ADDR
from .netns import Net

# each emulated node's share of the host's RAM; its ranks split it (four ranks at 0.3 each
# would ask for more than the host has)
NODE_MEMORY_SHARE = 0.3


def node_command(model: str, cfg: dict, node: int, api: int, port: int, max_seqs: int,
                 mem_share: float = NODE_MEMORY_SHARE) -> list[str]:
    from ...server_process import CPU_ARGS, attention_args, vllm_executable

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
            ranks = 2 if cfg["kind"] == "dptp" else 1  # ranks on this node, one core between them
            bind = "|".join([str(node)] * ranks)
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_HOST_IP": ADDR[node],
                   "GLOO_SOCKET_IFNAME": net.dev[node]}
            log = os.path.join(work, f"{idx:02d}-{name}-node{node}.log")
            cmd = ["ip", "netns", "exec", net.ns[node],
                   *node_command(a.model, cfg, node, api, port, max(phase.get("concurrency", 0) for phase in phases)
                                 or 8, a.memory_share or NODE_MEMORY_SHARE / ranks)]
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
    res["smoe_log"] = smoe_log_lines(text)
    return res


def smoe_log_lines(text: str) -> list[str]:
    """Each rank's last locality line (speculation's or the DP exchange's) in the nodes' logs,
    by rank, then the distinct advice lines. Keyed by rank because the ranks log every interval,
    so the last lines of the joined logs would all be one node's."""
    last: dict[int, str] = {}
    for ln in text.splitlines():
        m = re.search(r"smoe: (?:speculate \([^)]*\): rank|dp rank) (\d+) served", ln)
        if m:
            last[int(m.group(1))] = ln.split("smoe: ", 1)[1].strip()
    advice = {ln.split("smoe: advice: ", 1)[1].strip() for ln in text.splitlines() if "smoe: advice: " in ln}
    return [last[r] for r in sorted(last)] + sorted(advice)

