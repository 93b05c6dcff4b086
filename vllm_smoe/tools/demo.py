"""``make demo``: the smoe loop on the embedded tiny MoE, end to end on vLLM's CPU build.

1. the trained 4-domain testbed model and its routing statistics;
2. ``vllm serve --plugin smoe --smoe-record``: serve a mixed workload, record its routing;
3. ``smoe-place build`` on that recording;
4. ``vllm serve --plugin smoe --smoe-placement``: the same workload, outputs compared with step 2;
5. ``smoe-place evaluate`` on held-out routing, next to the placements users run today;
6. ``--smoe-mode speculate`` at TP=2 (experts split over the two ranks by an EP=2 placement
   built from the same recording), outputs compared with plain vLLM TP=2.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time


def _step(n: int, text: str) -> None:
    print(f"\n=== [{n}] {text}", flush=True)


def _workload(per_domain: int = 8, prompt_tokens: int = 96) -> list[list[int]]:
    """Token-id prompts cut from the held-out text of every domain."""
    import numpy as np

    from ..testbed import FIXTURE_TRACES
    from ..formats.trace import open_trace

    t = open_trace(FIXTURE_TRACES["heldout"])
    tok, req, dom = t["token_ids"], t["request_ids"], t["domain"]
    prompts = []
    for d in range(len(t.meta.domains)):
        for r in np.unique(req[dom == d])[:per_domain]:
            prompts.append(tok[req == r][:prompt_tokens].tolist())
    return prompts


def _serve(model: str, prompts, log: str, *flags: str, max_tokens: int = 16, env: dict | None = None):
    from .server_process import VllmServer

    with VllmServer(model, *flags, log=log, env=env) as server:
        t0 = time.monotonic()
        out = server.complete(prompts, max_tokens=max_tokens)
        secs = time.monotonic() - t0
        time.sleep(3)  # a recording closes its chunk after 2 s without steps
    print(f"    started in {server.started_s:.1f} s; {len(prompts)} requests x {max_tokens} tokens in {secs:.1f} s "
          f"({len(prompts) * max_tokens / secs:.1f} output tokens/s, requests sent one after another)")
    return out


def main() -> int:
    from .place import main as place_main
    from ..testbed import FIXTURE_MODEL, FIXTURE_TRACES
    from .testbed_cli import main as testbed_main
    from ..formats.trace import read_traces

    _step(1, "testbed: trained 4-domain Qwen3-MoE (4 MoE layers, 32 experts, top-4) and its routing")
    print(f"    model: {FIXTURE_MODEL}")
    testbed_main(["stats", "--trace", FIXTURE_TRACES["heldout"]])

    work = tempfile.mkdtemp(prefix="smoe-demo-")
    rec, placement = os.path.join(work, "traces"), os.path.join(work, "placement.yaml")
    prompts = _workload()

    _step(2, f"vllm serve {os.path.basename(FIXTURE_MODEL)} --plugin smoe --smoe-record {rec}")
    recorded = _serve(FIXTURE_MODEL, prompts, os.path.join(work, "record.log"), "--plugin", "smoe",
                      "--smoe-record", rec)
    meta, arr, files = read_traces([rec])
    print(f"    recorded {arr['token_ids'].size} tokens of {len(set(arr['request_ids'].tolist()))} requests "
          f"in {len(files)} file(s)")

    _step(3, f"smoe-place build --trace {rec} --ep-size 4 -o {placement}")
    rc = place_main(["build", "--trace", rec, "--ep-size", "4", "--model", FIXTURE_MODEL, "-o", placement])
    if rc:
        return rc

    _step(4, f"vllm serve ... --plugin smoe --smoe-placement {placement}")
    placed = _serve(FIXTURE_MODEL, prompts, os.path.join(work, "place.log"), "--plugin", "smoe",
                    "--smoe-placement", placement)
    same = sum(a[0] == b[0] for a, b in zip(recorded, placed))
    drift = max(abs(x - y) for a, b in zip(recorded, placed) for x, y in zip(a[1], b[1]))
    print(f"    completions identical to step 2: {same}/{len(prompts)}; max logprob difference {drift:.2e}")
    if same != len(prompts):
        print("    placement changed outputs: this is a bug, please report it")
        return 1

    _step(5, "smoe-place evaluate on held-out routing (placement built from the live recording)")
    rc = place_main(["evaluate", "--trace", FIXTURE_TRACES["heldout"], "--placement", placement,
                     "--compare", "linear,eplb,metis,coclust", "--train", rec])
    if rc:
        return rc
    print("    (LAR: share of (token, layer, expert) activations local to the token's rank; "
          "docs/metrics.md and docs/place.md say what each column counts)")

    ep2 = os.path.join(work, "placement-ep2.yaml")
    _step(6, f"speculative token shuffling at TP=2: smoe-place build --ep-size 2, then vllm serve ... "
             f"--tensor-parallel-size 2 --enable-expert-parallel --plugin smoe --smoe-mode speculate --smoe-placement {ep2}")
    rc = place_main(["build", "--trace", rec, "--ep-size", "2", "--model", FIXTURE_MODEL, "-o", ep2])
    if rc:
        return rc
    tp2, env = ("--tensor-parallel-size", "2"), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    print("    plain vLLM TP=2:")
    plain2 = _serve(FIXTURE_MODEL, prompts, os.path.join(work, "plain-tp2.log"), *tp2, env=env)
    spec_log = os.path.join(work, "speculate-tp2.log")
    print("    smoe speculate TP=2:")
    spec = _serve(FIXTURE_MODEL, prompts, spec_log, *tp2, "--enable-expert-parallel", "--plugin", "smoe", "--smoe-mode", "speculate",
                  "--smoe-placement", ep2, "--smoe-log-interval", "1", env=env)
    same = sum(a[0] == b[0] for a, b in zip(plain2, spec))
    drift = max(abs(x - y) for a, b in zip(plain2, spec) for x, y in zip(a[1], b[1]))
    print(f"    completions identical to plain TP=2: {same}/{len(prompts)}; max logprob difference {drift:.2e}")
    stats = [ln.split("smoe: ", 1)[1].strip() for ln in open(spec_log) if "smoe: speculate (" in ln]
    if stats:
        print(f"    last speculate log line: {stats[-1]}")
    if same != len(prompts):
        print("    speculate changed outputs: this is a bug, please report it")
        return 1
    print(f"\ndemo finished; files in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
