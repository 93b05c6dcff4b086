"""Greedy generation with vLLM's offline LLM in its own process; prints JSON to stdout.

usage: python vllm_generate.py MODEL_DIR PROMPTS_JSON MAX_TOKENS [ADDITIONAL_CONFIG_JSON]
       python vllm_generate.py --runs RUNS_JSON_FILE
PROMPTS_JSON: a list of token-id lists. Prints "SMOE_RESULT {"tokens": [...], "logprobs": [...]}".
RUNS_JSON_FILE: a JSON list of runs, each {"model", "prompts", "max_tokens", "extra" (the
additional config or null), "ep", "compiled", "engine" (more LLM arguments)}, served one after another by engines of this one
process (vLLM is imported once, ~16 s on this host, and each engine and its workers are shut
down before the next starts). Each run's output lies between "SMOE_RUN_BEGIN i" and
"SMOE_RUN_END i" and holds its "SMOE_RESULT" line.
SMOE_TEST_COMPILED=1 keeps vLLM's default compilation instead of enforce_eager;
SMOE_TEST_TP=2 runs tensor parallel on 2 ranks (set VLLM_CPU_OMP_THREADS_BIND="0|1" on CPU);
SMOE_TEST_EP=1 turns on vLLM's expert parallelism (a run's "compiled" and "ep" override both).
"""

import gc
import json
import os
import sys

# One engine process less per start (~16 s of vLLM's import on this 2-core host): the engine core
# runs in this process. The served tests (`vllm serve`) keep vLLM's default process layout.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's CPU workers outlive its 5 s shutdown grace and are then sent SIGTERM anyway: send it sooner.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")


RECORDING = False  # the engine being stopped recorded (smoe's record setting)
RESULT_PATH = ""  # with --runs: where the run being served writes its result (read by tests/support.py)


def stop_workers_sooner() -> None:
    """vLLM 0.32 stops an engine's workers by closing their death pipe, waits
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, sends SIGTERM and waits 4 s more before SIGKILL. A CPU
    worker that saw its death pipe has already set its shutdown flag and ignores SIGTERM (vLLM's
    handler raises only once), so those 4 s passed idle at every TP=2 engine of a run list. Here
    a worker still alive 2 s after its death pipe closed gets vLLM's SIGKILL 3 s sooner, except
    after a recording run: its recorder closes the trace once idle for 2 s, so that engine keeps
    vLLM's own schedule. Checked on test_uneven's three TP=2 engines (logs and tokens as before)."""
    import time

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    vllms = MultiprocExecutor._ensure_worker_termination

    def ensure_worker_termination(worker_procs):
        if RECORDING:
            return vllms(worker_procs)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(p.is_alive() for p in worker_procs):
            time.sleep(0.1)
        for p in worker_procs:
            if p.is_alive():
                p.kill()

    MultiprocExecutor._ensure_worker_termination = staticmethod(ensure_worker_termination)


def generate(model, prompts, max_tokens, extra, ep, compiled, dtype="float32", engine=None):
    from vllm import LLM, SamplingParams

    kwargs = {"additional_config": extra} if extra else {}
    kwargs.update(engine or {})
    with open(os.path.join(model, "config.json")) as f:
        if json.load(f).get("kv_lora_rank"):  # MLA: vLLM's AMX MLA backend refuses fp32 (server_process)
            kwargs["attention_backend"] = "CPU_MLA"
    tp = int(os.environ.get("SMOE_TEST_TP", "1"))
    llm = LLM(model=model, dtype=dtype, enforce_eager=not compiled, max_model_len=512, tensor_parallel_size=tp,
              enable_expert_parallel=ep,
              gpu_memory_utilization=0.15, max_num_seqs=8, skip_tokenizer_init=True, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    result = {"tokens": tokens, "logprobs": logprobs}
    if RESULT_PATH:  # read from the file: a long line in a pipe can be split by other writers' lines
        with open(RESULT_PATH + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(RESULT_PATH + ".tmp", RESULT_PATH)
    say("SMOE_RESULT " + json.dumps(result))
    return llm


def say(line: str) -> None:
    """One line of this helper's protocol in a single write, on a line of its own: vLLM's
    threads log into the same pipe, and print's separate writes of text and newline let their
    lines land inside a marker (seen: a run's BEGIN marker lost, the run reported missing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, ("\n" + line + "\n").encode())


def main() -> None:
    compiled = os.environ.get("SMOE_TEST_COMPILED") == "1"
    ep = os.environ.get("SMOE_TEST_EP") == "1"
    if sys.argv[1] != "--runs":
        extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
        generate(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), extra, ep, compiled)
        return
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    stop_workers_sooner()
    with open(sys.argv[2]) as f:
        runs = json.load(f)
    global RECORDING, RESULT_PATH
    for i, run in enumerate(runs):
        RESULT_PATH = f"{sys.argv[2]}.result{i}.json"
        say(f"SMOE_RUN_BEGIN {i}")
        RECORDING = bool(((run.get("extra") or {}).get("smoe") or {}).get("record"))
        llm = generate(run["model"], run["prompts"], run["max_tokens"], run.get("extra"), run.get("ep", ep),
                       run.get("compiled", compiled), run.get("dtype", "float32"), run.get("engine"))
        # the engine's workers stop (and log their last counters) before the next run begins
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        say(f"SMOE_RUN_END {i}")


if __name__ == "__main__":
    main()
