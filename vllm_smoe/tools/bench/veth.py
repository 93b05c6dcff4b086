"""Constants of the emulated link between the network namespaces of ``smoe-bench cluster``
(:mod:`.cluster`), shared with the exchange's model (:mod:`.wire_model`)."""

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12, per packet on the veth
ADDR = ("10.213.0.1", "10.213.0.2")  # the two nodes' addresses


def run_ranks(net, per_node: int, module: str, flag: str, spec_path: str, timeout: float, what: str) -> list[str]:
    """Starts ``python -m module flag RANK spec_path`` for each of the 2 x per_node gloo ranks in
    its node's namespace (gloo on that node's veth), waits for all, and returns their output;
    raises RuntimeError with each rank's tail when one fails."""
    import os
    import subprocess
    import sys

    procs = [subprocess.Popen(["ip", "netns", "exec", net.ns[r // per_node], sys.executable, "-m", module, flag,
                               str(r), spec_path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "GLOO_SOCKET_IFNAME": net.dev[r // per_node]})
             for r in range(2 * per_node)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{what} failed:\n" + "\n".join(log[-2000:] for log in logs))
    return logs
