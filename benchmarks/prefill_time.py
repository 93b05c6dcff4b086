"""Prefill time at TP=2 on this host: plain TP against speculate, side by side, one engine each.

    python benchmarks/prefill_time.py --model M --placement P [P2 ...] [--prompt-len 512] [--prompts 4]
        [--iters 8] [--rounds 2] [--json out.json]

Each engine (plain ``--tensor-parallel-size 2``, then speculate over each placement with
``--enable-expert-parallel``) prefills ``--prompts`` held-out requests of the fixture trace,
``--prompt-len`` tokens each (128-token requests of every workload, in a seeded order, laid end
to end), one token out, ``--iters``
times after one warm-up; ``--rounds`` repeats the whole set so that each configuration runs at
different times. Prints the median and spread of the timed iterations per configuration and
round. Needs vLLM's CPU build and 2 cores; fp32, eager (the served path without compilation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def _engine(model: str, placement: str | None, prompt_len: int, prompts: int, iters: int) -> list[float]:
    """Seconds of each timed iteration (one engine in this process)."""
    import time

    from vllm import LLM, SamplingParams

    from vllm_smoe.testbed import FIXTURE_TRACES
    from vllm_smoe.tools.bench.common import mixed_prompts

    # requests of every workload in a seeded order, laid end to end ``per`` at a time
    per = max(1, prompt_len // 128)  # the fixture's requests are 128 tokens long
    reqs = mixed_prompts(FIXTURE_TRACES["heldout"], (iters + 1) * prompts * per, prompt_len)
    kw = dict(model=model, dtype="float32", max_model_len=max(1024, prompt_len + 8), tensor_parallel_size=2,
              gpu_memory_utilization=0.3, max_num_seqs=8, skip_tokenizer_init=True, seed=0,
              max_num_batched_tokens=max(4096, prompt_len * prompts), enforce_eager=True)
    if placement:
        kw.update(enable_expert_parallel=True,
                  additional_config={"smoe": {"mode": "speculate", "placement": placement}})
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    out, k = [], 0
    for it in range(iters + 1):
        batch = []
        for _ in range(prompts):
            ids = [t for j in range(per) for t in reqs[(k + j) % len(reqs)]]
            batch.append({"prompt_token_ids": ids[:prompt_len]})
            k += per
        t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        if it:  # the first is the warm-up
            out.append(time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--placement", nargs="*", default=[], help="EP 2 placements, one speculate engine each")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine, print its times
    a = ap.parse_args(argv)
    if a.engine is not None:
        times = _engine(a.model, a.engine or None, a.prompt_len, a.prompts, a.iters)
        print("SMOE_PREFILL " + json.dumps(times), flush=True)
        return 0
    if not a.placement:
        ap.error("--placement: give at least one EP 2 placement")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    rows = []
    for rnd in range(a.rounds):
        for placement in ["", *a.placement]:
            r = subprocess.run([sys.executable, __file__, "--model", a.model, "--prompt-len", str(a.prompt_len),
                                "--prompts", str(a.prompts), "--iters",
                                str(a.iters), "--engine", placement], capture_output=True, text=True, env=env)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("SMOE_PREFILL ")]
            if r.returncode or not line:
                sys.exit(f"prefill_time: the engine for {placement or 'plain TP'} failed:\n{(r.stdout + r.stderr)[-3000:]}")
            times = json.loads(line[0].split(" ", 1)[1])
            rows.append({"round": rnd, "config": f"speculate {placement}" if placement else "tp", "seconds": times})
            med = statistics.median(times)
            print(f"round {rnd} {rows[-1]['config']}: median {med * 1000:.0f} ms "
                  f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}, {len(times)} iterations)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "prompt_len": a.prompt_len, "prompts": a.prompts, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
